//! `vit pretrain` end to end on the embedded digits: data parallelism, ZeRO and gradient
//! accumulation against one process, and resume against an uninterrupted run.
mod common;

use common::{args, compare, compare_with, job_dir, refused, single};
use suite_tests::{dist_test, TestResult};
use vit::train::{pretrain, Trained};

dist_test!(two_ranks_match_one_rank_over_twenty_steps, 2, |world| {
    let dp = pretrain(&args("--steps 20"), world)?;
    let one = pretrain(&args("--steps 20"), &single())?;
    assert!(dp.losses[19].1 < dp.losses[0].1, "training lowers the loss: {:?}", dp.losses);
    compare(&dp, &one, "2 ranks vs 1", 1e-5);
    TestResult::Ok(())
});

dist_test!(zero_1_and_2_match_plain_data_parallel, 2, |world| {
    let plain = pretrain(&args("--steps 10"), world)?;
    for zero in [1, 2] {
        let sharded = pretrain(&args(&format!("--steps 10 --zero {zero}")), world)?;
        compare(&sharded, &plain, &format!("ZeRO-{zero} vs DP"), 1e-5);
    }
    let lars = pretrain(&args("--steps 10 --optimizer lars --lr 2"), world)?;
    let lars_zero = pretrain(&args("--steps 10 --optimizer lars --lr 2 --zero 2"), world)?;
    compare(&lars_zero, &lars, "LARS ZeRO-2 vs DP", 1e-5);
    TestResult::Ok(())
});

#[test]
fn four_micro_batches_of_8_equal_one_batch_of_32() {
    let world = single();
    let accumulated = pretrain(&args("--steps 8 --micro-batch 8"), &world).unwrap();
    let whole = pretrain(&args("--steps 8"), &world).unwrap();
    compare(&accumulated, &whole, "4x8 vs 32", 1e-5);
}

#[test]
fn resume_repeats_the_uninterrupted_run() {
    let root = suite_tests::scratch("vit", "resume");
    let (a, b) = (root.join("whole"), root.join("resumed"));
    let world = single();
    let common = "--steps 8 --save-every 100 --mixup 0.4 --clip-grad 1.0";
    let whole = pretrain(&args(&format!("{common} --out {}", a.display())), &world).unwrap();
    let first = pretrain(&args(&format!("{common} --out {} --stop-after 3", b.display())), &world).unwrap();
    assert_eq!(first.losses.len(), 3);
    assert!(b.join("checkpoint-3/trainer.json").exists() && b.join("latest").exists());
    let rest = pretrain(&args(&format!("{common} --out {} --resume", b.display())), &world).unwrap();
    assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
    let joined: Vec<(usize, f64)> = first.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(joined, whole.losses, "the same loss curve, bit for bit");
    for ((n, x), (_, y)) in rest.weights.iter().zip(&whole.weights) {
        assert!(x.equal(y), "{n} differs after resume");
    }
    let metrics = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 8, "one record per step, none repeated:\n{metrics}");
    // A resume with different settings is refused, naming the setting.
    let err = pretrain(&args(&format!("{common} --out {} --resume --optimizer adamw", b.display())), &world)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("--optimizer lamb, this run has adamw"), "{err}");
    // Another model's numbers are named by what sets them, not printed as a struct.
    let err = pretrain(&args(&format!("{common} --out {} --resume --image-size 16", b.display())), &world)
        .err()
        .unwrap()
        .to_string();
    assert!(err.ends_with("the checkpoint was trained with --image-size 8, this run has 16"), "{err}");
    let err = pretrain(
        &args(&format!(
            "{common} --out {} --resume --model vit_tiny_patch32_224 --image-size 8 --patch-size 2",
            b.display()
        )),
        &world,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.ends_with(
            "trained with --model width 64, --model depth 4, --model heads 4 and --model mlp ratio 2, \
             this run has 192, 12, 3 and 4"
        ),
        "{err}"
    );
    // A checkpoint past the run's end is named, not a run that ends at once as if it trained.
    let err = pretrain(
        &args(&format!("--steps 6 --save-every 100 --mixup 0.4 --clip-grad 1.0 --out {} --resume", b.display())),
        &world,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("is at step 8, past this run's 6 steps"), "{err}");
    // A checkpoint whose optimizer file lost an entry is refused, naming it; resumed, that
    // weight's moments would silently start again from zero.
    let file = data::checkpoint_folders::latest(&b).unwrap().unwrap().join("optimizer-rank0.safetensors");
    let key = "blocks.0.attn.qkv.weight.exp_avg";
    let kept: Vec<(String, tch::Tensor)> =
        tch::Tensor::read_safetensors(&file).unwrap().into_iter().filter(|(k, _)| k != key).collect();
    tch::Tensor::write_safetensors(&kept, &file).unwrap();
    let err = pretrain(&args(&format!("{common} --out {} --resume", b.display())), &world).err().unwrap().to_string();
    assert!(err.contains(&format!("the optimizer state has no {key}")), "{err}");
}

