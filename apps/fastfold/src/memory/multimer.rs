//! AlphaFold-Multimer's inference pass traced on shapes alone, as [`super::profile`] traces the
//! monomer's: `model/multimer/alphafold.rs`'s `sampled_pass` in its order, one function per
//! part that differs (the MSA sampled inside the network, the relative encoding over chains,
//! the templates' pair stack, their MSA rows), the monomer's traces for what is the same (the
//! blocks, the recycling and extra-MSA embedders, the structure module, the heads).
//! `tests/memory.rs` checks the peak against the CPU allocator's.
//!
//! The sampling runs where the features are: on the host while the network runs on a GPU,
//! so its buffers count only in a CPU run ([`MultimerSizes::sampling_on_device`]).
use crate::memory::ops::{biased_attention, chunked, layer_norm, residual, transition, triangle_multiplication, Ctx};
use crate::memory::profile::{
    distance_one_hot, extra_msa_embedder, input_msa, input_pair, outputs, recycled_row, recycling_pair, stack,
};
use crate::memory::{dap, Buf, Peak, Sizes, Trace};
use crate::model::config::{EvoformerConfig, ModelConfig, TemplateConfig};
use crate::model::embedders::EXTRA_MSA_CLASSES;
use crate::model::exec::{ChunkOp, ChunkPlan, Stage};
use crate::model::masked_rows::count_unmasked_rows;
use crate::model::multimer::msa_feat::MSA_FEAT;
use crate::model::multimer::relpos::{MAX_RELATIVE_CHAIN, MAX_RELATIVE_IDX, RELATIVE_FEATURES, TARGET_CLASSES};
use crate::model::multimer::sampling::MSA_CLASSES;
use crate::model::multimer::{MultimerAlphaFold, MultimerInputs};
use crate::model::templates::DGRAM_BINS;

/// The sizes of one Multimer pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultimerSizes {
    /// Residues, the MSA rows the Evoformer runs (the cluster centres and template rows it
    /// keeps), the extra-MSA rows the extra stack runs, bytes per element.
    pub pass: Sizes,
    /// The sampled cluster centres (what the embedder makes and the heads read).
    pub centres: i64,
    /// Rows of the whole MSA the sampling draws from (the features' `msa`).
    pub msa: i64,
    /// Whether the Evoformer runs a fully-masked row (a stand-in for masked centres, or every
    /// padding row when none is left out).
    pub masked_rows: bool,
    /// The centres' rows the Evoformer runs (the rest of `pass.msa_rows` are template rows).
    pub own_rows: i64,
    /// Whether the features are on the network's device, so that the sampling's buffers count.
    pub sampling_on_device: bool,
}

/// One-hot of `elems` classes-of-`classes` entries: int64, then float32, then masked.
fn masked_one_hot(t: &mut Trace, elems: i64, classes: i64) -> Buf {
    let int = t.alloc(elems * classes * 8);
    let float = t.alloc(elems * classes * 4);
    t.free(int);
    let masked = t.alloc(elems * classes * 4);
    t.free(float);
    masked
}

