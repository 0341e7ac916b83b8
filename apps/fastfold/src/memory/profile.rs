//! The inference forward of one recycling pass traced on shapes alone: one function per module,
//! mirroring its code in `model/` (the order its buffers are allocated and freed, with
//! libtorch's own copies inside `einsum`, `layer_norm` and broadcasting `matmul`, as measured
//! on the CPU), under a [`ChunkPlan`]. The streams (MSA, pair) are updated in place, as the
//! no-grad forward does ([`crate::model::layers::Stream`]); the kernels are libtorch's
//! compositions on one rank. `tests/memory.rs` checks the peak against the CPU allocator's.
//!
//! Assumed: MSA and extra-MSA rows and templates without fully-masked padding (the stacks
//! leave those out anyway).
use crate::memory::ops::{
    biased_attention, biased_update, chunked, layer_norm, msa_column_attention, msa_column_global_attention,
    msa_widths, outer_product_mean, pair_bias, residual, step, transition, triangle_multiplication, AttentionLogits,
    Ctx,
};
use crate::memory::{dap, Buf, Trace};
use crate::model::config::{EvoformerConfig, ModelConfig, StructureConfig, TemplateConfig};
use crate::model::exec::{ChunkOp, ChunkPlan, Stage};
use crate::model::multimer::msa_feat::MSA_FEAT;
use crate::model::pair_rows::SYMMETRISE_BLOCK;
use crate::model::templates::{ANGLE_FEATURES, DGRAM_BINS, PAIR_FEATURES};

/// The sizes of one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// Residues N.
    pub residues: i64,
    /// MSA rows the Evoformer runs (the clusters; single-sequence mode: 1). The monomer's
    /// Evoformer runs the templates' rows beside them when its parameters embed the templates'
    /// torsion angles; AlphaFold-Multimer's count them here.
    pub msa_rows: i64,
    /// Extra-MSA rows the extra-MSA stack runs (at least 1).
    pub extra_rows: i64,
    /// Templates through the template stack (0: none, or parameters without one).
    pub templates: i64,
    /// Bytes per activation element: 4 (fp32) or 2 (bf16).
    pub elem: i64,
    /// How the attentions hold their logits (the fused kernels' whole logits by default on a
    /// GPU, libtorch's blocks on the CPU).
    pub logits: AttentionLogits,
    /// Whether the device's memory is apart from the host's (a GPU): what an offloading stack
    /// ([`ChunkPlan::offloading`]) moves to the host then leaves the device. On the CPU the
    /// moves are the identity and the trace is the one without them.
    pub host_apart: bool,
    /// The DAP ranks the pass is split over (`--nproc`; 1: one process). Over several, the
    /// trace is rank 0's, which holds the most real rows (`memory/dap.rs`).
    pub ranks: i64,
}

/// A pass's peak of live bytes beyond what was alive before it (parameters, features), the
/// previous pass's recycled outputs included, and where it happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peak {
    /// Bytes.
    pub bytes: u64,
    /// The module at the peak.
    pub at: &'static str,
}

