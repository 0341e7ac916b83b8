//! `vit pretrain --parallel auto`: the layout it trains with is the planner's best for the
//! job's ranks (checked against every plan vit can run, each modelled here), the run equals
//! one process (the model split over the ranks; alone, accumulation or recomputation), the
//! ranks' measurements of the machine (without --cluster) agree, and a layout flag beside it is
//! an error naming the flag. ViT-B/16 at a batch of 32k on 8 ranks: 4 GiB devices accumulate
//! gradients, 80 GB ones run data parallel with accumulation and no recomputation, and every
//! plan's printed flags run the layout the planner priced. In bf16 the memory priced is the
//! profiler's bf16 bytes (within 10% of an H200's measured peak); the cluster line printed is
//! the one priced, measured on the run's device in its precision; on one device `bench-auto`
//! compares accumulation and checkpointing choices, not ZeRO stages.
#[allow(dead_code)] // Shared by the vit test binaries; this one uses part of it.
mod common;

use common::{args, compare, job_dir, single};
use engine::dist::ReduceOp;
use engine::job::Precision;
use engine::parallel::tensor::TpMode;
use engine::planner::{estimate, plans, Cluster, Plan};
use suite_tests::{dist_test, TestResult};
use tch::{Device, Tensor};
use vit::layout::Checkpointing;
use vit::plan::{apply, choose, cluster, cluster_with_memory, compared, runs, Choice};
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
    let model = vit::profile::planner_model(&cfg, batch, 17.0, Precision::Fp32);
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

/// One device like the H200 `bench-auto` ran ViT-B/16 on in bf16 with `--memory-mib 16384`:
/// 16 GiB planned for, a bf16 matmul rate and the memory bandwidth it measured.
fn one_large_device() -> Cluster {
    Cluster {
        devices_per_node: 1,
        memory_bytes: 16384.0 * (1u64 << 20) as f64,
        peak_flops: 300e12,
        op_overhead_s: 12.7e-6,
        memory_bandwidth: 2.17e12,
        ..Cluster::default()
    }
}

/// A plan on one rank: `micro_batches` and the first `checkpointed` blocks (layers 1 to k).
fn one_rank(micro_batches: usize, checkpointed: usize) -> Plan {
    Plan {
        dp: 1,
        tp: 1,
        tp_mode: TpMode::OneD,
        tp_depth: 1,
        sp: 1,
        pp: 1,
        micro_batches,
        zero: 0,
        checkpoint: (1..=checkpointed).collect(),
    }
}

#[test]
fn in_bf16_the_memory_is_the_profilers_bf16_bytes_and_the_h200_peak() {
    let cfg = vit_b16();
    let bf16 = vit::profile::planner_model(&cfg, 1024, 17.0, Precision::Bf16);
    let fp32 = vit::profile::planner_model(&cfg, 1024, 17.0, Precision::Fp32);
    // The layers the planner prices are the profiler's at 2 bytes an element.
    assert_eq!(bf16.layers, vit::profile::profile(&cfg, 1, 2));
    assert_eq!(fp32.layers, vit::profile::profile(&cfg, 1, 4));
    let c = one_large_device();
    let plan = one_rank(4, 8);
    let (b, f) = (estimate(&bf16, &c, &plan).unwrap(), estimate(&fp32, &c, &plan).unwrap());
    let weights = 86_567_656.0;
    // bf16 weights and gradients; fp32 masters and two fp32 moments beside them.
    assert_eq!((b.param_bytes, b.grad_bytes, b.optimizer_bytes), (2.0 * weights, 2.0 * weights, 12.0 * weights));
    assert_eq!((f.param_bytes, f.grad_bytes, f.optimizer_bytes), (4.0 * weights, 4.0 * weights, 8.0 * weights));
    // Activations at half fp32's bytes, but for the f32 statistics (norms', attention's).
    let ratio = b.activation_bytes / f.activation_bytes;
    assert!(ratio > 0.5 && ratio < 0.505, "bf16 / fp32 activation bytes {ratio}");
    // The H200 ran this plan (4 micro-batches of 256, 8 of 12 blocks recomputed) at a peak of
    // 7,658 MiB in the caching allocator, where fp32 activations priced it at 15,224 MiB.
    let mib = b.memory_bytes / (1u64 << 20) as f64;
    println!("ViT-B/16 bf16, {plan}: predicted {mib:.0} MiB, 7,658 MiB measured on an H200; {b:?}");
    assert!((mib / 7658.48 - 1.0).abs() < 0.10, "predicted {mib:.0} MiB against 7,658 MiB measured");
}

