//! A `vit pretrain` job's parallel layout: how its ranks split the model and the batch. One
//! validated value, [`Layout`], built once, from the layout flags ([`Layout::from_flags`]) or
//! from the planner's plan ([`Layout::from_plan`]); every later step reads it: the groups
//! ([`crate::mesh::Mesh`]), the model's split ([`crate::parallelize`]), the batch's split, the
//! checkpoint record. The rules for what may combine with what live here once:
//! `Layout::validate` for the flags among themselves and the job's ranks, [`Layout::check`]
//! for the model they split (the planner asks the same two before it prices a plan).
use std::path::PathBuf;

use anyhow::bail;
use engine::parallel::pipeline::{split_costs, Balance, Schedule, ScheduleKind};
use engine::parallel::tensor::TpMode;
use engine::planner::Plan;

use crate::batch::BatchPlan;
use crate::model::VitConfig;
use crate::sequence_parallel::SpMode;

/// The largest micro-batch a rank takes when `--micro-batch` is not given, and the largest the
/// planner considers: larger ones save only the per-micro-batch overheads, while their
/// activations outgrow what allocators and caches keep warm (a CPU step at 16,384 digits per
/// micro-batch measured 2.6 times its pricing, one of 256 within a quarter).
pub const MAX_MICRO_BATCH: usize = 256;

/// What `--parallel` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlannerMode {
    /// Print the plan and the runners-up, then exit.
    Plan,
    /// Choose the plan and train with it: the plan fills in the layout flags (--tp, --tp-mode,
    /// --tp-depth, --sp, --pp, --micro-batch, --zero, --checkpoint-blocks), which must then be
    /// left at their defaults (--gradient-checkpointing too).
    Auto,
}

