//! One rank's share of an inference pass under DAP (`--nproc`), traced as
//! [`super::profile`] traces one process: the stacks' blocks on the rank's rows or columns of
//! the MSA and pair (`model/evoformer.rs`'s `BlockLayers::run` with a group), with the buffers
//! of the layout switches and gathers as `engine`'s collectives make them. The rank traced is
//! rank 0, which holds the most real rows; every rank holds blocks of the same padded shape.
//!
//! What the collectives hold (`engine/src/autograd/collectives.rs`, `engine/src/dist/group.rs`):
//! an all-to-all from rows to columns stacks the blocks it sends (a copy) and receives into a
//! buffer that becomes the result; from columns to rows it sends the contiguous tensor as it
//! lies and joins what it receives along the rows (a copy); so each switch holds three times the
//! rank's stream at its height. An all-gather copies a non-contiguous input first and holds the
//! whole result.
use crate::memory::ops::{
    biased_update, chunked, gated, layer_norm, msa_column_attention, msa_column_global_attention, msa_widths, residual,
    step, transition, triangle_projection, Ctx,
};
use crate::memory::{Buf, Trace};
use crate::model::config::EvoformerConfig;
use crate::model::exec::ChunkOp;

/// `Dap::row_to_col` (`to_columns`) or `Dap::col_to_row` of a stream whose rank block is
/// `bytes`: the switched stream, the old one freed.
fn switch(t: &mut Trace, stream: Buf, bytes: i64, to_columns: bool) -> Buf {
    let out = match to_columns {
        true => {
            let stacked = t.alloc(bytes);
            let received = t.alloc(bytes);
            t.free(stacked);
            received
        }
        false => {
            let received = t.alloc(bytes);
            let joined = t.alloc(bytes);
            t.free(received);
            joined
        }
    };
    t.free(stream);
    out
}

/// `Dap::all_gather` of a rank's `bytes` (`contiguous` or not as it is given): the whole result,
/// `ranks` blocks.
fn all_gather(t: &mut Trace, x: &Ctx, bytes: i64, contiguous: bool) -> Buf {
    let copy = (!contiguous).then(|| t.alloc(bytes));
    let out = t.alloc(x.ranks * bytes);
    t.free_all(copy);
    out
}

/// What the embedders made of a rank's real rows laid out in its zero-padded block of `bytes`
/// (`PairRows::into_block`, `zero_padded`): the block, the real rows freed. One process: as is.
pub(super) fn into_block(t: &mut Trace, x: &Ctx, real: Buf, bytes: i64) -> Buf {
    if !x.split() {
        return real;
    }
    let block = t.alloc(bytes);
    t.free(real);
    block
}

/// `model/alphafold.rs`'s `evoformer_msa_input` on rank 0 (every row in one process): of the
/// `rows` MSA rows that run, the first `own` the MSA's own (of the `all` its features hold) and
/// the rest template rows (of the `templates` the templates make, which the caller holds), the
/// rank's block of them. The MSA's rows are picked from their features when not all of
/// them (on the host where the device holds no features), made by `embed` (the features moved
/// and embedded) with the recycled `row` added to row 0 (`row` then freed), the template rows
/// joined (picked too, when the rank holds only some); under DAP the block zero-padded.
pub(super) fn msa_input(
    t: &mut Trace,
    x: &Ctx,
    (rows, own, all, templates): (i64, i64, i64, i64),
    (n, c_m, features): (i64, i64, i64),
    row: Buf,
    embed: impl FnOnce(&mut Trace, i64) -> Buf,
) -> Buf {
    let e = x.e;
    let real = x.real(rows);
    let from_msa = real.min(own).max(1);
    let picked = (from_msa < all && !x.host_apart).then(|| t.alloc(from_msa * n * features * e));
    let mut msa = embed(t, from_msa);
    t.free_all(picked);
    t.temp(n * c_m * e);
    t.free(row);
    let from_templates = real - from_msa;
    if from_templates > 0 {
        let picked = (from_templates < templates).then(|| t.alloc(from_templates * n * c_m * e));
        let joined = t.alloc(real * n * c_m * e);
        t.free_all(picked);
        t.free(msa);
        msa = joined;
    }
    into_block(t, x, msa, x.block(rows) * x.padded(n) * c_m * e)
}

/// `StackMsa::first_row`: row 0 of the stack's MSA [n, c_m] in a tensor of its own; under DAP
/// each rank's first row gathered first.
pub(super) fn first_row(t: &mut Trace, x: &Ctx, n: i64, c_m: i64) -> Buf {
    let gathered = x.split().then(|| all_gather(t, x, x.padded(n) * c_m * x.e, true));
    let own = t.alloc(n * c_m * x.e);
    t.free_all(gathered);
    own
}

