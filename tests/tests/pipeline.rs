//! Pipeline parallelism against one process: every schedule (GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1) on 2 and 4 stages with 1, pp and 3 pp micro-batches gives the losses, every gradient
//! and 20 steps of weights of one process on the whole batch (fp32, relative 1e-5); pp x dp on
//! 4 ranks and tied parameters likewise; 1F1B holds at most pp micro-batches where GPipe holds
//! them all; a measured step's parts (compute, posting, waiting) account for its wall time and
//! its counts match the schedule; a failing stage ends the job naming its rank, and a hanging
//! one within the collective timeout. The 2-stage schedules also run on
//! CUDA/NCCL where two GPUs exist.
use std::time::{Duration, Instant};

use engine::dist::{ParallelDims, ProcessGroup, ReduceOp};
use engine::optim::{AdamW, AdamWConfig, Optimizer, Param};
use engine::parallel::pipeline::{
    assign, clip_grad_norm, simulate_ranks, split, sum_tied_gradients, Action, Balance, Costs, FnLayer, Layer,
    Pipeline, Schedule, ScheduleKind, StepStats, Tied,
};
use suite_tests::{dist_test, run_job, seeded, test_name, TestResult};
use tch::{Device, Kind, Tensor};

const WIDTH: i64 = 6;
const LAYERS: usize = 8;
/// Divides by every micro-batch count used: 1, 2, 4, 6 and 12.
const BATCH: i64 = 12;
const STEPS: usize = 20;
const MAX_NORM: f64 = 0.3;

/// The model, the same on every rank (seeded): `LAYERS` affine layers, tanh between them.
/// With `tied`, the first layer's weight is also the last's, transposed (as tied input and
/// output embeddings are).
fn layers(tied: bool, device: Device) -> Vec<Box<dyn Layer>> {
    let param =
        |seed: i64, shape: &[i64], scale: f64| (seeded(seed, shape) * scale).to_device(device).set_requires_grad(true);
    let emb = param(7, &[WIDTH, WIDTH], 0.5);
    (0..LAYERS)
        .map(|i| {
            let last = i + 1 == LAYERS;
            let w = match (tied, i == 0 || last) {
                (true, true) => Param::new("emb", &emb),
                _ => Param::new(format!("l{i}.w"), &param(10 + i as i64, &[WIDTH, WIDTH], 0.5)),
            };
            let b = Param::new(format!("l{i}.b"), &param(50 + i as i64, &[WIDTH], 0.1));
            let transpose = tied && last;
            Box::new(FnLayer::new(vec![w, b], move |x: &Tensor, p: &[Param]| {
                let w = if transpose { p[0].tensor.tr() } else { p[0].tensor.shallow_clone() };
                let y = x.f_matmul(&w)? + &p[1].tensor;
                Ok(if last { y } else { y.f_tanh()? })
            })) as Box<dyn Layer>
        })
        .collect()
}

fn mse(out: &Tensor, target: &Tensor) -> Tensor {
    (out - target).square().mean(Kind::Float)
}

fn batch(step: usize, device: Device) -> (Tensor, Tensor) {
    let data = |seed: i64| seeded(seed, &[BATCH, WIDTH]).to_device(device);
    (data(1000 + step as i64), data(2000 + step as i64))
}

/// The one-process reference: the whole model and its parameters, deduplicated by name.
struct Reference {
    layers: Vec<Box<dyn Layer>>,
    opt: AdamW,
}

impl Reference {
    fn new(tied: bool, device: Device) -> Reference {
        let layers = layers(tied, device);
        let mut params: Vec<Param> = Vec::new();
        for p in layers.iter().flat_map(|l| l.params()) {
            if !params.iter().any(|q| q.name == p.name) {
                params.push(p);
            }
        }
        Reference { layers, opt: optimizer(params) }
    }

    /// Loss and gradients of the whole batch.
    fn backward(&mut self, x: &Tensor, y: &Tensor) -> f64 {
        self.opt.zero_grad();
        let out = self.layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).unwrap());
        let loss = mse(&out, y);
        loss.backward();
        loss.double_value(&[])
    }

    fn param(&self, name: &str) -> &Tensor {
        &self.opt.params().iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no parameter {name}")).tensor
    }
}

fn optimizer(params: Vec<Param>) -> AdamW {
    AdamW::new(params, AdamWConfig { lr: 0.01, ..AdamWConfig::default() })
}

fn assert_rel(a: &Tensor, e: &Tensor, what: &str) {
    let err = (a - e).norm().double_value(&[]) / e.norm().double_value(&[]).max(1e-12);
    assert!(err < 1e-5, "{what}: relative error {err:e}");
}