/// `model/evoformer.rs`'s `EvoformerStack::forward` of `x`'s stage on streams given up, on
/// one rank: the MSA [s, r, c] (moved to the host first when the stack moves its streams off
/// the device, [`Ctx::moves`]) and the pair updated in place by one block
/// (`EvoformerBlock::run`), which leaves them where it found them, so that one block's peak is
/// the stack's. Returns the streams where the stack leaves them.
pub(super) fn stack(
    t: &mut Trace,
    x: &Ctx,
    cfg: &EvoformerConfig,
    (s, r): (i64, i64),
    extra: bool,
    streams: (Buf, Buf),
) -> (Buf, Buf) {
    if x.split() {
        return dap::stack(t, x, cfg, (s, r), extra, streams);
    }
    let (c, heads, dim) = msa_widths(cfg, extra);
    let (c_z, e) = (cfg.c_z, x.e);
    let moves = x.moves(x.stage);
    let (mut msa, mut pair) = streams;
    if moves {
        msa = t.to_host(msa);
    }
    t.at(if extra { "extra-MSA row attention" } else { "MSA row attention" });
    let bias = pair_bias(t, x, r, c_z, heads, ChunkOp::MsaRowAttention, true);
    if moves {
        pair = t.to_host(pair);
        msa = t.to_device(msa, s * r * c * e);
    }
    biased_update(t, x, ChunkOp::MsaRowAttention, (s, r), (c, heads, dim), true);
    t.free(bias);
    t.at(if extra { "extra-MSA column global attention" } else { "MSA column attention" });
    match extra {
        true => msa_column_global_attention(t, x, s, r, c, heads, dim),
        false => msa_column_attention(t, x, s, r, c, heads, dim),
    }
    t.at("MSA transition");
    transition(t, x, s, r, c, cfg.transition_factor, ChunkOp::MsaTransition);
    if moves {
        msa = t.to_host(msa);
        pair = t.to_device(pair, r * r * c_z * e);
    }
    t.at("outer product mean");
    outer_product_mean(t, x, (s, r), (c, cfg.opm_channels, c_z), moves);
    t.at("triangle multiplication");
    triangle_multiplication(t, x, r, c_z, cfg.tri_mul_channels, true);
    triangle_multiplication(t, x, r, c_z, cfg.tri_mul_channels, false);
    t.at("triangle attention");
    for starting in [true, false] {
        let widths = (c_z, cfg.pair_heads, cfg.pair_head_dim);
        biased_attention(t, x, ChunkOp::TriangleAttention, r, (r, c_z), widths, starting);
    }
    t.at("pair transition");
    transition(t, x, r, r, c_z, cfg.transition_factor, ChunkOp::PairTransition);
    (msa, pair)
}

/// `FeatureProjections::embed_msa`: the two projections, the single one added to the MSA's in
/// place; with `upload`, `msa_feat` [s, n, 49] brought from the host for them (a GPU's
/// `predict` keeps it there).
pub(super) fn input_msa(t: &mut Trace, e: i64, (n, s): (i64, i64), c_m: i64, upload: bool) -> Buf {
    let feat = upload.then(|| t.alloc(s * n * MSA_FEAT * e));
    let (msa, single) = (t.alloc(s * n * c_m * e), t.alloc(n * c_m * e));
    t.free(single);
    t.free_all(feat);
    msa
}

/// `FeatureProjections::embed_pair`: the two single projections, then the pair rows (under DAP
/// the rank's real rows) a chunk at a time: the chunk's left + right single projections, its
/// relative encoding projected (`relative(t, rows)`, the model's: [`relative_positions`] for
/// the monomer), their sum.
pub(super) fn input_pair(t: &mut Trace, x: &Ctx, n: i64, c_z: i64, relative: impl Fn(&mut Trace, i64) -> Buf) -> Buf {
    let e = x.e;
    let (left, right) = (t.alloc(n * c_z * e), t.alloc(n * c_z * e));
    let pair = chunked(t, x.real(n), x.chunk(ChunkOp::PairEmbedding), n * c_z * e, |t, rows| {
        let sum = t.alloc(rows * n * c_z * e);
        let act = relative(t, rows);
        let out = t.alloc(rows * n * c_z * e);
        t.free(sum);
        t.free(act);
        out
    });
    t.free(left);
    t.free(right);
    pair
}

/// The monomer's relative positions of `rows` x `n` residue pairs projected to `c_z`: the
/// offsets as int64, clamped, their one-hot of `bins` (int64, then the model's kind).
fn relative_positions(t: &mut Trace, e: i64, (rows, n): (i64, i64), bins: i64, c_z: i64) -> Buf {
    let offset = t.alloc(rows * n * 8);
    let shifted = t.alloc(rows * n * 8);
    let clamped = t.alloc(rows * n * 8);
    t.free(shifted);
    let one_hot = t.alloc(rows * n * bins * 8);
    let rel = t.alloc(rows * n * bins * e);
    for b in [one_hot, clamped, offset] {
        t.free(b);
    }
    let act = t.alloc(rows * n * c_z * e);
    t.free(rel);
    act
}

/// `RecyclingEmbedder::first_row`: the previous first row normalised.
pub(super) fn recycled_row(t: &mut Trace, e: i64, n: i64, c_m: i64) -> Buf {
    layer_norm(t, n, c_m, e, true)
}

