//! `vit pretrain --parallel plan|auto`: the planner's choice of layout, ZeRO stage and
//! checkpointed blocks for the ranks, `--batch` and the model, printed without training
//! (`plan`, for `--nproc`) or trained with (`auto`, for the job's ranks; see [`layout`]). The
//! planner prices only plans that [`Layout::from_plan`] turns into a layout the model takes
//! ([`runs`]): the rules are the manual flags' own.
use anyhow::bail;
use engine::dist::{ProcessGroup, World};
use engine::planner::{calibrate, solve, Cluster, Plan, Solution};
use tch::Device;

use crate::args::PretrainArgs;
use crate::datasets::Splits;
use crate::layout::{Layout, PlannerMode};
use crate::model::VitConfig;
use crate::profile::planner_model;

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
    args.layout.leave_to_planner()?;
    let splits: Splits = args.data.splits()?;
    let cfg = args.model_config(&splits)?;
    let model = planner_model(&cfg, args.batch);
    let solution = solve(&model, cluster, nproc, 4, &|p| runs(&cfg, p, args.batch))?;
    Ok((cfg, solution))
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

/// The layout of the planner's best plan for `world`'s ranks, with the solution and the plan
/// as [`run`] prints it: `vit pretrain --parallel auto` then trains through the same path as
/// the manual flags. A collective without `--cluster` (the ranks measure the machine
/// together).
pub fn apply(args: &PretrainArgs, world: &World) -> anyhow::Result<(Layout, Solution, String)> {
    args.layout.leave_to_planner()?;
    let nproc = world.size();
    let (cluster, line) = cluster(args, nproc, Some(&world.group), args.job.launch.device(world)?)?;
    let (cfg, solution) = choose(args, nproc, &cluster)?;
    let text = line + &describe(&cfg, &solution, args.batch, nproc);
    let layout = Layout::from_plan(&solution.best.plan, args.batch, cfg.depth as usize)?;
    Ok((layout, solution, text))
}

/// Whether `vit pretrain` runs `plan` for `cfg` with a global batch of `global_batch`: the
/// plan makes a layout ([`Layout::from_plan`]: a checkpoint set `--checkpoint-blocks`
/// expresses) and the model splits as it cuts ([`Layout::check`]).
pub fn runs(cfg: &VitConfig, plan: &Plan, global_batch: usize) -> bool {
    Layout::from_plan(plan, global_batch, cfg.depth as usize).and_then(|layout| layout.check(cfg)).is_ok()
}
