//! Data parallelism against one process: the same global batch on 2 ranks gives the same
//! losses and parameters as one rank (fp32, relative 1e-5), with gradient accumulation, small
//! and default bucket sizes, and parameters that get no gradient on some or all ranks.
use engine::dist::{ReduceOp, World};
use engine::optim::{clip_grad_norm, AdamW, AdamWConfig, Lamb, LambConfig, Optimizer, Param};
use engine::parallel::{parallelize, partition, DataParallel, DataParallelConfig, ParallelPlan, ZeroOptimizer};
use suite_tests::{dist_test, seeded, TestResult};
use tch::{Kind, Tensor};

const GLOBAL_BATCH: i64 = 16;
/// Small enough that most steps clip.
const MAX_NORM: f64 = 0.5;

/// Parameters of a small network, the same on every rank (seeded).
fn parameters() -> Vec<Param> {
    let names = [("b1", vec![8]), ("b2", vec![1]), ("extra", vec![8]), ("w1", vec![6, 8]), ("w2", vec![8, 1])];
    names
        .into_iter()
        .enumerate()
        .map(|(i, (n, shape))| Param::new(n, &(seeded(100 + i as i64, &shape) * 0.5).set_requires_grad(true)))
        .collect()
}

fn get<'a>(ps: &'a [Param], name: &str) -> &'a Tensor {
    &ps.iter().find(|p| p.name == name).unwrap().tensor
}

/// Per-sample squared error; `extra` scales the hidden layer only where `use_extra`.
fn per_sample_loss(ps: &[Param], x: &Tensor, y: &Tensor, use_extra: bool) -> Tensor {
    let h = (x.matmul(get(ps, "w1")) + get(ps, "b1")).tanh();
    // Not `*=`: an in-place change would break tanh's backward.
    let h = if use_extra { h * (get(ps, "extra") + 1.0) } else { h };
    let out = h.matmul(get(ps, "w2")) + get(ps, "b2");
    (out - y).square().sum_dim_intlist(1, false, Kind::Float)
}

fn batch(step: usize) -> (Tensor, Tensor) {
    (seeded(1000 + step as i64, &[GLOBAL_BATCH, 6]), seeded(2000 + step as i64, &[GLOBAL_BATCH, 1]))
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    AdamW,
    Lamb,
}

fn optimizer(kind: Opt, ps: Vec<Param>) -> Box<dyn Optimizer> {
    match kind {
        Opt::AdamW => Box::new(AdamW::new(ps, AdamWConfig { lr: 0.01, ..AdamWConfig::default() })),
        Opt::Lamb => Box::new(Lamb::new(ps, LambConfig { lr: 0.01, weight_decay: 0.1, ..LambConfig::default() })),
    }
}

/// How the run is laid out.
#[derive(Clone, Copy, Debug)]
struct Layout {
    bucket_bytes: usize,
    micro: i64,
    zero: u8,
    opt: Opt,
}

/// Whether rank `rank` uses `extra` at `step`: on even steps rank 0 only, never on steps that
/// are multiples of 3 (so it sometimes gets no gradient anywhere).
fn uses_extra(step: usize, rank: usize) -> bool {
    step.is_multiple_of(2) && !step.is_multiple_of(3) && rank == 0
}

fn assert_rel(a: &Tensor, e: &Tensor, what: &str) {
    let err = (a - e).norm().double_value(&[]) / e.norm().double_value(&[]).max(1e-12);
    assert!(err < 1e-5, "{what}: relative error {err:e}");
}

