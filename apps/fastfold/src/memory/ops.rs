//! The Evoformer block's operations traced on shapes alone (the attentions, transitions,
//! outer product mean and triangle multiplication as `model/msa.rs`, `model/triangle.rs` and
//! `model/attention.rs` allocate and free their buffers), and what the traces share
//! ([`Ctx`]): the pieces [`super::profile`] assembles into one process's pass, [`super::dap`]
//! into a DAP rank's stacks and [`super::multimer`] into AlphaFold-Multimer's pass.
use crate::memory::{Buf, Trace};
use crate::model::config::EvoformerConfig;
use crate::model::exec::{ChunkOp, ChunkPlan, Stage};
use crate::model::AttentionKernel;

/// How an attention without autograd holds its logits, which its memory follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionLogits {
    /// libtorch's scaled-dot-product kernel (the compositions: the CPU, `--kernels torch`) makes
    /// them a block at a time.
    Blocks,
    /// The fused kernels (a GPU's default) make them whole and softmax them in place.
    Whole,
    /// The fused kernels with the tensor-core attention (`--attention flash`) never make them.
    Never,
}

impl AttentionLogits {
    /// The logits of modules running `kernels` with `attention`.
    pub fn of((kernels, attention): (kernels::Backend, AttentionKernel)) -> AttentionLogits {
        match (kernels, attention) {
            (kernels::Backend::Torch, _) => AttentionLogits::Blocks,
            (kernels::Backend::Fused, AttentionKernel::Logits) => AttentionLogits::Whole,
            (kernels::Backend::Fused, AttentionKernel::Flash) => AttentionLogits::Never,
        }
    }

    /// Whether the fused kernels run (they read a transposed LayerNorm input where it lies).
    pub fn fused(self) -> bool {
        self != AttentionLogits::Blocks
    }
}

/// What the traced modules share: the sizes, the chunk plan, the stage, and whether an MSA
/// row the Evoformer runs is masked (AlphaFold-Multimer's stand-in for its masked centres:
/// the MSA attentions then add the key mask's bias to their logits' shape).
pub(super) struct Ctx<'a> {
    pub(super) e: i64,
    pub(super) plan: &'a ChunkPlan,
    pub(super) stage: Stage,
    pub(super) masked_rows: bool,
    /// Whether the attentions' keys include masked ones (a DAP stack's padding of the axis they
    /// attend over): the key mask's bias is then added to the logits' shape, as for
    /// [`Ctx::masked_rows`].
    pub(super) masked_keys: bool,
    pub(super) logits: AttentionLogits,
    pub(super) host_apart: bool,
    /// DAP ranks (1: one process).
    pub(super) ranks: i64,
}

impl Ctx<'_> {
    pub(super) fn chunk(&self, op: ChunkOp) -> Option<i64> {
        self.plan.get(self.stage, op)
    }

    /// Whether the pass is split over DAP ranks.
    pub(super) fn split(&self) -> bool {
        self.ranks > 1
    }

    /// `len` padded to a multiple of the ranks, as the stacks pad a split axis.
    pub(super) fn padded(&self, len: i64) -> i64 {
        (len + self.ranks - 1) / self.ranks * self.ranks
    }

    /// The rows of a rank's block of a split axis of `len`.
    pub(super) fn block(&self, len: i64) -> i64 {
        self.padded(len) / self.ranks
    }

    /// The real rows of rank 0's block (the most any rank holds).
    pub(super) fn real(&self, len: i64) -> i64 {
        self.block(len).min(len)
    }

    /// Whether a LayerNorm reads a transposed input (an MSA's columns, a pair's, each row's
    /// elements adjacent) where it lies: the fused kernel does, libtorch's copies it first.
    pub(super) fn reads_transposed_rows(&self) -> bool {
        self.logits.fused()
    }

    /// Whether the stack of `stage` moves its streams out of the device's memory: it offloads,
    /// on a device apart from the host, in one process (plans for DAP ranks never offload).
    pub(super) fn moves(&self, stage: Stage) -> bool {
        self.host_apart && !self.split() && self.plan.offloads(stage)
    }
}

/// The rows of one chunk: the largest a loop over `len` takes.
pub(super) fn step(len: i64, chunk: Option<i64>) -> i64 {
    chunk.map_or(len, |c| c.min(len)).max(1)
}

