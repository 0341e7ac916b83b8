//! The solver on synthetic cost tables: its choice equals the optimum found by enumerating
//! every plan independently, memory limits push it to sharding and checkpointing, and a limit
//! nothing meets is an error naming the limit and the leanest plan's need.
use engine::parallel::tensor::TpMode;
use engine::planner::{estimate, plans, solve, Cluster, LayerProfile, Model, Plan};

/// A model of `blocks` identical blocks between a small stem and head, per sample.
fn synthetic(blocks: usize, global_batch: usize) -> Model {
    let block = |i: usize| LayerProfile {
        name: format!("blocks.{i}"),
        forward_flops: 4e9,
        split_flops: 3.8e9,
        param_bytes: 28e6,
        split_param_bytes: 27e6,
        param_tensors: 12.0,
        input_bytes: 1e6,
        saved_bytes: 12e6,
        split_saved_bytes: 8e6,
        output_bytes: 1e6,
        workspace_bytes: 4e6,
        tp_allreduce_bytes: 2e6,
        tp_allreduces: 2.0,
        matmul_operand_bytes: 30e6,
        matmuls: 4.0,
        norms: 2.0,
        attention_qkv_bytes: 3e6,
        checkpointable: true,
        ops: 30.0,
        measured: None,
    };
    let edge = |name: &str| LayerProfile {
        name: name.into(),
        forward_flops: 1e8,
        param_bytes: 1e6,
        param_tensors: 1.0,
        input_bytes: 1e6,
        saved_bytes: 1e6,
        output_bytes: 1e6,
        ..Default::default()
    };
    let mut layers = vec![edge("stem")];
    layers.extend((0..blocks).map(block));
    layers.push(edge("head"));
    // A multi-tensor optimizer: its update costs nothing per tensor.
    Model { layers, global_batch, optimizer_state_ratio: 2.0, optimizer_ops_per_tensor: 0.0, step_grad_ratio: 1.0 }
}

fn cluster(memory_gib: f64) -> Cluster {
    Cluster { memory_bytes: memory_gib * (1u64 << 30) as f64, peak_flops: 1e12, ..Cluster::default() }
}

/// The optimum by brute force: every plan, modelled, the fastest that fits.
fn brute_force(model: &Model, c: &Cluster, nproc: usize) -> (Plan, f64) {
    let mut best: Option<(Plan, f64)> = None;
    for plan in plans(model, nproc, &|_| true) {
        let e = estimate(model, c, &plan).unwrap();
        if e.memory_bytes <= c.memory_bytes && best.as_ref().is_none_or(|(_, t)| e.step_s < *t) {
            best = Some((plan, e.step_s));
        }
    }
    best.expect("some plan fits")
}

#[test]
fn the_solver_picks_the_enumerated_optimum() {
    let model = synthetic(8, 64);
    for (gib, nproc) in [(64.0, 8), (2.0, 8), (0.6, 8), (1.0, 4)] {
        let c = cluster(gib);
        let s = solve(&model, &c, nproc, 3, &|_| true).unwrap();
        let (_, best_time) = brute_force(&model, &c, nproc);
        assert_eq!(s.best.estimate.step_s, best_time, "{gib} GiB, {nproc} ranks: {s}");
        assert!(s.best.estimate.memory_bytes <= c.memory_bytes);
        assert!(s.runners_up.iter().all(|r| r.estimate.step_s >= s.best.estimate.step_s));
        assert_eq!(s.best.plan.ranks(), nproc);
    }
}

#[test]
fn plenty_of_memory_and_a_fast_link_choose_plain_data_parallelism() {
    let model = synthetic(8, 64);
    let c = Cluster { intra_node_bandwidth: 1e15, latency_s: 0.0, ..cluster(64.0) };
    let s = solve(&model, &c, 8, 0, &|_| true).unwrap();
    let p = &s.best.plan;
    // The memory is to spare, and ZeRO's broadcasts after the step, however fast the link,
    // cost time: no ZeRO stage.
    assert_eq!((p.dp, p.tp, p.sp, p.pp, p.zero, p.checkpoint.len()), (8, 1, 1, 1, 0, 0), "{s}");
}

#[test]
fn an_update_that_costs_time_is_shared_by_zero() {
    // The same fast links, but an update of 12 operations per tensor at 10 GB/s: each rank
    // updating its eighth under ZeRO beats every rank updating everything.
    let model = Model { optimizer_ops_per_tensor: 12.0, ..synthetic(8, 64) };
    let c = Cluster { intra_node_bandwidth: 1e15, latency_s: 0.0, ..cluster(64.0) };
    let s = solve(&model, &c, 8, 0, &|_| true).unwrap();
    assert!(s.best.plan.zero >= 1, "{s}");
    assert!(s.best.estimate.optimizer_s > 0.0, "{s}");
}