/// One pipeline run of `STEPS` steps against the reference. `dp`: the data-parallel group
/// (this replica takes its share of the batch); `clip`: clip to the global norm each step.
struct Run<'a> {
    pp: &'a ProcessGroup,
    dp: Option<&'a ProcessGroup>,
    kind: ScheduleKind,
    micro: usize,
    virtual_stages: usize,
    tied: bool,
    clip: bool,
    device: Device,
}

fn train_and_compare(run: Run) -> TestResult {
    let Run { pp, dp, kind, micro, virtual_stages, tied, clip, device } = run;
    let (p, rank) = (pp.size(), pp.rank());
    let what = format!("{} pp={p} micro={micro} v={virtual_stages}", kind.name());
    let model = layers(tied, device);
    let cut = split(&model, p * virtual_stages, Balance::Count)?;
    if rank == 0 && micro == 1 {
        eprintln!("{what}: split\n{cut}");
    }
    let chunks = assign(model, &cut, rank, p)?;
    let schedule = Schedule::new(kind, p, micro, virtual_stages)?;
    let mut pipe = Pipeline::new(pp, chunks, schedule, device)?;
    let mut ties = Vec::new();
    if tied {
        let emb = pipe.params().into_iter().find(|q| q.name == "emb");
        if let (Some(e), true) = (&emb, rank > 0) {
            // Spoilt on purpose: tying starts every copy from the first holder's values.
            let _ = tch::no_grad(|| e.tensor.shallow_clone().zero_());
        }
        ties.push(Tied::new(pp, "emb", &[0, p - 1], emb.as_ref().map(|q| &q.tensor))?);
    }
    let mut opt = optimizer(pipe.params());
    let mut reference = Reference::new(tied, device);
    let (replicas, replica) = dp.map_or((1, 0), |g| (g.size() as i64, g.rank() as i64));
    let rows = BATCH / replicas / micro as i64;
    for step in 0..STEPS {
        let (x, y) = batch(step, device);
        let (x, y) = (
            x.narrow(0, replica * rows * micro as i64, rows * micro as i64),
            y.narrow(0, replica * rows * micro as i64, rows * micro as i64),
        );
        opt.zero_grad();
        let inputs: Vec<Tensor> = (0..micro as i64).map(|i| x.narrow(0, i * rows, rows)).collect();
        let mut loss_of =
            |i: usize, out: &Tensor| -> engine::Result<Tensor> { Ok(mse(out, &y.narrow(0, i as i64 * rows, rows))) };
        let loss = pipe.step(&inputs, &mut loss_of)?;
        sum_tied_gradients(&ties)?;
        if let Some(dp) = dp {
            for q in opt.params() {
                dp.all_reduce(&q.tensor.grad(), ReduceOp::Avg)?;
            }
        }
        let (x_all, y_all) = batch(step, device);
        let ref_loss = reference.backward(&x_all, &y_all);
        if let Some(loss) = loss {
            let loss = match dp {
                Some(dp) => {
                    let t = Tensor::from_slice(&[loss]);
                    dp.all_reduce(&t, ReduceOp::Avg)?;
                    t.double_value(&[0])
                }
                None => loss,
            };
            assert!((loss - ref_loss).abs() <= 1e-5 * ref_loss.abs(), "{what}, step {step}: loss {loss} vs {ref_loss}");
        }
        for q in opt.params() {
            assert_rel(
                &q.tensor.grad(),
                &reference.param(&q.name).grad(),
                &format!("{what}, step {step}, gradient of {}", q.name),
            );
        }
        if clip {
            let norm = clip_grad_norm(opt.params(), MAX_NORM, pp, &ties)?;
            let ref_norm = engine::optim::clip_grad_norm(reference.opt.params(), MAX_NORM, None)?;
            assert!((norm - ref_norm).abs() <= 1e-5 * ref_norm, "{what}, step {step}: norm {norm} vs {ref_norm}");
        }
        opt.step()?;
        reference.opt.step()?;
        for q in opt.params() {
            assert_rel(&q.tensor, reference.param(&q.name), &format!("{what}, step {step}, weight {}", q.name));
        }
        // Activations held (the runtime counts them): 1F1B min(pp - rank, micro), ZB-H1 at most
        // pp, GPipe every micro-batch.
        let peak = pipe.peak_in_flight();
        match kind {
            ScheduleKind::GPipe => assert_eq!(peak, micro, "{what}: GPipe holds every micro-batch"),
            ScheduleKind::OneFOneB => assert_eq!(peak, (p - rank).min(micro), "{what}: 1F1B on rank {rank}"),
            ScheduleKind::ZeroBubbleH1 => assert!(peak <= p, "{what}: ZB-H1 holds {peak} > pp"),
            ScheduleKind::Interleaved => {}
        }
        // Receive buffers are reused once a micro-batch's backward is done: as many as were
        // in flight (and the receives posted ahead), an activation's and a gradient's each.
        let buffers = pipe.receive_buffers();
        assert!(buffers <= 2 * (peak + 1), "{what}: rank {rank} keeps {buffers} receive buffers for {peak} in flight");
    }
    Ok(())
}