/// The flags of `vit pretrain` that lay the model and the batch over the ranks (beside the
/// job's rank count, `--nproc` or the launcher's).
#[derive(clap::Args, Clone, Debug)]
pub struct LayoutArgs {
    /// Examples per forward/backward on one rank (default: the largest divisor of the per-rank
    /// batch up to 256); the rest of the per-rank batch is gradient accumulation.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub micro_batch: Option<usize>,
    /// Tensor-parallel ranks: the model's layers are split over groups of this many
    /// consecutive ranks (its heads and widths must divide as --tp-mode needs), and the job's
    /// ranks over --tp x --sp are the data-parallel replicas (--batch and ZeRO are over those).
    #[arg(long, default_value_t = 1, value_parser = engine::parse::count(1..))]
    pub tp: usize,
    /// How --tp splits the model: 1d (Megatron's column/row split of the blocks' linear
    /// layers), 2d (a q x q grid, --tp = q^2), 2.5d (q x q x --tp-depth), 3d (a q x q x q cube,
    /// --tp = q^3); 2d, 2.5d and 3d split every layer, the activations' batch and width too.
    #[arg(long, value_enum, default_value = "1d")]
    pub tp_mode: TpMode,
    /// Depth d of --tp-mode 2.5d (--tp = q x q x d).
    #[arg(long, default_value_t = 1, value_parser = engine::parse::count(1..))]
    pub tp_depth: usize,
    /// Megatron's sequence parallelism within the --tp group (1d): the norms and residual
    /// stream between the split layers hold 1/tp of the tokens (the tokens, patches plus the
    /// class token, must divide by --tp).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Sequence-parallel ranks: the tokens (patches plus the class token, which must divide
    /// by it) are split over groups of this many ranks, attention runs as --sp-mode says.
    #[arg(long, default_value_t = 1, value_parser = engine::parse::count(1..))]
    pub sp: usize,
    /// Attention over the --sp group: ulysses (the default: all-to-alls between token and
    /// head splits hand about 4 N h / sp elements per rank per layer forward, falling with
    /// --sp, where the ring passes 2 N h (sp - 1) / sp; the heads per --tp rank must divide by
    /// --sp) or ring (keys and values passed around the ring: any head count, and one score
    /// block of (N / sp)^2 at a time, for sequences too long for whole score matrices).
    #[arg(long, value_enum, default_value = "ulysses")]
    pub sp_mode: SpMode,
    /// Pipeline stages: the model's parts (stem, blocks, head) are cut into this many
    /// stages over groups of ranks; --pp x --tp x --sp must divide the ranks, the rest are the
    /// data-parallel replicas. A step's micro-batches (per-replica batch / --micro-batch) flow
    /// through the stages. Composes with ZeRO, every --tp-mode (1d with --sequence-parallel
    /// too) and --sp (ring or Ulysses) inside the stages.
    #[arg(long, default_value_t = 1, value_parser = engine::parse::count(1..))]
    pub pp: usize,
    /// The pipeline schedule (with --pp; default 1f1b): gpipe (all forwards, then all
    /// backwards), 1f1b (one forward, one backward: holds at most --pp micro-batches),
    /// interleaved (1F1B over --virtual-stages model chunks per rank: the bubble shrinks by that
    /// factor), zb (ZB-H1: the weight-gradient pass fills the bubble).
    #[arg(long, value_enum)]
    pub schedule: Option<ScheduleKind>,
    /// Model chunks per pipeline rank (--schedule interleaved; default 2 there, else 1).
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// What the stages balance (with --pp; default params): params (parameter bytes), layers
    /// (the number of parts), time (each part's forward and backward time on this device, as
    /// world rank 0 measured it: every rank cuts the same stages).
    #[arg(long, value_enum)]
    pub pp_balance: Option<Balance>,
    /// ZeRO stage: 0 (plain data parallel), 1 (sharded optimizer state), 2 (and gradients).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub zero: u8,
    /// Activation checkpointing (timm's set_grad_checkpointing): each transformer block keeps
    /// only its input between forward and backward and is recomputed in backward (about one
    /// more forward of compute for much less activation memory); under --pp, each stage's
    /// blocks. Not with --schedule zb, whose separate weight pass needs the blocks' graphs.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Checkpoint only the first this many transformer blocks (the rest keep their
    /// activations): less recomputation than --gradient-checkpointing for some of its memory
    /// saving; under --pp each block stays as set wherever its stage is.
    #[arg(long, conflicts_with = "gradient_checkpointing")]
    pub checkpoint_blocks: Option<usize>,
    /// `plan`: print the automatic planner's layout, ZeRO stage and checkpointed blocks for
    /// --nproc, --batch and the model (on --cluster), with predicted time and memory and the
    /// runners-up, and exit without training. `auto`: print the plan and train with it (the
    /// plan sets --tp, --tp-mode, --tp-depth, --sp, --pp, --micro-batch, --zero and
    /// --checkpoint-blocks; giving any of those, or --gradient-checkpointing,
    /// --sequence-parallel, --sp-mode, --schedule or --virtual-stages, beside it is an error
    /// naming the flag).
    #[arg(long = "parallel", value_enum)]
    pub planner: Option<PlannerMode>,
    /// The cluster the planner models (`cluster.json`: nodes, devices_per_node, memory_bytes,
    /// peak_flops, intra_node_bandwidth, inter_node_bandwidth, latency_s; missing keys default).
    #[arg(long, requires = "planner")]
    pub cluster: Option<PathBuf>,
    /// The argument ids given on the command line, not defaulted (`main` sets them from
    /// clap's matches): `--parallel` refuses a layout flag given even at its default value.
    #[arg(skip)]
    pub given: Vec<String>,
}

impl LayoutArgs {
    /// The layout flags `--parallel` chooses, each with whether it is set: given on the command
    /// line (`given`, even at its default value) or away from its default.
    fn planned_flags(&self) -> [(&'static str, bool); 13] {
        let given = |id: &str| self.given.iter().any(|g| g == id);
        [
            ("--tp", given("tp") || self.tp != 1),
            ("--tp-mode", given("tp_mode") || self.tp_mode != TpMode::OneD),
            ("--tp-depth", given("tp_depth") || self.tp_depth != 1),
            ("--sequence-parallel", self.sequence_parallel),
            ("--sp", given("sp") || self.sp != 1),
            ("--sp-mode", given("sp_mode") || self.sp_mode != SpMode::Ulysses),
            ("--pp", given("pp") || self.pp != 1),
            ("--schedule", self.schedule.is_some()),
            ("--virtual-stages", self.virtual_stages.is_some()),
            ("--micro-batch", self.micro_batch.is_some()),
            ("--zero", given("zero") || self.zero != 0),
            ("--gradient-checkpointing", self.gradient_checkpointing),
            ("--checkpoint-blocks", self.checkpoint_blocks.is_some()),
        ]
    }

    /// Errors unless every flag `--parallel` chooses is at its default: the planner chooses
    /// all of them together, and honouring one as a constraint would hide that the rest were
    /// chosen around it.
    pub fn leave_to_planner(&self) -> anyhow::Result<()> {
        if let Some((flag, _)) = self.planned_flags().into_iter().find(|(_, set)| *set) {
            bail!(
                "--parallel chooses {flag} itself: leave {flag} out, or leave out --parallel and give the whole layout"
            );
        }
        Ok(())
    }
}

/// Which transformer blocks recompute their activations in backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointing {
    /// The first this many blocks (0: none).
    First(usize),
    /// Every block (`--gradient-checkpointing`).
    All,
}

