//! The Evoformer stacks on one process: chunked evaluation equals unchunked, masked padding is
//! inert, and AlphaFold-named `.npz` files round-trip and are checked key by key.
use engine::parallel::dap::Dap;
use fastfold::model::layers::Stream;
use fastfold::model::AttentionKernel;
use fastfold::model::{Error, EvoformerConfig, EvoformerStack, Exec, Params, EVOFORMER, EXTRA_MSA};
use tch::{Device, Kind, Tensor};

/// MSA, pair and masks for `s` sequences of `r` residues. Masks have zeros, but the first
/// sequence and the pair diagonal are kept, so no attention row has every key masked.
fn inputs(s: i64, r: i64, c_m: i64, c_z: i64, seed: i64) -> [Tensor; 4] {
    tch::manual_seed(seed);
    let opts = (Kind::Float, Device::Cpu);
    let msa = Tensor::randn([s, r, c_m], opts);
    let pair = Tensor::randn([r, r, c_z], opts);
    let msa_mask = Tensor::rand([s, r], opts).gt(0.2).to_kind(Kind::Float);
    let _ = msa_mask.narrow(0, 0, 1).fill_(1.0);
    let pair_mask = Tensor::rand([r, r], opts).gt(0.2).to_kind(Kind::Float).maximum(&Tensor::eye(r, opts));
    [msa, pair, msa_mask, pair_mask]
}