/// [`crate::model::layers::chunked`]: `f(rows)` makes one chunk's result (`row_bytes` per
/// row of the output); with more than one chunk the output is allocated after the first and
/// each chunk is copied in.
pub(super) fn chunked(
    t: &mut Trace,
    len: i64,
    chunk: Option<i64>,
    row_bytes: i64,
    mut f: impl FnMut(&mut Trace, i64) -> Buf,
) -> Buf {
    let n = step(len, chunk);
    let first = f(t, n);
    if n >= len {
        return first;
    }
    let out = t.alloc(len * row_bytes);
    t.free(first);
    let next = f(t, n);
    t.free(next);
    out
}

/// [`crate::model::layers::Stream::add_chunked`] on an owned stream: each chunk's update is
/// added in place and freed.
pub(super) fn residual(t: &mut Trace, len: i64, chunk: Option<i64>, f: impl FnOnce(&mut Trace, i64) -> Buf) {
    let u = f(t, step(len, chunk));
    t.free(u);
}

/// LayerNorm of `rows` x `c`: a contiguous copy of an input not read where it lies (`in_place`
/// false; see [`Ctx::reads_transposed_rows`]), the output, and the mean and inverse deviation per
/// row for the call.
pub(super) fn layer_norm(t: &mut Trace, rows: i64, c: i64, e: i64, in_place: bool) -> Buf {
    let copy = (!in_place).then(|| t.alloc(rows * c * e));
    let out = t.alloc(rows * c * e);
    t.temp(2 * rows * e);
    if let Some(copy) = copy {
        t.free(copy);
    }
    out
}

/// `model/attention.rs`'s `Attention::forward` without autograd on `b` x `len` x `c` with
/// `heads` x `dim`: the queries, keys and values, the heads' averaged values, the gate, the
/// output. The averaged values by libtorch's scaled-dot-product kernel (`Blocks`: with a masked
/// key, the key mask's bias added to the pair's [b, heads, len, len]; the kernel's output and
/// the logits' log-sum-exp; its blocks' scratch is small), from whole logits (`Whole`, the
/// fused softmax: the queries and keys, the logits, softmaxed in place into the weights, then
/// the values; every operand made in its product's layout, so no copies; the gate applied in
/// place), or by the tensor-core attention (`Never`: the queries, keys and values, then its
/// output, nothing else).
fn attention(
    t: &mut Trace,
    x: &Ctx,
    (b, len, c): (i64, i64, i64),
    (heads, dim): (i64, i64),
    (masked, strided): (bool, bool),
) -> Buf {
    let e = x.e;
    let hd = b * len * heads * dim * e;
    let avg = match x.logits {
        AttentionLogits::Never => {
            let [q, k, v] = [t.alloc(hd), t.alloc(hd), t.alloc(hd)];
            let avg = t.alloc(hd);
            t.free_all([q, k, v]);
            avg
        }
        AttentionLogits::Blocks => {
            let [q, k, v] = [t.alloc(hd), t.alloc(hd), t.alloc(hd)];
            let bias = masked.then(|| t.alloc(b * heads * len * len * e));
            // A key mask read transposed (the ending node's) lays the summed bias out as it
            // lies, which the kernel copies contiguous.
            let copied = (masked && strided).then(|| t.alloc(b * heads * len * len * e));
            let avg = t.alloc(hd);
            t.temp(b * heads * len * 4);
            t.free_all(copied);
            t.free_all([q, k, v]);
            if let Some(bias) = bias {
                t.free(bias);
            }
            avg
        }
        AttentionLogits::Whole => {
            let [q, k] = [t.alloc(hd), t.alloc(hd)];
            let weights = t.alloc(b * heads * len * len * e);
            t.free_all([q, k]);
            let v = t.alloc(hd);
            let avg = t.alloc(hd);
            t.free_all([v, weights]);
            avg
        }
    };
    let gate = t.alloc(hd);
    t.free(gate);
    let out = t.alloc(b * len * c * e);
    t.free(avg);
    out
}

/// `model/msa.rs`'s `pair_bias` of the pair [r, r, c_z]: `[heads, r, r]`, the normalised pair
/// `chunk` rows at a time (`contiguous`: the rows are the pair's own, not the transposed
/// pair's).
pub(super) fn pair_bias(t: &mut Trace, x: &Ctx, r: i64, c_z: i64, heads: i64, op: ChunkOp, contiguous: bool) -> Buf {
    let e = x.e;
    chunked(t, r, x.chunk(op), heads * r * e, |t, n| {
        let normed = layer_norm(t, n * r, c_z, e, contiguous || x.reads_transposed_rows());
        let out = t.alloc(heads * n * r * e);
        t.free(normed);
        out
    })
}