/// The masked-MSA logits of the stack's MSA (`StackMsa::map_rows`): `s` rows of `n` residues
/// in one process; under DAP the head over the rank's block of the `rows` rows that ran (its
/// real residues, copied where the residues are padded), the blocks' logits gathered.
pub(super) fn msa_logits(t: &mut Trace, x: &Ctx, (s, rows, n): (i64, i64, i64), c_m: i64, classes: i64) -> Buf {
    let e = x.e;
    if !x.split() {
        return t.alloc(s * n * classes * e);
    }
    let block = x.block(rows);
    let copy = (x.padded(n) != n).then(|| t.alloc(block * n * c_m * e));
    let out = t.alloc(block * n * classes * e);
    t.free_all(copy);
    let gathered = all_gather(t, x, block * n * classes * e, true);
    t.free(out);
    gathered
}

/// `model/msa.rs`'s `pair_bias` on the rank's `b` pair rows of `rp` entries: each chunk's rows
/// normalised and projected, the rank's `[heads, b, rp]` (contiguous once chunks are joined, the
/// einsum's permuted output otherwise: a copy for the gather either way), then every rank's.
fn pair_bias(t: &mut Trace, x: &Ctx, (b, rp): (i64, i64), c_z: i64, heads: i64, op: ChunkOp, contiguous: bool) -> Buf {
    let e = x.e;
    let local = chunked(t, b, x.chunk(op), heads * rp * e, |t, n| {
        let normed = layer_norm(t, n * rp, c_z, e, contiguous || x.reads_transposed_rows());
        let out = t.alloc(heads * n * rp * e);
        t.free(normed);
        out
    });
    let whole = all_gather(t, x, heads * b * rp * e, false);
    t.free(local);
    whole
}

/// `model/msa.rs`'s `OuterProductMean::update` of the rank's `b` pair rows from the MSA's
/// columns [sp, b, c_m]: the masks' norm, then per batch of sequences its normalised rows, the
/// left projection and the right one gathered from every rank (`[rp, k, ch]` read as
/// `[k, rp, ch]`, which the outer product's einsum copies into its layout per chunk of rows).
fn outer_product_mean(t: &mut Trace, x: &Ctx, (sp, b, rp): (i64, i64, i64), (c_m, channels, c_z): (i64, i64, i64)) {
    let e = x.e;
    let (mc, norm) = (t.alloc(sp * b * e), t.alloc(b * rp * e));
    t.free(mc);
    let k = step(sp, x.chunk(ChunkOp::OuterProductMeanSequences));
    let normed = layer_norm(t, k * b, c_m, e, true);
    let left = t.alloc(k * b * channels * e);
    let own = t.alloc(k * b * channels * e);
    let right = all_gather(t, x, k * b * channels * e, false);
    t.free(own);
    t.free(normed);
    residual(t, b, x.chunk(ChunkOp::OuterProductMean), |t, n| {
        let copied = t.alloc(k * rp * channels * e);
        let outer = t.alloc(n * rp * channels * channels * e);
        t.free(copied);
        let flat = t.alloc(n * rp * channels * channels * e);
        t.free(outer);
        let y = t.alloc(n * rp * c_z * e);
        t.free(flat);
        t.temp(n * rp * e);
        y
    });
    t.free_all([left, right, norm]);
}

/// `model/triangle.rs`'s `TriangleMultiplication::add_by_ring` on the rank's pair block
/// `[len, width, c_z]` (outgoing: its `b` rows of `rp`; incoming: the columns' layout,
/// `[rp, b]`): both sides' gated projections of the block, normalised and projected chunks of
/// its `len` rows at a time and laid out as the product reads them; then the right side's
/// block goes around the ring `chunk` of its `b` rows at a time, each piece received into a
/// buffer of its own while the one held gives the update of as many of the other endpoint's
/// positions (the product over k, its norm, the pair's entries there normalised, the gated
/// output, added in place).
fn ring_triangle_multiplication(
    t: &mut Trace,
    x: &Ctx,
    (len, width): (i64, i64),
    (c_z, c): (i64, i64),
    outgoing: bool,
) {
    let e = x.e;
    let chunk = x.chunk(ChunkOp::TriangleMultiplication);
    let b = len.min(width);
    let rp = len.max(width);
    let own = triangle_projection(t, x, (len, width), (c_z, c));
    let left = triangle_projection(t, x, (len, width), (c_z, c));
    let n = step(b, chunk);
    let piece = n * c * rp * e;
    // Outgoing reads the pair's columns (a strided view), incoming its rows.
    let entries_in_place = !outgoing || x.reads_transposed_rows();
    let mut held: Option<Buf> = None;
    for hop in 0..x.ranks {
        let next = (hop + 1 < x.ranks).then(|| t.alloc(piece));
        let prod = t.alloc(c * b * n * e);
        let centred = layer_norm(t, b * n, c, e, false);
        t.free(prod);
        let entries = layer_norm(t, b * n, c_z, e, entries_in_place);
        let update = gated(t, b * n, c_z, e);
        t.free_all([centred, entries, update]);
        t.free_all(held.take());
        held = next;
    }
    t.free_all(held);
    t.free_all([own, left]);
}