impl Checkpointing {
    /// How many of `depth` blocks are checkpointed.
    pub fn blocks(self, depth: usize) -> usize {
        match self {
            Checkpointing::First(k) => k,
            Checkpointing::All => depth,
        }
    }

    /// Whether any block is.
    pub fn any(self) -> bool {
        self != Checkpointing::First(0)
    }
}

/// A job's layout: `pp x dp x sp x tp` ranks (tensor-parallel groups are runs of consecutive
/// ranks, then the sequence-parallel groups, the data replicas, the stages), how each axis
/// splits, the batch's split and what the data-parallel step shards and recomputes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Layout {
    /// Data-parallel replicas: they split the batch.
    pub dp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// How they split the model.
    pub tp_mode: TpMode,
    /// The grid's layers under 2.5D (1 otherwise).
    pub tp_depth: usize,
    /// Megatron's sequence parallelism within the 1D tensor-parallel group.
    pub sequence_parallel: bool,
    /// Sequence-parallel ranks.
    pub sp: usize,
    /// How they attend.
    pub sp_mode: SpMode,
    /// Pipeline stages.
    pub pp: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank.
    pub virtual_stages: usize,
    /// What the stages balance.
    pub balance: Balance,
    /// The global batch over the replicas, micro-batches and accumulation.
    pub batch: BatchPlan,
    /// ZeRO stage over the data (and sequence) ranks.
    pub zero: u8,
    /// Which blocks are recomputed in backward.
    pub checkpointing: Checkpointing,
}

impl Layout {
    /// The layout `args` give for `ranks` ranks and a global batch of `batch`: an impossible
    /// combination, or sizes that do not divide the job, are errors naming the flags and
    /// numbers.
    pub fn from_flags(args: &LayoutArgs, ranks: usize, batch: usize) -> anyhow::Result<Layout> {
        if args.pp == 1 && (args.schedule.is_some() || args.virtual_stages.is_some()) {
            bail!("--schedule and --virtual-stages need --pp 2 or more");
        }
        if args.pp == 1 && args.pp_balance.is_some() {
            bail!("--pp-balance needs --pp 2 or more");
        }
        let schedule = args.schedule.unwrap_or(ScheduleKind::OneFOneB);
        let virtual_stages = args.virtual_stages.unwrap_or(if schedule == ScheduleKind::Interleaved { 2 } else { 1 });
        let checkpointing = match (args.gradient_checkpointing, args.checkpoint_blocks) {
            (true, _) => Checkpointing::All,
            (false, k) => Checkpointing::First(k.unwrap_or(0)),
        };
        if checkpointing.any() && schedule == ScheduleKind::ZeroBubbleH1 {
            // ZB-H1 runs each layer's graph twice (input gradients, later weight gradients);
            // a checkpointed block has no graph to keep and would add its weight gradients twice.
            let flag = if args.gradient_checkpointing { "--gradient-checkpointing" } else { "--checkpoint-blocks" };
            bail!("{flag} with --schedule zb: the zero-bubble weight pass needs each block's graph; use gpipe, 1f1b or interleaved");
        }
        // `fill` sets the replicas and the batch's split once the sizes are known to fit.
        let layout = Layout {
            dp: 0,
            tp: args.tp,
            tp_mode: args.tp_mode,
            tp_depth: args.tp_depth,
            sequence_parallel: args.sequence_parallel,
            sp: args.sp,
            sp_mode: args.sp_mode,
            pp: args.pp,
            schedule,
            virtual_stages,
            balance: args.pp_balance.unwrap_or(Balance::ParameterBytes),
            batch: BatchPlan { global: batch, micro: 0, accumulation: 0 },
            zero: args.zero,
            checkpointing,
        };
        layout.fill(ranks, batch, args.micro_batch)
    }

