//! The chunk size of every chunked operation chosen from a memory budget: the largest that
//! keeps the planned peak under the budget, and no chunking where the budget allows it.
//!
//! The operations run one after another and each one's own temporaries come on top of what
//! every operation shares (the streams, the outputs so far), so each operation's size can be
//! chosen alone: from every operation at its smallest (one row: the least a pass can take),
//! each in turn is raised to the largest size, whole first, that keeps the pass's peak under
//! the budget ([`crate::memory::profile::pass_peak`]). Before the sizes, each stack's streams go
//! off the device in turn ([`ChunkPlan::offloading`]) only where the pass does not fit without
//! it at its smallest: its moves cost time where a smaller chunk costs little.
use tch::{Device, Kind};

use crate::features::Features;
use crate::memory::multimer::{multimer_pass_peak, MultimerSizes};
use crate::memory::profile::{bytes_of, pass_peak, sizes_of, Peak, Sizes};
use crate::model::alphafold::{AlphaFold, Batch};
use crate::model::config::{EvoformerConfig, ModelConfig, TemplateConfig};
use crate::model::exec::{ChunkOp, ChunkPlan, Stage};

/// A chosen plan and what it costs.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The chunk size of every operation.
    pub chunks: ChunkPlan,
    /// The pass's peak under it.
    pub pass: Peak,
    /// Bytes alive before the pass (parameters, features).
    pub fixed: u64,
    /// The operations the plan chose sizes for.
    ops: &'static [&'static [(Stage, ChunkOp)]],
}

impl Plan {
    /// The planned peak: what was alive before the pass, plus the pass's peak.
    pub fn peak(&self) -> u64 {
        self.fixed + self.pass.bytes
    }

    /// The chunked operations, `stage op=size` each, in one line (`none` when nothing is
    /// chunked).
    pub fn describe(&self) -> String {
        let offloads = OFFLOADED.iter().filter(|&&stage| self.chunks.offloads(stage)).map(|s| format!("{s:?}/offload"));
        let sizes = self
            .ops
            .iter()
            .copied()
            .flatten()
            .filter_map(|&(stage, op)| self.chunks.get(stage, op).map(|c| format!("{stage:?}/{op:?}={c}")));
        let parts: Vec<String> = offloads.chain(sizes).collect();
        match parts.is_empty() {
            true => "none".into(),
            false => parts.join(" "),
        }
    }
}

/// The stacks a plan may offload, the first kept on the device first (its 48 blocks move their
/// streams 12 times as often as the extra-MSA stack's 4).
const OFFLOADED: [Stage; 2] = [Stage::Evoformer, Stage::ExtraMsa];

/// The operations outside the stacks the pass profiles cover.
const OUTER_KEYS: [(Stage, ChunkOp); 3] = [
    (Stage::Outer, ChunkOp::PairEmbedding),
    (Stage::Outer, ChunkOp::ExtraMsaEmbedding),
    (Stage::Outer, ChunkOp::StructureAttention),
];

/// The template pair stack's operations.
const TEMPLATE_KEYS: [(Stage, ChunkOp); 4] = [
    (Stage::Templates, ChunkOp::PairEmbedding),
    (Stage::Templates, ChunkOp::TriangleMultiplication),
    (Stage::Templates, ChunkOp::TriangleAttention),
    (Stage::Templates, ChunkOp::PairTransition),
];

/// The extra-MSA stack's and the Evoformer's operations.
const STACK_KEYS: [(Stage, ChunkOp); 16] = [
    (Stage::ExtraMsa, ChunkOp::MsaRowAttention),
    (Stage::ExtraMsa, ChunkOp::MsaColumnAttention),
    (Stage::ExtraMsa, ChunkOp::MsaTransition),
    // Sequences before rows: a batch of sequences costs a projection of the pair, a row
    // chunk nothing, so the sequences get the larger share.
    (Stage::ExtraMsa, ChunkOp::OuterProductMeanSequences),
    (Stage::ExtraMsa, ChunkOp::OuterProductMean),
    (Stage::ExtraMsa, ChunkOp::TriangleMultiplication),
    (Stage::ExtraMsa, ChunkOp::TriangleAttention),
    (Stage::ExtraMsa, ChunkOp::PairTransition),
    (Stage::Evoformer, ChunkOp::MsaRowAttention),
    (Stage::Evoformer, ChunkOp::MsaColumnAttention),
    (Stage::Evoformer, ChunkOp::MsaTransition),
    (Stage::Evoformer, ChunkOp::OuterProductMeanSequences),
    (Stage::Evoformer, ChunkOp::OuterProductMean),
    (Stage::Evoformer, ChunkOp::TriangleMultiplication),
    (Stage::Evoformer, ChunkOp::TriangleAttention),
    (Stage::Evoformer, ChunkOp::PairTransition),
];

/// The monomer's attention of the pair over its templates.
const POINTWISE_KEYS: [(Stage, ChunkOp); 1] = [(Stage::Outer, ChunkOp::TemplatePointwise)];

/// The operations the monomer's profile covers, in the order the plan sizes them.
const KEYS: &[&[(Stage, ChunkOp)]] = &[&OUTER_KEYS, &STACK_KEYS];
/// The same with templates.
const TEMPLATED_KEYS: &[&[(Stage, ChunkOp)]] = &[&OUTER_KEYS, &TEMPLATE_KEYS, &POINTWISE_KEYS, &STACK_KEYS];
/// The operations the Multimer profile covers.
const MULTIMER_KEYS: &[&[(Stage, ChunkOp)]] = &[&OUTER_KEYS, &TEMPLATE_KEYS, &STACK_KEYS];

