//! Differentiable collectives on 2 and 4 ranks: forward values and gradients of a small
//! computation equal the same computation done in one process (fp32, relative error of the
//! whole tensor below 1e-6, elementwise within 1e-5 of the largest value).
use engine::autograd::collectives::{
    all_gather, all_gather_async, all_to_all, all_to_all_async, copy_to_group, gather, gather_async, reduce_from_group,
    reduce_scatter, split,
};
use engine::dist::World;
use suite_tests::{dist_test, seeded, TestResult};
use tch::{Kind, Tensor};

/// Relative error ||a - e|| / ||e|| below 1e-6.
fn assert_matches(actual: &Tensor, expected: &Tensor, what: &str) {
    assert_eq!(actual.size(), expected.size(), "{what}: shapes differ");
    let err = (actual - expected).norm().double_value(&[]) / expected.norm().double_value(&[]).max(1e-30);
    assert!(err < 1e-6, "{what}: relative error {err:e}");
}

fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

fn block(t: &Tensor, dim: i64, rank: usize, n: usize) -> Tensor {
    let size = t.size()[dim as usize] / n as i64;
    t.narrow(dim, rank as i64 * size, size)
}

/// Megatron's tensor-parallel MLP: column-parallel then row-parallel linear layers.
fn copy_to_and_reduce_from(world: &World) -> TestResult {
    let (g, r, n) = (&world.group, world.rank(), world.size());
    let (x, w1, w2, c) =
        (seeded(1, &[3, 4]), seeded(2, &[4, 2 * n as i64]), seeded(3, &[2 * n as i64, 4]), seeded(4, &[3, 4]));
    // Reference in one process.
    let (xr, w1r, w2r) = (leaf(&x), leaf(&w1), leaf(&w2));
    let yr = xr.matmul(&w1r).relu().matmul(&w2r);
    (&yr * &c).sum(Kind::Float).backward();
    // Sharded: each rank holds a column block of w1 and the matching row block of w2.
    let (xs, w1s, w2s) = (leaf(&x), leaf(&block(&w1, 1, r, n)), leaf(&block(&w2, 0, r, n)));
    let h = copy_to_group(&xs, g)?.matmul(&w1s).relu();
    let y = reduce_from_group(&h.matmul(&w2s), g)?;
    (&y * &c).sum(Kind::Float).backward();
    assert_matches(&y, &yr, "output");
    assert_matches(&xs.grad(), &xr.grad(), "input gradient");
    assert_matches(&w1s.grad(), &block(&w1r.grad(), 1, r, n), "w1 gradient");
    assert_matches(&w2s.grad(), &block(&w2r.grad(), 0, r, n), "w2 gradient");
    Ok(())
}

/// all_gather (backward reduce-scatter) feeding a per-rank computation, and reduce_scatter
/// (backward all-gather), along dims 0 and 1.
fn all_gather_and_reduce_scatter(world: &World) -> TestResult {
    let (g, r, n) = (&world.group, world.rank(), world.size());
    for dim in [0i64, 1] {
        let shape = if dim == 0 { [2 * n as i64, 3] } else { [3, 2 * n as i64] };
        let x = seeded(10, &shape);
        let weights: Vec<Tensor> = (0..n).map(|k| seeded(20 + k as i64, &shape)).collect();
        // Reference: the total loss sums every rank's term.
        let xr = leaf(&x);
        weights
            .iter()
            .map(|w| (xr.tanh() * w).sum(Kind::Float))
            .fold(Tensor::zeros([], (Kind::Float, tch::Device::Cpu)), |a, b| a + b)
            .backward();
        let xs = leaf(&block(&x, dim, r, n));
        let z = all_gather(&xs, dim, g)?;
        assert_matches(&z, &x, "all_gather output");
        (z.tanh() * &weights[r]).sum(Kind::Float).backward();
        assert_matches(&xs.grad(), &block(&xr.grad(), dim, r, n), "all_gather gradient");

        // reduce_scatter: rank k contributes u_k; rank r keeps block r of the sum.
        let us: Vec<Tensor> = (0..n).map(|k| seeded(30 + k as i64, &shape)).collect();
        let d = seeded(40, &shape);
        let urs: Vec<Tensor> = us.iter().map(leaf).collect();
        let total = urs.iter().fold(Tensor::zeros(shape, (Kind::Float, tch::Device::Cpu)), |a, b| a + b);
        let u = leaf(&us[r]);
        let out = reduce_scatter(&u, dim, g)?;
        assert_matches(&out, &block(&total, dim, r, n), "reduce_scatter output");
        (&out * block(&d, dim, r, n)).sum(Kind::Float).backward();
        // Every rank's loss term reaches every u_k: d/du_k of sum_r <block_r(sum u), block_r(d)> = d.
        assert_matches(&u.grad(), &d, "reduce_scatter gradient");
    }
    Ok(())
}

