//! The symbolic profile of a ViT block against the block itself on the CPU: its parameter bytes
//! exactly, and the bytes its forward leaves allocated for the backward (plus its output) within
//! 10%, measured as the resident-set growth with glibc made to map every buffer over 64 KiB on
//! its own (so a freed temporary is returned at once and a kept one stays counted).
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use vit::model::{Part, Vit, VitConfig};

#[test]
fn block_parameter_and_activation_bytes_match_a_cpu_run() {
    // SAFETY: mallopt only changes glibc's allocation policy; called before the buffers measured.
    assert_eq!(unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 10) }, 1);
    tch::set_num_threads(1);
    let cfg = VitConfig::tiny(16);
    let batch = 16;
    let vs = VarStore::new(Device::Cpu);
    let parts = Vit::new(&vs.root(), cfg).into_parts();
    let Part::Block(0, _) = &parts[1] else { panic!("part 1 is blocks.0") };
    let predicted = vit::profile::block(&cfg, "blocks.0", batch, 4);

    let params: i64 =
        vs.variables().iter().filter(|(name, _)| name.starts_with("blocks.0.")).map(|(_, t)| t.numel() as i64).sum();
    assert_eq!(predicted.param_bytes, (params * 4) as f64);

    let x = Tensor::randn([batch, cfg.num_patches() + 1, cfg.width], (Kind::Float, Device::Cpu));
    // A first step allocates the parameters' gradients and the kernels' one-time buffers.
    parts[1].forward(&x).unwrap().sum(Kind::Float).backward();
    let before = suite_tests::resident_bytes();
    let y = parts[1].forward(&x).unwrap();
    let grown = suite_tests::resident_bytes() - before;
    let expected = predicted.saved_bytes + predicted.output_bytes;
    suite_tests::assert_bytes_close(&format!("ViT-Ti blocks.0 at batch {batch}, CPU"), grown, expected, 0.10);
    drop(y);
}

// The same check against the CUDA caching allocator (bytes the live tensors requested after
// the forward less before: without its 512-byte rounding and reused blocks' remainders), where
// attention runs PyTorch's fused kernel as the profile assumes. Without a GPU this returns with
// a notice (a failure under SUITE_REQUIRE_CUDA=1).
#[test]
fn block_kept_bytes_match_the_cuda_caching_allocator() {
    if !suite_tests::cuda_devices(1, "block_kept_bytes_match_the_cuda_caching_allocator") {
        return;
    }
    let dev = Device::Cuda(0);
    for (cfg, batch) in [(VitConfig::tiny(16), 16), (VitConfig::base(16), 32)] {
        let vs = VarStore::new(dev);
        let parts = Vit::new(&vs.root(), cfg).into_parts();
        let predicted = vit::profile::block(&cfg, "blocks.0", batch, 4);
        let x = Tensor::randn([batch, cfg.num_patches() + 1, cfg.width], (Kind::Float, dev));
        parts[1].forward(&x).unwrap().sum(Kind::Float).backward();
        let before = engine::cuda::memory_stats(0).unwrap().requested;
        let y = parts[1].forward(&x).unwrap();
        let grown = (engine::cuda::memory_stats(0).unwrap().requested - before) as f64;
        let expected = predicted.saved_bytes + predicted.output_bytes;
        suite_tests::assert_bytes_close(
            &format!("ViT block of width {} at batch {batch}, cuda", cfg.width),
            grown,
            expected,
            0.10,
        );
        drop(y);
    }
}
