//! Compiles the C++ bridge (`csrc/`) against the libtorch of the project's Python environment
//! and tells every binary where libtorch lives.
//!
//! `LIBTORCH` (written into `.cargo/config.toml` by `scripts/setup.sh`) is the `torch` package
//! directory of the torch wheel: headers under `include/`, libraries under `lib/`. The CUDA
//! and NCCL headers come from the wheel's `nvidia` siblings.
use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=csrc");
    let libtorch = PathBuf::from(env::var("LIBTORCH").unwrap_or_else(|_| {
        panic!("LIBTORCH is not set: run scripts/setup.sh, which writes it into .cargo/config.toml")
    }));
    let lib = libtorch.join("lib");
    let site_packages = libtorch.parent().expect("LIBTORCH has a parent directory");
    let nvidia = site_packages.join("nvidia");
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
        .include(libtorch.join("include"))
        .include(libtorch.join("include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("GLOG_USE_GLOG_EXPORT", None)
        .define("USE_C10D_GLOO", None)
        .include(&cuda_include)
        .include(&nccl_include)
        .define("USE_C10D_NCCL", None)
        .file("csrc/dist.cpp")
        .file("csrc/autograd.cpp")
        .file("csrc/cuda.cpp")
        .file("csrc/storage.cpp");
    build.compile("engine_csrc");

    // The header-only parts of c10::cuda (events, device queries) call the CUDA runtime directly.
    let cuda_lib = nvidia.join("cu13").join("lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-search=native={}", cuda_lib.display());
    println!("cargo:rustc-link-lib=dylib:+verbatim=libcudart.so.13");
    for l in ["torch_cpu", "torch", "c10"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    for l in ["torch_cuda", "c10_cuda"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    // Binaries of dependent crates read this (DEP_ENGINE_CSRC_LINK_ARGS) in their build scripts.
    let args = link_args(&[&lib, &cuda_lib]);
    println!("cargo:link_args={}", args.join(" "));
    for arg in &args {
        println!("cargo:rustc-link-arg={arg}");
    }
}

/// rpath so that nobody sets LD_LIBRARY_PATH, and libtorch_cuda kept as a dependency even
/// where nothing references it directly: without it, CUDA silently reports unavailable.
fn link_args(lib_dirs: &[&Path]) -> Vec<String> {
    let rpath = lib_dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(":");
    vec![format!("-Wl,-rpath,{rpath}"), "-Wl,--no-as-needed".into(), "-ltorch_cuda".into(), "-Wl,--as-needed".into()]
}
