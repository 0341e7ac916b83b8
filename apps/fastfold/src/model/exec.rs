//! How a forward runs, apart from its weights and inputs: the DAP group the stacks split over
//! and the chunk size of each memory-heavy step. The stacks and modules take one `&Exec`, so
//! the command line's choices reach every operation through one value rather than parameters
//! threaded by hand through each layer.
//!
//! Each module that is an operation of its own (row and column attention, the transitions, the
//! outer product mean, the triangle updates and attentions, the template pointwise attention,
//! the embedders' pair, the structure module's attention) reads its chunk size with [`Exec::chunk_for`],
//! naming itself ([`ChunkOp`]); the stack it runs in ([`Stage`]: the template pair stack, the
//! extra-MSA stack, the Evoformer, or outside the stacks) is part of the context, so one plan
//! gives the 5,120-row extra-MSA stack and the 512-row Evoformer different sizes. A plan is
//! either one size for everything (`--chunk-size`) or the memory planner's choice per step
//! ([`crate::memory::plan()`], `--gpu-mem`). A plan may also keep a stack's streams off the
//! device in turn ([`ChunkPlan::offloading`]).
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use engine::parallel::dap::Dap;

use crate::model::dropout::DropoutRates;

/// The operations that run in chunks of their batch-like axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChunkOp {
    /// MSA row attention with pair bias: sequences at a time (and the bias's pair rows).
    MsaRowAttention,
    /// MSA column attention (global in the extra-MSA stack): residues at a time.
    MsaColumnAttention,
    /// The MSA transition: rows at a time.
    MsaTransition,
    /// The outer product mean: pair rows at a time.
    OuterProductMean,
    /// The outer product mean's normalised and projected MSA: sequences at a time, each
    /// batch's products added to the pair as they are made (in place only: without autograd).
    /// Each batch costs one more output projection of the pair's rows, so a uniform size
    /// (`--chunk-size`, which FastFold's and OpenFold's users know as a residue count) leaves
    /// it whole; only a plan sets it.
    OuterProductMeanSequences,
    /// The triangle multiplicative updates: pair rows (outgoing) or columns (incoming).
    TriangleMultiplication,
    /// The triangle attentions: pair rows (starting node) or columns (ending node).
    TriangleAttention,
    /// The pair transition: pair rows at a time.
    PairTransition,
    /// The template pointwise attention: pair rows at a time.
    TemplatePointwise,
    /// The input and recycling embedders' pair: rows at a time.
    PairEmbedding,
    /// The extra-MSA embedder: extra-MSA rows at a time.
    ExtraMsaEmbedding,
    /// The structure module's invariant point attention: query residues at a time.
    StructureAttention,
}

impl ChunkOp {
    /// Every chunked operation.
    pub const ALL: [ChunkOp; 12] = [
        ChunkOp::MsaRowAttention,
        ChunkOp::MsaColumnAttention,
        ChunkOp::MsaTransition,
        ChunkOp::OuterProductMean,
        ChunkOp::OuterProductMeanSequences,
        ChunkOp::TriangleMultiplication,
        ChunkOp::TriangleAttention,
        ChunkOp::PairTransition,
        ChunkOp::TemplatePointwise,
        ChunkOp::PairEmbedding,
        ChunkOp::ExtraMsaEmbedding,
        ChunkOp::StructureAttention,
    ];
}

/// Where in the network an operation runs: the same operation gets its own chunk size in each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Outside the stacks: embedders, template pointwise attention, structure module.
    Outer,
    /// The template pair stack (every rank runs it whole).
    Templates,
    /// The extra-MSA stack.
    ExtraMsa,
    /// The Evoformer stack.
    Evoformer,
}

impl Stage {
    /// Every stage.
    pub const ALL: [Stage; 4] = [Stage::Outer, Stage::Templates, Stage::ExtraMsa, Stage::Evoformer];
}

/// A chunk size per operation and stage (`None`: the whole axis at once), and the stacks that
/// keep their streams off the device in turn.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkPlan {
    uniform: Option<i64>,
    sizes: BTreeMap<(Stage, ChunkOp), Option<i64>>,
    offloaded: BTreeSet<Stage>,
}

impl ChunkPlan {
    /// One size for every operation (`None`: nothing chunked).
    pub fn uniform(chunk: Option<i64>) -> ChunkPlan {
        ChunkPlan { uniform: chunk, sizes: BTreeMap::new(), offloaded: BTreeSet::new() }
    }

    /// Every operation one row (or sequence) at a time: the least memory a pass takes with its
    /// streams on the device ([`ChunkPlan::offloading`] takes less).
    pub fn least() -> ChunkPlan {
        let sequences = |plan: ChunkPlan, stage| plan.with(stage, ChunkOp::OuterProductMeanSequences, Some(1));
        [Stage::ExtraMsa, Stage::Evoformer].into_iter().fold(ChunkPlan::uniform(Some(1)), sequences)
    }

