//! Each fused kernel beside its libtorch composition in the same run, on one CUDA device: time
//! per call (forward, and forward + backward where there is one), the ratio, and the fused
//! kernel's achieved bandwidth (the bytes its kernels must read and write per call, counting
//! each activation-sized tensor once per pass and leaving out the small ones, over its time) to
//! set against the device's peak. Sizes are the ones the apps run: ViT-B/16 at batch 64 (LayerNorm,
//! bias + GELU, bias + dropout + residual, the optimizers over 86M parameters) and the Evoformer
//! at 256 residues x 128 sequences (MSA row attention's softmax with its pair bias).
//!
//! `cargo bench -p kernels --bench kernels -- [--iters 20] [--dtype bf16|f16|f32]`. Needs CUDA.
use anyhow::{bail, Context};
use engine::cuda::{Event, Stream};
use engine::optim::{AdamWConfig, LambConfig, LarsConfig};
use kernels::{Backend, LarsTensors, OptimTensors};
use tch::{Device, Kind, Tensor};

struct Args {
    iters: usize,
    kind: Kind,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args { iters: 20, kind: Kind::BFloat16 };
    let mut it = std::env::args().skip(1).filter(|s| s != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--iters" => a.iters = value()?.parse().context("--iters")?,
            "--dtype" => {
                a.kind = match value()?.as_str() {
                    "f32" => Kind::Float,
                    "bf16" => Kind::BFloat16,
                    "f16" => Kind::Half,
                    other => bail!("--dtype {other}: expected f32, bf16 or f16"),
                }
            }
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

/// Milliseconds per call of `f`, after two warm-up calls, timed with CUDA events.
fn time(iters: usize, f: &mut dyn FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let stream = Stream::current(0)?;
    let (start, end) = (Event::new(true)?, Event::new(true)?);
    start.record(&stream)?;
    for _ in 0..iters {
        f()?;
    }
    end.record(&stream)?;
    end.synchronize()?;
    Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
}

/// One row: both backends' times, the ratio, and the fused kernel's bandwidth for `bytes`.
fn row(name: &str, bytes: f64, iters: usize, f: &dyn Fn(Backend) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let fused = time(iters, &mut || f(Backend::Fused))?;
    let torch = time(iters, &mut || f(Backend::Torch))?;
    println!(
        "| {name} | {fused:.3} ms | {torch:.3} ms | {:.2} | {:.0} GB/s |",
        torch / fused,
        bytes / (fused * 1e-3) / 1e9
    );
    Ok(())
}

/// Backward from `y` with output gradient `dy` (the inputs' `.grad`s accumulate, alike for both
/// backends).
fn with_backward(y: Tensor, dy: &Tensor) -> anyhow::Result<()> {
    Ok(engine::autograd::backward(&[&y], &[Some(dy)], false)?)
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    if !engine::cuda::is_available() {
        bail!("this benchmark needs a CUDA device");
    }
    let dev = Device::Cuda(0);
    let (k, n) = (a.kind, a.iters);
    let size = |kind: Kind| kind.elt_size_in_bytes() as f64;
    let e = size(k);
    let t = |shape: &[i64], grad: bool| Tensor::randn(shape, (k, dev)).set_requires_grad(grad);
    println!("{k:?}, {n} calls each, kernels compiled by NVRTC {}", kernels::nvrtc()?.version_string());
    println!("| operation | fused | libtorch | libtorch / fused | fused bandwidth |");
    println!("|---|---:|---:|---:|---:|");

    // MSA row attention at 256 residues x 128 sequences, 8 heads: logits [128, 8, 256, 256].
    let (s, h, r) = (128, 8, 256);
    let x = t(&[s, h, r, r], true);
    let mask = Tensor::ones([s, r], (k, dev));
    let bias = t(&[h, r, r], true);
    let logits = (s * h * r * r) as f64;
    let dy = Tensor::randn([s, h, r, r], (k, dev));
    row("attention softmax forward", 2.0 * logits * e, n, &|b| {
        let _ = tch::no_grad(|| kernels::attention_softmax(&x, 0.125, Some(&mask), Some(&bias), b))?;
        Ok(())
    })?;
    row("attention softmax forward + backward", 6.0 * logits * e, n, &|b| {
        with_backward(kernels::attention_softmax(&x, 0.125, Some(&mask), Some(&bias), b)?, &dy)
    })?;
    drop((x, dy));

    // The whole attention at the same sizes, head width 32: [128, 8, 256, 32] queries, keys and
    // values; the composition materialises the [128, 8, 256, 256] weights, the fused kernel not.
    let (qkv, bias) = ([s, h, r, 32], t(&[h, r, r], true));
    let (qt, kt, vt) = (t(&qkv, true), t(&qkv, true), t(&qkv, true));
    let dout = Tensor::randn(qkv, (k, dev));
    let io = 4.0 * (s * h * r * 32) as f64 * e + (h * r * r) as f64 * e;
    row("memory-efficient attention forward", io, n, &|b| {
        let _ = tch::no_grad(|| kernels::memory_efficient_attention(&qt, &kt, &vt, 0.18, Some(&mask), Some(&bias), b))?;
        Ok(())
    })?;
    row("memory-efficient attention forward + backward", 3.0 * io, n, &|b| {
        let y = kernels::memory_efficient_attention(&qt, &kt, &vt, 0.18, Some(&mask), Some(&bias), b)?;
        with_backward(y, &dout)
    })?;
    // The same forward on tensor cores (inference only: the inputs without autograd), against
    // the same composition; the queries, keys and values laid out as fastfold makes them, each
    // head's [32, 256] contiguous.
    let transposed = |t: &Tensor| t.detach().transpose(2, 3).contiguous().transpose(2, 3);
    let (qf, kf, vf, bias_f) = (transposed(&qt), transposed(&kt), transposed(&vt), bias.detach());
    row("tensor-core attention forward (inference)", io, n, &|b| {
        let _ = tch::no_grad(|| kernels::flash_attention(&qf, &kf, &vf, 0.18, Some(&mask), Some(&bias_f), b))?;
        Ok(())
    })?;
    drop((qt, kt, vt, dout, qf, kf, vf));

    // Triangle multiplication's gated projection at 256 residues, 128 channels: pair [256, 256, 128].
    let (x, g, xb, gb) = (t(&[r, r, 128], true), t(&[r, r, 128], true), t(&[128], true), t(&[128], true));
    let pair_mask = Tensor::ones([r, r], (k, dev));
    let dy = Tensor::randn([r, r, 128], (k, dev));
    let act = (r * r * 128) as f64;
    row("sigmoid gate (masked) forward", 3.0 * act * e, n, &|b| {
        let _ = tch::no_grad(|| kernels::sigmoid_gate(&x, &xb, &g, &gb, Some(&pair_mask), b))?;
        Ok(())
    })?;
    // Backward reads x, g and dy and writes dx and dg.
    row("sigmoid gate (masked) forward + backward", 8.0 * act * e, n, &|b| {
        with_backward(kernels::sigmoid_gate(&x, &xb, &g, &gb, Some(&pair_mask), b)?, &dy)
    })?;
    drop((x, g, dy));

    // The MSA column attention's norm: the MSA [128, 256, 256] transposed to [256, 128, 256]
    // (its columns), without autograd: the fused kernel reads the rows where they lie,
    // libtorch's composition copies the view first.
    let msa = t(&[s, r, 256], false);
    let (w256, b256) = (t(&[256], false), t(&[256], false));
    row("layer norm forward of a transposed MSA", 2.0 * (s * r * 256) as f64 * e, n, &|b| {
        let _ = kernels::layer_norm(&msa.transpose(0, 1), &w256, &b256, 1e-5, b)?;
        Ok(())
    })?;
    drop(msa);

    // ViT-B/16 at batch 64: 64 x 197 tokens of width 768, MLP width 3072.
    let tokens = 64 * 197;
    let (x, w, bias) = (t(&[tokens, 768], true), t(&[768], true), t(&[768], true));
    let dy = Tensor::randn([tokens, 768], (k, dev));
    let act = (tokens * 768) as f64;
    row("layer norm forward", 2.0 * act * e, n, &|b| {
        let _ = tch::no_grad(|| kernels::layer_norm(&x, &w, &bias, 1e-6, b))?;
        Ok(())
    })?;
    row("layer norm forward + backward", 7.0 * act * e, n, &|b| {
        with_backward(kernels::layer_norm(&x, &w, &bias, 1e-6, b)?, &dy)
    })?;
    let residual = t(&[tokens, 768], true);
    row("bias + dropout 0.1 + residual forward + backward", 5.0 * act * e + 2.0 * act, n, &|b| {
        let y = kernels::bias_dropout_residual(&x, &bias, &residual, 0.1, true, b)?;
        with_backward(y, &dy)
    })?;
    let (hidden, b3072) = (t(&[tokens, 3072], true), t(&[3072], true));
    let dh = Tensor::randn([tokens, 3072], (k, dev));
    let act4 = 4.0 * act;
    row("bias + GELU forward", 2.0 * act4 * e, n, &|b| {
        let _ = tch::no_grad(|| kernels::bias_gelu(&hidden, &b3072, b))?;
        Ok(())
    })?;
    row("bias + GELU forward + backward", 5.0 * act4 * e, n, &|b| {
        with_backward(kernels::bias_gelu(&hidden, &b3072, b)?, &dh)
    })?;
    drop((x, dy, residual, hidden, dh));

    // The optimizers over ViT-B/16's parameter shapes (86M, f32): 12 blocks and the ends.
    let mut shapes: Vec<Vec<i64>> =
        vec![vec![768, 3, 16, 16], vec![768], vec![1, 197, 768], vec![1000, 768], vec![1000]];
    for _ in 0..12 {
        for s in [vec![768], vec![768], vec![2304, 768], vec![2304], vec![768, 768], vec![768], vec![768], vec![768]] {
            shapes.push(s);
        }
        shapes.extend([vec![3072, 768], vec![3072], vec![768, 3072], vec![768]]);
    }
    let f32s = |s: &Vec<i64>| Tensor::randn(s.as_slice(), (Kind::Float, dev));
    let sets: Vec<[Tensor; 4]> =
        shapes.iter().map(|s| [f32s(s), f32s(s), f32s(s).abs() * 0.0, f32s(s).abs()]).collect();
    let numel: i64 = shapes.iter().map(|s| s.iter().product::<i64>()).sum();
    let tensors: Vec<OptimTensors> = sets
        .iter()
        .map(|[w, g, m, v]| OptimTensors { param: w, grad: g, exp_avg: m, exp_avg_sq: v, adapt: w.dim() >= 2 })
        .collect();
    let (adamw, lamb) = (AdamWConfig { lr: 1e-5, ..Default::default() }, LambConfig { lr: 1e-5, ..Default::default() });
    let step = std::cell::Cell::new(0);
    let bytes = 7.0 * numel as f64 * 4.0; // read w, g, m, v; write w, m, v
    row(&format!("AdamW step, {:.1}M parameters in {} tensors", numel as f64 / 1e6, shapes.len()), bytes, n, &|b| {
        step.set(step.get() + 1);
        Ok(kernels::adamw_step(&tensors, &adamw, step.get(), b)?)
    })?;
    step.set(0);
    row(
        &format!("LAMB step, {:.1}M parameters in {} tensors", numel as f64 / 1e6, shapes.len()),
        bytes + 3.0 * numel as f64 * 4.0,
        n,
        &|b| {
            step.set(step.get() + 1);
            Ok(kernels::lamb_step(&tensors, &lamb, step.get(), b)?)
        },
    )?;
    // LARS with momentum, the buffer in the first moment's tensors.
    let lars_cfg = LarsConfig { lr: 1e-5, ..Default::default() };
    let lars: Vec<LarsTensors> = sets
        .iter()
        .map(|[w, g, m, _]| LarsTensors { param: w, grad: g, momentum_buffer: Some(m), adapt: w.dim() >= 2 })
        .collect();
    step.set(0);
    // Norms read w and g; the update reads w, g, the buffer and writes w and the buffer.
    row(
        &format!("LARS step, {:.1}M parameters in {} tensors", numel as f64 / 1e6, shapes.len()),
        7.0 * numel as f64 * 4.0,
        n,
        &|b| {
            step.set(step.get() + 1);
            Ok(kernels::lars_step(&lars, &lars_cfg, step.get(), b)?)
        },
    )?;
    Ok(())
}
