//! `vit pretrain --parallel plan|auto`: the planner's choice of layout, ZeRO stage and
//! checkpointed blocks for the ranks, `--batch` and the model, printed without training
//! (`plan`, for `--nproc`) or filled into the layout flags and trained with (`auto`, for the
//! job's ranks; see [`apply`]).
use engine::planner::{solve, Cluster, Plan, Solution, TpMode};

use crate::model::VitConfig;
use crate::profile::planner_model;
use crate::train::{model_config, PretrainArgs};

/// What `--parallel` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlannerMode {
    /// Print the plan and the runners-up, then exit.
    Plan,
    /// Choose the plan and train with it: the plan fills in the layout flags (--tp, --tp-mode,
    /// --tp-depth, --sp, --pp, --micro-batch, --zero, --gradient-checkpointing), which must
    /// then be left at their defaults.
    Auto,
}

/// The layout flags `--parallel` chooses, each with whether `args` sets it away from its
/// default (a flag given at its default value changes nothing and is accepted).
fn layout_flags(args: &PretrainArgs) -> [(&'static str, bool); 12] {
    let (p, pp) = (&args.parallel, &args.pipeline);
    [
        ("--tp", p.tp != 1),
        ("--tp-mode", p.tp_mode != crate::tensor_parallel::TpMode::OneD),
        ("--tp-depth", p.tp_depth != 1),
        ("--sequence-parallel", p.sequence_parallel),
        ("--sp", p.sp != 1),
        ("--sp-mode", p.sp_mode != crate::sequence_parallel::SpMode::Ulysses),
        ("--pp", pp.pp != 1),
        ("--schedule", pp.schedule.is_some()),
        ("--virtual-stages", pp.virtual_stages.is_some()),
        ("--micro-batch", args.micro_batch.is_some()),
        ("--zero", args.zero != 0),
        ("--gradient-checkpointing", args.gradient_checkpointing),
    ]
}

/// The model's config and the planner's solution for `args` on `nproc` ranks. A layout flag
/// set beside `--parallel` is an error naming it: the planner chooses all of them together,
/// and honouring one as a constraint would hide that the rest were chosen around it.
pub fn choose(args: &PretrainArgs, nproc: usize) -> anyhow::Result<(VitConfig, Solution)> {
    if let Some((flag, _)) = layout_flags(args).into_iter().find(|(_, set)| *set) {
        anyhow::bail!(
            "--parallel chooses {flag} itself: leave {flag} out, or leave out --parallel and give the whole layout"
        );
    }
    let cluster = match &args.cluster {
        Some(path) => Cluster::load(path)?,
        None => Cluster { devices_per_node: nproc, ..Cluster::default() },
    };
    if nproc > cluster.devices() {
        anyhow::bail!("--nproc {nproc}: the cluster has {} devices", cluster.devices());
    }
    let splits = args.data.splits()?;
    let cfg =
        model_config(args.model.as_deref(), args.image_size, args.patch_size, splits.embedded, splits.train.as_ref())?;
    let model = planner_model(&cfg, args.batch);
    let solution = solve(&model, &cluster, nproc, 4, &|p| runs(&cfg, p, args.batch))?;
    Ok((cfg, solution))
}

/// The plan for `args` as text (the error names the flag or file that cannot work).
pub fn run(args: &PretrainArgs) -> anyhow::Result<String> {
    let nproc = args.job.launch.nproc;
    let (cfg, solution) = choose(args, nproc)?;
    Ok(describe(&cfg, &solution, args.batch, nproc))
}

/// The model, the chosen plan with its predicted step time and memory per device, the
/// runners-up and the blocks to checkpoint.
fn describe(cfg: &VitConfig, solution: &Solution, batch: usize, nproc: usize) -> String {
    let blocks: Vec<String> = solution.best.plan.checkpoint.iter().map(|i| format!("blocks.{}", i - 1)).collect();
    let mut out = format!(
        "model: {}px images in {}px patches ({} tokens), width {}, depth {}; batch {batch}, {nproc} ranks\n{solution}",
        cfg.image_size,
        cfg.patch_size,
        cfg.num_patches() + 1,
        cfg.width,
        cfg.depth,
    );
    if !blocks.is_empty() {
        out += &format!("blocks to checkpoint (--gradient-checkpointing): {}\n", blocks.join(", "));
    }
    out
}

/// `args` with the layout flags filled in from the planner's best plan for `nproc` ranks
/// (and `--parallel` cleared), and the plan as [`run`] prints it: `vit pretrain --parallel
/// auto` then trains through the same path as the manual flags.
pub fn apply(args: &PretrainArgs, nproc: usize) -> anyhow::Result<(PretrainArgs, Solution, String)> {
    let (cfg, solution) = choose(args, nproc)?;
    let text = describe(&cfg, &solution, args.batch, nproc);
    Ok((with_plan(args, &solution.best.plan), solution, text))
}

/// `args` with the layout flags that run `plan` (one of those [`runs`] admits) and without
/// `--parallel`.
pub fn with_plan(args: &PretrainArgs, plan: &Plan) -> PretrainArgs {
    let mut out = args.clone();
    out.planner = None;
    out.parallel.tp = plan.tp;
    (out.parallel.tp_mode, out.parallel.tp_depth) = match plan.tp_mode {
        TpMode::OneD => (crate::tensor_parallel::TpMode::OneD, 1),
        TpMode::TwoD => (crate::tensor_parallel::TpMode::TwoD, 1),
        TpMode::TwoHalfD { depth } => (crate::tensor_parallel::TpMode::TwoPointFiveD, depth),
        TpMode::ThreeD => (crate::tensor_parallel::TpMode::ThreeD, 1),
    };
    out.parallel.sp = plan.sp;
    out.pipeline.pp = plan.pp;
    out.micro_batch = Some(args.batch / (plan.dp * plan.micro_batches));
    out.zero = plan.zero;
    // `runs` admits no checkpoint set but none and every block.
    out.gradient_checkpointing = !plan.checkpoint.is_empty();
    out
}

/// Whether `vit pretrain` runs `plan` for `cfg`: the layouts' own divisibility rules, and
/// checkpointing every block or none (`--gradient-checkpointing` is all or nothing; the
/// solver's other sets, the first k blocks of each stage, have no flag).
pub fn runs(cfg: &VitConfig, plan: &Plan, global_batch: usize) -> bool {
    if !(plan.checkpoint.is_empty() || plan.checkpoint.len() == cfg.depth as usize) {
        return false;
    }
    let micro = global_batch / (plan.dp * plan.micro_batches);
    let tp = plan.tp as i64;
    if plan.tp > 1 {
        let ok = match plan.tp_mode {
            TpMode::OneD => crate::tensor_parallel::check(cfg, tp).is_ok(),
            mode => {
                // The grids cut the linear inputs into q blocks (q^2 for the cube), the outputs,
                // heads and classes into q; every batch block count divides tp.
                let q = mode.side(plan.tp) as i64;
                let inputs = if mode == TpMode::ThreeD { q * q } else { q };
                let patch = cfg.in_channels * cfg.patch_size * cfg.patch_size;
                cfg.heads % q == 0
                    && cfg.num_classes % q == 0
                    && [cfg.width, cfg.mlp_hidden(), patch].iter().all(|w| w % inputs == 0)
                    && micro.is_multiple_of(plan.tp)
            }
        };
        if !ok {
            return false;
        }
    }
    if plan.sp > 1 {
        let sp = plan.sp as i64;
        let tokens = cfg.num_patches() + 1;
        // --sp runs with 1D tensor parallelism only; the default Ulysses needs the heads.
        if plan.tp_mode != TpMode::OneD || tokens % sp != 0 || (cfg.heads / tp) % sp != 0 {
            return false;
        }
    }
    plan.pp <= cfg.depth as usize + 2
}
