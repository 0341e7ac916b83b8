//! `vit pretrain --tp` and `--sp`: Megatron's 1D tensor parallelism, the 2D, 2.5D and 3D
//! modes, ring and all-to-all sequence parallelism, alone and with data parallelism and ZeRO,
//! against one process (losses and every weight, relative 1e-5 unless a test says otherwise),
//! and checkpoints moving between layouts.
mod common;

use common::{args, compare, compare_with, fresh, job_dir, joined, single};
use engine::dist::World;
use suite_tests::{dist_test, TestResult};
use vit::train::{pretrain, Trained};

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
    let err = pretrain(&args("--steps 1 --tp 2 --tp-mode 2d"), world).err().unwrap().to_string();
    assert!(err.contains("--tp 2 --tp-mode 2d: 2D tensor parallelism needs a square number of ranks"), "{err}");
    let err = pretrain(&args("--steps 1 --tp 2 --tp-mode 2.5d --tp-depth 3"), world).err().unwrap().to_string();
    assert!(err.contains("--tp-depth 3: 2.5D tensor parallelism: 2 ranks do not divide into depth 3"), "{err}");
    let err = pretrain(&args("--steps 1 --tp 2 --tp-depth 2"), world).err().unwrap().to_string();
    assert!(err.contains("--tp-depth 2 is for --tp-mode 2.5d, not 1d"), "{err}");
    let err = pretrain(&args("--steps 1 --sp 2"), world).err().unwrap().to_string();
    assert!(
        err.contains("--sp 2: the model's 17 tokens (16 patches and the class token) do not split over 2"),
        "{err}"
    );
    let err = pretrain(&args("--steps 1 --sp 3"), world).err().unwrap().to_string();
    assert!(err.contains("--tp 1 x --sp 3 does not divide the job's 2 ranks"), "{err}");
    // ViT-Ti's 3 heads do not split over 2 sequence ranks (12x12 images in 4x4 patches: 10
    // tokens, which do).
    let line = "--steps 1 --sp 2 --model vit_tiny_patch16_224 --image-size 12 --patch-size 4";
    let err = pretrain(&args(line), world).err().unwrap().to_string();
    assert!(
        err.contains("--sp 2 --sp-mode ulysses: the 3 attention heads per tensor-parallel rank (3 over --tp 1)"),
        "{err}"
    );
    TestResult::Ok(())
});

// 6x6 images in 2x2 patches: 9 patches and the class token, 5 tokens per sequence rank.
const SP_LINE: &str = "--steps 20 --image-size 6 --optimizer lamb --clip-grad 0.5";

dist_test!(sp_2_ring_and_ulysses_match_one_process_and_resume_at_1, 2, |world| {
    let one = pretrain(&args(SP_LINE), &single())?;
    for mode in ["ring", "ulysses"] {
        let sp = pretrain(&args(&format!("{SP_LINE} --sp 2 --sp-mode {mode}")), world)?;
        compare(&sp, &one, &format!("sp=2 {mode} vs 1 process"), 1e-5);
        same_on_every_rank(&sp, world)?;
    }
    // Saved at sp=2 under ZeRO-1 (each sequence rank owns an optimizer shard), resumed by one
    // process.
    let dir = job_dir("from-sp2");
    fresh(world, &[&dir])?;
    let out = format!("--save-every 100 --out {}", dir.display());
    pretrain(&args(&format!("{SP_LINE} {out} --sp 2 --zero 1 --stop-after 3")), world)?;
    if world.rank() == 0 {
        let rest = pretrain(&args(&format!("{SP_LINE} {out} --resume")), &single())?;
        compare(&joined(&one, rest), &one, "saved at sp=2 under ZeRO-1, resumed at 1 process", 1e-5);
    }
    fresh(world, &[&dir])?;
    TestResult::Ok(())
});

dist_test!(dp_2_by_sp_2_and_tp_2_by_sp_2_match_one_process, 4, |world| {
    let one = pretrain(&args(SP_LINE), &single())?;
    let mesh = pretrain(&args(&format!("{SP_LINE} --sp 2 --sp-mode ring --zero 1")), world)?;
    compare(&mesh, &one, "dp=2 x sp=2 (ring) with ZeRO-1 vs 1 process", 1e-5);
    same_on_every_rank(&mesh, world)?;
    let mesh = pretrain(&args(&format!("{SP_LINE} --tp 2 --sp 2")), world)?;
    compare(&mesh, &one, "tp=2 x sp=2 (ulysses) vs 1 process", 1e-5);
    same_on_every_rank(&mesh, world)?;
    TestResult::Ok(())
});

