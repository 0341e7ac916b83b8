//! `vit pretrain --parallel plan|auto`: the planner's choice of layout, ZeRO stage and
//! checkpointed blocks for the ranks, `--batch` and the model, printed without training
//! (`plan`, for `--nproc`) or filled into the layout flags and trained with (`auto`, for the
//! job's ranks; see [`apply`]).
use engine::dist::{ProcessGroup, World};
use engine::planner::{calibrate, solve, Cluster, Plan, Solution, TpMode};
use tch::Device;

use crate::model::VitConfig;
use crate::profile::planner_model;
use crate::train::{model_config, PretrainArgs};

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

/// The layout flags `--parallel` chooses, each with whether `args` sets it: given on the
/// command line (`args.given`, even at its default value) or away from its default.
fn layout_flags(args: &PretrainArgs) -> [(&'static str, bool); 13] {
    let (p, pp) = (&args.parallel, &args.pipeline);
    let given = |id: &str| args.given.iter().any(|g| g == id);
    [
        ("--tp", given("tp") || p.tp != 1),
        ("--tp-mode", given("tp_mode") || p.tp_mode != crate::tensor_parallel::TpMode::OneD),
        ("--tp-depth", given("tp_depth") || p.tp_depth != 1),
        ("--sequence-parallel", p.sequence_parallel),
        ("--sp", given("sp") || p.sp != 1),
        ("--sp-mode", given("sp_mode") || p.sp_mode != crate::sequence_parallel::SpMode::Ulysses),
        ("--pp", given("pp") || pp.pp != 1),
        ("--schedule", pp.schedule.is_some()),
        ("--virtual-stages", pp.virtual_stages.is_some()),
        ("--micro-batch", args.micro_batch.is_some()),
        ("--zero", given("zero") || args.zero != 0),
        ("--gradient-checkpointing", args.gradient_checkpointing),
        ("--checkpoint-blocks", args.checkpoint_blocks.is_some()),
    ]
}

/// Errors unless every layout flag is at its default: the planner chooses all of them
/// together, and honouring one as a constraint would hide that the rest were chosen around it.
pub fn check_flags(args: &PretrainArgs) -> anyhow::Result<()> {
    if let Some((flag, _)) = layout_flags(args).into_iter().find(|(_, set)| *set) {
        anyhow::bail!(
            "--parallel chooses {flag} itself: leave {flag} out, or leave out --parallel and give the whole layout"
        );
    }
    Ok(())
}

/// The cluster the planner models for `nproc` ranks, and a line saying where its figures come
/// from: `--cluster`'s file, else the default cluster with this machine's matmul FLOP/s and,
/// given the job's `group` (a collective then: every rank calls it and gets the same
/// figures), its links' latency and bandwidth measured ([`engine::planner::calibrate`]).
pub fn cluster(
    args: &PretrainArgs,
    nproc: usize,
    group: Option<&ProcessGroup>,
    device: Device,
) -> anyhow::Result<(Cluster, String)> {
    let (cluster, source) = match &args.cluster {
        Some(path) => (Cluster::load(path)?, format!("from {}", path.display())),
        None => {
            let base = Cluster { devices_per_node: nproc, ..Cluster::default() };
            let measured = calibrate::calibrated(base, group, device)?;
            let what = match group.is_some_and(|g| g.size() > 1) {
                true => "matmul FLOP/s and link latency and bandwidth measured on this machine",
                false => "matmul FLOP/s measured on this machine, link figures assumed",
            };
            (measured, format!("{what}; memory assumed, --cluster sets any of them"))
        }
    };
    if nproc > cluster.devices() {
        anyhow::bail!("--nproc {nproc}: the cluster has {} devices", cluster.devices());
    }
    let line = format!(
        "cluster: {} x {} devices of {}, {:.1} GFLOP/s, links {:.2} GB/s and {:.1} us ({source})\n",
        cluster.nodes,
        cluster.devices_per_node,
        engine::gemini::budget::human(cluster.memory_bytes as usize),
        cluster.peak_flops / 1e9,
        cluster.intra_node_bandwidth / 1e9,
        cluster.latency_s * 1e6
    );
    Ok((cluster, line))
}

/// The model's config and the planner's solution for `args` on `nproc` ranks of `cluster`
/// (a layout flag set beside `--parallel` is an error naming it).
pub fn choose(args: &PretrainArgs, nproc: usize, cluster: &Cluster) -> anyhow::Result<(VitConfig, Solution)> {
    check_flags(args)?;
    let splits = args.data.splits()?;
    let cfg =
        model_config(args.model.as_deref(), args.image_size, args.patch_size, splits.embedded, splits.train.as_ref())?;
    let model = planner_model(&cfg, args.batch);
    let solution = solve(&model, cluster, nproc, 4, &|p| runs(&cfg, p, args.batch))?;
    Ok((cfg, solution))
}

/// The plan for `args` as text (the error names the flag or file that cannot work). Without
/// `--cluster` the matmul is timed with this process's share of the cores for `--nproc` ranks
/// (the threads are set so: this runs only as `vit pretrain --parallel plan`, which then exits).
pub fn run(args: &PretrainArgs) -> anyhow::Result<String> {
    let nproc = args.job.launch.nproc;
    check_flags(args)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tch::set_num_threads(i32::try_from((cores / nproc.max(1)).max(1))?);
    // The matmul is timed where the run would compute (one GPU, or this share of the cores).
    let device = args.job.launch.device.device.device(0, nproc)?;
    let (cluster, line) = self::cluster(args, nproc, None, device)?;
    let (cfg, solution) = choose(args, nproc, &cluster)?;
    Ok(line + &describe(&cfg, &solution, args.batch, nproc))
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
        let flag = match blocks.len() == cfg.depth as usize {
            true => "--gradient-checkpointing".to_string(),
            false => format!("--checkpoint-blocks {}", blocks.len()),
        };
        out += &format!("blocks to checkpoint ({flag}): {}\n", blocks.join(", "));
    }
    out
}