/// `model/multimer/sampling.rs`'s `MsaSampling::sample` of `full` rows to `s` centres and
/// `full - s` extra rows, in float32 and int64 whatever the model's kind: the profile over
/// every row, the rows taken, the nearest-neighbour clusters. Returns the `SampledMsa`'s
/// buffers (alive to the pass's end).
fn sampling(t: &mut Trace, full: i64, s: i64, n: i64) -> Vec<Buf> {
    let e = full - s;
    let profile = {
        let one_hot = masked_one_hot(t, full * n, MSA_CLASSES);
        let p = t.alloc(n * MSA_CLASSES * 4);
        t.free(one_hot);
        p
    };
    let (true_msa, msa_mask) = (t.alloc(s * n * 8), t.alloc(s * n * 4));
    let (masked, positions) = (t.alloc(s * n * 8), t.alloc(s * n * 4));
    let deletion = t.alloc(s * n * 4);
    let (extra, extra_mask, extra_deletion) = (t.alloc(e * n * 8), t.alloc(e * n * 4), t.alloc(e * n * 4));
    // `nearest_neighbor_clusters`: the one-hots, the agreement of every centre with every
    // extra row and its softmax, the clusters' sums.
    let msa_oh = masked_one_hot(t, s * n, EXTRA_MSA_CLASSES);
    let extra_oh = masked_one_hot(t, e * n, EXTRA_MSA_CLASSES);
    let weighted = t.alloc(s * n * EXTRA_MSA_CLASSES * 4);
    let agreement = t.alloc(s * e * 4);
    t.free(weighted);
    let scaled = t.alloc(s * e * 4);
    let softmax = t.alloc(s * e * 4);
    t.free_all([scaled, agreement]);
    let pair_mask = t.alloc(s * e * 4);
    let assignment = t.alloc(s * e * 4);
    t.free_all([pair_mask, softmax]);
    let product = t.alloc(s * n * EXTRA_MSA_CLASSES * 4);
    let sum = t.alloc(s * n * EXTRA_MSA_CLASSES * 4);
    t.free(product);
    let cluster_profile = t.alloc(s * n * EXTRA_MSA_CLASSES * 4);
    t.free(sum);
    let deletions = t.alloc(e * n * 4);
    let del_sum = t.alloc(s * n * 4);
    let cluster_deletion = t.alloc(s * n * 4);
    t.free_all([deletions, del_sum, assignment, msa_oh, extra_oh, profile]);
    let bert = t.alloc(s * n * 4);
    vec![true_msa, msa_mask, masked, positions, deletion, extra, extra_mask, extra_deletion, cluster_profile]
        .into_iter()
        .chain([cluster_deletion, bert])
        .collect()
}

/// `model/multimer/msa_feat.rs`'s `msa_feat` [s, n, 49] in float32: the one-hot, the deletion
/// features, their concatenation.
fn msa_feat(t: &mut Trace, s: i64, n: i64) -> Buf {
    let int = t.alloc(s * n * EXTRA_MSA_CLASSES * 8);
    let one_hot = t.alloc(s * n * EXTRA_MSA_CLASSES * 4);
    t.free(int);
    let parts = [t.alloc(s * n * 4), t.alloc(s * n * 4), t.alloc(s * n * 4)];
    let feat = t.alloc(s * n * MSA_FEAT * 4);
    t.free(one_hot);
    t.free_all(parts);
    feat
}

/// `model/multimer/relpos.rs`'s relative encoding of `rows` x `n` residue pairs projected to
/// `c_z`: each part's bins (int64, the other-chain bin, the choice), its one-hot (int64, then
/// the model's kind), the parts joined, the projection.
fn relative_encoding(t: &mut Trace, e: i64, (rows, n): (i64, i64), c_z: i64) -> Buf {
    let flags = t.alloc(2 * rows * n);
    let part = |t: &mut Trace, k: i64| {
        let bins = 2 * k + 2;
        let (b, other, chosen) = (t.alloc(rows * n * 8), t.alloc(rows * n * 8), t.alloc(rows * n * 8));
        let int = t.alloc(rows * n * bins * 8);
        let one_hot = t.alloc(rows * n * bins * e);
        t.free_all([int, chosen, other, b]);
        one_hot
    };
    let position = part(t, MAX_RELATIVE_IDX);
    let chain = part(t, MAX_RELATIVE_CHAIN);
    let entity = t.alloc(rows * n * e);
    let joined = t.alloc(rows * n * RELATIVE_FEATURES * e);
    t.free_all([position, chain, entity, flags]);
    let act = t.alloc(rows * n * c_z * e);
    t.free(joined);
    act
}

