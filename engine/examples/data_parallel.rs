//! Data-parallel training of a small regression network on N local ranks, checked step by
//! step against the same training in one process.
//!
//! Each rank computes gradients on its shard of the global batch; a gradient hook on every
//! parameter launches an asynchronous all-reduce (average) the moment that parameter's
//! gradient is ready, so communication overlaps the rest of backward. Rank 0 also trains a
//! copy of the model on the whole batch in-process and prints how far the two drift apart.
//!
//! `cargo run --release -p engine --example data_parallel -- --nproc 2`
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use engine::autograd::register_post_accumulate_grad_hook;
use engine::dist::{self, InitOptions, ProcessGroup, ReduceOp, Work};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser, Debug)]
#[command(about = "Data-parallel training demo of the engine, checked against one process")]
struct Args {
    /// Local ranks to spawn.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Training steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Global batch size (split evenly over the ranks).
    #[arg(long, default_value_t = 256)]
    batch: i64,
    /// Learning rate of plain SGD.
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
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

fn sgd(vs: &nn::VarStore, lr: f64) {
    tch::no_grad(|| {
        for mut p in vs.trainable_variables() {
            let g = p.grad();
            p -= g * lr;
            p.zero_grad();
        }
    });
}

/// Hooks that average each gradient over the group as soon as it is accumulated.
fn sync_gradients(vs: &nn::VarStore, group: &ProcessGroup) -> anyhow::Result<Arc<Mutex<Vec<Work>>>> {
    let in_flight = Arc::new(Mutex::new(Vec::new()));
    for p in vs.trainable_variables() {
        let (group, in_flight) = (group.clone(), in_flight.clone());
        register_post_accumulate_grad_hook(&p, move |t| {
            let work = group.all_reduce_async(&t.grad(), ReduceOp::Avg)?;
            in_flight.lock().expect("hook state").push(work);
            Ok(())
        })?;
    }
    Ok(in_flight)
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
    if dist::maybe_relaunch(args.nproc)? {
        return Ok(());
    }
    let world =
        dist::init(&InitOptions { timeout: Duration::from_secs_f64(args.timeout) }).context("joining the job")?;
    let (rank, n) = (world.rank(), world.size());
    let group = &world.group;

    tch::manual_seed(rank as i64); // different on purpose: the broadcast below makes them equal
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs.root());
    // Every rank must issue the same collectives in the same order: sort by name (the
    // variable map's own order differs from process to process).
    let mut params: Vec<_> = vs.variables().into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, p) in &params {
        group.broadcast(p, 0)?;
    }
    let in_flight = sync_gradients(&vs, group)?;

    // Rank 0's single-process reference, starting from the same parameters.
    let reference = (rank == 0).then(|| {
        let mut rvs = nn::VarStore::new(Device::Cpu);
        let rnet = model(&rvs.root());
        rvs.copy(&vs).expect("same architecture");
        (rvs, rnet)
    });

    let shard = args.batch / n as i64;
    let start = Instant::now();
    let mut worst = 0.0f64;
    for step in 0..args.steps {
        let (x, y) = batch(step, args.batch);
        let (xs, ys) = (x.narrow(0, rank as i64 * shard, shard), y.narrow(0, rank as i64 * shard, shard));
        let loss = net.forward(&xs).mse_loss(&ys, tch::Reduction::Mean);
        engine::autograd::backward(&[&loss], &[None], false)?;
        for work in in_flight.lock().expect("hook state").drain(..) {
            work.wait()?;
        }
        sgd(&vs, args.lr);
        let global_loss = loss.detach().copy();
        group.all_reduce(&global_loss, ReduceOp::Avg)?;

        if let Some((rvs, rnet)) = &reference {
            let rloss = rnet.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            rloss.backward();
            sgd(rvs, args.lr);
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
            "{n} ranks x {shard} samples, {} steps in {:.2} s; largest parameter difference from one-process training: {worst:.2e}",
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