/// `RecyclingEmbedder::update_pair`: the previous pair normalised and the pseudo-beta
/// distances embedded, each added in place rows (under DAP the rank's real rows) at a time.
/// A rank's previous pair is its padded block: its real part's rows are not contiguous where
/// the columns are padded.
pub(super) fn recycling_pair(t: &mut Trace, x: &Ctx, n: i64, c_z: i64, model: &ModelConfig) {
    let e = x.e;
    let chunk = x.chunk(ChunkOp::PairEmbedding);
    let contiguous = x.padded(n) == n || x.reads_transposed_rows();
    residual(t, x.real(n), chunk, |t, rows| layer_norm(t, rows * n, c_z, e, contiguous));
    residual(t, x.real(n), chunk, |t, rows| {
        let bins = model.recycle_bins;
        let diff = t.alloc(rows * n * 3 * e);
        let squared = t.alloc(rows * n * 3 * e);
        let d2 = t.alloc(rows * n * e);
        t.free(squared);
        let (gt, lt, and) = (t.alloc(rows * n * bins), t.alloc(rows * n * bins), t.alloc(rows * n * bins));
        let dgram = t.alloc(rows * n * bins * e);
        for b in [and, lt, gt, d2, diff] {
            t.free(b);
        }
        let out = t.alloc(rows * n * c_z * e);
        t.free(dgram);
        out
    });
}

/// `model/embedders.rs`'s `ExtraMsaEmbedder::forward`: the one-hot (int64, then the model's
/// kind), the joined feature, the projection, rows at a time; made on the host (each chunk
/// moved as it is made: the output holds no device bytes) when the extra-MSA stack moves its
/// streams off the device. Whole, the one chunk is the device's until the stack moves it,
/// with nothing made in between.
pub(super) fn extra_msa_embedder(t: &mut Trace, x: &Ctx, (n, rows): (i64, i64), c_e: i64, upload: bool) -> Buf {
    let e = x.e;
    let row_bytes = if x.moves(Stage::ExtraMsa) { 0 } else { n * c_e * e };
    chunked(t, rows, x.chunk(ChunkOp::ExtraMsaEmbedding), row_bytes, |t, k| {
        // With `upload`, the chunk's rows of the features (classes in int64, two floats) come
        // from the host for the chunk (a GPU's monomer `predict` keeps them there).
        let uploaded = upload.then(|| [t.alloc(k * n * 8), t.alloc(k * n * e), t.alloc(k * n * e)]);
        let one_hot = t.alloc(k * n * 23 * 8);
        let float = t.alloc(k * n * 23 * e);
        let feat = t.alloc(k * n * 25 * e);
        t.free(one_hot);
        t.free(float);
        let out = t.alloc(k * n * c_e * e);
        t.free(feat);
        t.free_all(uploaded.into_iter().flatten());
        out
    })
}

/// `model/structure.rs`'s `global_points` of `points` per head: the projection, the rotations
/// broadcast (copied) over the points, the strided coordinates copied, the product and the
/// translated result.
fn global_points(t: &mut Trace, n: i64, heads: i64, points: i64, e: i64) -> Buf {
    let hp = n * heads * points;
    let local = t.alloc(3 * hp * e);
    let (rot, xyz, prod) = (t.alloc(9 * hp * 4), t.alloc(3 * hp * 4), t.alloc(3 * hp * 4));
    let out = t.alloc(3 * hp * 4);
    for b in [rot, xyz, prod, local] {
        t.free(b);
    }
    out
}