/// 20 steps: 2 ranks with `micro` micro-batches each (and ZeRO stage `zero`) against one
/// process on the whole batch.
fn train_and_compare(world: &World, layout: Layout) -> TestResult {
    let Layout { bucket_bytes, micro, zero, opt } = layout;
    let (rank, n) = (world.rank(), world.size());
    let shard = GLOBAL_BATCH / n as i64;
    let params = parameters();
    let owners = partition(&params, n);
    let cfg = DataParallelConfig { bucket_bytes, ..Default::default() };
    let ddp = match zero {
        2 => DataParallel::new_sharded(&params, &world.group, cfg, owners.clone())?,
        _ => DataParallel::new(&params, &world.group, cfg)?,
    };
    let mut dp_opt: Box<dyn Optimizer> = match zero {
        0 => optimizer(opt, params),
        _ => Box::new(ZeroOptimizer::new(params, owners.clone(), &world.group, |ps| optimizer(opt, ps))?),
    };
    let mut ref_opt = optimizer(opt, parameters());
    for step in 0..20 {
        let (x, y) = batch(step);
        // Data parallel: this rank's shard, in `micro` micro-batches.
        dp_opt.zero_grad();
        let micro_rows = shard / micro;
        let mut local = 0.0;
        for m in 0..micro {
            ddp.set_sync(m == micro - 1)?;
            let rows = rank as i64 * shard + m * micro_rows;
            let l = per_sample_loss(
                dp_opt.params(),
                &x.narrow(0, rows, micro_rows),
                &y.narrow(0, rows, micro_rows),
                uses_extra(step, rank),
            )
            .mean(Kind::Float)
                / micro as f64;
            engine::autograd::backward(&[&l], &[None], false)?;
            local += l.double_value(&[]);
        }
        ddp.finish_gradients()?;
        // Clipping sees the global norm: ZeRO-2's gradients are spread over the ranks.
        let norm = clip_grad_norm(dp_opt.params(), MAX_NORM, (zero == 2).then_some(&world.group))?;
        dp_opt.step()?;
        let loss = Tensor::from_slice(&[local as f32]);
        world.group.all_reduce(&loss, ReduceOp::Avg)?;

        // One process: every rank's samples, with the same use of `extra` per rank's rows.
        ref_opt.zero_grad();
        let per_sample: Vec<Tensor> = (0..n)
            .map(|r| {
                let rows = r as i64 * shard;
                per_sample_loss(
                    ref_opt.params(),
                    &x.narrow(0, rows, shard),
                    &y.narrow(0, rows, shard),
                    uses_extra(step, r),
                )
            })
            .collect();
        let ref_loss = Tensor::cat(&per_sample, 0).mean(Kind::Float);
        ref_loss.backward();
        let ref_norm = clip_grad_norm(ref_opt.params(), MAX_NORM, None)?;
        assert!((norm - ref_norm).abs() <= 1e-5 * ref_norm, "step {step}: gradient norm {norm} vs {ref_norm}");
        ref_opt.step()?;

        let (a, e) = (loss.double_value(&[0]), ref_loss.double_value(&[]));
        assert!((a - e).abs() <= 1e-5 * e.abs(), "step {step}: loss {a} vs {e}");
        for ((p, q), &owner) in dp_opt.params().iter().zip(ref_opt.params()).zip(&owners) {
            assert_rel(&p.tensor, &q.tensor, &format!("step {step}, parameter {}", p.name));
            if zero < 2 || owner == rank {
                assert_eq!(
                    p.tensor.grad().defined(),
                    q.tensor.grad().defined(),
                    "step {step}: {} has a gradient",
                    p.name
                );
            } else {
                assert!(
                    !p.tensor.grad().defined(),
                    "step {step}: ZeRO-2 keeps {}'s gradient only on its owner",
                    p.name
                );
            }
        }
    }
    Ok(())
}

const SMALL: Layout = Layout { bucket_bytes: 64, micro: 1, zero: 0, opt: Opt::AdamW };

dist_test!(data_parallel_matches_one_process_small_buckets, 2, |world| { train_and_compare(world, SMALL) });

dist_test!(data_parallel_matches_one_process_default_buckets, 2, |world| {
    train_and_compare(world, Layout { bucket_bytes: DataParallelConfig::default().bucket_bytes, ..SMALL })
});

dist_test!(accumulating_micro_batches_matches_one_batch, 2, |world| {
    train_and_compare(world, Layout { micro: 2, ..SMALL })
});

dist_test!(zero_1_and_2_match_one_process_with_adamw_and_lamb, 2, |world| {
    for zero in [1, 2] {
        for opt in [Opt::AdamW, Opt::Lamb] {
            train_and_compare(world, Layout { zero, opt, micro: 2, ..SMALL })?;
        }
    }
    train_and_compare(world, Layout { opt: Opt::Lamb, ..SMALL })
});