#[test]
fn on_one_device_the_compared_layouts_vary_accumulation_and_checkpointing_not_zero() {
    let cfg = vit_b16();
    let model = vit::profile::planner_model(&cfg, 1024, 17.0, Precision::Bf16);
    let c = one_large_device();
    let solution = engine::planner::solve(&model, &c, 1, 4, &|p| runs(&cfg, p, 1024)).unwrap();
    let auto = &solution.best.plan;
    let rows = compared(&cfg, &model, &c, 1, 1024, auto).unwrap();
    let text: Vec<String> = rows.iter().map(|(p, e)| format!("{p}: {:.0} MiB", e.memory_bytes / 1048576.0)).collect();
    assert!(rows.iter().any(|(p, _)| p == auto), "{text:#?}");
    assert!(rows.iter().all(|(p, e)| p.zero == 0 && e.memory_bytes <= c.memory_bytes), "{text:#?}");
    let mut micro: Vec<usize> = rows.iter().map(|(p, _)| p.micro_batches).collect();
    micro.dedup();
    let mut checkpointed: Vec<usize> = rows.iter().map(|(p, _)| p.checkpoint.len()).collect();
    checkpointed.sort_unstable();
    checkpointed.dedup();
    assert!(micro.len() >= 3 && checkpointed.len() >= 2 && rows.len() <= 7, "{text:#?}");
    // The largest micro-batches vit runs (256, 4 of them) come first; at the planner's, none,
    // half and all of the blocks recomputed.
    assert_eq!(rows[0].0.micro_batches, 4, "{text:#?}");
    for k in [0, 6, 12] {
        assert!(
            rows.iter().any(|(p, _)| p.micro_batches == auto.micro_batches && p.checkpoint.len() == k),
            "{text:#?}"
        );
    }
}

#[test]
fn the_cluster_printed_is_the_cluster_priced_and_measured_on_the_runs_device_and_precision() {
    let world = single();
    for precision in ["fp32", "bf16"] {
        let a = args(&format!("--steps 1 --parallel plan --precision {precision}"));
        // Without a memory given, the default 4 GiB is printed and priced: the digits' whole
        // batch in one micro-batch, nothing recomputed.
        let (c, line) = cluster(&a, 1, None, Device::Cpu).unwrap();
        assert_eq!(c.memory_bytes, Cluster::default().memory_bytes);
        assert!(line.contains("devices of 4.0 GiB,") && line.contains("memory assumed"), "{line}");
        // Measured on the run's device (here the CPU) in its precision.
        assert!(line.contains(&format!("device figures (CPU, {precision}) measured")), "{line}");
        let Choice { model, solution, .. } = choose(&a, 1, &c, Device::Cpu, None).unwrap();
        assert_eq!(solution.best.plan, one_rank(1, 0));
        let whole = estimate(&model, &c, &one_rank(1, 0)).unwrap().memory_bytes;

        // With room for less than that, the line prints the memory given and the plan fits it.
        let memory = (0.7 * whole).round();
        let (c, line) = cluster_with_memory(&a, 1, Some(&world.group), Device::Cpu, Some(memory)).unwrap();
        assert_eq!(c.memory_bytes, memory);
        let size = engine::gemini::budget::human(memory as usize);
        assert!(line.contains(&format!("1 x 1 devices of {size},")) && line.contains("memory given"), "{line}");
        let Choice { solution, .. } = choose(&a, 1, &c, Device::Cpu, Some(&world.group)).unwrap();
        let best = &solution.best;
        assert!(best.estimate.memory_bytes <= memory, "{}", best.plan);
        assert!(best.plan.micro_batches > 1 || !best.plan.checkpoint.is_empty(), "{}", best.plan);
    }
}