    /// The layout that runs the planner's `plan` with a global batch of `batch`. Checkpoint sets
    /// other than the model's first blocks (or, under a pipeline, none or all: the planner's
    /// sets there are each stage's first blocks) have no flags, and are errors.
    pub fn from_plan(plan: &Plan, batch: usize, depth: usize) -> anyhow::Result<Layout> {
        let k = plan.checkpoint.len();
        if !plan.checkpoint.iter().copied().eq(1..=k) {
            bail!("{plan}: the checkpointed blocks are not the model's first ones");
        }
        if plan.pp > 1 && k != 0 && k != depth {
            bail!("{plan}: under a pipeline only none or all of the blocks can be checkpointed");
        }
        let layout = Layout {
            dp: 0,
            tp: plan.tp,
            tp_mode: plan.tp_mode,
            tp_depth: plan.tp_depth,
            sequence_parallel: false,
            sp: plan.sp,
            sp_mode: SpMode::Ulysses,
            pp: plan.pp,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            balance: Balance::ParameterBytes,
            batch: BatchPlan { global: batch, micro: 0, accumulation: 0 },
            zero: plan.zero,
            checkpointing: Checkpointing::First(k),
        };
        let micro = batch.checked_div(plan.dp * plan.micro_batches).filter(|m| *m > 0);
        layout.fill(plan.ranks(), batch, micro)
    }

    /// This layout over `ranks` ranks, validated, with its replica count and the split of the
    /// global batch `global` (micro-batches of `micro`, or the default) filled in.
    fn fill(mut self, ranks: usize, global: usize, micro: Option<usize>) -> anyhow::Result<Layout> {
        self.dp = self.validate(ranks)?;
        self.batch = BatchPlan::new(global, self.dp, micro, MAX_MICRO_BATCH).map_err(anyhow::Error::msg)?;
        Ok(self)
    }

    /// The rules the sizes and modes obey among themselves and over `ranks` ranks; returns
    /// the data-parallel replicas.
    fn validate(&self, ranks: usize) -> anyhow::Result<usize> {
        let (pp, tp, sp) = (self.pp, self.tp, self.sp);
        let v = self.virtual_stages;
        if v == 0 || pp.checked_mul(v).is_none() {
            bail!("--virtual-stages {v}: give 1 or more, and few enough to count --pp x --virtual-stages chunks");
        }
        if v > 1 && self.schedule != ScheduleKind::Interleaved {
            bail!(
                "--virtual-stages {v} needs --schedule interleaved (the other schedules run one model chunk per rank)"
            );
        }
        let Some(replica) = pp.checked_mul(tp).and_then(|r| r.checked_mul(sp)) else {
            bail!("--pp {pp} x --tp {tp} x --sp {sp} is more ranks than can be counted");
        };
        // Modes that would change nothing at their sizes are errors, not silently ignored.
        if tp == 1 && self.tp_mode != TpMode::OneD {
            bail!("--tp-mode {} splits the model over --tp ranks: it needs --tp 2 or more", self.tp_mode.name());
        }
        if sp == 1 && self.sp_mode != SpMode::Ulysses {
            bail!("--sp-mode ring is how --sp ranks attend: it needs --sp 2 or more");
        }
        if replica == 0 || !ranks.is_multiple_of(replica) {
            let mut sizes = vec![format!("--tp {tp}")];
            if pp != 1 {
                sizes.insert(0, format!("--pp {pp}"));
            }
            if sp != 1 {
                sizes.push(format!("--sp {sp}"));
            }
            let sizes = match pp {
                1 => sizes.join(" x "),
                _ => format!("{} = {replica} ranks per replica", sizes.join(" x ")),
            };
            bail!("{sizes} does not divide the job's {ranks} ranks (--nproc or the launcher's world size)");
        }
        if self.tp_depth != 1 && self.tp_mode != TpMode::TwoHalfD {
            bail!("--tp-depth {} is for --tp-mode 2.5d, not {}", self.tp_depth, self.tp_mode.name());
        }
        if self.sequence_parallel && tp < 2 {
            bail!("--sequence-parallel splits the tokens over the tensor-parallel ranks: it needs --tp 2 or more");
        }
        if self.sequence_parallel && self.tp_mode != TpMode::OneD {
            bail!("--sequence-parallel is Megatron's, for --tp-mode 1d (2d, 2.5d and 3d split the batch instead)");
        }
        if tp > 1 {
            self.tp_mode.side(tp, self.tp_depth).map_err(|e| anyhow::anyhow!("{}: {e}", self.tp_flags()))?;
        }
        if sp > 1 && self.tp_mode != TpMode::OneD {
            bail!(
                "--sp {sp} with --tp-mode {}: sequence parallelism combines with --tp-mode 1d only (2d, 2.5d and 3d \
                 split the batch over the grid already)",
                self.tp_mode.name()
            );
        }
        if sp > 1 && self.sequence_parallel {
            bail!("--sp {sp} with --sequence-parallel: choose one way to split the tokens");
        }
        Ok(ranks / replica)
    }

