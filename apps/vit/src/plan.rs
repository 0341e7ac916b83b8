//! `vit pretrain --parallel plan|auto`: the planner's choice of layout, ZeRO stage and
//! checkpointed blocks for the ranks, `--batch` and the model, printed without training
//! (`plan`, for `--nproc`) or trained with (`auto`, for the job's ranks; see [`layout`]). The
//! planner prices only plans that [`Layout::from_plan`] turns into a layout the model takes
//! ([`runs`]): the rules are the manual flags' own.
use anyhow::bail;
use engine::dist::{ProcessGroup, World};
use engine::job::OptimizerKind;
use engine::planner::{calibrate, solve, Cluster, Model, Plan, Solution};
use tch::Device;

use crate::args::PretrainArgs;
use crate::datasets::Splits;
use crate::layout::{Layout, PlannerMode, MAX_MICRO_BATCH};
use crate::model::VitConfig;
use crate::profile::{planner_model, timed, with_times};

/// The job's layout: the flags', or under `--parallel auto` the planner's best for `world`'s
/// ranks (rank 0 prints the plan; a collective without `--cluster`, the ranks measuring the
/// machine together).
pub fn layout(args: &PretrainArgs, world: &World) -> anyhow::Result<Layout> {
    match args.layout.planner {
        None => Layout::from_flags(&args.layout, world.size(), args.batch),
        Some(PlannerMode::Plan) => bail!("--parallel plan prints the plan without training; use --parallel auto"),
        Some(PlannerMode::Auto) => {
            let (layout, _, text) = apply(args, world)?;
            if world.rank() == 0 {
                println!("{text}--parallel auto: training with the plan above");
            }
            Ok(layout)
        }
    }
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
    let (cluster, source) = match &args.layout.cluster {
        Some(path) => (Cluster::load(path)?, format!("from {}", path.display())),
        None => {
            let base = Cluster { devices_per_node: nproc, ..Cluster::default() };
            let measured = calibrate::calibrated(base, group, device)?;
            let what = match group.is_some_and(|g| g.size() > 1) {
                true => "device figures and link latency and bandwidth measured on this machine",
                false => "device figures measured on this machine, link figures assumed",
            };
            (measured, format!("{what}; memory assumed, --cluster sets any of them"))
        }
    };
    if nproc > cluster.devices() {
        anyhow::bail!("--nproc {nproc}: the cluster has {} devices", cluster.devices());
    }
    let line = format!(
        "cluster: {} x {} devices of {}, {:.1} GFLOP/s, {:.1} us per operation, memory {:.1} GB/s, links {:.2} \
         GB/s and {:.1} us, {:.1} us per collective in flight, {:.1} us per blocking one{} ({source})\n",
        cluster.nodes,
        cluster.devices_per_node,
        engine::gemini::budget::human(cluster.memory_bytes as usize),
        cluster.peak_flops / 1e9,
        cluster.op_overhead_s * 1e6,
        cluster.memory_bandwidth / 1e9,
        cluster.intra_node_bandwidth / 1e9,
        cluster.latency_s * 1e6,
        cluster.collective_s * 1e6,
        cluster.sync_s * 1e6,
        match cluster.cores_per_node {
            0 => String::new(),
            cores =>
                format!(", {cores} cores per node shared by its ranks, {:.2}x slower together", cluster.co_run_slowdown),
        }
    );
    Ok((cluster, line))
}

/// What the planner chose for a job, and what it chose for.
pub struct Choice {
    /// The ViT's architecture.
    pub cfg: VitConfig,
    /// The model as the planner prices it.
    pub model: Model,
    /// The plans it found.
    pub solution: Solution,
}

/// Element-wise operations each rule's update runs per parameter tensor on the engine's
/// tensor path (the moments, the direction, decay and, for LAMB and LARS, the trust ratio's
/// norms), counted from `engine::optim`; the fused multi-tensor kernels run a few launches
/// for all tensors instead.
fn optimizer_ops(kind: OptimizerKind, backend: kernels::Backend) -> f64 {
    match (backend, kind) {
        (kernels::Backend::Fused, _) => 0.0,
        (_, OptimizerKind::Adamw) => 12.0,
        (_, OptimizerKind::Lamb) => 17.0,
        (_, OptimizerKind::Lars) => 10.0,
    }
}