/// `model/structure.rs`'s invariant point attention on `n` residues, `chunk` query rows at a
/// time (the logit terms in fp32), each chunk's pair rows normalised as it reads them when
/// `by_rows`.
fn invariant_point_attention(t: &mut Trace, x: &Ctx, n: i64, c: &StructureConfig, by_rows: bool) {
    let real = x.real(n);
    let e = x.e;
    let (h, f) = (c.heads, 4);
    let bf16 = e != 4;
    let q = t.alloc(n * h * c.c_ipa * e);
    let kv = t.alloc(2 * n * h * c.c_ipa * e);
    let kv32 = bf16.then(|| t.alloc(2 * n * h * c.c_ipa * 4));
    let q_pts = global_points(t, n, h, c.qk_points, e);
    let kv_pts = global_points(t, n, h, c.qk_points + c.v_points, e);
    let width = h * c.c_ipa + 4 * h * c.v_points + h * c.c_z;
    let features = chunked(t, real, x.chunk(ChunkOp::StructureAttention), width * f, |t, rows| {
        let q32 = bf16.then(|| t.alloc(rows * h * c.c_ipa * 4));
        let plane = h * rows * n * f;
        // Scalar logits: bmm copies of the queries and keys, the product, its scaling.
        let (qc, kc) = (t.alloc(rows * h * c.c_ipa * f), t.alloc(n * h * c.c_ipa * f));
        let product = t.alloc(plane);
        let scalar = t.alloc(plane);
        t.free_all([product, qc, kc]);
        let diff = t.alloc(plane * c.qk_points * 3);
        let squared = t.alloc(plane * c.qk_points * 3);
        let dist2 = t.alloc(plane);
        t.free(squared);
        t.free(diff);
        let scaled = t.alloc(plane);
        let points = t.alloc(plane);
        t.free(scaled);
        t.free(dist2);
        let normed = by_rows.then(|| layer_norm(t, rows * n, c.c_z, e, true));
        let linear = t.alloc(rows * n * h * e);
        let linear32 = bf16.then(|| t.alloc(rows * n * h * 4));
        let bias = t.alloc(plane);
        t.free(linear);
        if let Some(b) = linear32 {
            t.free(b);
        }
        let mask_2d = t.alloc(rows * n * f);
        let (t1, t2, r1, r2) = (t.alloc(plane), t.alloc(plane), t.alloc(rows * n * f), t.alloc(rows * n * f));
        let logits = t.alloc(plane);
        for b in [t1, t2, r1, r2, scalar, points, bias, mask_2d] {
            t.free(b);
        }
        let attn = t.alloc(plane);
        t.free(logits);
        // The per-row outputs: values' copies, products, their strided layouts copied.
        let (vc, o) = (t.alloc(n * h * c.c_ipa * f), t.alloc(rows * h * c.c_ipa * f));
        let out_scalar = t.alloc(rows * h * c.c_ipa * f);
        t.free(vc);
        t.free(o);
        let vp = t.alloc(n * h * c.v_points * 3 * f);
        let out_global = t.alloc(rows * h * c.v_points * 3 * f);
        t.free(vp);
        let flat = t.alloc(rows * h * c.v_points * 3 * f);
        let shifted = t.alloc(rows * h * c.v_points * 3 * f);
        let rot = t.alloc(rows * h * c.v_points * 9 * f);
        let local = t.alloc(rows * h * c.v_points * 3 * f);
        t.free(shifted);
        t.free(rot);
        t.temp(rows * h * c.v_points * 3 * f);
        let norm = t.alloc(rows * h * c.v_points * f);
        let attn_copy = t.alloc(plane);
        let pair32 = bf16.then(|| t.alloc(rows * n * c.c_z * 4));
        let over_pair = t.alloc(rows * h * c.c_z * f);
        t.free(attn_copy);
        if let Some(b) = pair32 {
            t.free(b);
        }
        let joined = t.alloc(rows * width * f);
        for b in [out_scalar, out_global, flat, local, norm, over_pair, attn] {
            t.free(b);
        }
        if let Some(b) = normed {
            t.free(b);
        }
        if let Some(b) = q32 {
            t.free(b);
        }
        joined
    });
    // Under DAP the ranks' rows of the features gathered (`PairRows::gather`: padded to the
    // block, then every block).
    let gathered = x.split().then(|| {
        let padded = (real < x.block(n)).then(|| t.alloc(x.block(n) * width * f));
        let all = t.alloc(x.padded(n) * width * f);
        t.free_all(padded);
        all
    });
    let cast = bf16.then(|| t.alloc(n * width * e));
    let out = t.alloc(n * c.c_s * e);
    for b in [features, q, kv, q_pts, kv_pts, out] {
        t.free(b);
    }
    t.free_all(gathered);
    for b in [cast, kv32].into_iter().flatten() {
        t.free(b);
    }
}

