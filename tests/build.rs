// Binaries, tests and benches find libtorch without LD_LIBRARY_PATH (an rpath from libtorch-build).
fn main() {
    libtorch_build::Libtorch::from_env().link_binaries();
}
