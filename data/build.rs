// Test binaries find libtorch without LD_LIBRARY_PATH: link arguments from engine/build.rs.
fn main() {
    for arg in std::env::var("DEP_ENGINE_CSRC_LINK_ARGS").unwrap_or_default().split_whitespace() {
        println!("cargo:rustc-link-arg={arg}");
    }
}