/// `model/structure.rs`'s `StructureModule::run`: the normalised single and pair (whole, or
/// with the attention in query-row chunks each chunk's rows in it), then each iteration's
/// attention (what else an iteration makes is per residue and small).
fn structure_module(t: &mut Trace, x: &Ctx, n: i64, c_z: i64, c: &StructureConfig) {
    let e = x.e;
    let aatype = t.alloc(n * 8);
    let initial = layer_norm(t, n, c.c_s, e, true);
    // Under DAP the rank's real rows, a view of its padded block.
    let real = x.real(n);
    let by_rows = x.chunk(ChunkOp::StructureAttention).is_some_and(|rows| rows < real);
    let contiguous = x.padded(n) == n || x.reads_transposed_rows();
    let pair = (!by_rows).then(|| layer_norm(t, real * n, c_z, e, contiguous));
    let act = t.alloc(n * c.c_s * e);
    invariant_point_attention(t, x, n, c, by_rows);
    for b in [Some(act), pair, Some(initial), Some(aatype)].into_iter().flatten() {
        t.free(b);
    }
}

/// What a pass makes from its stacks' `msa` (the heads read `s` rows of it; on the host when
/// the Evoformer moves its streams off the device, then moved back) and pair: the MSA's
/// readout (first row, single representation, masked-MSA logits), after which the MSA is
/// freed, the structure module, the other heads' logits; the outputs all alive at the pass's
/// end (the [`crate::model::alphafold::Pass`]).
pub(super) fn outputs(
    t: &mut Trace,
    x: &Ctx,
    msa: Buf,
    (n, s, rows): (i64, i64, i64),
    (c_m, c_z): (i64, i64),
    model: &ModelConfig,
    restored: bool,
) {
    let e = x.e;
    t.at("single representation");
    let moved = x.moves(Stage::Evoformer).then(|| t.alloc(s * n * c_m * e));
    let first_row = dap::first_row(t, x, n, c_m);
    let single = t.alloc(n * model.c_s * e);
    let classes = model.masked_msa_classes;
    let mut masked_msa = dap::msa_logits(t, x, (s, rows, n), c_m, classes);
    if restored {
        // The logits of the rows left out, copied from their stand-in's (`MsaRows::restore`).
        let every_row = t.alloc(s * n * classes * e);
        t.free(masked_msa);
        masked_msa = every_row;
    }
    t.free(msa);
    if let Some(b) = moved {
        t.free(b);
    }
    t.at("structure module");
    structure_module(t, x, n, c_z, &model.structure);
    // What it hands on (`StructureOutput`): its single representation, every iteration's
    // rotations, translations and torsions (raw and normalised), the last iteration's eight
    // frames and the atoms (atom14, atom37 and its mask), in float32 but the single.
    let sm = &model.structure;
    let geometry = sm.layers * (9 + 3 + 2 * 14) + 8 * 12 + 14 * 3 + 37 * 3 + 37;
    let structure_out = t.alloc(n * (sm.c_s * e + geometry * 4));
    t.at("heads");
    // The heads project the rank's real rows (all of them in one process) and keep them so
    // (`HeadOutputs::rows`): the distogram's half logits symmetrised in place a block at a time
    // (`PairRows::symmetrised`), under DAP in the rank's zero-padded block with its columns'
    // rows brought by an all-to-all (the blocks stacked to send, and those received).
    let (real, block) = (x.real(n), x.block(n));
    // A rank's real rows are a strided view of its block where the columns are padded: each
    // projection copies them first.
    let project = |t: &mut Trace, bins: i64| -> Buf {
        let copy = (x.padded(n) != n).then(|| t.alloc(real * n * c_z * e));
        let out = t.alloc(real * n * bins * e);
        t.free_all(copy);
        out
    };
    let bins = model.distogram_bins;
    let half = project(t, bins);
    let distogram = match x.split() {
        false => {
            t.temp(SYMMETRISE_BLOCK.min(n).pow(2) * bins * e);
            half
        }
        true => {
            let bytes = block * x.padded(n) * bins * e;
            let padded = t.alloc(bytes);
            t.free(half);
            let stacked = t.alloc(bytes);
            let received = t.alloc(bytes);
            t.free_all([stacked, received]);
            padded
        }
    };
    let per_residue = [t.alloc(n * model.lddt_bins * e), t.alloc(n * model.resolved_atoms * e)];
    let aligned_error = model.aligned_error_bins.map(|b| project(t, b));
    t.free_all([distogram, masked_msa, first_row, single, structure_out]);
    t.free_all(per_residue);
    if let Some(b) = aligned_error {
        t.free(b);
    }
}