/// The sizes tried, largest first: whole, then powers of two below `len`, down to 1.
fn candidates(len: i64) -> Vec<Option<i64>> {
    let mut sizes = vec![None];
    let mut c = 1i64 << 40;
    while c >= 1 {
        if c < len {
            sizes.push(Some(c));
        }
        c /= 2;
    }
    sizes
}

/// The length of the axis `op` chunks in `stage`.
fn axis(stage: Stage, op: ChunkOp, sizes: &Sizes) -> i64 {
    match (stage, op) {
        (Stage::ExtraMsa, ChunkOp::MsaRowAttention | ChunkOp::MsaTransition | ChunkOp::OuterProductMeanSequences)
        | (_, ChunkOp::ExtraMsaEmbedding) => sizes.extra_rows.max(1),
        (_, ChunkOp::MsaRowAttention | ChunkOp::MsaTransition | ChunkOp::OuterProductMeanSequences) => sizes.msa_rows,
        _ => sizes.residues,
    }
}

/// The plan for one monomer pass of `sizes` whose peak, on top of `fixed` bytes already alive,
/// stays within `budget` bytes; an error saying what the leanest plan needs when none does.
pub fn plan(cfg: &EvoformerConfig, model: &ModelConfig, sizes: Sizes, fixed: u64, budget: u64) -> Result<Plan, String> {
    let templated = model.templates.is_some() && sizes.templates > 0;
    let keys = if templated { TEMPLATED_KEYS } else { KEYS };
    search(keys, &sizes, fixed, budget, |chunks| pass_peak(cfg, model, sizes, chunks))
}

/// The plan for a monomer prediction of `features` (recycling slice 0's sizes, [`sizes_of`]) by
/// `net` with `model`'s sizes, in `kind` on `device`, over `ranks` DAP ranks (each rank's
/// budget), with `param_bytes` of parameters on the device: before the pass the device holds
/// the parameters and the features, all of them on the CPU (one memory) and on a GPU one
/// recycling slice but for its per-row features (`fastfold predict` keeps the rest on the
/// host, and the pass moves those as it uses them). The sizes come with it.
pub fn plan_prediction(
    net: &AlphaFold,
    model: &ModelConfig,
    param_bytes: u64,
    features: &Features,
    (kind, device, ranks): (Kind, Device, i64),
    budget: u64,
) -> anyhow::Result<(Plan, Sizes)> {
    let sizes = sizes_of(features, (kind, device), net.attention_logits(), ranks)?;
    let feature_bytes = match device {
        Device::Cpu => bytes_of(features.named().map(|(_, t)| t)),
        _ => bytes_of(Batch::new(features, 0, kind)?.resident_tensors()),
    };
    let plan = plan(net.config(), model, sizes, param_bytes + feature_bytes, budget).map_err(anyhow::Error::msg)?;
    Ok((plan, sizes))
}

/// [`plan`] for one AlphaFold-Multimer pass ([`multimer_pass_peak`]), the template pair stack
/// (`template`: the parameters' stack, if any) planned with the rest.
pub fn plan_multimer(
    cfg: &EvoformerConfig,
    model: &ModelConfig,
    template: Option<&TemplateConfig>,
    sizes: MultimerSizes,
    fixed: u64,
    budget: u64,
) -> Result<Plan, String> {
    search(MULTIMER_KEYS, &sizes.pass, fixed, budget, |chunks| multimer_pass_peak(cfg, model, template, sizes, chunks))
}

/// From every operation of `ops` at its smallest and the stacks offloaded, each stack's streams
/// kept on the device where the pass then fits, and each operation in turn raised to the
/// largest size that keeps `fixed` + `peak` within `budget`; no chunking when the whole pass
/// fits.
fn search(
    ops: &'static [&'static [(Stage, ChunkOp)]],
    sizes: &Sizes,
    fixed: u64,
    budget: u64,
    peak: impl Fn(&ChunkPlan) -> Peak,
) -> Result<Plan, String> {
    let whole = ChunkPlan::uniform(None);
    let whole_peak = peak(&whole);
    if fixed + whole_peak.bytes <= budget {
        return Ok(Plan { chunks: whole, pass: whole_peak, fixed, ops });
    }
    // Under DAP the stacks' layout switches need the streams on the device: no offloading.
    let offloads = sizes.ranks == 1;
    let mut chunks = if offloads { ChunkPlan::least_offloaded() } else { ChunkPlan::least() };
    let least = peak(&chunks);
    if fixed + least.bytes > budget {
        let off = if offloads { ", the stacks' streams off the device in turn" } else { "" };
        return Err(format!(
            "{} residues need {} at the least (every operation one row at a time{off}; {} of it before the pass, \
             the peak in {}), more than the budget of {}",
            sizes.residues,
            human(fixed + least.bytes),
            human(fixed),
            least.at,
            human(budget)
        ));
    }
    for stage in OFFLOADED.into_iter().filter(|_| offloads) {
        let tried = chunks.clone().offloading(stage, false);
        if fixed + peak(&tried).bytes <= budget {
            chunks = tried;
        }
    }
    for &(stage, op) in ops.iter().copied().flatten() {
        for size in candidates(axis(stage, op, sizes)) {
            let tried = chunks.clone().with(stage, op, size);
            if fixed + peak(&tried).bytes <= budget {
                chunks = tried;
                break;
            }
        }
    }
    let pass = peak(&chunks);
    Ok(Plan { chunks, pass, fixed, ops })
}

/// Bytes in GiB.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Bytes in the largest binary unit that keeps them at 1 or more: a budget of a few MiB reads
/// as such in an error, not as "0.00 GiB".
fn human(bytes: u64) -> String {
    engine::gemini::human(bytes as usize)
}
