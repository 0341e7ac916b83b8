// Test binaries find libtorch without LD_LIBRARY_PATH (an rpath from libtorch-build), and the
// crate learns where the torch wheel's NVRTC lives (the pip package nvidia-cuda-nvrtc, installed
// with torch by scripts/setup.sh): the first place it looks for libnvrtc at run time.
fn main() {
    let libtorch = libtorch_build::Libtorch::from_env();
    libtorch.link_binaries();
    println!("cargo:rustc-env=KERNELS_NVRTC_DIR={}", libtorch.cuda_lib_dir().display());
}
