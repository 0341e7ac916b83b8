//! `vit pretrain --parallel plan`: the planner's choice of layout, ZeRO stage and checkpointed
//! blocks for `--nproc`, `--batch` and the model, printed without training.
use engine::planner::{solve, Cluster, Plan, TpMode};

use crate::model::VitConfig;
use crate::profile::planner_model;
use crate::train::{model_config, PretrainArgs};

/// What `--parallel` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlannerMode {
    /// Print the plan and the runners-up, then exit.
    Plan,
}

/// The plan for `args` as text (the error names the flag or file that cannot work).
pub fn run(args: &PretrainArgs) -> anyhow::Result<String> {
    let nproc = args.job.launch.nproc;
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
    let blocks: Vec<String> = solution.best.plan.checkpoint.iter().map(|i| format!("blocks.{}", i - 1)).collect();
    let mut out = format!(
        "model: {}px images in {}px patches ({} tokens), width {}, depth {}; batch {}, {nproc} ranks\n{solution}",
        cfg.image_size,
        cfg.patch_size,
        cfg.num_patches() + 1,
        cfg.width,
        cfg.depth,
        args.batch
    );
    if !blocks.is_empty() {
        // --gradient-checkpointing checkpoints every block; a chosen subset has no flag yet.
        let flag = if blocks.len() == cfg.depth as usize {
            "--gradient-checkpointing"
        } else {
            "a subset: not yet a vit flag"
        };
        out += &format!("blocks to checkpoint ({flag}): {}\n", blocks.join(", "));
    }
    Ok(out)
}

/// Whether `vit pretrain` runs `plan` for `cfg` (the layouts' own divisibility rules).
fn runs(cfg: &VitConfig, plan: &Plan, global_batch: usize) -> bool {
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
