//! Data-parallel training of a small regression network on N local ranks, checked step by
//! step against the same training in one process.
//!
//! Each rank computes gradients on its shard of the global batch; `DataParallel` buckets the
//! gradients and launches each bucket's all-reduce from gradient hooks the moment it is full,
//! so communication overlaps the rest of backward; LAMB then steps every replica alike. Rank 0
//! also trains a copy of the model on the whole batch in-process and prints how far the two
//! drift apart.
//!
//! `cargo run --release -p engine --example data_parallel -- --nproc 2`
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use engine::dist::{self, InitOptions, ReduceOp};
use engine::optim::{params_of, Lamb, LambConfig, Optimizer};
use engine::parallel::{DataParallel, DataParallelConfig};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser, Debug)]
#[command(about = "Data-parallel training demo of the engine, checked against one process")]
struct Args {
    /// Local ranks to spawn.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Training steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Global batch size (split evenly over the ranks).
    #[arg(long, default_value_t = 256)]
    batch: i64,
    /// Learning rate of LAMB.
    #[arg(long, default_value_t = 0.02)]
    lr: f64,
    /// Gradient bucket size in bytes (small, so that this small model has several buckets).
    #[arg(long, default_value_t = 4096)]
    bucket_bytes: usize,
    /// Rendezvous and collective timeout, seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
}

fn model(vs: &nn::Path) -> impl Module {
    nn::seq().add(nn::linear(vs / "fc1", 16, 64, Default::default())).add_fn(|x| x.tanh()).add(nn::linear(
        vs / "fc2",
        64,
        1,
        Default::default(),
    ))
}

/// The fixed global batch of step `step`: y = sin(x . a) + noise.
fn batch(step: usize, size: i64) -> (Tensor, Tensor) {
    tch::manual_seed(1000 + step as i64);
    let x = Tensor::randn([size, 16], (Kind::Float, Device::Cpu));
    let a = Tensor::linspace(-1.0, 1.0, 16, (Kind::Float, Device::Cpu));
    let y = x.matmul(&a).sin().unsqueeze(1) + Tensor::randn([size, 1], (Kind::Float, Device::Cpu)) * 0.05;
    (x, y)
}

fn lamb(vs: &nn::VarStore, lr: f64) -> Lamb {
    Lamb::new(params_of(vs), LambConfig { lr, ..LambConfig::default() })
}

fn max_difference(a: &nn::VarStore, b: &nn::VarStore) -> f64 {
    let (a, b) = (a.variables(), b.variables());
    a.iter().map(|(k, v)| (v - &b[k]).abs().max().double_value(&[])).fold(0.0, f64::max)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.nproc == 0 || args.batch % args.nproc as i64 != 0 {
        bail!("--batch {} must split evenly over --nproc {}", args.batch, args.nproc);
    }
    if dist::maybe_relaunch(args.nproc, Duration::from_secs_f64(args.timeout))? {
        return Ok(());
    }
    let world =
        dist::init(&InitOptions { timeout: Duration::from_secs_f64(args.timeout) }).context("joining the job")?;
    let (rank, n) = (world.rank(), world.size());
    let group = &world.group;

    tch::manual_seed(rank as i64); // different on purpose: DataParallel broadcasts rank 0's
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs.root());
    let mut opt = lamb(&vs, args.lr);
    let ddp = DataParallel::new(
        opt.params(),
        group,
        DataParallelConfig { bucket_bytes: args.bucket_bytes, ..Default::default() },
    )?;

    // Rank 0's single-process reference, starting from the same parameters.
    let mut reference = (rank == 0).then(|| {
        let mut rvs = nn::VarStore::new(Device::Cpu);
        let rnet = model(&rvs.root());
        rvs.copy(&vs).expect("same architecture");
        let ropt = lamb(&rvs, args.lr);
        (rvs, rnet, ropt)
    });

    let shard = args.batch / n as i64;
    let start = Instant::now();
    let mut worst = 0.0f64;
    for step in 0..args.steps {
        let (x, y) = batch(step, args.batch);
        let (xs, ys) = (x.narrow(0, rank as i64 * shard, shard), y.narrow(0, rank as i64 * shard, shard));
        opt.zero_grad();
        let loss = net.forward(&xs).mse_loss(&ys, tch::Reduction::Mean);
        engine::autograd::backward(&[&loss], &[None], false)?;
        ddp.finish_gradients()?;
        opt.step()?;
        let global_loss = loss.detach().copy();
        group.all_reduce(&global_loss, ReduceOp::Avg)?;

        if let Some((rvs, rnet, ropt)) = &mut reference {
            ropt.zero_grad();
            let rloss = rnet.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            rloss.backward();
            ropt.step()?;
            let diff = max_difference(&vs, rvs);
            worst = worst.max(diff);
            println!(
                "step {step:>3}  loss {:.5}  (one process: {:.5})  max |param difference| {diff:.2e}",
                global_loss.double_value(&[]),
                rloss.double_value(&[])
            );
        }
    }
    if rank == 0 {
        println!(
            "{n} ranks x {shard} samples, {} gradient buckets, {} steps in {:.2} s; largest parameter difference from one-process training: {worst:.2e}",
            ddp.bucket_count()?,
            args.steps,
            start.elapsed().as_secs_f64()
        );
        if worst > 1e-5 {
            bail!("data-parallel training drifted from the one-process reference by {worst:.2e} (> 1e-5)");
        }
    }
    group.barrier()?;
    Ok(())
}