/// `model/embedders.rs`'s `distance_one_hot_between` of `r` x `n` positions in `e`-byte
/// floats: the differences, their squared sum, the bins compared (as bytes), the one-hot.
pub(super) fn distance_one_hot(t: &mut Trace, r: i64, n: i64, e: i64) -> Buf {
    let plane = r * n * e;
    let diff = t.alloc(plane * 3);
    let squared = t.alloc(plane * 3);
    let d2 = t.alloc(plane);
    t.free(squared);
    let compared = [0; 3].map(|_| t.alloc(r * n * DGRAM_BINS));
    let one_hot = t.alloc(plane * DGRAM_BINS);
    t.free_all(compared);
    t.free_all([diff, d2]);
    one_hot
}

/// `model/templates.rs`'s `pair_feature_rows` of one template's `r` rows and their
/// projection to `c_t` ([`PAIR_FEATURES`] channels, made in float32): the distogram (the
/// differences, their squares and sum, two comparisons and their conjunction as bytes), the
/// masks' outer products, the zero unit vectors, the features joined and masked.
fn template_pair_feature_rows(t: &mut Trace, r: i64, n: i64, c_t: i64, e: i64) -> Buf {
    let plane = r * n * 4;
    let dgram = distance_one_hot(t, r, n, 4);
    let (pb_mask, backbone, unit) = (t.alloc(plane), t.alloc(plane), t.alloc(plane * 3));
    let joined = t.alloc(plane * PAIR_FEATURES);
    let masked = t.alloc(plane * PAIR_FEATURES);
    t.free_all([joined, dgram, pb_mask, backbone, unit]);
    // In bf16 the features are converted before the projection.
    let features = match e {
        4 => masked,
        _ => {
            let converted = t.alloc(r * n * PAIR_FEATURES * e);
            t.free(masked);
            converted
        }
    };
    let out = t.alloc(r * n * c_t * e);
    t.free(features);
    out
}

/// One template's pair features [`ChunkOp::PairEmbedding`] rows at a time, through the
/// template pair stack in place and its final norm: the [n, n, c_t] embedding.
fn template_stack(t: &mut Trace, x: &Ctx, n: i64, c: &TemplateConfig) -> Buf {
    let (e, c_t) = (x.e, c.c_t);
    t.at("template embedding");
    let embedded =
        chunked(t, n, x.chunk(ChunkOp::PairEmbedding), n * c_t * e, |t, r| template_pair_feature_rows(t, r, n, c_t, e));
    t.at("template pair stack");
    for starting in [true, false] {
        let widths = (c_t, c.pair_heads, c.pair_head_dim);
        biased_attention(t, x, ChunkOp::TriangleAttention, n, (n, c_t), widths, starting);
    }
    for outgoing in [true, false] {
        triangle_multiplication(t, x, n, c_t, c.tri_mul_channels, outgoing);
    }
    transition(t, x, n, n, c_t, c.transition_factor, ChunkOp::PairTransition);
    let out = layer_norm(t, n * n, c_t, e, true);
    t.free(embedded);
    out
}

/// One template folded into the online softmax over `entries` pair entries (a chunk of pair
/// rows): the scaled query, the keys, their products and the logits (biased by the template
/// mask), the values; the first template copies its logits and values in, the next ones
/// make the new maximum, the rescaling of the old terms and their own weights, and update
/// the running terms in place. `e`: the pair's element bytes, `a` the running terms' (the
/// logits and values widened to them as they are made).
fn template_fold(t: &mut Trace, entries: i64, (heads, hd): (i64, i64), (e, a): (i64, i64), first: bool) {
    let q = t.alloc(entries * hd * e);
    let scaled = t.alloc(entries * hd * e);
    t.free(q);
    let k = t.alloc(entries * hd * e);
    let products = t.alloc(entries * hd * e);
    let summed = t.alloc(entries * heads * e);
    let logits = t.alloc(entries * heads * e);
    t.free_all([products, summed, scaled, k]);
    let logits = widened(t, logits, entries * heads, (e, a));
    let v = t.alloc(entries * hd * e);
    let v = widened(t, v, entries * hd, (e, a));
    if !first {
        let [new_max, rescale, weight] = [0; 3].map(|_| t.alloc(entries * heads * a));
        t.free(logits);
        t.free_all([v, new_max, rescale, weight]);
        return;
    }
    t.free_all([logits, v]);
}