/// Attention with a bias from the pair [r, r, c_z] over `batch` rows of `r` entries of `c`
/// channels, updated in place: `model/msa.rs`'s `MsaRowAttentionWithPairBias::update` (the
/// MSA's sequences) and `model/triangle.rs`'s `TriangleAttention::update` (the pair's rows,
/// `contiguous`, or columns).
pub(super) fn biased_attention(
    t: &mut Trace,
    x: &Ctx,
    op: ChunkOp,
    batch: i64,
    (r, c_z): (i64, i64),
    (c, heads, dim): (i64, i64, i64),
    contiguous: bool,
) {
    let bias = pair_bias(t, x, r, c_z, heads, op, contiguous);
    biased_update(t, x, op, (batch, r), (c, heads, dim), contiguous);
    t.free(bias);
}

/// [`biased_attention`]'s update of `batch` rows of `r` entries once its bias is made.
pub(super) fn biased_update(
    t: &mut Trace,
    x: &Ctx,
    op: ChunkOp,
    (batch, r): (i64, i64),
    (c, heads, dim): (i64, i64, i64),
    contiguous: bool,
) {
    let e = x.e;
    let masked = x.masked_keys || (x.masked_rows && op == ChunkOp::MsaRowAttention);
    residual(t, batch, x.chunk(op), |t, n| {
        let normed = layer_norm(t, n * r, c, e, contiguous || x.reads_transposed_rows());
        let out = attention(t, x, (n, r, c), (heads, dim), (masked, !contiguous));
        t.free(normed);
        out
    });
}

/// `model/msa.rs`'s `MsaColumnAttention::update`: residues at a time, each chunk's transposed
/// rows normalised.
pub(super) fn msa_column_attention(t: &mut Trace, x: &Ctx, s: i64, r: i64, c: i64, heads: i64, dim: i64) {
    let e = x.e;
    residual(t, r, x.chunk(ChunkOp::MsaColumnAttention), |t, n| {
        let normed = layer_norm(t, n * s, c, e, x.reads_transposed_rows());
        let out = attention(t, x, (n, s, c), (heads, dim), (x.masked_keys || x.masked_rows, false));
        t.free(normed);
        out
    });
}

/// `model/msa.rs`'s `MsaColumnGlobalAttention::update` (the extra-MSA stack) with
/// `model/attention.rs`'s `GlobalAttention::forward`.
pub(super) fn msa_column_global_attention(t: &mut Trace, x: &Ctx, s: i64, r: i64, c: i64, heads: i64, dim: i64) {
    let e = x.e;
    residual(t, r, x.chunk(ChunkOp::MsaColumnAttention), |t, n| {
        let normed = layer_norm(t, n * s, c, e, x.reads_transposed_rows());
        let rows = n * s;
        // The masked mean of the queries' inputs: x * mask, summed (small terms left out).
        t.temp(rows * c * e);
        let (k, v) = (t.alloc(rows * dim * e), t.alloc(rows * dim * e));
        // The key mask's bias [n, 1, s].
        let bias = t.alloc(rows * e);
        // The weights [n, heads, s] and the gate [n, s, heads, dim]: each the product, + bias,
        // softmax or sigmoid, a new tensor at each step of one statement. The products read
        // their operands as views (no copies).
        let three = |t: &mut Trace, bytes: i64| {
            let (a, b) = (t.alloc(bytes), t.alloc(bytes));
            let c = t.alloc(bytes);
            t.free_all([a, b]);
            c
        };
        let weights = three(t, rows * heads * e);
        let hd = rows * heads * dim * e;
        let gate = three(t, hd);
        let gated = t.alloc(hd);
        // The output projection, then + bias.
        let o = t.alloc(rows * c * e);
        let out = t.alloc(rows * c * e);
        t.free_all([o, gated, gate, weights, bias, k, v, normed]);
        out
    });
}

/// `model/msa.rs`'s `Transition::update` of `rows` x `c` split along a dim of `len`.
pub(super) fn transition(t: &mut Trace, x: &Ctx, len: i64, row: i64, c: i64, factor: i64, op: ChunkOp) {
    let e = x.e;
    residual(t, len, x.chunk(op), |t, n| {
        let normed = layer_norm(t, n * row, c, e, true);
        let h = t.alloc(n * row * factor * c * e);
        t.free(normed);
        let out = t.alloc(n * row * c * e);
        t.free(h);
        out
    });
}