fn run(stack: &EvoformerStack, x: &[Tensor; 4], chunk: Option<i64>) -> (Tensor, Tensor) {
    let (msa, pair) = (Stream::new(x[0].shallow_clone(), false), Stream::new(x[1].shallow_clone(), false));
    let (m, z, _) =
        tch::no_grad(|| stack.forward(msa, pair, &x[2], &x[3], &Exec::new(Dap::none(), chunk), None).unwrap());
    (m, z)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

fn stacks(params: &Params) -> [(EvoformerStack, i64); 2] {
    let cfg = params.config();
    [(EvoformerStack::main(params).unwrap(), cfg.c_m), (EvoformerStack::extra(params).unwrap(), cfg.c_e)]
}

#[test]
fn chunked_equals_unchunked() {
    let params = Params::random(&EvoformerConfig::tiny(), 1).unwrap();
    for (stack, c_m) in stacks(&params) {
        let x = inputs(5, 7, c_m, params.config().c_z, 2);
        let (m, z) = run(&stack, &x, None);
        assert!(m.abs().max().double_value(&[]) > 0.1, "the stack produces a non-trivial MSA");
        for chunk in [1, 2, 3] {
            let (mc, zc) = run(&stack, &x, Some(chunk));
            let (dm, dz) = (max_diff(&mc, &m), max_diff(&zc, &z));
            assert!(dm <= 1e-5 && dz <= 1e-5, "chunk {chunk}: msa differs by {dm:e}, pair by {dz:e} (tolerance 1e-5)");
        }
    }
}

// The stacks with the fused kernels (attention softmax with mask and pair bias, LayerNorm,
// triangle gates) equal libtorch's compositions, forward and the parameters' gradients. On a
// GPU; without one, on the CPU emulator (a failure under SUITE_REQUIRE_CUDA=1).
#[test]
fn fused_kernels_equal_the_compositions_on_cuda_or_the_emulator() {
    let dev = suite_tests::cuda_or_emulator(
        "fused_kernels_equal_the_compositions_on_cuda_or_the_emulator",
        kernels::emulator::enable,
    );
    let params = Params::random(&EvoformerConfig::tiny(), 13).unwrap();
    let grads_of = |backend: kernels::Backend| {
        let p = params.to_device(dev, true).unwrap().with_kernels(backend);
        let mut outs = vec![];
        for (stack, c_m) in stacks(&p) {
            let x = inputs(5, 7, c_m, p.config().c_z, 14).map(|t| t.to_device(dev));
            let (msa, pair) = (Stream::new(x[0].shallow_clone(), false), Stream::new(x[1].shallow_clone(), false));
            let (m, z, _) = stack.forward(msa, pair, &x[2], &x[3], &Exec::new(Dap::none(), Some(3)), None).unwrap();
            (m.square().sum(Kind::Float) + z.square().sum(Kind::Float)).backward();
            outs.extend([m.detach(), z.detach()]);
        }
        outs.extend(p.iter().filter(|(_, t)| t.grad().defined()).map(|(_, t)| t.grad()));
        outs
    };
    let (fused, torch) = (grads_of(kernels::Backend::Fused), grads_of(kernels::Backend::Torch));
    assert_eq!(fused.len(), torch.len(), "the same outputs and gradients");
    for (i, (a, b)) in fused.iter().zip(&torch).enumerate() {
        let scale = b.abs().max().double_value(&[]).max(1.0);
        let d = max_diff(a, b);
        assert!(d <= 1e-4 * scale, "output or gradient {i}: differs by {d:e} (scale {scale:e}, tolerance 1e-4)");
    }
}

// The attentions' four paths give the same stacks: libtorch's scaled-dot-product kernel
// (inference with the compositions), the whole logits with autograd (training), the whole
// logits with the biases and gates applied in place (inference with the fused kernels, on the
// CPU emulator without a GPU), and the tensor-core attention (`--attention flash`), with masked
// keys and chunks. The last takes its products in TF32 (10-bit mantissas): within 2e-3 of the
// largest value, where a wrong head or layout moves values by their size.
#[test]
fn the_attentions_paths_agree_in_training_and_inference() {
    let params = Params::random(&EvoformerConfig::tiny(), 21).unwrap();
    let run_with = |p: &Params, dev: Device| {
        let mut outs = vec![];
        for (stack, c_m) in stacks(p) {
            let x = inputs(5, 7, c_m, p.config().c_z, 22).map(|t| t.to_device(dev));
            let (msa, pair) = (Stream::new(x[0].shallow_clone(), false), Stream::new(x[1].shallow_clone(), false));
            let (m, z, _) = stack.forward(msa, pair, &x[2], &x[3], &Exec::new(Dap::none(), Some(2)), None).unwrap();
            outs.extend([m.detach().to_device(Device::Cpu), z.detach().to_device(Device::Cpu)]);
        }
        outs
    };
    let inference = tch::no_grad(|| run_with(&params, Device::Cpu));
    let training = run_with(&params.to_device(Device::Cpu, true).unwrap(), Device::Cpu);
    let dev = suite_tests::cuda_or_emulator(
        "the_attentions_paths_agree_in_training_and_inference",
        kernels::emulator::enable,
    );
    let on_fused = || params.to_device(dev, false).unwrap().with_kernels(kernels::Backend::Fused);
    let fused = tch::no_grad(|| run_with(&on_fused(), dev));
    let flash = tch::no_grad(|| run_with(&on_fused().with_attention(AttentionKernel::Flash), dev));
    for (path, outs, tolerance) in
        [("training", &training, 1e-5), ("fused inference", &fused, 1e-5), ("flash inference", &flash, 2e-3)]
    {
        for (i, (a, b)) in outs.iter().zip(&inference).enumerate() {
            let scale = b.abs().max().double_value(&[]).max(1.0);
            let d = max_diff(a, b);
            eprintln!("{path}, output {i}: differs by {d:e} (scale {scale:e})");
            assert!(
                d <= tolerance * scale,
                "{path}, output {i}: differs by {d:e} (scale {scale:e}, tolerance {tolerance:e})"
            );
        }
    }
}

#[test]
fn masked_padding_does_not_change_real_positions() {
    let params = Params::random(&EvoformerConfig::tiny(), 3).unwrap();
    let dap = Dap::none();
    for (stack, c_m) in stacks(&params) {
        let x = inputs(4, 6, c_m, params.config().c_z, 4);
        let (m, z) = run(&stack, &x, None);
        // Two padded sequences and three padded residues, all masked out.
        let pad2 = |t: &Tensor, a: i64, b: i64| dap.pad_to(&dap.pad_to(t, 0, a).unwrap(), 1, b).unwrap();
        let padded = [pad2(&x[0], 6, 9), pad2(&x[1], 9, 9), pad2(&x[2], 6, 9), pad2(&x[3], 9, 9)];
        let (mp, zp) = run(&stack, &padded, None);
        // The padded shapes sum in other orders: fp32 noise, relative to the largest value.
        let scale = |t: &Tensor| t.abs().max().double_value(&[]).max(1.0);
        let dm = max_diff(&mp.narrow(0, 0, 4).narrow(1, 0, 6), &m) / scale(&m);
        let dz = max_diff(&zp.narrow(0, 0, 6).narrow(1, 0, 6), &z) / scale(&z);
        eprintln!("padding changed msa by {dm:e}, pair by {dz:e} of their largest values");
        assert!(dm <= 1e-5 && dz <= 1e-5, "padding changed msa by {dm:e}, pair by {dz:e} (relative tolerance 1e-5)");
    }
}

#[test]
fn every_array_has_an_alphafold_name_and_a_user() {
    let cfg = EvoformerConfig::tiny();
    let params = Params::random(&cfg, 5).unwrap();
    // Per block: row attention 12, column attention 9, transitions 2 x 6, OPM 8, triangle
    // multiplications 2 x 16, triangle attentions 2 x 10.
    assert_eq!(params.len(), 2 * (12 + 9 + 12 + 8 + 32 + 20));
    for (key, t) in params.iter() {
        assert!(key.starts_with(EVOFORMER) || key.starts_with(EXTRA_MSA), "{key}");
        assert!(key.contains("//"), "{key} separates module path and name by //");
        let blocks = if key.starts_with(EVOFORMER) { cfg.num_blocks } else { cfg.num_extra_blocks };
        assert_eq!(t.size()[0], blocks, "{key} is stacked over blocks");
    }
    let q = params.get(&format!("{EVOFORMER}/msa_row_attention_with_pair_bias/attention//query_w")).unwrap();
    assert_eq!(q.size(), [cfg.num_blocks, cfg.c_m, cfg.msa_heads, cfg.msa_head_dim]);
    let k = params.get(&format!("{EXTRA_MSA}/msa_column_global_attention/attention//key_w")).unwrap();
    assert_eq!(k.size(), [cfg.num_extra_blocks, cfg.c_e, cfg.extra_head_dim]);
    assert_eq!(infer(&params), cfg);
}

fn infer(p: &Params) -> EvoformerConfig {
    let map = p.iter().map(|(k, t)| (k.to_string(), t.shallow_clone())).collect();
    EvoformerConfig::infer(&map).unwrap()
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("fastfold-{}-{name}", std::process::id()))
}