/// `--report-to tensorboard`: TensorBoard's own reader finds every step's scalars and the
/// validation figures; a run that got past its last checkpoint before it died (steps 4 and 5
/// logged, checkpoint 3 kept) and resumed reads as one run, each step once, as the JSON lines do.
#[test]
fn tensorboard_shows_every_step_once_across_a_resume() {
    let root = suite_tests::scratch("vit", "tensorboard");
    let out = root.join("run");
    let world = single();
    let common = format!("--steps 8 --save-every 3 --clip-grad 1.0 --report-to tensorboard --out {}", out.display());
    // Steps 1-3 and their checkpoint; then steps 4 and 5, whose checkpoint (which replaces
    // step 3's: one is kept) is lost, as if the job died writing it.
    pretrain(&args(&format!("{common} --stop-after 3")), &world).unwrap();
    let kept = root.join("checkpoint-3");
    std::fs::rename(out.join("checkpoint-3"), &kept).unwrap();
    std::fs::create_dir(out.join("checkpoint-3")).unwrap();
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        for f in std::fs::read_dir(from).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
        }
    };
    copy(&kept, &out.join("checkpoint-3"));
    pretrain(&args(&format!("{common} --resume --stop-after 5")), &world).unwrap();
    std::fs::remove_dir_all(out.join("checkpoint-5")).unwrap();
    std::fs::rename(&kept, out.join("checkpoint-3")).unwrap();
    std::fs::write(out.join("latest"), "checkpoint-3").unwrap();
    let rest = pretrain(&args(&format!("{common} --resume")), &world).unwrap();
    assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
    let logs = out.join("logs/vit-pretrain");
    assert_eq!(std::fs::read_dir(&logs).unwrap().count(), 3, "an event file per run");
    let events = suite_tests::read_tensorboard(&logs);
    let every = ["train/loss", "train/lr", "train/images_per_s", "train/step_seconds", "train/grad_norm"];
    for tag in every.into_iter().chain(["train/peak_memory_gib"]) {
        assert_eq!(events.steps(tag), (1..=8).collect::<Vec<i64>>(), "{tag}: {events:?}");
    }
    // Validation at each run's end: step 3, (5, dropped) and 8.
    assert_eq!(events.steps("val/top1"), [3, 8]);
    assert_eq!(events.steps("val/top5"), [3, 8]);
    let jsonl: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(jsonl.len(), 8);
    for (tag, field) in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")] {
        for (record, logged) in jsonl.iter().zip(events.values(tag)) {
            let want = record[field].as_f64().unwrap() as f32 as f64;
            assert!((logged - want).abs() <= 1e-12 * want.abs(), "{tag} at step {}: {logged}, {want}", record["step"]);
        }
    }
    for (logged, i) in events.values("val/top1").into_iter().zip([2, 7]) {
        let want = jsonl[i]["val_top1"].as_f64().unwrap() as f32 as f64;
        assert!((logged - want).abs() <= 1e-12, "val/top1 {logged}, {want}");
    }
    assert!(events.images.is_empty());
    let err = pretrain(&args("--steps 1 --report-to tensorboard"), &world).err().unwrap().to_string();
    assert!(err.contains("--report-to tensorboard needs --out"), "{err}");
}