    /// [`ChunkPlan::least`] with both stacks' streams off the device in turn
    /// ([`ChunkPlan::offloading`]): the least device memory a pass can take.
    pub fn least_offloaded() -> ChunkPlan {
        [Stage::ExtraMsa, Stage::Evoformer]
            .into_iter()
            .fold(ChunkPlan::least(), |plan, stage| plan.offloading(stage, true))
    }

    /// This plan with `op` in `stage` `chunk` rows at a time.
    pub fn with(mut self, stage: Stage, op: ChunkOp, chunk: Option<i64>) -> ChunkPlan {
        self.sizes.insert((stage, op), chunk);
        self
    }

    /// This plan with the stack of `stage` (the extra-MSA stack or the Evoformer) keeping its
    /// streams off the device in turn, or not (OpenFold's `offload_inference`): in each block
    /// the MSA is on the host but for its own updates, and the pair is there during them (its
    /// bias for the row attention made first); the outer product mean reads the MSA from the
    /// host a batch of sequences at a time ([`ChunkOp::OuterProductMeanSequences`]), and the
    /// extra-MSA stack's MSA is embedded into host memory. Only the no-grad, in-place forward
    /// moves its streams (a recording one leaves them where they are): each block moves the MSA
    /// to the device and back once and reads it once more, and the pair the same, so a plan
    /// sets it only where no chunking fits the budget without it.
    pub fn offloading(mut self, stage: Stage, on: bool) -> ChunkPlan {
        match on {
            true => self.offloaded.insert(stage),
            false => self.offloaded.remove(&stage),
        };
        self
    }

    /// Whether the stack of `stage` keeps its streams off the device in turn.
    pub fn offloads(&self, stage: Stage) -> bool {
        self.offloaded.contains(&stage)
    }

    /// The size of `op` in `stage`.
    pub fn get(&self, stage: Stage, op: ChunkOp) -> Option<i64> {
        match self.sizes.get(&(stage, op)) {
            Some(&size) => size,
            None if op == ChunkOp::OuterProductMeanSequences => None,
            None => self.uniform,
        }
    }
}

/// The DAP context and chunk sizes a forward runs under.
#[derive(Clone, Debug)]
pub struct Exec {
    dap: Dap,
    plan: Arc<ChunkPlan>,
    stage: Stage,
    checkpoint_blocks: bool,
    dropout: Option<DropoutRates>,
}

impl Exec {
    /// One process, nothing chunked: the reference the chunked and DAP runs are checked against.
    pub fn serial() -> Exec {
        Exec::new(Dap::none(), None)
    }

    /// DAP over `dap`'s group, every memory-heavy step `chunk` rows at a time (`None`: whole).
    pub fn new(dap: Dap, chunk: Option<i64>) -> Exec {
        Exec::planned(dap, ChunkPlan::uniform(chunk))
    }

    /// DAP over `dap`'s group, each step chunked as `plan` says.
    pub fn planned(dap: Dap, plan: ChunkPlan) -> Exec {
        Exec { dap, plan: Arc::new(plan), stage: Stage::Outer, checkpoint_blocks: false, dropout: None }
    }

    /// The DAP context (with no group, every layout switch is the identity).
    pub fn dap(&self) -> &Dap {
        &self.dap
    }

    /// How many rows of its batch-like axis `op` takes at a time in this stage (`None`: all).
    /// Every chunked operation reads its size here, so that one place decides it.
    pub fn chunk_for(&self, op: ChunkOp) -> Option<i64> {
        self.plan.get(self.stage, op)
    }

    /// Whether this stage's stack keeps its streams off the device in turn
    /// ([`ChunkPlan::offloading`]).
    pub fn offloads(&self) -> bool {
        self.plan.offloads(self.stage)
    }

    /// The plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    /// This context with the Evoformer and extra-MSA blocks checkpointed or not: in training,
    /// each block keeps no activations and backward recomputes it (AlphaFold's
    /// rematerialisation), the same gradients for about one more forward's compute.
    pub fn with_checkpointed_blocks(self, on: bool) -> Exec {
        Exec { checkpoint_blocks: on, ..self }
    }

    /// Whether the Evoformer and extra-MSA blocks are checkpointed.
    pub fn checkpoints_blocks(&self) -> bool {
        self.checkpoint_blocks
    }

    /// This context with training dropout at `rates` (`None`: none, as in inference and
    /// AlphaFold's `deterministic`). Dropout needs a key too: the modules that are given one
    /// drop at these rates, and nothing is drawn without one.
    pub fn with_dropout(self, rates: Option<DropoutRates>) -> Exec {
        Exec { dropout: rates, ..self }
    }

    /// The training dropout rates, if dropout is on.
    pub fn dropout(&self) -> Option<&DropoutRates> {
        self.dropout.as_ref()
    }

    /// This context inside `stage`.
    pub fn in_stage(&self, stage: Stage) -> Exec {
        Exec { stage, ..self.clone() }
    }

    /// This context without the DAP group, for the modules every rank runs whole (the
    /// templates): they chunk as the plan says, on this rank alone.
    pub fn without_dap(&self) -> Exec {
        Exec { dap: Dap::none(), ..self.clone() }
    }
}