fn every_schedule(pp: &ProcessGroup, device: Device) -> TestResult {
    let p = pp.size();
    for micro in [1, p, 3 * p] {
        for (kind, virtual_stages) in [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZeroBubbleH1, 1),
        ] {
            train_and_compare(Run { pp, dp: None, kind, micro, virtual_stages, tied: false, clip: false, device })?;
        }
    }
    Ok(())
}

dist_test!(cpu_and_cuda every_schedule_on_2_stages_equals_one_process, every_schedule_on_2_stages_equals_one_process_cuda, 2, |world, device| {
    every_schedule(&world.group, device)
});

dist_test!(every_schedule_on_4_stages_equals_one_process, 4, |world| { every_schedule(&world.group, Device::Cpu) });

dist_test!(pp_by_dp_on_4_ranks_equals_one_process, 4, |world| {
    let mesh = ParallelDims { pp: 2, dp: 2, sp: 1, tp: 1 }.build(&world.group)?;
    let (pp, dp) = (mesh.group("pp").unwrap(), mesh.group("dp").unwrap());
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
        train_and_compare(Run {
            pp,
            dp: Some(dp),
            kind,
            micro: 2,
            virtual_stages: 1,
            tied: false,
            clip: true,
            device: Device::Cpu,
        })?;
    }
    Ok(())
});

dist_test!(tied_parameters_sum_their_gradients_across_stages, 2, |world| {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
        train_and_compare(Run {
            pp: &world.group,
            dp: None,
            kind,
            micro: 2,
            virtual_stages: 1,
            tied: true,
            clip: true,
            device: Device::Cpu,
        })?;
    }
    Ok(())
});

// Measuring a pipeline: every action is counted once, the timed parts are disjoint pieces of
// the step's wall time that cover nearly all of it (the rest is the runtime's bookkeeping),
// the last stage waits for its inputs, and the measured means feed the simulator. Wider
// layers than the equivalence tests', so that a pass takes about a millisecond and the
// bookkeeping stays a small share.
dist_test!(measured_steps_account_for_their_wall_time, 2, |world| {
    const WIDE: i64 = 256;
    const ROWS: i64 = 32;
    let pp = &world.group;
    let (p, rank) = (pp.size(), pp.rank());
    let wide = || -> Vec<Box<dyn Layer>> {
        (0..4)
            .map(|i| {
                let w = (seeded(300 + i, &[WIDE, WIDE]) / (WIDE as f64).sqrt()).set_requires_grad(true);
                Box::new(FnLayer::new(vec![Param::new(format!("w{i}"), &w)], |x: &Tensor, p: &[Param]| {
                    Ok(x.f_matmul(&p[0].tensor)?.f_tanh()?)
                })) as Box<dyn Layer>
            })
            .collect()
    };
    for (kind, micro) in [(ScheduleKind::GPipe, 4), (ScheduleKind::ZeroBubbleH1, 4)] {
        let schedule = Schedule::new(kind, p, micro, 1)?;
        let sends = schedule.actions[rank]
            .iter()
            .filter(|a| matches!(a, Action::SendActivation(_) | Action::SendGrad(_)))
            .count();
        let chunks = assign(wide(), &split(&wide(), p, Balance::Count)?, rank, p)?;
        let mut pipe = Pipeline::new(pp, chunks, schedule.clone(), Device::Cpu)?;
        let inputs: Vec<Tensor> = (0..micro as i64).map(|i| seeded(400 + i, &[ROWS, WIDE])).collect();
        let mut loss = |_: usize, out: &Tensor| -> engine::Result<Tensor> { Ok(out.f_square()?.f_mean(Kind::Float)?) };
        pipe.step(&inputs, &mut loss)?;
        assert!(pipe.last_stats().is_none(), "an unmeasured step has no stats");
        pipe.measure(true);
        let mut total = StepStats::default();
        for _ in 0..3 {
            pipe.step(&inputs, &mut loss)?;
            total.accumulate(pipe.last_stats().expect("a measured step has stats"));
        }
        let what = format!("{} rank {rank}", kind.name());
        let weights = if kind == ScheduleKind::ZeroBubbleH1 { micro } else { 0 };
        assert_eq!(
            (total.steps, total.forward.count, total.backward.count, total.weight.count, total.posting.count),
            (3, 3 * micro, 3 * micro, 3 * weights, 3 * sends),
            "{what}: actions counted"
        );
        let covered = total.compute() + total.posting.seconds + total.waiting;
        assert!(covered <= total.wall * (1.0 + 1e-9), "{what}: parts {covered} s exceed the wall {} s", total.wall);
        assert!(covered >= 0.9 * total.wall, "{what}: parts {covered} s cover under 90% of the wall {} s", total.wall);
        assert!(total.forward.mean() > 0.0 && total.backward.mean() > 0.0, "{what}: {total:?}");
        if rank == p - 1 {
            assert!(total.waiting > 0.0, "{what}: the last stage never waited for an activation");
        }
        // Every rank's measured costs, gathered, drive the simulator to a bubble between 0 and 1.
        let hop = pipe.hop_time(&inputs[0], 5)?;
        assert!(hop > 0.0, "{what}: hop time {hop}");
        let c = total.costs(hop);
        let mine = Tensor::from_slice(&[c.forward, c.input_grad, c.weight_grad]);
        let all = pp.all_gather(&mine)?.view([p as i64, 3]);
        let costs: Vec<_> = (0..p as i64)
            .map(|r| Costs {
                forward: all.double_value(&[r, 0]),
                input_grad: all.double_value(&[r, 1]),
                weight_grad: all.double_value(&[r, 2]),
                hop,
            })
            .collect();
        let sim = simulate_ranks(&schedule, &costs)?;
        assert!(sim.bubble > 0.0 && sim.bubble < 1.0, "{what}: simulated {sim}");
        pipe.measure(false);
        assert!(pipe.last_stats().is_none(), "{what}: stats stay after measuring stopped");
    }
    Ok(())
});