/// `buf` of `elems` elements converted from `e`-byte to `a`-byte elements (a copy, the
/// original freed after it), or itself where the two are the same.
fn widened(t: &mut Trace, buf: Buf, elems: i64, (e, a): (i64, i64)) -> Buf {
    if e == a {
        return buf;
    }
    let out = t.alloc(elems * a);
    t.free(buf);
    out
}

/// `model/templates.rs`'s `Templates::add_pair_update` (its inference path) and `msa_rows` on
/// the pair [n, n, c_z]: each of `count` templates embedded [`ChunkOp::PairEmbedding`] rows
/// at a time, through the pair stack in place (AlphaFold's monomer order: the triangle
/// attentions first) and normalised ([`template_stack`]), then folded into the pointwise
/// attention's online softmax over the templates ([`template_fold`]; its running maximum, sum
/// and weighted values, [n, n, heads] twice and [n, n, heads x dim], in f32 at a reduced
/// precision, made after the first template's stack) before the next is embedded; then the softmax's averaged values
/// projected and added to the pair in place, pair rows at a time. Never [count, n, n, c_t].
fn templates(t: &mut Trace, x: &Ctx, count: i64, n: i64, c_z: i64, c: &TemplateConfig) {
    let e = x.e;
    // The online softmax's running terms: f32 at a reduced precision.
    let a = e.max(4);
    let (heads, hd) = (c.attention_heads, c.attention_heads * c.attention_head_dim);
    let stage = Ctx { stage: Stage::Outer, ..*x };
    // The stacks run whole on every rank; the attention over them reads the rank's real rows.
    let real = x.real(n);
    let rows = step(real, stage.chunk(ChunkOp::TemplatePointwise));
    let mut softmax: Option<[Buf; 3]> = None;
    for i in 0..count {
        let embedded = template_stack(t, x, n, c);
        t.at("template pointwise attention");
        softmax.get_or_insert_with(|| {
            [t.alloc(real * n * heads * a), t.alloc(real * n * heads * a), t.alloc(real * n * hd * a)]
        });
        template_fold(t, rows * n, (heads, hd), (e, a), i == 0);
        t.free(embedded);
    }
    if let Some(softmax) = softmax {
        residual(t, real, Some(rows), |t, r| {
            let avg = t.alloc(r * n * hd * a);
            let avg = widened(t, avg, r * n * hd, (a, e));
            let projected = t.alloc(r * n * c_z * e);
            let out = t.alloc(r * n * c_z * e);
            t.free(projected);
            let gated = t.alloc(r * n * c_z * e);
            t.free_all([out, avg]);
            gated
        });
        t.free_all(softmax);
    }
}

/// `model/templates.rs`'s `Templates::msa_rows`: the `count` templates' MSA rows [count, n,
/// c_m] from their torsion angles.
fn template_rows(t: &mut Trace, e: i64, count: i64, n: i64, c_m: i64) -> Buf {
    t.at("template rows");
    let features = t.alloc(count * n * ANGLE_FEATURES * 4);
    let embedded = t.alloc(count * n * c_m * e);
    t.free(features);
    let rows = t.alloc(count * n * c_m * e);
    t.free(embedded);
    rows
}

