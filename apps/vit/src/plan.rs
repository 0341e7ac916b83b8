//! `vit pretrain --parallel plan|auto`: the planner's choice of layout, ZeRO stage and
//! checkpointed blocks for the ranks, `--batch` and the model, printed without training
//! (`plan`, for `--nproc`) or trained with (`auto`, for the job's ranks; see [`layout`]). The
//! planner prices only plans that [`Layout::from_plan`] turns into a layout the model takes
//! ([`runs`]): the rules are the manual flags' own.
use anyhow::bail;
use engine::dist::{ProcessGroup, World};
use engine::job::OptimizerKind;
use engine::planner::{calibrate, estimate, plans, solve, Cluster, Estimate, Model, Plan, Solution};
use tch::Device;

use crate::args::PretrainArgs;
use crate::datasets::Splits;
use crate::layout::{Layout, PlannerMode, MAX_MICRO_BATCH};
use crate::model::VitConfig;
use crate::profile::{planner_model, timed, with_times, Timing};

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
/// from: `--cluster`'s file, else the default cluster with the figures of `device` (the one the
/// run computes on) measured in the run's `--precision` and, given the job's `group` (a
/// collective then: every rank calls it and gets the same figures), its links' latency and
/// bandwidth measured ([`engine::planner::calibrate`]).
pub fn cluster(
    args: &PretrainArgs,
    nproc: usize,
    group: Option<&ProcessGroup>,
    device: Device,
) -> anyhow::Result<(Cluster, String)> {
    cluster_with_memory(args, nproc, group, device, None)
}