/// One block of `model/evoformer.rs`'s stack on rank 0 of a DAP group (`EvoformerBlock::run`),
/// the MSA `[s, r, c]` and pair `[r, r, c_z]` given as the rank's blocks of their padded rows
/// (`[sp / ranks, rp, c]`, `[rp / ranks, rp, c_z]`): row attention on the MSA's rows with the
/// pair's bias gathered, the MSA switched to columns for its column attention, transition and
/// outer product mean (AlphaFold-Multimer's first, on a copy of the input MSA in columns), and
/// switched back to rows while the pair's updates run (the switch in
/// flight holds the columns and what it receives); the triangle multiplications by the ring,
/// outgoing on rows, incoming on columns; the triangle attentions on rows and columns with
/// their biases gathered; the pair transition on columns. The padded masks live through the
/// stack. Returns the streams as the stack leaves them, the rank's rows of each.
pub(super) fn stack(
    t: &mut Trace,
    x: &Ctx,
    cfg: &EvoformerConfig,
    (s, r): (i64, i64),
    extra: bool,
    streams: (Buf, Buf),
) -> (Buf, Buf) {
    let (c, heads, dim) = msa_widths(cfg, extra);
    let (c_z, e) = (cfg.c_z, x.e);
    let (sp, rp) = (x.padded(s), x.padded(r));
    let (sb, b) = (x.block(s), x.block(r));
    let (msa_bytes, pair_bytes) = (sb * rp * c * e, b * rp * c_z * e);
    let masks = [((sp, rp) != (s, r)).then(|| t.alloc(sp * rp * e)), (rp != r).then(|| t.alloc(rp * rp * e))];
    let (msa, mut pair) = streams;
    // The attentions over a padded axis mask the padding's keys.
    let over_residues = Ctx { masked_keys: rp != r, ..*x };
    let over_sequences = Ctx { masked_keys: sp != s, ..*x };
    let opm = (c, cfg.opm_channels, c_z);
    if cfg.outer_product_mean_first {
        // AlphaFold-Multimer's order: the outer product mean of the block's input MSA, switched
        // to columns for it (a copy: the MSA stays in rows).
        t.at("outer product mean");
        let stacked = t.alloc(msa_bytes);
        let columns = t.alloc(msa_bytes);
        t.free(stacked);
        outer_product_mean(t, x, (sp, b, rp), opm);
        t.free(columns);
    }
    t.at(if extra { "extra-MSA row attention" } else { "MSA row attention" });
    let bias = pair_bias(t, x, (b, rp), c_z, heads, ChunkOp::MsaRowAttention, true);
    biased_update(t, &over_residues, ChunkOp::MsaRowAttention, (sb, rp), (c, heads, dim), true);
    t.free(bias);
    let columns = switch(t, msa, msa_bytes, true);
    t.at(if extra { "extra-MSA column global attention" } else { "MSA column attention" });
    match extra {
        true => msa_column_global_attention(t, x, sp, b, c, heads, dim),
        false => msa_column_attention(t, &over_sequences, sp, b, c, heads, dim),
    }
    t.at("MSA transition");
    transition(t, x, sp, b, c, cfg.transition_factor, ChunkOp::MsaTransition);
    if !cfg.outer_product_mean_first {
        t.at("outer product mean");
        outer_product_mean(t, x, (sp, b, rp), opm);
    }
    // The MSA's switch back to rows, launched now and waited for at the block's end.
    let receiving = t.alloc(msa_bytes);
    t.at("triangle multiplication");
    ring_triangle_multiplication(t, x, (b, rp), (c_z, cfg.tri_mul_channels), true);
    pair = switch(t, pair, pair_bytes, true);
    ring_triangle_multiplication(t, x, (rp, b), (c_z, cfg.tri_mul_channels), false);
    pair = switch(t, pair, pair_bytes, false);
    t.at("triangle attention");
    let widths = (c_z, cfg.pair_heads, cfg.pair_head_dim);
    let bias = pair_bias(t, x, (b, rp), c_z, cfg.pair_heads, ChunkOp::TriangleAttention, true);
    biased_update(t, &over_residues, ChunkOp::TriangleAttention, (b, rp), widths, true);
    t.free(bias);
    pair = switch(t, pair, pair_bytes, true);
    let bias = pair_bias(t, x, (b, rp), c_z, cfg.pair_heads, ChunkOp::TriangleAttention, false);
    biased_update(t, &over_residues, ChunkOp::TriangleAttention, (b, rp), widths, false);
    t.free(bias);
    t.at("pair transition");
    transition(t, x, rp, b, c_z, cfg.transition_factor, ChunkOp::PairTransition);
    pair = switch(t, pair, pair_bytes, false);
    t.at("MSA layout switch");
    let msa = t.alloc(msa_bytes);
    t.free_all([receiving, columns]);
    t.free_all(masks.into_iter().flatten());
    (msa, pair)
}