#[test]
fn bad_settings_name_the_numbers() {
    let world = single();
    // A run that fails leaves no empty --out behind (one it did not create stays).
    let root = suite_tests::scratch("vit", "failed-out");
    let out = root.join("run");
    for (flags, named) in
        [("--metrics sub/m.jsonl", "sub/m.jsonl"), ("--report-to tensorboard --logging-dir /proc/x", "--logging-dir")]
    {
        let err = pretrain(&args(&format!("--steps 1 {flags} --out {}", out.display())), &world).err().unwrap();
        assert!(err.to_string().contains(named), "{err}");
        assert!(!out.exists(), "{flags}: the failed run left {} behind", out.display());
    }
    std::fs::create_dir(&out).unwrap();
    assert!(pretrain(&args(&format!("--steps 1 --metrics sub/m.jsonl --out {}", out.display())), &world).is_err());
    assert!(out.is_dir(), "a folder the run did not create is kept");
    let err = pretrain(&args("--steps 1 --micro-batch 5"), &world).err().unwrap().to_string();
    assert!(err.contains("--micro-batch 5 does not divide the per-rank batch 32"), "{err}");
    let err = pretrain(&args("--steps 1 --batch 4k"), &world).err().unwrap().to_string();
    assert!(err.contains("--batch 4096 exceeds the 1500 training images"), "{err}");
    let err = pretrain(&args("--steps 1 --model vit_huge_patch14_224"), &world).err().unwrap().to_string();
    assert!(err.contains("--model vit_huge_patch14_224: not a known model"), "{err}");
    let err = pretrain(&args("--steps 1 --resume"), &world).err().unwrap().to_string();
    assert!(err.contains("--resume needs --out"), "{err}");
    let err = pretrain(&args("--steps 1 --device cpu --kernels fused"), &world).err().unwrap().to_string();
    assert!(err.contains("--kernels fused needs a CUDA device"), "{err}");
    // Counts of nothing are refused by flag (--epochs 0 saved the untrained model as if trained).
    for flag in ["--epochs", "--steps", "--micro-batch", "--tp", "--tp-depth", "--sp", "--pp"] {
        let err = refused(&format!("{flag} 0"));
        assert!(err.contains(&format!("'0' for '{flag}")) && err.contains("must be at least 1"), "{flag} 0: {err}");
    }
}

#[test]
fn bf16_and_fp16_train_on_fp32_master_weights_close_to_fp32() {
    let world = single();
    let fp32 = pretrain(&args("--steps 12"), &world).unwrap();
    for precision in ["bf16", "fp16"] {
        let low = pretrain(&args(&format!("--steps 12 --precision {precision}")), &world).unwrap();
        assert!(low.weights.iter().all(|(_, w)| w.kind() == tch::Kind::Float), "master weights are fp32");
        let last = |t: &Trained| t.losses.last().unwrap().1;
        assert!(last(&low) < low.losses[0].1, "{precision} training lowers the loss: {:?}", low.losses);
        // Rounding to 8 (bf16) or 11 (fp16) mantissa bits moves the loss by well under 5%.
        assert!(
            (last(&low) - last(&fp32)).abs() < 0.05 * last(&fp32),
            "{precision}: {} vs fp32 {}",
            last(&low),
            last(&fp32)
        );
    }
}

dist_test!(fp16_on_4_ranks_follows_the_one_process_run, 4, |world| {
    // Each rank's loss is divided by the 4 ranks before backward, as gradient accumulation
    // divides a micro-batch's: its fp16 gradients are its share of the batch's, and overflow
    // no sooner than one process's (undivided, the first step overflowed on 4 ranks only and
    // was skipped, and every later loss differed by a few percent).
    let line = "--steps 6 --warmup 1 --batch 16 --precision fp16";
    let dp = pretrain(&args(line), world)?;
    let one = pretrain(&args(line), &single())?;
    // fp16 rounds the two layouts' sums differently.
    compare_with(&dp, &one, "fp16 on 4 ranks vs 1 process", 2e-3, f64::INFINITY);
    TestResult::Ok(())
});