#[test]
fn npz_round_trip_gives_identical_outputs() {
    let params = Params::random(&EvoformerConfig::tiny(), 6).unwrap();
    let path = temp("roundtrip.npz");
    params.save(&path).unwrap();
    let loaded = Params::load_npz(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded.config(), params.config());
    assert_eq!(loaded.len(), params.len());
    for ((ka, ta), (kb, tb)) in params.iter().zip(loaded.iter()) {
        assert_eq!(ka, kb);
        assert!(ta.equal(tb), "{ka} changed in the round trip");
    }
    for ((a, c_m), (b, _)) in stacks(&params).into_iter().zip(stacks(&loaded)) {
        let x = inputs(3, 5, c_m, params.config().c_z, 7);
        let (ma, za) = run(&a, &x, None);
        let (mb, zb) = run(&b, &x, None);
        assert!(ma.equal(&mb) && za.equal(&zb), "outputs after the round trip differ");
    }
}

/// Writes `params` with `key` replaced by `value` (or dropped) and loads the file back.
fn load_modified(params: &Params, key: &str, value: Option<Tensor>, name: &str) -> Error {
    let mut arrays: Vec<(String, Tensor)> = params.iter().map(|(k, t)| (k.to_string(), t.shallow_clone())).collect();
    arrays.retain(|(k, _)| k != key);
    if let Some(v) = value {
        arrays.push((key.to_string(), v));
    }
    // An array of another module, as in AlphaFold's files: ignored.
    arrays.push((
        "alphafold/alphafold_iteration/structure_module//x".into(),
        Tensor::zeros([3], (Kind::Float, Device::Cpu)),
    ));
    let path = temp(name);
    Tensor::write_npz(&arrays, &path).unwrap();
    let result = Params::load_npz(&path);
    std::fs::remove_file(&path).unwrap();
    match result {
        Err(e) => e,
        Ok(_) => panic!("loading with {key} modified succeeded"),
    }
}