/// `model/msa.rs`'s `OuterProductMean::update`: the mask's norm, then per batch of
/// sequences (every batch the first's shape or smaller) its normalised MSA, projections and
/// pair chunks; with the MSA on the host (`streamed`), each batch moved to the device first.
pub(super) fn outer_product_mean(
    t: &mut Trace,
    x: &Ctx,
    (s, r): (i64, i64),
    (c_m, channels, c_z): (i64, i64, i64),
    streamed: bool,
) {
    let e = x.e;
    let (mc, norm) = (t.alloc(s * r * e), t.alloc(r * r * e));
    t.free(mc);
    let batch = step(s, x.chunk(ChunkOp::OuterProductMeanSequences));
    let moved = streamed.then(|| t.alloc(batch * r * c_m * e));
    let normed = layer_norm(t, batch * r, c_m, e, true);
    if let Some(b) = moved {
        t.free(b);
    }
    let (left, right) = (t.alloc(batch * r * channels * e), t.alloc(batch * r * channels * e));
    t.free(normed);
    residual(t, r, x.chunk(ChunkOp::OuterProductMean), |t, n| {
        let outer = t.alloc(n * r * channels * channels * e);
        let flat = t.alloc(n * r * channels * channels * e);
        t.free(outer);
        let y = t.alloc(n * r * c_z * e);
        t.free(flat);
        t.temp(n * r * e);
        y
    });
    for b in [left, right, norm] {
        t.free(b);
    }
}

/// `model/triangle.rs`'s gated projection of `rows` normalised entries to `c` channels: the
/// projection and its gate.
pub(super) fn gated(t: &mut Trace, rows: i64, c: i64, e: i64) -> Buf {
    let y = t.alloc(rows * c * e);
    t.temp(rows * c * e);
    y
}

/// `model/triangle.rs`'s `TriangleMultiplication::update` of the pair [r, r, c_z] through `c`
/// channels: the other endpoint's projection whole, channel-first (each chunk of it copied so
/// as it is made), then per chunk the chunk's projection, the product over k (bmm's scratch, 4 r (n + r) bytes as measured), its norm (of the
/// product's strided layout) and the gated output.
pub(super) fn triangle_multiplication(t: &mut Trace, x: &Ctx, r: i64, c_z: i64, c: i64, outgoing: bool) {
    let e = x.e;
    let chunk = x.chunk(ChunkOp::TriangleMultiplication);
    let right = triangle_projection(t, x, (r, r), (c_z, c));
    residual(t, r, chunk, |t, n| {
        let normed = layer_norm(t, n * r, c_z, e, outgoing || x.reads_transposed_rows());
        let left = gated(t, n * r, c, e);
        let prod = t.alloc(n * r * c * e);
        t.temp(4 * r * (n + r));
        t.free(left);
        let centred = layer_norm(t, n * r, c, e, false);
        t.free(prod);
        let out = gated(t, n * r, c_z, e);
        t.free(centred);
        t.free(normed);
        out
    });
    t.free(right);
}

/// `model/triangle.rs`'s `TriangleMultiplication::projection`: one side's gated projection of
/// `len` pair rows of `width` entries to `c` channels, made [`ChunkOp::TriangleMultiplication`]
/// rows at a time, each chunk laid out as the product reads it as it is made (the chunk's
/// input freed first) and written into the whole.
pub(super) fn triangle_projection(t: &mut Trace, x: &Ctx, (len, width): (i64, i64), (c_z, c): (i64, i64)) -> Buf {
    let e = x.e;
    chunked(t, len, x.chunk(ChunkOp::TriangleMultiplication), width * c * e, |t, n| {
        let normed = layer_norm(t, n * width, c_z, e, true);
        let p = gated(t, n * width, c, e);
        t.free(normed);
        let laid_out = t.alloc(n * width * c * e);
        t.free(p);
        laid_out
    })
}

/// The widths of a stack's MSA: channels, attention heads and their width (the extra-MSA
/// stack's, or the Evoformer's).
pub(super) fn msa_widths(cfg: &EvoformerConfig, extra: bool) -> (i64, i64, i64) {
    match extra {
        true => (cfg.c_e, cfg.extra_heads, cfg.extra_head_dim),
        false => (cfg.c_m, cfg.msa_heads, cfg.msa_head_dim),
    }
}
