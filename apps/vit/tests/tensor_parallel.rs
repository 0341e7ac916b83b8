//! `vit pretrain --tp`: Megatron's 1D tensor parallelism, alone and with data parallelism and
//! ZeRO, against one process (losses and every weight, relative 1e-5), and checkpoints moving
//! between tensor-parallel sizes.
use clap::Parser;
use engine::dist::{InitOptions, World};
use suite_tests::{dist_test, TestResult, TEST_TIMEOUT};
use vit::train::{pretrain, PretrainArgs, Trained};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: PretrainArgs,
}

/// Pretrain arguments from a command line (after `vit pretrain`): quiet, small batches unless
/// `line` says otherwise.
fn args(line: &str) -> PretrainArgs {
    let defaults = [("--batch", "32"), ("--warmup", "5"), ("--lr", "4e-3"), ("--timeout", "60")];
    let mut words = vec!["vit", "--quiet"];
    for (flag, value) in defaults {
        if !line.split_whitespace().any(|w| w == flag) {
            words.extend([flag, value]);
        }
    }
    words.extend(line.split_whitespace());
    Cli::parse_from(words).args
}

fn single() -> World {
    World::single(&InitOptions { timeout: TEST_TIMEOUT }).unwrap()
}

/// Asserts that per-step losses of `a` are within `rtol` of `b`'s, and every weight within
/// `weight_rtol` (relative to its largest magnitude).
fn compare_with(a: &Trained, b: &Trained, what: &str, rtol: f64, weight_rtol: f64) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: step counts");
    for ((sa, la), (sb, lb)) in a.losses.iter().zip(&b.losses) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= rtol * lb.abs(), "{what}: step {sa} loss {la} vs {lb}");
    }
    assert_eq!(a.weights.len(), b.weights.len());
    for ((na, ta), (nb, tb)) in a.weights.iter().zip(&b.weights) {
        assert_eq!(na, nb);
        assert_eq!(ta.size(), tb.size(), "{what}: {na} is not a full tensor");
        let (ta, tb) = match na.ends_with("attn.qkv.bias") && weight_rtol > rtol {
            // The key bias adds one constant to each query's scores, which softmax removes:
            // its gradient is zero but for rounding, and Adam's small eps turns that noise into
            // full-size steps, different in any two summation orders. Queries and values only.
            true => {
                let d = ta.size()[0] / 3;
                let qv = |t: &tch::Tensor| tch::Tensor::cat(&[t.narrow(0, 0, d), t.narrow(0, 2 * d, d)], 0);
                (qv(ta), qv(tb))
            }
            false => (ta.shallow_clone(), tb.shallow_clone()),
        };
        let diff = (&ta - &tb).abs().max().double_value(&[]);
        let scale = tb.abs().max().double_value(&[]).max(1e-12);
        assert!(diff <= weight_rtol * scale, "{what}: {na} differs by {diff:.3e} (max |w| {scale:.3e})");
    }
}

/// [`compare_with`] at one tolerance for losses and weights.
fn compare(a: &Trained, b: &Trained, what: &str, rtol: f64) {
    compare_with(a, b, what, rtol, rtol)
}

/// Asserts every rank of `world` ends with the same full weights, replicated ones included
/// (they are never synchronised explicitly: equal gradients keep them equal).
fn same_on_every_rank(run: &Trained, world: &World) -> TestResult {
    for (name, w) in &run.weights {
        let mine = w.copy();
        world.group.broadcast(&mine, 0)?;
        assert!(mine.equal(w), "{name} differs between rank 0 and rank {}", world.rank());
    }
    TestResult::Ok(())
}

dist_test!(tp_2_matches_one_process_with_adamw_lamb_and_lars, 2, |world| {
    // AdamW's eps (1e-8, against LAMB's 1e-6) magnifies the rounding of near-zero gradient
    // elements: plain data parallelism on 2 ranks moves the same run's weights by up to 3e-5
    // against one process, so its weights are held to 1e-4 (its losses to 1e-5).
    for (opt, weight_rtol) in
        [("--optimizer adamw", 1e-4), ("--optimizer lamb --clip-grad 0.5", 1e-5), ("--optimizer lars --lr 2", 1e-5)]
    {
        let line = format!("--steps 20 {opt}");
        let tp = pretrain(&args(&format!("{line} --tp 2")), world)?;
        let one = pretrain(&args(&line), &single())?;
        compare_with(&tp, &one, &format!("tp=2 vs 1 process, {opt}"), 1e-5, weight_rtol);
        same_on_every_rank(&tp, world)?;
    }
    TestResult::Ok(())
});

dist_test!(sequence_parallel_matches_one_process, 2, |world| {
    // 6x6 images in 2x2 patches: 9 patches and the class token, 5 tokens per rank.
    let line = "--steps 20 --image-size 6 --optimizer lamb --clip-grad 0.5";
    let sp = pretrain(&args(&format!("{line} --tp 2 --sequence-parallel")), world)?;
    let one = pretrain(&args(line), &single())?;
    compare(&sp, &one, "tp=2 with sequence parallelism vs 1 process", 1e-5);
    same_on_every_rank(&sp, world)?;
    TestResult::Ok(())
});