/// `model/multimer/templates.rs`'s `TemplatePairEmbedding::embed` of one template, `rows` of
/// the [n, n, c_t] result at a time: each chunk's pair features (the masks, the distogram with
/// its bins compared as bytes, the frames' unit vectors through their dot products), then the
/// running sum of the features' projections (a new tensor per term; a scalar feature's
/// projection is a product and a sum), then the normalised query rows' projection.
fn template_pair_embedding(t: &mut Trace, x: &Ctx, n: i64, c_z: i64, c_t: i64) -> Buf {
    let e = x.e;
    chunked(t, n, x.chunk(ChunkOp::PairEmbedding), n * c_t * e, |t, r| {
        let plane = r * n * e;
        let eq = t.alloc(r * n);
        let same = t.alloc(plane);
        t.free(eq);
        let outer = t.alloc(plane);
        let pb_mask = t.alloc(plane);
        t.free(outer);
        let one_hot = distance_one_hot(t, r, n, e);
        let dgram = t.alloc(plane * DGRAM_BINS);
        t.free(one_hot);
        let outer = t.alloc(plane);
        let backbone = t.alloc(plane);
        t.free(outer);
        let local: Vec<Buf> = (0..3)
            .map(|_| {
                // Two dot products' terms, partial sums and the difference.
                let terms = [0; 5].map(|_| t.alloc(plane));
                let l = t.alloc(plane);
                t.free_all(terms);
                l
            })
            .collect();
        let zeros = t.alloc(plane);
        let mut acc = zeros;
        for _ in 0..3 {
            let squared = t.alloc(plane);
            let next = t.alloc(plane);
            t.free_all([squared, acc]);
            acc = next;
        }
        let clamped = t.alloc(plane);
        let norm = t.alloc(plane);
        t.free(clamped);
        let unit = [0; 3].map(|_| {
            let d = t.alloc(plane);
            let u = t.alloc(plane);
            t.free(d);
            u
        });
        t.free_all([acc, norm, same]);
        t.free_all(local);
        // The projections summed: the distogram's, then per scalar feature its product, its
        // sum with the bias and the new running sum.
        let mut act = t.alloc(plane * c_t);
        for _ in 0..5 {
            let product = t.alloc(plane * c_t);
            let term = t.alloc(plane * c_t);
            t.free(product);
            let next = t.alloc(plane * c_t);
            t.free_all([term, act]);
            act = next;
        }
        // The residue types' projections broadcast over a row or a column: small, the sums not.
        for _ in 0..2 {
            let next = t.alloc(plane * c_t);
            t.free(act);
            act = next;
        }
        let normed = layer_norm(t, r * n, c_z, e, true);
        let query = t.alloc(plane * c_t);
        let out = t.alloc(plane * c_t);
        t.free_all([query, normed, act, dgram, pb_mask, backbone]);
        t.free_all(unit);
        out
    })
}

/// `model/multimer/templates.rs`'s `MultimerTemplates::add_update` on the pair [n, n, c_z]:
/// per template, its pair features and their embedding with the normalised query pair, the
/// pair stack on it in place, its normalised output summed in place; the mean's projection to
/// `c_z` added to the pair rows at a time.
fn template_stack(t: &mut Trace, x: &Ctx, count: i64, n: i64, c_z: i64, c: &TemplateConfig) {
    let (e, c_t) = (x.e, c.c_t);
    // Under DAP the query pair gathered whole for the embedding (`PairRows::gather` of the
    // rank's real rows: padded to its block, or made contiguous where the columns are padded,
    // then every block); each rank then adds its own rows' update.
    let (real, block) = (x.real(n), x.block(n));
    let query = x.split().then(|| {
        let staged = (real < block || x.padded(n) != n).then(|| t.alloc(block * n * c_z * e));
        let whole = t.alloc(x.padded(n) * n * c_z * e);
        t.free_all(staged);
        whole
    });
    let mut sum: Option<Buf> = None;
    // From the second template on, each runs beside the sum of those before: two are the peak
    // of any number.
    for _ in 0..count.min(2) {
        t.at("template embedding");
        let embedded = template_pair_embedding(t, x, n, c_z, c_t);
        t.at("template pair stack");
        for outgoing in [true, false] {
            triangle_multiplication(t, x, n, c_t, c.tri_mul_channels, outgoing);
        }
        for starting in [true, false] {
            let widths = (c_t, c.pair_heads, c.pair_head_dim);
            biased_attention(t, x, ChunkOp::TriangleAttention, n, (n, c_t), widths, starting);
        }
        transition(t, x, n, n, c_t, c.transition_factor, ChunkOp::PairTransition);
        let out = layer_norm(t, n * n, c_t, e, true);
        sum = Some(match sum {
            None => out,
            // Added to the sum in place.
            Some(s) => {
                t.free(out);
                s
            }
        });
        // The template's stream lives to the end of its iteration, past the sum.
        t.free(embedded);
    }
    t.free_all(query);
    let Some(sum) = sum else { return };
    // The mean and its ReLU in the sum's buffer; the projection added to the pair rows at a
    // time.
    residual(t, real, x.chunk(ChunkOp::PairEmbedding), |t, rows| t.alloc(rows * n * c_z * e));
    t.free(sum);
}

