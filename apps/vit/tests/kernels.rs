//! The ViT with the fused kernels (the blocks' LayerNorms, the MLP's bias + GELU) equals the one
//! with libtorch's compositions on the same parameters, logits and every parameter's gradient;
//! and `vit pretrain --kernels fused` (those kernels and the installed multi-tensor optimizer
//! steps) trains as `--kernels torch` does. On a GPU; without one, on the CPU emulator (a
//! failure under SUITE_REQUIRE_CUDA=1). scripts/gpu-check.sh packs and runs it.
#[allow(dead_code)] // Shared by the vit test binaries; this one uses part of it.
mod common;

use common::{args, compare, single};
use tch::nn::VarStore;
use tch::{Kind, Tensor};
use vit::model::{Vit, VitConfig};
use vit::train::pretrain;

/// libtorch's random generator is process-wide: the tests take turns, or each would draw from
/// the other's seeded sequence.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Waits for `test`'s turn, and picks its device: CUDA, else the CPU emulator.
fn turn(test: &str) -> (std::sync::MutexGuard<'static, ()>, tch::Device) {
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    (turn, suite_tests::cuda_or_emulator(test, kernels::emulator::enable))
}

#[test]
fn fused_kernels_equal_the_compositions_on_cuda_or_the_emulator() {
    let (_turn, dev) = turn("fused_kernels_equal_the_compositions_on_cuda_or_the_emulator");
    let cfg = VitConfig { image_size: 32, ..VitConfig::tiny(8) };
    tch::manual_seed(3);
    let images = Tensor::randn([5, 3, 32, 32], (Kind::Float, dev));
    let run = |backend: kernels::Backend| {
        tch::manual_seed(4);
        let vs = VarStore::new(dev);
        let model = Vit::with_kernels(&vs.root(), cfg, backend);
        let logits = model.forward(&images).unwrap();
        logits.square().sum(Kind::Float).backward();
        let mut out = vec![("logits".to_string(), logits.detach())];
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        out.extend(named.into_iter().map(|(n, t)| (n, t.grad())));
        out
    };
    let (fused, torch) = (run(kernels::Backend::Fused), run(kernels::Backend::Torch));
    assert_eq!(fused.len(), torch.len());
    for ((name, a), (_, b)) in fused.iter().zip(&torch) {
        let scale = b.abs().max().double_value(&[]).max(1e-3);
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-4 * scale, "{name}: differs by {d:e} (scale {scale:e}, tolerance 1e-4 of it)");
    }
}

#[test]
fn training_with_fused_kernels_equals_the_compositions_on_cuda_or_the_emulator() {
    let (_turn, dev) = turn("training_with_fused_kernels_equals_the_compositions_on_cuda_or_the_emulator");
    let device = if dev.is_cuda() { "cuda" } else { "cpu" };
    // The main job's model; LAMB steps every parameter through the fused kernels (two launches).
    let line = format!("--steps 2 --batch 8 --optimizer lamb --device {device}");
    let torch = pretrain(&args(&format!("{line} --kernels torch")), &single()).unwrap();
    assert!(engine::optim::fused::installed().is_none(), "--kernels torch installs no optimizer steps");
    let fused = pretrain(&args(&format!("{line} --kernels fused")), &single()).unwrap();
    assert!(engine::optim::fused::installed().is_some(), "--kernels fused installs the optimizer steps");
    engine::optim::fused::install(None);
    // f32 throughout: the kernels' sums in another order, over two steps.
    compare(&fused, &torch, "--kernels fused vs torch", 1e-4);
}
