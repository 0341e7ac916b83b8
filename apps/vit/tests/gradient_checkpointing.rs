//! `vit pretrain --gradient-checkpointing`: the same losses and weights as without it in one
//! process, under data parallelism with ZeRO-1, 1D tensor parallelism and a 2-stage pipeline
//! (each stage's blocks checkpointed), the first blocks only (`--checkpoint-blocks`), and fewer
//! bytes held between forward and backward (about half with half the blocks).
#[allow(dead_code)] // Shared by the vit test binaries; this one uses part of it.
mod common;

use common::{args, compare, single};
use engine::host_memory;
use suite_tests::{dist_test, TestResult};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use vit::model::{Vit, VitConfig};
use vit::train::pretrain;

/// LAMB and clipping: the norms see every block's recomputed gradients.
const LINE: &str = "--steps 4 --micro-batch 8 --optimizer lamb --clip-grad 0.5";

dist_test!(checkpointing_equals_plain_whole_and_per_stage, 2, |world| {
    let one = pretrain(&args(LINE), &single())?;
    // Recomputation repeats the same fp32 operations: equal up to rounding of the order in
    // which the blocks' gradients are summed.
    let checkpointed = pretrain(&args(&format!("{LINE} --gradient-checkpointing")), &single())?;
    compare(&checkpointed, &one, "checkpointed vs plain, 1 process", 1e-6);
    // The planner's middle ground: the first blocks checkpointed, the rest plain.
    let first_two = pretrain(&args(&format!("{LINE} --checkpoint-blocks 2")), &single())?;
    compare(&first_two, &one, "first 2 blocks checkpointed vs plain, 1 process", 1e-6);
    let err = pretrain(&args(&format!("{LINE} --checkpoint-blocks 5")), &single()).err().map(|e| format!("{e:#}"));
    assert!(err.as_deref().unwrap_or_default().contains("--checkpoint-blocks 5: the model has 4 blocks"), "{err:?}");
    for (layout, what) in [
        ("--zero 1", "dp=2 with ZeRO-1"),
        ("--tp 2", "tp=2 (1D)"),
        ("--pp 2", "pp=2 1f1b"),
        ("--pp 2 --schedule interleaved", "pp=2 interleaved"),
    ] {
        let run = pretrain(&args(&format!("{LINE} {layout} --gradient-checkpointing")), world)?;
        compare(&run, &one, &format!("checkpointed {what} vs plain, 1 process"), 1e-5);
    }
    let err = pretrain(&args(&format!("{LINE} --pp 2 --schedule zb --gradient-checkpointing")), world)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(err.contains("--gradient-checkpointing with --schedule zb"), "{err}");
    TestResult::Ok(())
});

/// The bytes a forward pass leaves allocated for backward (the graph's saved activations and
/// the logits), read from the host allocator's counter.
fn held_by_forward(checkpointed_blocks: usize) -> anyhow::Result<i64> {
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let mut model = Vit::new(&vs.root(), VitConfig::digits());
    model.set_checkpointed_blocks(checkpointed_blocks);
    let images = Tensor::randn([64, 1, 8, 8], (Kind::Float, Device::Cpu));
    let before = host_memory::stats()?.current;
    let logits = model.forward(&images)?;
    let held = host_memory::stats()?.current - before;
    // The graph is sound: backward reaches every block's weights.
    logits.square().sum(Kind::Float).backward();
    for (name, t) in vs.variables() {
        anyhow::ensure!(t.grad().defined(), "{name} got no gradient");
    }
    Ok(held)
}

// One rank: a process of its own, so the counter sees nothing else.
dist_test!(checkpointed_blocks_hold_fewer_bytes_for_backward, 1, |_world| {
    host_memory::track()?;
    let plain = held_by_forward(0)?;
    let checkpointed = held_by_forward(4)?;
    // Two of the four blocks checkpointed: between the two, about halfway.
    let half = held_by_forward(2)?;
    assert!(
        (half - (plain + checkpointed) / 2).abs() < (plain - checkpointed) / 10,
        "2 blocks checkpointed {half} B, none {plain} B, all {checkpointed} B"
    );
    // Each checkpointed block keeps its input only (64 images x 17 tokens x 64 features); a
    // plain block also keeps its norms, queries/keys/values, attention, MLP hidden features
    // (twice the width) and GELU input: many times that.
    let block_input = 64 * 17 * 64 * 4;
    assert!(checkpointed > 0 && checkpointed < 3 * plain / 10, "checkpointed {checkpointed} B vs plain {plain} B");
    assert!(plain > 4 * 4 * block_input, "plain {plain} B: four blocks' activations");
    TestResult::Ok(())
});