/// The peak of live bytes of one no-grad Multimer pass (`MultimerAlphaFold::pass`) with the
/// template stack `templates` (when the parameters have one), from its start (the previous
/// pass's outputs alive) to its end, under `plan`.
pub fn multimer_pass_peak(
    cfg: &EvoformerConfig,
    model: &ModelConfig,
    template: Option<&TemplateConfig>,
    sizes: MultimerSizes,
    plan: &ChunkPlan,
) -> Peak {
    let mut t = Trace::new();
    let Sizes { residues: n, msa_rows: run, extra_rows, elem: e, templates, logits, host_apart, ranks } = sizes.pass;
    let s = sizes.centres;
    let (c_m, c_z) = (cfg.c_m, cfg.c_z);
    let templates = template.map_or(0, |_| templates);
    let mut x = Ctx { e, plan, stage: Stage::Outer, masked_rows: false, masked_keys: false, logits, host_apart, ranks };
    // The pair rows the rank holds, as in the monomer's pass (`super::profile::pass_peak`).
    let pair_block = x.block(n) * x.padded(n) * c_z * e;
    t.at("recycled inputs");
    let prev = [t.alloc(n * c_m * e), t.alloc(pair_block), t.alloc(n * 3 * e)];
    t.at("MSA sampling");
    let sampled = match sizes.sampling_on_device {
        true => sampling(&mut t, sizes.msa.max(s), s, n),
        false => Vec::new(),
    };
    t.at("input embedder");
    let target = t.alloc(n * TARGET_CLASSES * e);
    let pair = input_pair(&mut t, &x, n, c_z, |t, rows| relative_encoding(t, e, (rows, n), c_z));
    t.free(target);
    let mut pair = dap::into_block(&mut t, &x, pair, pair_block);
    t.at("recycling embedder");
    let row = recycled_row(&mut t, e, n, c_m);
    recycling_pair(&mut t, &x, n, c_z, model);
    t.free_all(prev);
    let pair_mask = t.alloc(n * n * e);
    if let (Some(c), true) = (template, templates > 0) {
        x.stage = Stage::Templates;
        template_stack(&mut t, &x, templates, n, c_z, c);
        x.stage = Stage::Outer;
    }
    if cfg.num_extra_blocks > 0 {
        t.at("extra-MSA embedder");
        let rows = extra_rows.max(1);
        let deletions = [t.alloc(rows * n * 4), t.alloc(rows * n * 4)];
        let embedded = extra_msa_embedder(&mut t, &x, (n, x.real(rows)), cfg.c_e, false);
        let embedded = dap::into_block(&mut t, &x, embedded, x.block(rows) * x.padded(n) * cfg.c_e * e);
        x.stage = Stage::ExtraMsa;
        let (extra, updated) = stack(&mut t, &x, cfg, (rows, n), true, (embedded, pair));
        pair = updated;
        t.free(extra);
        t.free_all(deletions);
    }
    // The MSA, embedded after the extra-MSA stack, from the sampled centres' features: the
    // rows that run (`evoformer_msa_input`, picked when some are left out; under DAP the
    // rank's block), the recycled row added, the template rows joined; after the stack, the
    // logits of the centres' rows put back.
    t.at("input embedder");
    let feat = msa_feat(&mut t, s, n);
    let own = sizes.own_rows;
    let embed = |t: &mut Trace, r: i64| {
        let target = t.alloc(n * TARGET_CLASSES * e);
        let msa = input_msa(t, e, (n, r), c_m, false);
        t.free(target);
        msa
    };
    let mut msa = dap::msa_input(&mut t, &x, (run, own, s, templates), (n, c_m, MSA_FEAT), row, embed);
    t.free(feat);
    x.stage = Stage::Evoformer;
    x.masked_rows = sizes.masked_rows;
    if cfg.num_blocks > 0 {
        (msa, pair) = stack(&mut t, &x, cfg, (run, n), false, (msa, pair));
    }
    x.masked_rows = false;
    x.stage = Stage::Outer;
    outputs(&mut t, &x, msa, (n, own, run), (c_m, c_z), model, own < s);
    t.free_all([pair_mask, pair]);
    t.free_all(sampled);
    Peak { bytes: t.peak(), at: t.peak_at() }
}