    /// Errors unless `cfg` splits as this layout cuts it: the heads, widths and classes over
    /// the tensor-parallel ranks, the tokens over the sequence ranks, the micro-batch into the
    /// grid's batch blocks, the parts into the pipeline's stages, the blocks to checkpoint.
    /// The errors name the flags and numbers.
    pub fn check(&self, cfg: &VitConfig) -> anyhow::Result<()> {
        let (tp, sp, n) = (self.tp, self.sp, self.tp as i64);
        let tokens = cfg.num_patches() + 1;
        if self.sequence_parallel && tokens % n != 0 {
            bail!(
                "--sequence-parallel: the model's {tokens} tokens ({} patches and the class token) do not split over \
                 --tp {n} ranks (choose --image-size / --patch-size to fit)",
                tokens - 1
            );
        }
        match self.tp_mode {
            _ if tp == 1 => {}
            TpMode::OneD => split_1d(cfg, n)?,
            mode => {
                // The linear layers' input widths divide into q blocks (2D) or q^2 (3D), their
                // outputs into q; the heads and classes into q.
                let q = mode.side(tp, self.tp_depth)? as i64;
                let inputs = if mode == TpMode::ThreeD { q * q } else { q };
                let patch = cfg.in_channels * cfg.patch_size * cfg.patch_size;
                let widths = [
                    ("attention heads", cfg.heads, q),
                    ("width", cfg.width, inputs),
                    ("MLP width", cfg.mlp_hidden(), inputs),
                    ("patch size (channels x patch^2)", patch, inputs),
                    ("classes", cfg.num_classes, q),
                ];
                for (what, len, parts) in widths {
                    if len % parts != 0 {
                        bail!(
                            "--tp {n} --tp-mode {} (q = {q}): the model's {what} ({len}) cannot be cut into {parts} \
                             blocks",
                            mode.name()
                        );
                    }
                }
            }
        }
        if sp > 1 {
            let s = sp as i64;
            if tokens % s != 0 {
                bail!(
                    "--sp {sp}: the model's {tokens} tokens ({} patches and the class token) do not split over {sp} \
                     ranks (choose --image-size / --patch-size to fit)",
                    tokens - 1
                );
            }
            let heads = cfg.heads / n;
            if self.sp_mode == SpMode::Ulysses && heads % s != 0 {
                bail!(
                    "--sp {sp} --sp-mode ulysses: the {heads} attention heads per tensor-parallel rank ({} over --tp \
                     {n}) do not split over {sp} ranks (use --sp-mode ring)",
                    cfg.heads
                );
            }
        }
        let (micro, blocks) = (self.batch.micro, self.batch_blocks());
        if !micro.is_multiple_of(blocks) {
            bail!(
                "--tp {tp}: a micro-batch of {micro} examples per data-parallel rank does not split into the layout's \
                 {blocks} batch blocks (choose --batch / --micro-batch to fit)"
            );
        }
        let depth = cfg.depth as usize;
        if let Checkpointing::First(k) = self.checkpointing {
            if k > depth {
                bail!("--checkpoint-blocks {k}: the model has {depth} blocks");
            }
        }
        if self.pp > 1 {
            self.check_pipeline(depth)?;
        }
        Ok(())
    }

    /// The pipeline's stages over the model's parts (stem, `depth` blocks, head) and its
    /// schedule over the step's micro-batches: the engine's own rules, asked before any group.
    fn check_pipeline(&self, depth: usize) -> anyhow::Result<()> {
        let (p, v) = (self.pp, self.virtual_stages);
        split_costs(vec![1.0; depth + 2], p * v, "layers").map_err(|e| {
            anyhow::anyhow!(
                "--pp {p} x --virtual-stages {v} = {} stages: the model has {} parts to cut (stem, {depth} blocks, \
                 head): {e}",
                p * v,
                depth + 2
            )
        })?;
        let micro_batches = self.batch.accumulation;
        Schedule::new(self.schedule, p, micro_batches, v).map_err(|e| {
            let flag =
                clap::ValueEnum::to_possible_value(&self.schedule).map_or_else(String::new, |v| v.get_name().into());
            anyhow::anyhow!(
                "--pp {p} --schedule {flag} with {micro_batches} micro-batches per step (the per-replica batch over \
                 --micro-batch): {e}"
            )
        })?;
        Ok(())
    }