#[test]
fn a_tight_limit_is_met_by_sharding_or_recomputing() {
    let model = synthetic(8, 64);
    let roomy = solve(&model, &cluster(64.0), 8, 0, &|_| true).unwrap();
    let limit = 0.5 * roomy.best.estimate.memory_bytes;
    let c = Cluster { memory_bytes: limit, ..cluster(64.0) };
    let tight = solve(&model, &c, 8, 0, &|_| true).unwrap();
    assert!(tight.best.estimate.memory_bytes <= limit);
    assert!(tight.best.estimate.step_s >= roomy.best.estimate.step_s);
    assert_ne!(tight.best.plan, roomy.best.plan);
}

/// Plain data parallelism over `dp` ranks at ZeRO stage `zero`, nothing checkpointed.
fn data_parallel(dp: usize, zero: u8) -> Plan {
    Plan {
        dp,
        tp: 1,
        tp_mode: TpMode::OneD,
        tp_depth: 1,
        sp: 1,
        pp: 1,
        micro_batches: 1,
        zero,
        checkpoint: Default::default(),
    }
}

#[test]
fn checkpointing_trades_memory_for_time() {
    let model = synthetic(8, 64);
    let c = cluster(64.0);
    let base = data_parallel(8, 0);
    let all = Plan { checkpoint: (1..=8).collect(), ..base.clone() };
    let (e0, e1) = (estimate(&model, &c, &base).unwrap(), estimate(&model, &c, &all).unwrap());
    assert!(e1.memory_bytes < e0.memory_bytes && e1.step_s > e0.step_s, "{e0:?} {e1:?}");
}

#[test]
fn nothing_fits_names_the_limit_and_the_leanest_need() {
    let model = synthetic(8, 64);
    let c = cluster(0.001);
    let e = solve(&model, &c, 8, 3, &|_| true).unwrap_err().to_string();
    assert!(e.contains("no plan fits the 0.001 GiB") && e.contains("memory_bytes") && e.contains("needs"), "{e}");
}

#[test]
fn no_valid_layout_is_an_error() {
    let e = solve(&synthetic(2, 64), &cluster(64.0), 4, 3, &|_| false).unwrap_err().to_string();
    assert!(e.contains("no parallel layout of 4 ranks"), "{e}");
}

#[test]
fn tensor_parallel_modes_match_their_grids() {
    assert_eq!(TpMode::for_degree(2), vec![(TpMode::OneD, 1)]);
    assert_eq!(TpMode::for_degree(4), vec![(TpMode::OneD, 1), (TpMode::TwoD, 1)]);
    assert_eq!(TpMode::for_degree(8), vec![(TpMode::OneD, 1), (TpMode::TwoHalfD, 2), (TpMode::ThreeD, 1)]);
}

#[test]
fn zero_costs_its_broadcasts_when_links_cost_time() {
    let model = synthetic(8, 64);
    let c = cluster(64.0);
    let at = |zero| estimate(&model, &c, &data_parallel(8, zero)).unwrap();
    let (plain, zero1, zero2) = (at(0), at(1), at(2));
    // Each ZeRO stage adds the parameters' broadcast: an all-gather of their bytes plus a
    // collective's own cost per tensor (98 tensors: 12 per block, one per edge layer).
    let params: f64 = model.layers.iter().map(|l| l.param_bytes).sum();
    let tensors: f64 = model.layers.iter().map(|l| l.param_tensors).sum();
    let broadcast = c.all_gather(params, 8, 1) + tensors * c.collective_s;
    assert!((zero1.step_s - plain.step_s - broadcast).abs() < 1e-12, "{plain:?} {zero1:?}");
    assert_eq!(zero1.step_s, zero2.step_s);
    assert!(zero2.memory_bytes < zero1.memory_bytes && zero1.memory_bytes < plain.memory_bytes);
    // With the memory to spare, plain data parallelism is chosen over either stage.
    let s = solve(&model, &c, 8, 0, &|p| p.tp == 1 && p.pp == 1 && p.sp == 1).unwrap();
    assert_eq!(s.best.plan.zero, 0, "{s}");
}

#[test]
fn a_step_is_the_sum_of_its_parts_and_memory_of_its_holdings() {
    let model = Model { optimizer_ops_per_tensor: 12.0, ..synthetic(8, 64) };
    let c = Cluster { cores_per_node: 4, ..cluster(64.0) };
    for plan in plans(&model, 8, &|_| true) {
        let e = estimate(&model, &c, &plan).unwrap();
        let parts = e.compute_s + e.communication_s + e.overhead_s + e.bubble_s + e.optimizer_s;
        assert!((parts - e.step_s).abs() <= 1e-9 * e.step_s, "{plan}: {parts} of {e:?}");
        let held = e.state_bytes() + e.activation_bytes;
        assert!((held - e.memory_bytes).abs() <= 1e-9 * e.memory_bytes, "{plan}: {held} of {e:?}");
    }
}