dist_test!(offloaded_optimizer_state_matches_plain_zero, 2, |world| {
    let plain = pretrain(&args("--steps 6 --zero 1"), world)?;
    let offloaded = pretrain(&args("--steps 6 --zero 1 --offload-optimizer"), world)?;
    compare(&offloaded, &plain, "ZeRO-1 with offload vs without", 1e-6);
    let scaled = pretrain(&args("--steps 2 --lr 1e-3 --lr-base-batch 16"), world)?;
    let doubled = pretrain(&args("--steps 2 --lr 2e-3"), world)?;
    compare(&scaled, &doubled, "linear scaling 32/16", 1e-6);
    TestResult::Ok(())
});

dist_test!(resume_on_another_rank_count_and_zero_stage_continues_the_run, 2, |world| {
    // 2 ranks with ZeRO-1 (optimizer state in two shards), stopped at step 3, resumed on one
    // process without ZeRO; and one process stopped at step 3, resumed on 2 ranks with ZeRO-2.
    let (sharded, whole_dir) = (job_dir("sharded"), job_dir("single"));
    if world.rank() == 0 {
        let _ = std::fs::remove_dir_all(&sharded);
        let _ = std::fs::remove_dir_all(&whole_dir);
    }
    world.group.barrier()?;
    let common = "--steps 6 --save-every 100 --clip-grad 1.0";
    let reference = pretrain(&args(&format!("{common} --zero 1")), world)?;
    pretrain(&args(&format!("{common} --zero 1 --out {} --stop-after 3", sharded.display())), world)?;
    if world.rank() == 0 {
        let rest = pretrain(&args(&format!("{common} --out {} --resume", sharded.display())), &single())?;
        assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
        for ((step, got), (_, want)) in rest.losses.iter().zip(&reference.losses[3..]) {
            assert!((got - want).abs() <= 1e-5 * want.abs(), "step {step} on 1 rank: {got} vs {want} on 2");
        }
        pretrain(&args(&format!("{common} --out {} --stop-after 3", whole_dir.display())), &single())?;
    }
    world.group.barrier()?;
    let rest = pretrain(&args(&format!("{common} --zero 2 --out {} --resume", whole_dir.display())), world)?;
    compare(
        &Trained { losses: [&reference.losses[..3], &rest.losses[..]].concat(), ..rest },
        &reference,
        "1 rank resumed on 2 with ZeRO-2",
        1e-5,
    );
    world.group.barrier()?;
    if world.rank() == 0 {
        std::fs::remove_dir_all(&sharded)?;
        std::fs::remove_dir_all(&whole_dir)?;
    }
    TestResult::Ok(())
});

dist_test!(bf16_resume_at_another_zero_stage_restores_the_sharded_masters, 2, |world| {
    // Under bf16 the fp32 masters are sharded with ZeRO-1: the checkpoint must hold every
    // master (gathered from its owner), and a resume under ZeRO-2 must re-shard them.
    let dir = job_dir("bf16");
    if world.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    world.group.barrier()?;
    let common = "--steps 6 --save-every 100 --clip-grad 1.0 --precision bf16";
    let reference = pretrain(&args(common), world)?;
    pretrain(&args(&format!("{common} --zero 1 --out {} --stop-after 3", dir.display())), world)?;
    let rest = pretrain(&args(&format!("{common} --zero 2 --out {} --resume", dir.display())), world)?;
    // Only the clipping norm's summation order differs (two shards), and bf16 roundings with
    // it: a lost or misplaced master would change the losses by far more.
    compare(
        &Trained { losses: [&reference.losses[..3], &rest.losses[..]].concat(), ..rest },
        &reference,
        "bf16 ZeRO-1 resumed under ZeRO-2",
        1e-3,
    );
    world.group.barrier()?;
    if world.rank() == 0 {
        std::fs::remove_dir_all(&dir)?;
    }
    TestResult::Ok(())
});