/// split (backward gather) and gather (backward split) of a replicated tensor.
fn split_and_gather(world: &World) -> TestResult {
    let (g, r, n) = (&world.group, world.rank(), world.size());
    let (x, c) = (seeded(50, &[3, 2 * n as i64]), seeded(51, &[3, 2 * n as i64]));
    let xr = leaf(&x);
    (xr.sin() * &c).sum(Kind::Float).backward();
    // split: the replicated x is cut; each rank computes its block's share of the loss.
    let xs = leaf(&x);
    let y = split(&xs, 1, g)?;
    assert_matches(&y, &block(&x, 1, r, n), "split output");
    (y.sin() * block(&c, 1, r, n)).sum(Kind::Float).backward();
    assert_matches(&xs.grad(), &xr.grad(), "split gradient");
    // gather: the sharded x is made whole; every rank computes the whole (replicated) loss.
    for asynchronous in [false, true] {
        let xb = leaf(&block(&x, 1, r, n));
        let z = if asynchronous { gather_async(&xb, 1, g)?.wait()? } else { gather(&xb, 1, g)? };
        assert_matches(&z, &x, "gather output");
        (z.sin() * &c).sum(Kind::Float).backward();
        assert_matches(&xb.grad(), &block(&xr.grad(), 1, r, n), "gather gradient");
    }
    Ok(())
}

/// all_to_all from row blocks to column blocks, synchronous and with computation overlapped
/// between launch and wait, in forward and backward.
fn all_to_all_rows_to_columns(world: &World) -> TestResult {
    let (g, r, n) = (&world.group, world.rank(), world.size());
    let (x, c) = (seeded(60, &[2 * n as i64, 3 * n as i64]), seeded(61, &[2 * n as i64, 3 * n as i64]));
    let (v, cv) = (seeded(62, &[5]), seeded(63, &[5]));
    let (xr, vr) = (leaf(&x), leaf(&v));
    ((xr.sin() * &c).sum(Kind::Float) + (vr.exp() * &cv).sum(Kind::Float) * n as f64).backward();
    for asynchronous in [false, true] {
        let (xs, vs) = (leaf(&block(&x, 0, r, n)), leaf(&v));
        let (y, other) = if asynchronous {
            let pending = all_to_all_async(&xs, 1, 0, g)?;
            let other = (vs.exp() * &cv).sum(Kind::Float); // overlaps the communication
            (pending.wait()?, other)
        } else {
            (all_to_all(&xs, 1, 0, g)?, (vs.exp() * &cv).sum(Kind::Float))
        };
        assert_matches(&y, &block(&x, 1, r, n), "all_to_all output");
        ((y.sin() * block(&c, 1, r, n)).sum(Kind::Float) + other).backward();
        assert_matches(&xs.grad(), &block(&xr.grad(), 0, r, n), "all_to_all gradient");
        assert_matches(&vs.grad(), &(vr.grad() / n as f64), "overlapped computation's gradient");
    }
    // The async all-gather's gradient is reduce-scattered like the synchronous one.
    let xs = leaf(&block(&x, 0, r, n));
    let z = all_gather_async(&xs, 0, g)?.wait()?;
    (z.sin() * &c).sum(Kind::Float).backward();
    assert_matches(&xs.grad(), &block(&(x.cos() * &c * n as f64), 0, r, n), "async all_gather gradient");
    Ok(())
}

fn all(world: &World) -> TestResult {
    copy_to_and_reduce_from(world)?;
    all_gather_and_reduce_scatter(world)?;
    split_and_gather(world)?;
    all_to_all_rows_to_columns(world)
}

dist_test!(differentiable_collectives_match_one_process_on_2_ranks, 2, |world| { all(world) });
dist_test!(differentiable_collectives_match_one_process_on_4_ranks, 4, |world| { all(world) });
