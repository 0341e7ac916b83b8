//! `vit pretrain --parallel auto`: the layout it trains with is the planner's best for the
//! job's ranks (checked against every plan vit can run, each modelled here), the run equals
//! one process (the model split over the ranks; alone, accumulation or recomputation), the
//! ranks' measurements of the machine (without --cluster) agree, and a layout flag beside it is
//! an error naming the flag. ViT-B/16 at a batch of 32k on 8 ranks: 4 GiB devices accumulate
//! gradients, 80 GB ones run data parallel with accumulation and no recomputation, and every
//! plan's printed flags run the layout the planner priced.
#[allow(dead_code)] // Shared by the vit test binaries; this one uses part of it.
mod common;

use common::{args, compare, job_dir, single};
use engine::dist::ReduceOp;
use engine::planner::{estimate, plans, Cluster};
use suite_tests::{dist_test, TestResult};
use tch::{Device, Tensor};
use vit::layout::Checkpointing;
use vit::plan::{apply, choose, cluster, runs, Choice};
use vit::train::pretrain;

/// LAMB and clipping: their norms see the whole model, whatever the layout splits.
const LINE: &str = "--steps 3 --optimizer lamb --clip-grad 0.5";

/// A device of 1 MB: 4 data-parallel replicas of the digits model (LAMB's state whole or
/// ZeRO-sharded, however small their micro-batches) do not fit, so the planner has to split
/// the model.
const TIGHT: &str = r#"{"memory_bytes": 1e6}"#;