// A parameter used in two checkpointed segments reaches `.grad` once per recomputation: its
// bucket (alone in it) is reduced when the first part arrives, and the second part, which the
// reduced gradient would overwrite when backward ends, is refused by name instead of lost.
dist_test!(a_gradient_after_its_bucket_was_reduced_is_refused, 2, |world| {
    let w = Param::new("w", &seeded(7, &[4]).set_requires_grad(true));
    let cfg = DataParallelConfig { bucket_bytes: 1, ..Default::default() };
    let ddp = DataParallel::new(std::slice::from_ref(&w), &world.group, cfg)?;
    let times = |w: Tensor| move |ins: &[Tensor]| Ok(vec![&ins[0] * &w]);
    let x = seeded(8, &[4]).set_requires_grad(true);
    let once = engine::autograd::checkpoint(&[&x], times(w.tensor.shallow_clone()))?;
    let twice = engine::autograd::checkpoint(&[&once[0]], times(w.tensor.shallow_clone()))?;
    engine::autograd::backward(&[&twice[0].sum(Kind::Float)], &[None], false)?;
    let err = ddp.finish_gradients().unwrap_err().to_string();
    assert!(err.contains("w received more gradient after its bucket was reduced"), "{err}");
    Ok(())
});

dist_test!(zero_shards_optimizer_state_bytes, 2, |world| {
    // Eight equal parameters: each rank owns exactly half of them.
    let params = || {
        (0..8).map(|i| Param::new(format!("p{i}"), &seeded(i, &[16, 16]).set_requires_grad(true))).collect::<Vec<_>>()
    };
    let step = |opt: &mut dyn Optimizer| -> TestResult {
        for p in opt.params() {
            (&p.tensor * 1.0).sum(Kind::Float).backward();
        }
        opt.step()?;
        Ok(())
    };
    let mut full = optimizer(Opt::AdamW, params());
    step(full.as_mut())?;
    let ps = params();
    let owners = partition(&ps, world.size());
    let mut sharded = ZeroOptimizer::new(ps, owners, &world.group, |ps| optimizer(Opt::AdamW, ps))?;
    step(&mut sharded)?;
    assert_eq!(full.state_bytes(), 8 * 2 * 16 * 16 * 4, "AdamW keeps two fp32 moments per parameter");
    assert_eq!(sharded.state_bytes() * world.size(), full.state_bytes(), "each rank holds 1/N of the state");
    Ok(())
});