/// The peak of live bytes of one no-grad pass ([`crate::model::alphafold::AlphaFold::pass`])
/// on one rank with the compositions of libtorch, from its start (the previous pass's outputs
/// alive: they are given up to it) to its end, under `plan`.
pub fn pass_peak(cfg: &EvoformerConfig, model: &ModelConfig, sizes: Sizes, plan: &ChunkPlan) -> Peak {
    let mut t = Trace::new();
    let Sizes { residues: n, msa_rows: s, extra_rows, elem: e, templates: count, logits, host_apart, ranks } = sizes;
    let (c_m, c_z) = (cfg.c_m, cfg.c_z);
    let mut x = Ctx { e, plan, stage: Stage::Outer, masked_rows: false, masked_keys: false, logits, host_apart, ranks };
    // The pair rows the rank holds from the embedders to the heads: all of them, or under DAP
    // its block of the padded rows (`model/pair_rows.rs`).
    let pair_block = x.block(n) * x.padded(n) * c_z * e;
    t.at("recycled inputs");
    let prev = [t.alloc(n * c_m * e), t.alloc(pair_block), t.alloc(n * 3 * e)];
    t.at("input embedder");
    let bins = 2 * model.max_relative_feature + 1;
    let pair = input_pair(&mut t, &x, n, c_z, |t, rows| relative_positions(t, e, (rows, n), bins, c_z));
    let mut pair = dap::into_block(&mut t, &x, pair, pair_block);
    t.at("recycling embedder");
    let row = recycled_row(&mut t, e, n, c_m);
    recycling_pair(&mut t, &x, n, c_z, model);
    for b in prev {
        t.free(b);
    }
    let pair_mask = t.alloc(n * n * e);
    let templated = model.templates.as_ref().filter(|_| count > 0);
    if let Some(c) = templated {
        x.stage = Stage::Templates;
        templates(&mut t, &x, count, n, c_z, c);
        x.stage = Stage::Outer;
    }
    if cfg.num_extra_blocks > 0 {
        t.at("extra-MSA embedder");
        let rows = extra_rows.max(1);
        // Under DAP the rank embeds its real rows of the extra MSA, then pads them to its block.
        let embedded = extra_msa_embedder(&mut t, &x, (n, x.real(rows)), cfg.c_e, host_apart);
        let embedded = dap::into_block(&mut t, &x, embedded, x.block(rows) * x.padded(n) * cfg.c_e * e);
        // On a GPU the stack's mask comes from the host for it.
        let mask = host_apart.then(|| t.alloc(rows * n * e));
        x.stage = Stage::ExtraMsa;
        let (extra, updated) = stack(&mut t, &x, cfg, (rows, n), true, (embedded, pair));
        pair = updated;
        t.free(extra);
        t.free_all(mask);
        x.stage = Stage::Outer;
    }
    // The MSA, embedded after the extra-MSA stack; the Evoformer's rows: the MSA's, then the
    // templates' joined to them, made first (`AlphaFold::pass`); under DAP the rank's block.
    t.at("input embedder");
    let template_rows = templated.filter(|c| c.torsion_angles).map(|_| template_rows(&mut t, e, count, n, c_m));
    let rows = s + if template_rows.is_some() { count } else { 0 };
    let embed = |t: &mut Trace, r: i64| input_msa(t, e, (n, r), c_m, host_apart);
    let mut msa = dap::msa_input(&mut t, &x, (rows, s, s, count), (n, c_m, MSA_FEAT), row, embed);
    t.free_all(template_rows);
    x.stage = Stage::Evoformer;
    if cfg.num_blocks > 0 {
        (msa, pair) = stack(&mut t, &x, cfg, (rows, n), false, (msa, pair));
    }
    x.stage = Stage::Outer;
    outputs(&mut t, &x, msa, (n, s, rows), (c_m, c_z), model, false);
    t.free_all([pair_mask, pair]);
    Peak { bytes: t.peak(), at: t.peak_at() }
}

/// The sizes a pass of `features` (recycling slice 0) runs at in `kind` on `device` over `ranks`
/// DAP ranks: its residues, the MSA and extra-MSA rows with an unmasked entry (the rows the
/// stacks run), its real templates (those the template stack runs), and the attentions'
/// `logits`.
pub fn sizes_of(
    features: &crate::features::Features,
    (kind, device): (tch::Kind, tch::Device),
    logits: AttentionLogits,
    ranks: i64,
) -> tch::Result<Sizes> {
    let real_rows = |mask: &tch::Tensor| -> tch::Result<i64> {
        let m = mask.f_select(0, 0)?;
        m.f_ne(0.0)?.f_any_dim(1, false)?.f_sum(tch::Kind::Int64)?.f_int64_value(&[])
    };
    let templates = match &features.templates {
        Some(t) => t.mask.f_select(0, 0)?.f_ne(0.0)?.f_sum(tch::Kind::Int64)?.f_int64_value(&[])?,
        None => 0,
    };
    Ok(Sizes {
        residues: features.aatype.size()[1],
        msa_rows: real_rows(&features.msa_mask)?.max(1),
        extra_rows: real_rows(&features.extra_msa_mask)?.max(1),
        elem: kind.elt_size_in_bytes() as i64,
        templates,
        logits,
        host_apart: device.is_cuda(),
        ranks,
    })
}

/// The bytes of tensors.
pub fn bytes_of<'a>(tensors: impl IntoIterator<Item = &'a tch::Tensor>) -> u64 {
    tensors.into_iter().map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
}
