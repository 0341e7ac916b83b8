//! `vit pretrain --pp`: every schedule on 2 stages (and fp16 with its loss scaler), pp x dp with
//! ZeRO-1, pp x tp and pp x sp (ring and Ulysses) on 4 ranks and pp x 2D on 8, against one
//! process (losses, every weight and the validation accuracy; fp32, relative 1e-5, with LAMB
//! and clipping, whose norms span the stages), checkpoints moving between pp=2 and pp=1, and
//! layouts that do not fit.
mod common;

use common::{args, compare, fresh, job_dir, joined, single};
use suite_tests::{dist_test, TestResult};
use vit::train::{pretrain, Trained};

/// LAMB's trust ratios and the clipping norm both see the whole model.
const OPT: &str = "--optimizer lamb --clip-grad 0.5";

/// `a` against the one-process `b`: losses and weights, and the same validation accuracy.
fn equal_runs(a: &Trained, b: &Trained, what: &str) {
    compare(a, b, what, 1e-5);
    assert_eq!((a.val_top1, a.val_top5), (b.val_top1, b.val_top5), "{what}: validation accuracy");
}

dist_test!(pp_2_matches_one_process_under_every_schedule, 2, |world| {
    // 32 examples in 4 micro-batches of 8.
    let line = format!("--steps 4 --micro-batch 8 {OPT}");
    let one = pretrain(&args(&line), &single())?;
    for schedule in ["gpipe", "1f1b", "interleaved", "zb"] {
        let pp = pretrain(&args(&format!("{line} --pp 2 --schedule {schedule}")), world)?;
        equal_runs(&pp, &one, &format!("pp=2 {schedule} vs 1 process"));
    }
    // fp16: the loss scaled on the last stage, the overflow check over every stage.
    let line = format!("{line} --precision fp16");
    let one = pretrain(&args(&line), &single())?;
    let pp = pretrain(&args(&format!("{line} --pp 2")), world)?;
    equal_runs(&pp, &one, "pp=2 fp16 vs 1 process");
    TestResult::Ok(())
});

dist_test!(pp_2_by_dp_2_with_zero_1_and_pp_2_by_tp_2_with_sp_match_one_process, 4, |world| {
    // Per replica 16 examples in 4 micro-batches of 4 (pp x dp); 32 in 8 (pp x tp). 6x6 images
    // in 2x2 patches: 9 patches and the class token, 5 tokens per rank under sequence
    // parallelism, which is what crosses the stages then.
    let line = format!("--steps 4 --micro-batch 4 --image-size 6 {OPT}");
    let one = pretrain(&args(&line), &single())?;
    let dp = pretrain(&args(&format!("{line} --pp 2 --zero 1")), world)?;
    equal_runs(&dp, &one, "pp=2 x dp=2 with ZeRO-1 vs 1 process");
    let tp = pretrain(&args(&format!("{line} --pp 2 --tp 2 --sequence-parallel --schedule interleaved")), world)?;
    equal_runs(&tp, &one, "pp=2 x tp=2 with sequence parallelism, interleaved, vs 1 process");
    TestResult::Ok(())
});

dist_test!(pp_2_by_sp_2_ring_and_ulysses_match_one_process_and_resume_at_1, 4, |world| {
    // The 20 steps; 32 examples per step in 4 micro-batches of 8. 6x6 images in 2x2
    // patches: 9 patches and the class token, so each sequence rank's block of 5 tokens,
    // [8, 5, 64], is what crosses the stages. ZB-H1 runs each layer's backward twice (input
    // gradient, then weight gradient), the ring's and the all-to-alls' exchanges with it.
    let line = format!("--steps 20 --micro-batch 8 --image-size 6 {OPT}");
    let one = pretrain(&args(&line), &single())?;
    for mode in ["ring", "ulysses"] {
        for schedule in ["1f1b", "zb"] {
            let run = pretrain(&args(&format!("{line} --pp 2 --sp 2 --sp-mode {mode} --schedule {schedule}")), world)?;
            equal_runs(&run, &one, &format!("pp=2 x sp=2 ({mode}, {schedule}) vs 1 process"));
        }
    }
    // Saved at pp=2 x sp=2 under ZeRO-1 (each stage's two sequence ranks own an optimizer
    // shard each), resumed by one process: the model file holds full tensors under timm's names.
    let dir = job_dir("from-pp2-sp2");
    fresh(world, &[&dir])?;
    let out = format!("--save-every 100 --out {}", dir.display());
    pretrain(&args(&format!("{line} {out} --pp 2 --sp 2 --zero 1 --stop-after 3")), world)?;
    if world.rank() == 0 {
        let file = data::checkpoint::read_tensors(&dir.join("checkpoint-3/model.safetensors"))?;
        assert_eq!(file.len(), one.weights.len(), "every parameter of every stage");
        assert_eq!(file["pos_embed"].size(), [1, 10, 64], "the position embedding of every token");
        let rest = pretrain(&args(&format!("{line} {out} --resume")), &single())?;
        assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
        compare(&joined(&one, rest), &one, "saved at pp=2 x sp=2 under ZeRO-1, resumed at 1 process", 1e-5);
    }
    fresh(world, &[&dir])?;
    TestResult::Ok(())
});