/// `args` with the layout flags filled in from the planner's best plan for `world`'s ranks
/// (and `--parallel` cleared), and the plan as [`run`] prints it: `vit pretrain --parallel
/// auto` then trains through the same path as the manual flags. A collective without
/// `--cluster` (the ranks measure the machine together).
pub fn apply(args: &PretrainArgs, world: &World) -> anyhow::Result<(PretrainArgs, Solution, String)> {
    check_flags(args)?;
    let nproc = world.size();
    let (cluster, line) = cluster(args, nproc, Some(&world.group), args.job.launch.device(world)?)?;
    let (cfg, solution) = choose(args, nproc, &cluster)?;
    let text = line + &describe(&cfg, &solution, args.batch, nproc);
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
    // `runs` admits the first k blocks (under a pipeline only none or all), which is what
    // --checkpoint-blocks k checkpoints (k = depth: every block, as --gradient-checkpointing).
    let k = plan.checkpoint.len();
    out.gradient_checkpointing = false;
    out.checkpoint_blocks = (k > 0).then_some(k);
    out
}

/// Whether `vit pretrain` runs `plan` for `cfg`: the layouts' own divisibility rules, and a
/// checkpoint set `--checkpoint-blocks` expresses: the model's first k blocks (its layers
/// 1..=k, after the stem). Under a pipeline the solver's sets are the first k blocks of each
/// stage, which is that only for none or all.
pub fn runs(cfg: &VitConfig, plan: &Plan, global_batch: usize) -> bool {
    let k = plan.checkpoint.len();
    let leading = plan.checkpoint.iter().copied().eq(1..=k);
    if !leading || (plan.pp > 1 && k != 0 && k != cfg.depth as usize) {
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