/// A folder every rank of this job names alike (the job's rendezvous port is shared).
fn job_dir(name: &str) -> std::path::PathBuf {
    let port = std::env::var("MASTER_PORT").unwrap_or_default();
    std::env::temp_dir().join(format!("vit-tp-{port}-{name}"))
}

fn fresh(world: &World, dirs: &[&std::path::Path]) -> TestResult {
    if world.rank() == 0 {
        for d in dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    world.group.barrier()?;
    TestResult::Ok(())
}

/// `reference`'s losses up to the checkpoint followed by `rest`'s: the whole curve of a run
/// resumed at step 3.
fn joined(reference: &Trained, rest: Trained) -> Trained {
    Trained { losses: [&reference.losses[..3], &rest.losses[..]].concat(), ..rest }
}

dist_test!(dp_2_by_tp_2_with_zero_matches_one_process_and_resumes_at_tp_4, 4, |world| {
    let common = "--steps 20 --optimizer lamb --clip-grad 1.0 --save-every 100";
    let one = pretrain(&args(common), &single())?;
    let dir = job_dir("dp2tp2");
    fresh(world, &[&dir])?;
    let mesh = pretrain(&args(&format!("{common} --tp 2 --zero 1")), world)?;
    compare(&mesh, &one, "dp=2 x tp=2 with ZeRO-1 vs 1 process", 1e-5);
    same_on_every_rank(&mesh, world)?;
    // Saved at dp=2 x tp=2 under ZeRO-2 (two optimizer shards, gradients reduced to their
    // owners), resumed at tp=4: its next losses are those of one process.
    pretrain(&args(&format!("{common} --tp 2 --zero 2 --out {} --stop-after 3", dir.display())), world)?;
    let rest = pretrain(&args(&format!("{common} --tp 4 --out {} --resume", dir.display())), world)?;
    assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
    compare(&joined(&one, rest), &one, "saved at dp=2 x tp=2 under ZeRO-2, resumed at tp=4", 1e-5);
    fresh(world, &[&dir])?;
    TestResult::Ok(())
});

dist_test!(checkpoints_move_between_tp_2_and_tp_1, 2, |world| {
    let (at_tp2, at_tp1) = (job_dir("from-tp2"), job_dir("from-tp1"));
    fresh(world, &[&at_tp2, &at_tp1])?;
    let common = "--steps 6 --save-every 100 --clip-grad 1.0";
    let reference = pretrain(&args(&format!("{common} --tp 2")), world)?;
    pretrain(&args(&format!("{common} --tp 2 --out {} --stop-after 3", at_tp2.display())), world)?;
    if world.rank() == 0 {
        // The model file holds full tensors under timm's names, as one process writes them.
        let file = data::checkpoint::read_tensors(&at_tp2.join("checkpoint-3/model.safetensors"))?;
        assert_eq!(file["blocks.0.attn.qkv.weight"].size(), [192, 64]);
        assert_eq!(file["blocks.0.mlp.fc2.weight"].size(), [64, 128]);
        let rest = pretrain(&args(&format!("{common} --out {} --resume", at_tp2.display())), &single())?;
        assert_eq!(rest.losses.first().map(|l| l.0), Some(4), "continues at step 4");
        compare(&joined(&reference, rest), &reference, "saved at tp=2, resumed at tp=1", 1e-5);
        pretrain(&args(&format!("{common} --out {} --stop-after 3", at_tp1.display())), &single())?;
    }
    world.group.barrier()?;
    let rest = pretrain(&args(&format!("{common} --tp 2 --out {} --resume", at_tp1.display())), world)?;
    compare(&joined(&reference, rest), &reference, "saved at tp=1, resumed at tp=2", 1e-5);
    fresh(world, &[&at_tp2, &at_tp1])?;
    TestResult::Ok(())
});

dist_test!(layouts_that_do_not_fit_name_the_numbers, 2, |world| {
    let err = pretrain(&args("--steps 1 --tp 3"), world).err().unwrap().to_string();
    assert!(err.contains("--tp 3 does not divide the job's 2 ranks"), "{err}");
    // ViT-Ti has 3 heads.
    let err = pretrain(&args("--steps 1 --tp 2 --model vit_tiny_patch16_224 --image-size 32"), world)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("--tp 2: the model's 3 attention heads (width 192) do not split over 2 ranks"), "{err}");
    let err = pretrain(&args("--steps 1 --tp 2 --sequence-parallel"), world).err().unwrap().to_string();
    assert!(
        err.contains(
            "--sequence-parallel: the model's 17 tokens (16 patches and the class token) do not split over --tp 2"
        ),
        "{err}"
    );
    let err = pretrain(&args("--steps 1 --tp 2 --tp-mode 2.5d"), world).err().unwrap().to_string();
    assert!(err.contains("--tp-mode 2.5d is not available yet"), "{err}");
    TestResult::Ok(())
});