#[test]
fn a_mis_shaped_array_is_named_with_both_shapes() {
    let params = Params::random(&EvoformerConfig::tiny(), 8).unwrap();
    let key = format!("{EVOFORMER}/msa_transition/transition2//weights");
    let err = load_modified(&params, &key, Some(Tensor::zeros([2, 23, 12], (Kind::Float, Device::Cpu))), "shape.npz");
    let msg = err.to_string();
    assert!(
        matches!(&err, Error::Shape { key: k, expected, found, .. }
        if *k == key && expected == &[2, 24, 12] && found == &[2, 23, 12]),
        "{msg}"
    );
    assert!(msg.contains(&key) && msg.contains("[2, 24, 12]") && msg.contains("[2, 23, 12]"), "{msg}");
    assert!(msg.contains("shape.npz"), "the message names the file: {msg}");

    let key = format!("{EXTRA_MSA}/msa_column_global_attention/attention//value_w");
    let err = load_modified(&params, &key, Some(Tensor::zeros([1, 6, 4], (Kind::Float, Device::Cpu))), "shape2.npz");
    assert!(err.to_string().contains("expected shape [1, 6, 3], found [1, 6, 4]"), "{err}");
}

#[test]
fn a_missing_array_is_named() {
    let params = Params::random(&EvoformerConfig::tiny(), 9).unwrap();
    let key = format!("{EVOFORMER}/triangle_attention_ending_node/attention//gating_b");
    let err = load_modified(&params, &key, None, "missing.npz");
    assert!(matches!(&err, Error::Missing { key: k, .. } if *k == key), "{err}");
    assert!(err.to_string().contains(&key), "{err}");
}

#[test]
fn an_unused_array_of_a_stack_is_an_error() {
    let params = Params::random(&EvoformerConfig::tiny(), 12).unwrap();
    let key = format!("{EVOFORMER}/outer_product_mean//extra_w");
    let err = load_modified(&params, &key, Some(Tensor::zeros([2, 3], (Kind::Float, Device::Cpu))), "unused.npz");
    assert!(err.to_string().contains(&key), "{err}");
}

#[test]
fn wrong_input_shapes_are_errors() {
    let params = Params::random(&EvoformerConfig::tiny(), 10).unwrap();
    let stack = EvoformerStack::main(&params).unwrap();
    let x = inputs(3, 5, 12, 10, 11);
    let bad = Tensor::zeros([5, 4, 10], (Kind::Float, Device::Cpu));
    let (msa, bad) = (Stream::new(x[0].shallow_clone(), false), Stream::new(bad, false));
    let err = stack.forward(msa, bad, &x[2], &x[3], &Exec::serial(), None).expect_err("a mis-shaped pair fails");
    assert!(err.to_string().contains("pair: expected shape [5, 5, 10], found [5, 4, 10]"), "{err}");
}