dist_test!(tp_2d_matches_one_process_and_checkpoints_move_to_1d, 4, |world| {
    let common = "--steps 20 --optimizer lamb --clip-grad 1.0 --save-every 100";
    let one = pretrain(&args(common), &single())?;
    let grid = pretrain(&args(&format!("{common} --tp 4 --tp-mode 2d")), world)?;
    compare(&grid, &one, "2D on a 2 x 2 grid vs 1 process", 1e-5);
    same_on_every_rank(&grid, world)?;
    // 297 validation images: the last chunk of 41 is padded to the grid's 2 batch blocks.
    assert_eq!(grid.val_top1, one.val_top1, "2D validation top-1");
    // Saved on the grid, resumed at dp=2 x tp=2 (1D) and at 2D again from a 1D checkpoint.
    let (at_2d, at_1d) = (job_dir("from-2d"), job_dir("from-1d"));
    fresh(world, &[&at_2d, &at_1d])?;
    pretrain(&args(&format!("{common} --tp 4 --tp-mode 2d --out {} --stop-after 3", at_2d.display())), world)?;
    let rest = pretrain(&args(&format!("{common} --tp 2 --out {} --resume", at_2d.display())), world)?;
    compare(&joined(&one, rest), &one, "saved at 2D, resumed at dp=2 x tp=2 (1D)", 1e-5);
    pretrain(&args(&format!("{common} --tp 2 --zero 1 --out {} --stop-after 3", at_1d.display())), world)?;
    let rest = pretrain(&args(&format!("{common} --tp 4 --tp-mode 2d --out {} --resume", at_1d.display())), world)?;
    compare(&joined(&one, rest), &one, "saved at dp=2 x tp=2 (1D) under ZeRO-1, resumed at 2D", 1e-5);
    fresh(world, &[&at_2d, &at_1d])?;
    // bf16: the grid's LayerNorms compute in fp32 and return bf16, as one process's do (they
    // returned fp32, which the next bf16 matmul refused). bf16 rounds each layout's differently
    // ordered sums differently: the losses agree to 1%.
    let bf16 = "--steps 4 --optimizer lamb --precision bf16";
    let one = pretrain(&args(bf16), &single())?;
    let grid = pretrain(&args(&format!("{bf16} --tp 4 --tp-mode 2d")), world)?;
    compare_with(&grid, &one, "bf16: 2D on a 2 x 2 grid vs 1 process", 1e-2, f64::INFINITY);
    // ViT-Ti's 3 heads do not split over the grid's 2 columns; 31 examples not over its rows.
    let line = "--steps 1 --tp 4 --tp-mode 2d --model vit_tiny_patch16_224 --image-size 32";
    let err = pretrain(&args(line), world).err().unwrap().to_string();
    assert!(
        err.contains("--tp 4 --tp-mode 2d (q = 2): the model's attention heads (3) cannot be cut into 2 blocks"),
        "{err}"
    );
    let err = pretrain(&args("--steps 1 --tp 4 --tp-mode 2d --batch 31"), world).err().unwrap().to_string();
    assert!(
        err.contains("a micro-batch of 31 examples per data-parallel rank does not split into the layout's 2"),
        "{err}"
    );
    let err =
        pretrain(&args("--steps 1 --tp 4 --tp-mode 2d --sp 1 --sequence-parallel"), world).err().unwrap().to_string();
    assert!(err.contains("--sequence-parallel is Megatron's, for --tp-mode 1d"), "{err}");
    TestResult::Ok(())
});

dist_test!(tp_2p5d_3d_and_dp_by_2d_match_one_process, 8, |world| {
    // The 20 steps; eight ranks share CI's two cores, so each layout runs once.
    let common = "--steps 20 --optimizer lamb --clip-grad 1.0";
    let one = pretrain(&args(common), &single())?;
    for (layout, what) in [
        ("--tp 8 --tp-mode 2.5d --tp-depth 2", "2.5D on 2 x 2 x 2"),
        ("--tp 8 --tp-mode 3d", "3D on a 2 x 2 x 2 cube"),
        ("--tp 4 --tp-mode 2d --zero 1", "dp=2 x 2D with ZeRO-1"),
    ] {
        let run = pretrain(&args(&format!("{common} {layout}")), world)?;
        compare(&run, &one, &format!("{what} vs 1 process"), 1e-5);
        same_on_every_rank(&run, world)?;
        assert_eq!(run.val_top1, one.val_top1, "{what}: validation top-1");
    }
    TestResult::Ok(())
});