/// [`cluster`] with each device's memory set to `memory_bytes` where given (the benchmark's
/// `--memory-mib`): the line printed describes the cluster returned, the one priced.
pub fn cluster_with_memory(
    args: &PretrainArgs,
    nproc: usize,
    group: Option<&ProcessGroup>,
    device: Device,
    memory_bytes: Option<f64>,
) -> anyhow::Result<(Cluster, String)> {
    let memory = match memory_bytes {
        Some(_) => "memory given",
        None => "memory assumed",
    };
    let (mut cluster, source) = match &args.layout.cluster {
        Some(path) => {
            let given = if memory_bytes.is_some() { ", memory given" } else { "" };
            (Cluster::load(path)?, format!("from {}{given}", path.display()))
        }
        None => {
            let base = Cluster { devices_per_node: nproc, ..Cluster::default() };
            let measured = calibrate::calibrated(base, group, device, args.precision.precision.kind())?;
            let on = match device {
                Device::Cuda(_) => "GPU",
                _ => "CPU",
            };
            let precision = args.precision.precision.name();
            let what = match group.is_some_and(|g| g.size() > 1) {
                true => format!(
                    "device figures ({on}, {precision}) and link latency and bandwidth measured on this machine"
                ),
                false => format!("device figures ({on}, {precision}) measured on this machine, link figures assumed"),
            };
            (measured, format!("{what}; {memory}, --cluster sets any of them"))
        }
    };
    if let Some(bytes) = memory_bytes {
        anyhow::ensure!(bytes.is_finite() && bytes > 0.0, "device memory must be positive, got {bytes} bytes");
        cluster.memory_bytes = bytes;
    }
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
    let precision = args.precision.precision;
    let mut model = planner_model(&cfg, args.batch, optimizer_ops(args.optimizer.optimizer, backend), precision);
    if args.layout.cluster.is_none() {
        let timing = Timing {
            device,
            kind: precision.kind(),
            backend,
            peak_flops: cluster.peak_flops,
            memory_bytes: cluster.memory_bytes,
        };
        model = with_times(model, timed(&cfg, &timing, group)?);
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

/// Micro-batch counts [`compared`] measures alone on one rank besides the planner's: the fewest
/// that fit (the largest micro-batches; more accumulation steps than these are only slower).
const COMPARED_ACCUMULATIONS: usize = 3;

/// The manual layouts `bench-auto` measures beside the planner's choice `auto` (which is among
/// them), with their estimates: of every plan vit runs on `nproc` ranks that fits `cluster`,
///
/// - on several ranks, for each layout (dp/tp/sp/pp sizes and tensor-parallel mode) and ZeRO
///   stage the plan priced fastest (its micro-batches and checkpointed blocks the planner's);
///   where the gradient group (dp x sp) is one rank ZeRO shards nothing, so only ZeRO-0 (or
///   the planner's stage);
/// - on one rank, where there is one layout and ZeRO means nothing, the choices that remain:
///   the accumulation steps (the fewest `COMPARED_ACCUMULATIONS` (3) micro-batch counts that
///   fit, and the planner's), each with the checkpointed blocks priced fastest, and at the
///   planner's micro-batches the fewest, half and all blocks checkpointed (of those that fit).
///
/// In the plans' order (micro-batches, then checkpointed blocks, on one rank).
pub fn compared(
    cfg: &VitConfig,
    model: &Model,
    cluster: &Cluster,
    nproc: usize,
    batch: usize,
    auto: &Plan,
) -> anyhow::Result<Vec<(Plan, Estimate)>> {
    let mut fitting = Vec::new();
    for plan in plans(model, nproc, &|p| runs(cfg, p, batch)) {
        let useful_zero = plan.zero == 0 || plan.dp * plan.sp > 1;
        if plan != *auto && !useful_zero {
            continue;
        }
        let e = estimate(model, cluster, &plan)?;
        if e.memory_bytes <= cluster.memory_bytes || plan == *auto {
            fitting.push((plan, e));
        }
    }
    // The plan priced fastest (then leanest; the first of equals) among `candidates`, the
    // planner's own where it is one of them.
    let fastest = |candidates: Vec<&(Plan, Estimate)>| -> Option<(Plan, Estimate)> {
        if let Some(found) = candidates.iter().find(|(p, _)| p == auto) {
            return Some((*found).clone());
        }
        let key = |e: &Estimate| (e.step_s, e.memory_bytes);
        let best = candidates.into_iter().reduce(|a, b| if key(&b.1) < key(&a.1) { b } else { a });
        best.cloned()
    };
    let mut chosen: Vec<(Plan, Estimate)> = Vec::new();
    let mut add = |found: Option<(Plan, Estimate)>| {
        if let Some(found) = found.filter(|(p, _)| !chosen.iter().any(|(q, _)| q == p)) {
            chosen.push(found);
        }
    };
    if nproc == 1 {
        let mut counts: Vec<usize> = fitting.iter().map(|(p, _)| p.micro_batches).collect();
        counts.sort_unstable();
        counts.dedup();
        counts.truncate(COMPARED_ACCUMULATIONS);
        counts.push(auto.micro_batches);
        for m in counts {
            add(fastest(fitting.iter().filter(|(p, _)| p.micro_batches == m).collect()));
        }
        let at_auto: Vec<&(Plan, Estimate)> =
            fitting.iter().filter(|(p, _)| p.micro_batches == auto.micro_batches && p.zero == auto.zero).collect();
        let fewest = at_auto.iter().min_by_key(|(p, _)| p.checkpoint.len()).map(|&x| x.clone());
        let most = at_auto.iter().max_by_key(|(p, _)| p.checkpoint.len()).map(|&x| x.clone());
        if let (Some((low, _)), Some((high, _))) = (&fewest, &most) {
            let half = (low.checkpoint.len() + high.checkpoint.len()) / 2;
            add(at_auto.iter().find(|(p, _)| p.checkpoint.len() == half).map(|&x| x.clone()));
        }
        add(fewest);
        add(most);
        chosen.sort_by(|(a, _), (b, _)| {
            (a.micro_batches, a.checkpoint.len()).cmp(&(b.micro_batches, b.checkpoint.len()))
        });
    } else {
        let mut layouts: Vec<_> =
            fitting.iter().map(|(p, _)| (p.dp, p.tp, p.tp_mode, p.tp_depth, p.sp, p.pp, p.zero)).collect();
        layouts.sort();
        layouts.dedup();
        for key in layouts {
            let of = |p: &Plan| (p.dp, p.tp, p.tp_mode, p.tp_depth, p.sp, p.pp, p.zero) == key;
            add(fastest(fitting.iter().filter(|(p, _)| of(p)).collect()));
        }
    }
    anyhow::ensure!(chosen.iter().any(|(p, _)| p == auto), "the planner's choice {auto} is not a plan vit runs here");
    Ok(chosen)
}