/// The planner's choice for `args` on `nproc` ranks of `cluster`, computing on `device` (a
/// layout flag set beside `--parallel` is an error naming it). Without `--cluster` (the
/// machine at hand, calibrated) the model's parts are timed on `device` and priced from that;
/// with `group` (the job's ranks, a collective) the ranks take turns and agree.
pub fn choose(
    args: &PretrainArgs,
    nproc: usize,
    cluster: &Cluster,
    device: Device,
    group: Option<&ProcessGroup>,
) -> anyhow::Result<Choice> {
    args.layout.leave_to_planner()?;
    let splits: Splits = args.data.splits()?;
    let cfg = args.model_config(&splits)?;
    let backend = kernels::Backend::resolve(args.kernels, device)?;
    let mut model = planner_model(&cfg, args.batch, optimizer_ops(args.optimizer.optimizer, backend));
    if args.layout.cluster.is_none() {
        model = with_times(model, timed(&cfg, device, group)?);
    }
    let solution = solve(&model, cluster, nproc, 4, &|p| runs(&cfg, p, args.batch))?;
    Ok(Choice { cfg, model, solution })
}

/// The plan for `args` as text (the error names the flag or file that cannot work). Without
/// `--cluster` the matmul is timed with this process's share of the cores for `--nproc` ranks
/// (the threads are set so: this runs only as `vit pretrain --parallel plan`, which then exits).
pub fn run(args: &PretrainArgs) -> anyhow::Result<String> {
    let nproc = args.job.launch.nproc;
    args.layout.leave_to_planner()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tch::set_num_threads(i32::try_from((cores / nproc.max(1)).max(1))?);
    // The matmul is timed where the run would compute (one GPU, or this share of the cores).
    let device = args.job.launch.device.device.device(0, nproc)?;
    let (cluster, line) = self::cluster(args, nproc, None, device)?;
    let choice = choose(args, nproc, &cluster, device, None)?;
    Ok(line + &describe(&choice, args.batch, nproc))
}

/// The model, the chosen plan with its predicted step time and memory per device and what
/// they are made of, the runners-up (each with the flags that run it) and the blocks to
/// checkpoint.
fn describe(choice: &Choice, batch: usize, nproc: usize) -> String {
    let Choice { cfg, solution, .. } = choice;
    let depth = cfg.depth as usize;
    let flags = |plan: &Plan| Layout::from_plan(plan, batch, depth).map_or_else(|e| format!("({e})"), |l| l.flags());
    let mut out = format!(
        "model: {}px images in {}px patches ({} tokens), width {}, depth {}; batch {batch}, {nproc} ranks{}\n{}",
        cfg.image_size,
        cfg.patch_size,
        cfg.num_patches() + 1,
        cfg.width,
        cfg.depth,
        if choice.model.layers.iter().any(|l| l.measured.is_some()) { "; each part timed on this device" } else { "" },
        solution.report(&flags)
    );
    let blocks: Vec<String> = solution.best.plan.checkpoint.iter().map(|i| format!("blocks.{}", i - 1)).collect();
    if !blocks.is_empty() {
        out += &format!("blocks to checkpoint: {}\n", blocks.join(", "));
    }
    out
}

/// The layout of the planner's best plan for `world`'s ranks, with the solution and the plan
/// as [`run`] prints it: `vit pretrain --parallel auto` then trains through the same path as
/// the manual flags. A collective without `--cluster` (the ranks measure the machine
/// together).
pub fn apply(args: &PretrainArgs, world: &World) -> anyhow::Result<(Layout, Solution, String)> {
    args.layout.leave_to_planner()?;
    let nproc = world.size();
    let device = args.job.launch.device(world)?;
    let (cluster, line) = cluster(args, nproc, Some(&world.group), device)?;
    let choice = choose(args, nproc, &cluster, device, Some(&world.group))?;
    let text = line + &describe(&choice, args.batch, nproc);
    let layout = Layout::from_plan(&choice.solution.best.plan, args.batch, choice.cfg.depth as usize)?;
    Ok((layout, choice.solution, text))
}

/// Whether the planner considers `plan` for `cfg` with a global batch of `global_batch`: the
/// plan makes a layout ([`Layout::from_plan`]: a checkpoint set `--checkpoint-blocks`
/// expresses) with micro-batches of at most [`MAX_MICRO_BATCH`] examples, and the model splits
/// as it cuts ([`Layout::check`]).
pub fn runs(cfg: &VitConfig, plan: &Plan, global_batch: usize) -> bool {
    let layout = Layout::from_plan(plan, global_batch, cfg.depth as usize);
    layout.and_then(|l| l.check(cfg).map(|_| l.batch.micro <= MAX_MICRO_BATCH)).unwrap_or(false)
}