/// The sizes a pass of `net` on `inputs` runs at in `kind`: every row of the MSA sampled from
/// (padding rows too), `num_msa` of them the centres, the extra stack the next
/// `num_extra_msa` (at least one row), every template through the template stack; when the
/// network leaves out fully-masked rows ([`MultimerAlphaFold::drop_masked_rows`]), the stacks
/// run the real rows only, and one stand-in for the masked centres (as the sampling orders
/// them: real rows first); whole logits on a GPU (`device` the network's: the fused softmax's).
/// `sampling_on_device`: the features are on the network's device. Over `ranks` DAP ranks (1:
/// one process).
pub fn multimer_sizes_of(
    inputs: &MultimerInputs,
    net: &MultimerAlphaFold,
    (kind, device): (tch::Kind, tch::Device),
    sampling_on_device: bool,
    ranks: i64,
) -> crate::model::Result<MultimerSizes> {
    let (msa, residues) = match inputs.msa.size().as_slice() {
        [s, n] => (*s, *n),
        other => return Err(crate::model::Error::Invalid(format!("msa: expected [rows, residues], found {other:?}"))),
    };
    let sampling = &net.sampling;
    let centres = sampling.num_msa.clamp(1, msa.max(1));
    let taken = (msa - centres).min(sampling.num_extra_msa);
    let templates = inputs.template_aatype.as_ref().map_or(0, |t| t.size().first().copied().unwrap_or(0));
    let real = count_unmasked_rows(&inputs.msa_mask)?;
    let real_templates = match &inputs.template_all_atom_mask {
        Some(mask) if templates > 0 => count_unmasked_rows(mask)?,
        _ => 0,
    };
    let real_centres = real.min(centres);
    let (own_rows, evoformer_rows, extra, masked_rows) = match net.drops_masked_rows() {
        true => {
            let stand_in = real_centres < centres;
            let own = real_centres + i64::from(stand_in);
            (own, own + real_templates, (real - real_centres).clamp(0, taken), stand_in)
        }
        false => (centres, centres + templates, taken, real_centres < centres || real_templates < templates),
    };
    Ok(MultimerSizes {
        pass: Sizes {
            residues,
            msa_rows: evoformer_rows,
            extra_rows: extra.max(1),
            elem: kind.elt_size_in_bytes() as i64,
            templates,
            logits: net.attention_logits(),
            host_apart: device.is_cuda(),
            ranks,
        },
        centres,
        msa,
        masked_rows,
        own_rows,
        sampling_on_device,
    })
}