/// The fault tests' pipeline: this rank's stage of the untied model on 2 stages under 1F1B,
/// with batch 0 cut into 2 micro-batches of 6, and its targets.
fn two_stages_1f1b(world: &engine::dist::World) -> engine::Result<(Pipeline, Vec<Tensor>, Tensor)> {
    let model = layers(false, Device::Cpu);
    let chunks = assign(model, &split(&layers(false, Device::Cpu), 2, Balance::Count)?, world.rank(), 2)?;
    let pipe = Pipeline::new(&world.group, chunks, Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1)?, Device::Cpu)?;
    let (x, y) = batch(0, Device::Cpu);
    Ok((pipe, vec![x.narrow(0, 0, 6), x.narrow(0, 6, 6)], y))
}

#[test]
fn a_failing_stage_ends_the_job_naming_its_rank() {
    let start = Instant::now();
    let test = test_name(module_path!(), "a_failing_stage_ends_the_job_naming_its_rank");
    let result = run_job(2, &test, &[(engine::dist::launch::TIMEOUT_ENV, "4")], |world| {
        let (mut pipe, inputs, y) = two_stages_1f1b(world)?;
        for step in 0..3 {
            // The last stage's loss fails at the second step; the first stage is then waiting
            // for a gradient that never comes.
            let mut loss_of = |i: usize, out: &Tensor| -> engine::Result<Tensor> {
                match step {
                    1 => Err(engine::Error::invalid("the loss went wrong on purpose")),
                    _ => Ok(mse(out, &y.narrow(0, 6 * i as i64, 6))),
                }
            };
            pipe.step(&inputs, &mut loss_of)?;
        }
        Ok(())
    });
    let err = result.expect_err("the job must fail").to_string();
    assert!(err.contains("rank 1 failed"), "{err}");
    assert!(err.contains("pipeline rank 1 (stage 1): F(micro 0, chunk 0): the loss went wrong on purpose"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
}

#[test]
fn a_hanging_stage_ends_the_job_within_the_timeout_naming_the_ranks() {
    const HANG: Duration = Duration::from_secs(300);
    let start = Instant::now();
    let test = test_name(module_path!(), "a_hanging_stage_ends_the_job_within_the_timeout_naming_the_ranks");
    let result = run_job(2, &test, &[(engine::dist::launch::TIMEOUT_ENV, "4")], |world| {
        let (mut pipe, inputs, y) = two_stages_1f1b(world)?;
        for step in 0..3 {
            // At the second step the last stage blocks (a stuck kernel, a dead file system)
            // far longer than the 4-second collective timeout; the first stage is left waiting
            // for a gradient.
            let mut loss_of = |i: usize, out: &Tensor| -> engine::Result<Tensor> {
                if step == 1 {
                    std::thread::sleep(HANG);
                }
                Ok(mse(out, &y.narrow(0, 6 * i as i64, 6)))
            };
            pipe.step(&inputs, &mut loss_of)?;
        }
        Ok(())
    });
    let err = result.expect_err("the job must fail").to_string();
    // The waiting rank's receive times out naming itself, its stage and the action; the
    // launcher then ends the hanging rank instead of waiting for it.
    assert!(err.contains("rank 0 failed"), "{err}");
    assert!(err.contains("pipeline rank 0 (stage 0): B(micro 0, chunk 0)"), "{err}");
    assert!(start.elapsed() < HANG / 5, "took {:?}", start.elapsed());
}