#[test]
fn ranks_sharing_cores_compute_slower() {
    // 8 ranks on 4 cores: one thread each, two ranks a core.
    let shared = Cluster { cores_per_node: 4, ..Cluster::default() };
    assert_eq!(shared.contention(1.0), 2.0);
    assert_eq!(shared.contention(0.25), 1.0);
    assert_eq!(Cluster::default().contention(1.0), 1.0);
    let model = synthetic(8, 64);
    let plan = &plans(&model, 8, &|p| p.dp == 8 && p.zero == 0 && p.micro_batches == 1 && p.checkpoint.is_empty())[0];
    let alone = estimate(&model, &Cluster::default(), plan).unwrap();
    let sharing = estimate(&model, &shared, plan).unwrap();
    assert!((sharing.compute_s - 2.0 * alone.compute_s).abs() <= 1e-12 * alone.compute_s, "{sharing:?} {alone:?}");
}

#[test]
fn ranks_computing_together_share_memory_in_proportion_to_their_work() {
    let c = Cluster { cores_per_node: 4, co_run_slowdown: 1.5, ..Cluster::default() };
    // 8 ranks on 4 cores (twice as many threads as cores), and half as slow again together.
    assert_eq!(c.contention(1.0), 3.0);
    // A quarter of them busy: the cores suffice, a quarter of the memory's slowdown.
    assert_eq!(c.contention(0.25), 1.125);
}

#[test]
fn tensor_parallel_collectives_are_blocking_calls_between_computations() {
    let model = synthetic(8, 64);
    let plan = |tp_mode| Plan {
        dp: 1,
        tp: if tp_mode == TpMode::OneD { 2 } else { 4 },
        tp_mode,
        tp_depth: 1,
        sp: 1,
        pp: 1,
        micro_batches: 1,
        zero: 0,
        checkpoint: Default::default(),
    };
    let slower = |c: &Cluster| Cluster { sync_s: c.sync_s + 1e-3, ..c.clone() };
    let c = cluster(64.0);
    for (mode, calls) in [
        // Two all-reduces forward and two backward in each of the 8 blocks, and the loss's.
        (TpMode::OneD, 8.0 * 4.0 + 1.0),
        // SUMMA on a 2 x 2 grid: 2q = 4 collectives per matmul (4 a block) and two per norm (2
        // a block) forward, twice as many backward; and the loss's.
        (TpMode::TwoD, 8.0 * 3.0 * (4.0 * 4.0 + 2.0 * 2.0) + 1.0),
    ] {
        let (base, more) =
            (estimate(&model, &c, &plan(mode)).unwrap(), estimate(&model, &slower(&c), &plan(mode)).unwrap());
        let added = more.step_s - base.step_s;
        assert!((added - calls * 1e-3).abs() < 1e-9, "{mode:?}: {added} s for {calls} calls");
        assert!((more.communication_s - base.communication_s - added).abs() < 1e-9, "{base:?} {more:?}");
    }
}

#[test]
fn master_gradients_make_the_step_the_peak_when_the_activations_are_few() {
    // One sample a step: the activations are few beside the weights' 230 MB.
    let fp32 = synthetic(8, 1);
    let masters = Model { step_grad_ratio: 2.0, ..synthetic(8, 1) };
    let c = cluster(64.0);
    let e = estimate(&fp32, &c, &data_parallel(1, 0)).unwrap();
    assert!(!e.peak_in_step, "the model's own gradients: the backward's peak {e:?}");
    let params = e.param_bytes;
    for (dp, zero, step_grads) in [
        // Every gradient moved to the masters, at twice the weight's bytes.
        (1, 0, 2.0 * params),
        // ZeRO-1: this rank's half moved, the other half left as the backward made it.
        (2, 1, 0.5 * params + 2.0 * 0.5 * params),
        // ZeRO-2: only this rank's half was kept, and it moved.
        (2, 2, 2.0 * 0.5 * params),
    ] {
        let e = estimate(&masters, &c, &data_parallel(dp, zero)).unwrap();
        assert!(e.peak_in_step, "dp {dp}, ZeRO-{zero}: {e:?}");
        assert!((e.grad_bytes - step_grads).abs() < 1.0, "dp {dp}, ZeRO-{zero}: {e:?}");
        assert_eq!(e.activation_bytes, 0.0);
        assert!((e.memory_bytes - (e.param_bytes + e.grad_bytes + e.optimizer_bytes)).abs() < 1.0, "{e:?}");
    }
    // A large batch's activations outweigh the step: the backward's peak, as in fp32.
    let large = Model { step_grad_ratio: 2.0, ..synthetic(8, 4096) };
    let e = estimate(&large, &c, &data_parallel(1, 0)).unwrap();
    assert!(!e.peak_in_step && e.activation_bytes > params, "{e:?}");
}
