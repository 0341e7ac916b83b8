//! Attention with AlphaFold's key mask and pair bias on tensor cores, for inference:
//! `softmax(q k^T scale + 1e9 (mask - 1) + bias) v` as FlashAttention-2's forward, the
//! `[heads, queries, keys]` logits never in memory (the composition writes them, softmaxes them
//! and reads them again: three passes over the largest buffer of an Evoformer attention). The
//! products run on tensor cores with f32 accumulation: bf16 and f16 as they are, f32 as TF32
//! (the precision of every other f32 product of a GPU run unless strict IEEE is asked for).
//! No gradient: training keeps [`crate::attention_softmax`] over whole logits.
use tch::Tensor;

use crate::checks::{ceil_div, dtype, target_rows};
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::memory_efficient::{composition, sizes, Sizes};
use crate::{Backend, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "flash_attention",
    include_str!("cuda/flash.cu"),
    &[
        "flash_forward_f32_d16",
        "flash_forward_f32_d32",
        "flash_forward_f32_d64",
        "flash_forward_bf16_d16",
        "flash_forward_bf16_d32",
        "flash_forward_bf16_d64",
        "flash_forward_f16_d16",
        "flash_forward_f16_d32",
        "flash_forward_f16_d64",
    ],
    &[],
)
// mma.sync with TF32 and bf16 operands: Ampere and later.
.needs_arch(80);

const OP: &str = "flash_attention";
/// The head widths the kernel is compiled for (a head is zero-padded to the next).
const WIDTHS: [i64; 3] = [16, 32, 64];
/// The queries a block of 128 threads owns (16 per warp).
const BLOCK_QUERIES: i64 = 64;
const THREADS: u32 = 128;

/// Attention of queries `q` `[batch, heads, queries, dim]` over keys and values `k`, `v`
/// `[batch, heads, keys, dim]`, each at any strides: weights `softmax(q k^T scale + 1e9
/// (mask - 1) + bias)` with `mask` `[batch, keys]` (1 keeps a key) and `bias` `[heads, queries,
/// keys]` (shared across the batch) or `[batch, heads, queries, keys]`. The fused result is laid
/// out as `q` is where `q` is dense (fastfold's queries are `[batch, heads * dim, queries]`
/// underneath, and so is what reads the result). Inference only: an input that requires grad
/// is refused by the fused path. Heads up to 64 wide.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
    backend: Backend,
) -> Result<Tensor> {
    let Sizes { b, h, nq, nk, d } = sizes(OP, q, k, v, mask, bias)?;
    if backend == Backend::Torch {
        return composition(q, k, v, scale, mask, bias);
    }
    let grad = [Some(q), Some(k), Some(v), bias].into_iter().flatten().any(Tensor::requires_grad);
    ensure!(!grad, "{OP}: the fused kernel is for inference; an input requires grad (use attention_softmax)");
    let Some(width) = WIDTHS.into_iter().find(|&w| d <= w) else {
        return Err(crate::Error::invalid(format!("{OP}: heads of width {d}; the fused kernel takes at most 64")));
    };
    let mask = mask.map(|m| m.to_kind(q.kind()).contiguous());
    let bias = bias.map(Tensor::contiguous);
    let mut named = vec![("q", q), ("k", k), ("v", v)];
    named.extend(mask.as_ref().map(|m| ("mask", m)));
    named.extend(bias.as_ref().map(|t| ("bias", t)));
    let at = target_rows(OP, Some(q.kind()), &named, &["q", "k", "v"])?;
    let suffix = dtype(OP, "q", q)?;
    // Laid out as q where q is dense (libtorch's preserve format), else contiguous; without keys
    // the weighted sum is empty: zeros, as the composition gives (no launch).
    let out = if nk > 0 { q.f_empty_like()? } else { return Ok(q.f_zeros_like()?) };
    let blocks = ceil_div(nq, BLOCK_QUERIES) * b * h;
    ensure!(blocks < 1 << 31, "{OP}: {b} x {h} x {nq} queries need more blocks than a launch has");
    ensure!(nq <= i32::MAX as i64 && nk <= i32::MAX as i64 && h <= i32::MAX as i64, "{OP}: {nq} x {nk} is too large");
    if blocks == 0 {
        return Ok(out);
    }
    let bias_rows = bias.as_ref().map_or(1, |t| t.numel() as i64 / nk);
    let mut a = Args::default().tensor(q).tensor(k).tensor(v).opt(mask.as_ref()).opt(bias.as_ref()).tensor(&out);
    a = a.i32(h as i32).i32(nq as i32).i32(nk as i32).i32(d as i32).i64(bias_rows).f32(scale as f32);
    for t in [q, k, v, &out] {
        a = t.stride().into_iter().fold(a, Args::i64);
    }
    KERNEL.launch(&format!("flash_forward_{suffix}_d{width}"), at, (blocks as u32, 1, 1), THREADS, &mut a)?;
    Ok(out)
}
