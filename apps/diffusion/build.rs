// Binaries and tests find libtorch without LD_LIBRARY_PATH: link arguments from engine/build.rs.
fn main() {
    let args = std::env::var("DEP_ENGINE_CSRC_LINK_ARGS").unwrap_or_default();
    args.split_whitespace().for_each(|a| println!("cargo:rustc-link-arg={a}"));
}