    /// Into how many blocks a micro-batch is cut over the tensor-parallel group (2D, 2.5D and
    /// 3D split it; 1 otherwise): every batch the model takes must divide by it.
    pub fn batch_blocks(&self) -> usize {
        match self.tp {
            1 => 1,
            tp => self.tp_mode.batch_blocks(tp, self.tp_depth).unwrap_or(1),
        }
    }

    /// Whether anything is split or parallel beyond data parallelism within a stage.
    pub fn splits_model(&self) -> bool {
        self.tp > 1 || self.sp > 1
    }

    /// The flags that make this layout (beside `--batch`), each given even at its default
    /// where the planner chooses it: what `--parallel plan` prints under each plan, and what
    /// [`Layout::from_flags`] turns back into this layout.
    pub fn flags(&self) -> String {
        let mut f = format!("--nproc {}", self.dp * self.tp * self.sp * self.pp);
        if self.tp > 1 {
            f += &format!(" {}", self.tp_flags());
        }
        if self.sequence_parallel {
            f += " --sequence-parallel";
        }
        if self.sp > 1 {
            f += &format!(" --sp {}", self.sp);
        }
        if self.sp_mode != SpMode::Ulysses {
            f += " --sp-mode ring";
        }
        if self.pp > 1 {
            f += &format!(" --pp {}", self.pp);
            if self.schedule != ScheduleKind::OneFOneB || self.virtual_stages != 1 {
                let name = clap::ValueEnum::to_possible_value(&self.schedule).map(|v| v.get_name().to_string());
                f += &format!(" --schedule {} --virtual-stages {}", name.unwrap_or_default(), self.virtual_stages);
            }
            if self.balance != Balance::ParameterBytes {
                let name = clap::ValueEnum::to_possible_value(&self.balance).map(|v| v.get_name().to_string());
                f += &format!(" --pp-balance {}", name.unwrap_or_default());
            }
        }
        f += &format!(" --micro-batch {}", self.batch.micro);
        if self.zero > 0 {
            f += &format!(" --zero {}", self.zero);
        }
        match self.checkpointing {
            Checkpointing::First(0) => {}
            Checkpointing::First(k) => f += &format!(" --checkpoint-blocks {k}"),
            Checkpointing::All => f += " --gradient-checkpointing",
        }
        f
    }

    /// `--tp N --tp-mode M [--tp-depth D]`, for messages.
    fn tp_flags(&self) -> String {
        let mut flags = format!("--tp {} --tp-mode {}", self.tp, self.tp_mode.name());
        if self.tp_mode == TpMode::TwoHalfD {
            flags += &format!(" --tp-depth {}", self.tp_depth);
        }
        flags
    }
}

/// Checks that `tp` ranks can split `cfg` in 1D: its heads (and with them the width, a
/// multiple of the heads) and the MLP's hidden features must divide by `tp`. The error names
/// the numbers.
pub fn split_1d(cfg: &VitConfig, tp: i64) -> anyhow::Result<()> {
    let hidden = cfg.mlp_hidden();
    if cfg.heads % tp != 0 {
        bail!(
            "--tp {tp}: the model's {} attention heads (width {}) do not split over {tp} ranks",
            cfg.heads,
            cfg.width
        );
    }
    if hidden % tp != 0 {
        bail!("--tp {tp}: the model's MLP width {hidden} does not split over {tp} ranks");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_that_do_not_split_name_the_numbers() {
        let digits = VitConfig::digits();
        assert!(split_1d(&digits, 4).is_ok());
        let err = split_1d(&digits, 3).unwrap_err().to_string();
        assert!(err.contains("--tp 3: the model's 4 attention heads (width 64) do not split over 3 ranks"), "{err}");
        let odd_mlp = VitConfig { mlp_ratio: 1.5, width: 66, heads: 2, ..digits };
        let err = split_1d(&odd_mlp, 2).unwrap_err().to_string();
        assert!(err.contains("--tp 2: the model's MLP width 99 does not split over 2 ranks"), "{err}");
    }
}