dist_test!(parameters_are_broadcast_from_rank_0, 2, |world| {
    let p = Tensor::full([3], world.rank() as f64, (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    let ddp = DataParallel::new(&[Param::new("p", &p)], &world.group, DataParallelConfig::default())?;
    assert_eq!(Vec::<f32>::try_from(&p)?, vec![0.0; 3]);
    assert_eq!(ddp.bucket_count()?, 1);
    Ok(())
});

/// A deep narrow network (64 layers of 16 x 16, 1 KiB each in fp32) so that 1 KiB buckets
/// are many and small beside the model, as 25 MiB buckets are beside a real one.
fn deep_layers(kind: Kind) -> Vec<Param> {
    (0..64)
        .map(|i| {
            let w = (seeded(500 + i, &[16, 16]) * 0.25).to_kind(kind).set_requires_grad(true);
            Param::new(format!("layer{i:02}.weight"), &w)
        })
        .collect()
}

fn deep_loss(ps: &[Param], x: &Tensor) -> Tensor {
    let h = ps.iter().fold(x.to_kind(ps[0].tensor.kind()), |h, p| h.matmul(&p.tensor).tanh());
    h.square().mean(Kind::Float)
}

/// What [`deep_run`] returns: the fp32 weights at the end (gathered), the gradient bytes at
/// the peak of the last backward, and the master bytes.
type DeepRun = (Vec<(String, Tensor)>, usize, usize);

/// One rank's 5 steps on its own batch under `plan`.
fn deep_run(world: &World, plan: ParallelPlan) -> anyhow::Result<DeepRun> {
    let mut par = parallelize(deep_layers(plan.compute), &world.group, &plan, |ps| {
        Box::new(AdamW::new(ps, AdamWConfig { lr: 0.01, ..AdamWConfig::default() }))
    })?;
    for step in 0..5 {
        let x = seeded(3000 + 10 * step + world.rank() as i64, &[4, 16]);
        par.backward(&deep_loss(par.model_params(), &x), true)?;
        // Clipping at a norm most steps exceed: the fused norm takes the sharded sum.
        par.step(0.01, Some(0.05))?;
    }
    let peak = par.gradient_bytes()?.peak;
    Ok((par.full_weights()?, peak, par.master_bytes()))
}

dist_test!(zero_2_holds_a_share_of_the_gradients_at_the_peak_of_backward, 2, |world| {
    let plan = |zero| ParallelPlan { zero, bucket_bytes: 1024, ..ParallelPlan::default() };
    let (replicated, peak0, _) = deep_run(world, plan(0))?;
    let (sharded, peak2, _) = deep_run(world, plan(2))?;
    let model: usize = 64 * 1024;
    // Every gradient, plus the buffers being all-reduced: at least the whole model.
    assert!(peak0 >= model, "ZeRO-0 peak {peak0} B below the model's {model} B of gradients");
    // This rank's 32 one-parameter buckets, the bucket being filled, the one being launched
    // and at most MAX_SENDING sends (each bucket carries one flag per member after its
    // gradients).
    let bound = (32 + engine::parallel::data::MAX_SENDING + 2) * (1024 + 4);
    assert!(peak2 <= bound, "ZeRO-2 peak {peak2} B above {bound} B ({:.2} of ZeRO-0's)", peak2 as f64 / peak0 as f64);
    eprintln!("rank {}: gradient bytes at the peak: ZeRO-0 {peak0}, ZeRO-2 {peak2}", world.rank());
    for ((name, a), (_, b)) in replicated.iter().zip(&sharded) {
        assert_rel(b, a, name);
    }
    Ok(())
});

dist_test!(sharded_masters_hold_a_share_and_step_like_replicated_ones, 2, |world| {
    for compute in [Kind::BFloat16, Kind::Half] {
        let plan = |zero| ParallelPlan { zero, compute, bucket_bytes: 4096, ..ParallelPlan::default() };
        let (replicated, _, all_masters) = deep_run(world, plan(0))?;
        assert_eq!(all_masters, 64 * 1024, "{compute:?}: ZeRO-0 keeps every fp32 master");
        for zero in [1, 2] {
            let (sharded, _, masters) = deep_run(world, plan(zero))?;
            // Balanced by bytes over 64 equal parameters: exactly half.
            assert_eq!(masters, 32 * 1024, "{compute:?} ZeRO-{zero}: master bytes on rank {}", world.rank());
            // The clipping norm is summed in another order (two shards), so the last bit of
            // a clip coefficient may differ, and a bf16/fp16 rounding with it.
            for ((name, a), (_, b)) in replicated.iter().zip(&sharded) {
                let err = (a - b).norm().double_value(&[]) / a.norm().double_value(&[]);
                assert!(err < 1e-3, "{compute:?} ZeRO-{zero}: {name} relative error {err:e}");
            }
        }
    }
    Ok(())
});

dist_test!(average_gradients_handles_gradients_missing_on_some_ranks, 2, |world| {
    // a: a gradient on both ranks; b: on rank 0 only; c: on no rank.
    let rank = world.rank() as f64;
    let [a, b, c] = [3, 2, 4].map(|n| Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true));
    let mut loss = (&a * (rank + 1.0)).sum(Kind::Float);
    if world.rank() == 0 {
        loss += (&b * 4.0).sum(Kind::Float);
    }
    loss.backward();
    let params = [Param::new("a", &a), Param::new("b", &b), Param::new("c", &c)];
    engine::parallel::average_gradients(&params, &world.group)?;
    assert_eq!(Vec::<f32>::try_from(a.grad())?, vec![1.5; 3], "(1 + 2) / 2");
    assert_eq!(Vec::<f32>::try_from(b.grad())?, vec![2.0; 2], "(4 + 0) / 2 on every rank");
    assert!(!c.grad().defined(), "no gradient anywhere stays none");
    Ok(())
});

dist_test!(fp16_gradients_whose_sum_overflows_average_as_their_mean, 2, |world| {
    // 40000 on each of 2 ranks: the sum (80000) is past fp16's largest value (65504), their
    // mean is not. Loss-scaled fp16 gradients sit near that edge, so each rank divides before
    // the sum (as PyTorch DDP's default hook does), through buckets and the one-call average.
    let fp16 = (Kind::Half, tch::Device::Cpu);
    let p = Tensor::zeros([4], fp16).set_requires_grad(true);
    let ddp = DataParallel::new(&[Param::new("p", &p)], &world.group, DataParallelConfig::default())?;
    (&p * 40000.0).sum(Kind::Half).backward();
    ddp.finish_gradients()?;
    assert_eq!(Vec::<f32>::try_from(p.grad().to_kind(Kind::Float))?, vec![40000.0; 4], "bucketed average");
    let q = Tensor::zeros([3], fp16).set_requires_grad(true);
    (&q * 40000.0).sum(Kind::Half).backward();
    engine::parallel::average_gradients(&[Param::new("q", &q)], &world.group)?;
    assert_eq!(Vec::<f32>::try_from(q.grad().to_kind(Kind::Float))?, vec![40000.0; 3], "one-call average");
    Ok(())
});