dist_test!(pp_2_by_2d_matches_one_process, 8, |world| {
    // Two stages, each a 2 x 2 SUMMA grid: every part is split, and each rank's block of the
    // batch and the width, [4, 17, 32] of each micro-batch of 8, crosses the stages. Eight
    // ranks share CI's two cores, so 4 steps (as the schedules above); the 297 validation
    // images leave a last chunk of 41, padded to the grid's 2 batch blocks on the first stage
    // and cut back on the last.
    let line = format!("--steps 4 --micro-batch 8 {OPT}");
    let one = pretrain(&args(&line), &single())?;
    for schedule in ["1f1b", "interleaved"] {
        let run = pretrain(&args(&format!("{line} --pp 2 --tp 4 --tp-mode 2d --schedule {schedule}")), world)?;
        equal_runs(&run, &one, &format!("pp=2 x 2D (q=2), {schedule}, vs 1 process"));
    }
    TestResult::Ok(())
});

dist_test!(checkpoints_move_between_pp_2_and_pp_1, 2, |world| {
    let (at_pp2, at_pp1) = (job_dir("from-pp2"), job_dir("from-pp1"));
    fresh(world, &[&at_pp2, &at_pp1])?;
    let common = format!("--steps 6 --save-every 100 --micro-batch 8 {OPT}");
    let reference = pretrain(&args(&format!("{common} --pp 2")), world)?;
    pretrain(&args(&format!("{common} --pp 2 --out {} --stop-after 3", at_pp2.display())), world)?;
    if world.rank() == 0 {
        // The model file holds the whole model under timm's names, as one process writes it.
        let file = data::checkpoint::read_tensors(&at_pp2.join("checkpoint-3/model.safetensors"))?;
        assert_eq!(file.len(), reference.weights.len(), "every parameter of every stage");
        assert_eq!(file["patch_embed.proj.weight"].size(), [64, 1, 2, 2]);
        assert_eq!(file["head.weight"].size(), [10, 64]);
        let rest = pretrain(&args(&format!("{common} --out {} --resume", at_pp2.display())), &single())?;
        assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
        compare(&joined(&reference, rest), &reference, "saved at pp=2, resumed at pp=1", 1e-5);
        pretrain(&args(&format!("{common} --out {} --stop-after 3", at_pp1.display())), &single())?;
    }
    world.group.barrier()?;
    let rest = pretrain(&args(&format!("{common} --pp 2 --schedule zb --out {} --resume", at_pp1.display())), world)?;
    compare(&joined(&reference, rest), &reference, "saved at pp=1, resumed at pp=2 under ZB-H1", 1e-5);
    fresh(world, &[&at_pp2, &at_pp1])?;
    TestResult::Ok(())
});

dist_test!(layouts_that_do_not_fit_name_the_numbers, 2, |world| {
    let err = |line: &str| pretrain(&args(line), world).err().map(|e| format!("{e:#}")).unwrap_or_default();
    let e = err("--steps 1 --pp 3");
    assert!(e.contains("--pp 3 x --tp 1 = 3 ranks per replica does not divide the job's 2 ranks"), "{e}");
    let e = err("--steps 1 --pp 2 --tp 2");
    assert!(e.contains("--pp 2 x --tp 2 = 4 ranks per replica does not divide the job's 2 ranks"), "{e}");
    let e = err("--steps 1 --pp 2 --tp 4 --tp-mode 2d");
    assert!(e.contains("--pp 2 x --tp 4 = 8 ranks per replica does not divide the job's 2 ranks"), "{e}");
    let e = err("--steps 1 --pp 2 --sp 2 --image-size 6");
    assert!(e.contains("--pp 2 x --tp 1 x --sp 2 = 4 ranks per replica does not divide the job's 2 ranks"), "{e}");
    // The digits model: 4 blocks, so 6 parts.
    let e = err("--steps 1 --micro-batch 4 --pp 2 --schedule interleaved --virtual-stages 4");
    assert!(e.contains("--pp 2 x --virtual-stages 4 = 8 stages: the model has 6 parts to cut"), "{e}");
    assert!(e.contains("6 layers cannot fill 8 stages"), "{e}");
    let e = err("--steps 1 --batch 24 --micro-batch 8 --pp 2 --schedule interleaved");
    assert!(e.contains("with 3 micro-batches per step"), "{e}");
    assert!(e.contains("micro_batches=3 to be a multiple of pp=2"), "{e}");
    let e = err("--steps 1 --pp 2 --virtual-stages 2");
    assert!(e.contains("--virtual-stages 2 needs --schedule interleaved"), "{e}");
    let e = format!("{:#}", pretrain(&args("--steps 1 --schedule zb"), &single()).err().unwrap());
    assert!(e.contains("--schedule and --virtual-stages need --pp 2 or more"), "{e}");
    TestResult::Ok(())
});

dist_test!(every_pp_balance_matches_one_process, 2, |world| {
    // The split moves parts between stages, never the arithmetic: each balance equals one
    // process. `time` cuts by world rank 0's measured times, broadcast, so both ranks cut alike
    // (a disagreement would hang or fail the step, not pass it).
    let line = format!("--steps 2 --micro-batch 8 {OPT}");
    let one = pretrain(&args(&line), &single())?;
    for balance in ["layers", "time"] {
        let pp = pretrain(&args(&format!("{line} --pp 2 --pp-balance {balance}")), world)?;
        equal_runs(&pp, &one, &format!("pp=2 balanced by {balance} vs 1 process"));
    }
    let e = format!("{:#}", pretrain(&args("--steps 1 --pp-balance time"), &single()).err().unwrap());
    assert!(e.contains("--pp-balance needs --pp 2 or more"), "{e}");
    TestResult::Ok(())
});
