//! Memory-efficient attention with AlphaFold's key mask and pair bias:
//! `softmax(q k^T scale + 1e9 (mask - 1) + bias) v` without materialising the weights, so a
//! long sequence's `[heads, queries, keys]` logits never exist (the pair bias, an input, does).
//! The forward keeps each query's largest logit and log-sum of exponentials apart (a fully
//! masked query's -1e9 would round a single log-sum-exp); the backward recomputes the weights
//! from them.
use tch::{Kind, Tensor};

use crate::checks::{ceil_div, dtype, target, with_grad};
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::{Backend, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "memory_efficient_attention",
    include_str!("cuda/attention.cu"),
    &[
        "mea_forward_f32",
        "mea_forward_bf16",
        "mea_forward_f16",
        "mea_backward_queries_f32",
        "mea_backward_queries_bf16",
        "mea_backward_queries_f16",
        "mea_backward_keys_f32",
        "mea_backward_keys_bf16",
        "mea_backward_keys_f16",
    ],
    &[],
);

const OP: &str = "memory_efficient_attention";
/// The largest head width the kernels keep in registers (AlphaFold's are 8 to 32, ViT's 64).
const MAX_HEAD_DIM: i64 = 64;
/// The rows (queries, or keys in the backward's second pass) a block of 128 threads owns.
const BLOCK_ROWS: i64 = 32;
const THREADS: u32 = 128;

/// Attention of queries `q` `[batch, heads, queries, dim]` over keys and values `k`, `v`
/// `[batch, heads, keys, dim]`: weights `softmax(q k^T scale + 1e9 (mask - 1) + bias)` with
/// `mask` `[batch, keys]` (1 keeps a key) and `bias` `[heads, queries, keys]` (shared across the
/// batch) or `[batch, heads, queries, keys]`. Differentiable in `q`, `k`, `v` and `bias`.
pub fn memory_efficient_attention(
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
    ensure!(d <= MAX_HEAD_DIM, "{OP}: heads of width {d}; the fused kernel takes at most {MAX_HEAD_DIM}");
    let [q, k, v] = [q, k, v].map(Tensor::contiguous);
    let mask = mask.map(|m| m.to_kind(q.kind()).contiguous());
    let bias_c = bias.map(Tensor::contiguous);
    let mut named = vec![("q", &q), ("k", &k), ("v", &v)];
    named.extend(mask.as_ref().map(|m| ("mask", m)));
    named.extend(bias_c.as_ref().map(|t| ("bias", t)));
    let at = target(OP, Some(q.kind()), &named)?;
    let suffix = dtype(OP, "q", &q)?;
    let rows = b * h * nq;
    let bias_rows = bias_c.as_ref().map_or(0, |t| t.numel() as i64 / nk.max(1));
    // Without keys the weighted sum is empty: zeros, as the composition gives (no launch).
    let out = if nk > 0 { q.f_empty_like()? } else { q.f_zeros_like()? };
    // Each query's largest logit and log-sum of exponentials, apart (see attention.cu).
    let stats = Tensor::f_empty([rows, 2], (Kind::Float, q.device()))?;
    // One block per BLOCK_ROWS rows of each batch element and head (a grid's x is below 2^31).
    let grid = move |n: i64| ceil_div(n, BLOCK_ROWS) * b * h;
    ensure!(grid(nq.max(nk)) < 1 << 31, "{OP}: {b} x {h} x {} rows need more blocks than a launch has", nq.max(nk));
    let blocks = move |n: i64| (grid(n).max(1) as u32, 1, 1);
    let tail =
        move |a: Args| a.i32(h as i32).i32(nq as i32).i32(nk as i32).i32(d as i32).i64(bias_rows).f32(scale as f32);
    if rows > 0 && nk > 0 {
        let a = Args::default().tensor(&q).tensor(&k).tensor(&v).opt(mask.as_ref()).opt(bias_c.as_ref());
        let mut a = tail(a.tensor(&out).tensor(&stats));
        KERNEL.launch(&format!("mea_forward_{suffix}"), at, blocks(nq), THREADS, &mut a)?;
    }
    let mut inputs = vec![&q, &k, &v];
    inputs.extend(bias_c.as_ref());
    let bias_grad = bias.is_some_and(|t| t.requires_grad());
    let bias_shape = bias.map(|t| t.size());
    let mut saved = vec![q.shallow_clone(), k.shallow_clone(), v.shallow_clone(), out.shallow_clone(), stats];
    saved.push(mask.unwrap_or_default());
    saved.push(bias_c.as_ref().map_or_else(Tensor::new, Tensor::shallow_clone));
    let n_inputs = inputs.len();
    let outputs = with_grad(OP, &inputs, vec![out], saved, move |grads, saved| {
        let [q, k, v, out, stats, mask, bias] = saved else { unreachable!("seven tensors saved") };
        let (mask, bias) = (mask.defined().then_some(mask), bias.defined().then_some(bias));
        let dout = grads[0].f_contiguous()?;
        let (dq, dk, dv) = (q.f_zeros_like()?, k.f_zeros_like()?, v.f_zeros_like()?);
        let delta = Tensor::f_empty([rows], (Kind::Float, q.device()))?;
        let dbias = match (bias_grad, &bias_shape) {
            (true, Some(s)) => Some(Tensor::f_zeros(s.as_slice(), (Kind::Float, q.device()))?),
            _ => None,
        };
        if rows > 0 && nk > 0 {
            let a = Args::default().tensor(q).tensor(k).tensor(v).opt(mask).opt(bias).tensor(out).tensor(&dout);
            let a = a.tensor(stats).tensor(&delta).tensor(&dq).opt(dbias.as_ref());
            let mut a = tail(a.i64(rows));
            KERNEL.launch(&format!("mea_backward_queries_{suffix}"), at, blocks(nq), THREADS, &mut a)?;
            let a = Args::default().tensor(q).tensor(k).tensor(v).opt(mask).opt(bias).tensor(&dout).tensor(stats);
            let a = a.tensor(&delta).tensor(&dk).tensor(&dv);
            let mut a = tail(a);
            KERNEL.launch(&format!("mea_backward_keys_{suffix}"), at, blocks(nk), THREADS, &mut a)?;
        }
        let mut out: Vec<Option<Tensor>> = vec![Some(dq), Some(dk), Some(dv)];
        if n_inputs == 4 {
            out.push(match dbias {
                Some(d) => Some(d.f_to_kind(q.kind())?),
                None => None,
            });
        }
        Ok(out)
    })?;
    Ok(outputs.into_iter().next().expect("one output"))
}