dist_test!(auto_runs_the_planner_best_plan_and_matches_one_process, 4, |world| {
    let cluster_path = job_dir(&format!("cluster-{}.json", world.rank()));
    std::fs::write(&cluster_path, TIGHT)?;
    let auto = args(&format!("{LINE} --parallel auto --cluster {}", cluster_path.display()));

    // The best plan by enumeration: every plan vit runs on 4 ranks, modelled one by one.
    let tight = Cluster::load(&cluster_path)?;
    let Choice { cfg, model, solution } = choose(&auto, 4, &tight, Device::Cpu, None)?;
    let mut fitting = Vec::new();
    for plan in plans(&model, 4, &|p| runs(&cfg, p, 32)) {
        let e = estimate(&model, &tight, &plan)?;
        if e.memory_bytes <= tight.memory_bytes {
            fitting.push((e.step_s, plan));
        }
    }
    let fastest = fitting.iter().map(|(s, _)| *s).fold(f64::INFINITY, f64::min);
    let best = &solution.best.plan;
    assert_eq!(solution.best.estimate.step_s, fastest, "the chosen plan {best} is the fastest that fits");
    assert!(fitting.iter().any(|(_, p)| p == best), "{best} is one of the fitting plans");
    assert!(!fitting.iter().any(|(_, p)| p.dp == 4 && p.checkpoint.is_empty()), "dp=4 fits: the test is weak");

    // What `--parallel auto` hands the trainer: the best plan's layout.
    let (applied, _, text) = apply(&auto, world)?;
    assert!(text.contains(&best.to_string()), "{text}");
    let sizes = (applied.tp, applied.sp, applied.pp, applied.zero);
    assert_eq!(sizes, (best.tp, best.sp, best.pp, best.zero), "layout of {best}");
    assert_eq!(applied.batch.micro, 32 / (best.dp * best.micro_batches));
    let k = best.checkpoint.len();
    assert_eq!(applied.checkpointing, Checkpointing::First(k), "checkpointed blocks of {best}");

    // Trained with the plan, against one process. The plan splits the batch into smaller
    // micro-batches and sums their gradients in another order: fp32 rounding, well inside 1e-4.
    let run = pretrain(&auto, world)?;
    let one = pretrain(&args(LINE), &single())?;
    compare(&run, &one, &format!("--parallel auto ({best}) vs 1 process"), 1e-4);

    // One process with room for about half the batch's activations: the planner accumulates
    // smaller micro-batches or recomputes blocks (whichever it prices faster), applied as
    // --micro-batch or --checkpoint-blocks; either equals the plain run up to the rounding of
    // the gradients' summation order.
    if world.rank() == 0 {
        std::fs::write(&cluster_path, r#"{"memory_bytes": 8.5e6}"#)?;
        let (applied, solution, _) = apply(&auto, &single())?;
        let best = &solution.best.plan;
        assert!(applied.batch.accumulation > 1 || applied.checkpointing.any(), "{best} holds the whole batch");
        assert_eq!(applied.batch.accumulation, best.micro_batches, "{best}");
        assert_eq!(applied.checkpointing, Checkpointing::First(best.checkpoint.len()), "{best}");
        let run = pretrain(&auto, &single())?;
        compare(&run, &one, &format!("--parallel auto ({best}) vs plain, 1 process"), 1e-5);
    }
    std::fs::remove_file(&cluster_path)?;

    // Without --cluster the ranks measure the machine together and must hold the same figures,
    // or they would plan different layouts.
    let (measured, line) = cluster(&args(LINE), 4, Some(&world.group), Device::Cpu)?;
    assert!(line.contains("link latency and bandwidth measured"), "{line}");
    let figures = [measured.peak_flops, measured.intra_node_bandwidth, measured.latency_s];
    assert!(figures.iter().all(|f| f.is_finite() && *f > 0.0), "{figures:?}");
    let (high, low) = (Tensor::from_slice(&figures), Tensor::from_slice(&figures));
    world.group.all_reduce(&high, ReduceOp::Max)?;
    world.group.all_reduce(&low, ReduceOp::Min)?;
    assert_eq!(Vec::<f64>::try_from(&high)?, Vec::<f64>::try_from(&low)?, "every rank's figures");
    TestResult::Ok(())
});

#[test]
fn layout_flags_beside_auto_are_named() {
    for flag in
        ["--tp 2", "--tp-mode 2d", "--sp 2", "--pp 2", "--zero 1", "--micro-batch 8", "--gradient-checkpointing"]
    {
        let err = args(&format!("--parallel auto {flag}")).layout.leave_to_planner().err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        let name = flag.split_whitespace().next().unwrap();
        assert!(err.contains(&format!("--parallel chooses {name} itself")), "{flag}: {err}");
    }
    // A flag at its default value changes nothing.
    assert!(args("--parallel auto --tp 1 --zero 0").layout.leave_to_planner().is_ok());
}

/// ViT-B/16 on ImageNet's shapes (3 channels, 1,000 classes).
fn vit_b16() -> vit::model::VitConfig {
    vit::model::VitConfig { in_channels: 3, num_classes: 1000, ..vit::model::VitConfig::base(16) }
}

/// The planner's solution for ViT-B/16 with LAMB at a global batch of `batch` on 8 ranks of
/// `cluster`, and the check that every plan it prints is run by the flags printed for it.
fn plan_vit_b16(batch: usize, cluster: &Cluster) -> engine::planner::Solution {
    let cfg = vit_b16();
    let model = vit::profile::planner_model(&cfg, batch, 17.0);
    let solution = engine::planner::solve(&model, cluster, 8, 4, &|p| runs(&cfg, p, batch)).unwrap();
    let depth = cfg.depth as usize;
    for r in std::iter::once(&solution.best).chain(&solution.runners_up) {
        let priced = vit::layout::Layout::from_plan(&r.plan, batch, depth).unwrap();
        let line = format!("--model vit_base_patch16_224 --batch {batch} {}", priced.flags());
        let given = args(&line);
        let run = vit::layout::Layout::from_flags(&given.layout, 8, given.batch).unwrap();
        assert_eq!(run, priced, "`{line}` runs another layout than the planner priced, {}", r.plan);
    }
    solution
}

#[test]
fn a_32k_batch_on_8_small_devices_accumulates_gradients() {
    let solution = plan_vit_b16(32 * 1024, &Cluster::default());
    let best = &solution.best;
    assert!(best.estimate.memory_bytes <= Cluster::default().memory_bytes, "{}", best.plan);
    assert!(best.plan.micro_batches > 1, "a 32k batch fits 4 GiB only in micro-batches: {}", best.plan);
}

#[test]
fn a_32k_batch_on_8_large_devices_is_data_parallel_with_accumulation_and_no_recomputation() {
    let large = Cluster {
        memory_bytes: 80e9,
        peak_flops: 400e12,
        intra_node_bandwidth: 450e9,
        inter_node_bandwidth: 50e9,
        latency_s: 5e-6,
        op_overhead_s: 5e-6,
        memory_bandwidth: 3e12,
        ..Cluster::default()
    };
    let solution = plan_vit_b16(32 * 1024, &large);
    let best = &solution.best.plan;
    assert_eq!(best.dp, 8, "{best}");
    assert!(best.micro_batches > 1, "{best}");
    assert!(best.checkpoint.is_empty(), "nothing needs recomputing in 80 GB: {best}");
}
