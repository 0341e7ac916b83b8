//! The ViT with the fused kernels (the blocks' LayerNorms, the MLP's bias + GELU) equals the one
//! with libtorch's compositions on the same parameters, logits and every parameter's gradient.
//! On a GPU; without one, on the CPU emulator (a failure under SUITE_REQUIRE_CUDA=1).
//! scripts/gpu-check.sh packs and runs it.
use tch::nn::VarStore;
use tch::{Kind, Tensor};
use vit::model::{Vit, VitConfig};

#[test]
fn fused_kernels_equal_the_compositions_on_cuda_or_the_emulator() {
    let dev = suite_tests::cuda_or_emulator(
        "fused_kernels_equal_the_compositions_on_cuda_or_the_emulator",
        kernels::emulator::enable,
    );
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