/// An attention's sizes: batch, heads, queries, keys and head width.
pub(crate) struct Sizes {
    pub(crate) b: i64,
    pub(crate) h: i64,
    pub(crate) nq: i64,
    pub(crate) nk: i64,
    pub(crate) d: i64,
}

/// The sizes of `q` `[batch, heads, queries, dim]`, checked against `k`, `v` `[batch, heads,
/// keys, dim]`, `mask` `[batch, keys]` and `bias` `[heads, queries, keys]` or `[batch, heads,
/// queries, keys]`; errors name `op` and the argument.
pub(crate) fn sizes(
    op: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<Sizes> {
    let [b, h, nq, d] = q.size()[..] else {
        return Err(crate::Error::invalid(format!("{op}: q is {:?}, expected [batch, heads, queries, dim]", q.size())));
    };
    let nk = k.size().get(2).copied().unwrap_or(0);
    ensure!(
        k.size() == [b, h, nk, d],
        "{op}: k is {:?}, expected [{b}, {h}, keys, {d}] like q {:?}",
        k.size(),
        q.size()
    );
    ensure!(v.size() == k.size(), "{op}: v is {:?}, k is {:?}", v.size(), k.size());
    if let Some(m) = mask {
        ensure!(m.size() == [b, nk], "{op}: mask is {:?}, expected [batch, keys] = [{b}, {nk}]", m.size());
    }
    if let Some(bias) = bias {
        let s = bias.size();
        ensure!(
            s == [h, nq, nk] || s == [b, h, nq, nk],
            "{op}: bias is {s:?}, expected [heads, queries, keys] = [{h}, {nq}, {nk}] or [batch, heads, queries, keys]"
        );
    }
    Ok(Sizes { b, h, nq, nk, d })
}

/// The attention as libtorch's composition: the whole logits, softmaxed, times `v`.
pub(crate) fn composition(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let mut z = q.f_matmul(&k.f_transpose(-2, -1)?)?.f_mul_scalar(scale)?;
    if let Some(m) = mask {
        let (b, nk) = (m.size()[0], m.size()[1]);
        z = z.f_add(&m.f_to_kind(q.kind())?.f_sub_scalar(1.0)?.f_mul_scalar(1e9)?.f_reshape([b, 1, 1, nk])?)?;
    }
    if let Some(bias) = bias {
        z = z.f_add(bias)?;
    }
    Ok(z.f_softmax(-1, None::<Kind>)?.f_matmul(v)?)
}
