//! Compiles the C++ bridge (`csrc/`) against the libtorch of the project's Python environment
//! (found by `libtorch-build`, which also gives the engine's own binaries their rpath). The CUDA
//! and NCCL headers come from the wheel's `nvidia` siblings.
use libtorch_build::Libtorch;

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    let libtorch = Libtorch::from_env();
    let torch = libtorch.dir();
    let nvidia = libtorch.nvidia_dir();
    let cuda_include = nvidia.join("cu13").join("include");
    let nccl_include = nvidia.join("nccl").join("include");
    // The torch wheel's CUDA and NCCL headers (pip packages of the CUDA 13 build, installed by
    // scripts/setup.sh): the bridge is always built with CUDA and NCCL support, and answers
    // "CUDA not available" at run time on a machine without a GPU.
    for header in [cuda_include.join("cuda_runtime_api.h"), nccl_include.join("nccl.h")] {
        assert!(header.exists(), "{} is missing: run scripts/setup.sh", header.display());
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .warnings(false)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("GLOG_USE_GLOG_EXPORT", None)
        .define("USE_C10D_GLOO", None)
        .include(&cuda_include)
        .include(&nccl_include)
        .define("USE_C10D_NCCL", None)
        .file("csrc/dist.cpp")
        .file("csrc/autograd.cpp")
        .file("csrc/cuda.cpp")
        .file("csrc/storage.cpp")
        .file("csrc/host_memory.cpp")
        .file("csrc/fp32_matmul.cpp")
        .file("csrc/kernel_trace.cpp");
    build.compile("engine_csrc");

    // The header-only parts of c10::cuda (events, device queries) call the CUDA runtime directly.
    println!("cargo:rustc-link-search=native={}", libtorch.lib_dir().display());
    println!("cargo:rustc-link-search=native={}", libtorch.cuda_lib_dir().display());
    println!("cargo:rustc-link-lib=dylib:+verbatim=libcudart.so.13");
    for l in ["torch_cpu", "torch", "c10"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    for l in ["torch_cuda", "c10_cuda"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    libtorch.link_binaries();
}
