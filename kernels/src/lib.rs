//! Fused GPU kernels: CUDA C compiled at run time by NVRTC, each paired with a libtorch
//! fallback that runs on the CPU and serves as the kernel's test reference.
//!
//! The crate holds no kernels yet: the first ones come with the applications that need them
//! (Evoformer attention and layer norm for FastFold, the optimizer updates for Gemini).
