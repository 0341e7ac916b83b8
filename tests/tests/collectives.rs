//! Every process-group operation and its async form, on 2 and 4 ranks, against values worked
//! out by hand.
use engine::dist::{ProcessGroup, ReduceOp, World};
use suite_tests::{dist_test, TestResult};
use tch::{Device, Kind, Tensor};

fn t(values: &[f32], device: Device) -> Tensor {
    Tensor::from_slice(values).to_device(device)
}

fn values(x: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(x.to_device(Device::Cpu).to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

fn check_all_reduce(g: &ProcessGroup, dev: Device) -> TestResult {
    let (r, n) = (g.rank() as f32 + 1.0, g.size() as f32);
    let tri = n * (n + 1.0) / 2.0;
    let factorial: f32 = (1..=g.size()).map(|i| i as f32).product();
    for (op, want) in [
        (ReduceOp::Sum, [tri, 2.0 * tri]),
        (ReduceOp::Avg, [tri / n, 2.0 * tri / n]),
        (ReduceOp::Max, [n, 2.0 * n]),
        (ReduceOp::Min, [1.0, 2.0]),
        (ReduceOp::Product, [factorial, factorial * 2f32.powf(n)]),
    ] {
        let x = t(&[r, 2.0 * r], dev);
        g.all_reduce(&x, op)?;
        assert_eq!(values(&x), want, "all_reduce {op:?}");
        let y = t(&[r, 2.0 * r], dev);
        let work = g.all_reduce_async(&y, op)?;
        work.wait()?;
        assert_eq!(values(&y), want, "all_reduce_async {op:?}");
    }
    // A non-contiguous tensor is reduced through a contiguous copy and written back.
    let base = Tensor::arange(6, (Kind::Float, dev)).view([2, 3]) + g.rank() as f64;
    let tr = base.tr();
    g.all_reduce(&tr, ReduceOp::Sum)?;
    let shift = (g.size() * (g.size() - 1) / 2) as f32;
    let want: Vec<f32> = [0., 3., 1., 4., 2., 5.].iter().map(|v| v * n + shift).collect();
    assert_eq!(values(&tr), want, "all_reduce of a transposed tensor");
    Ok(())
}

fn check_broadcast_and_gather(g: &ProcessGroup, dev: Device) -> TestResult {
    let (rank, n) = (g.rank(), g.size());
    let root = n - 1;
    // reduce: only the root's result is specified.
    let x = t(&[rank as f32 + 1.0, 1.0], dev);
    g.reduce(&x, root, ReduceOp::Sum)?;
    let y = t(&[rank as f32 + 1.0, 1.0], dev);
    g.reduce_async(&y, 0, ReduceOp::Avg)?.wait()?;
    if rank == root {
        assert_eq!(values(&x), vec![(n * (n + 1) / 2) as f32, n as f32], "reduce");
    }
    if rank == 0 {
        assert_eq!(values(&y), vec![(n + 1) as f32 / 2.0, 1.0], "reduce_async avg");
    }
    let x = t(&[rank as f32; 3], dev);
    g.broadcast(&x, root)?;
    assert_eq!(values(&x), vec![root as f32; 3], "broadcast");
    let y = t(&[rank as f32; 3], dev);
    g.broadcast_async(&y, 0)?.wait()?;
    assert_eq!(values(&y), vec![0.0; 3], "broadcast_async");

    let row = t(&[rank as f32, 10.0 * rank as f32], dev).view([1, 2]);
    let want: Vec<f32> = (0..n).flat_map(|r| [r as f32, 10.0 * r as f32]).collect();
    assert_eq!(g.all_gather(&row)?.size(), vec![n as i64, 2]);
    assert_eq!(values(&g.all_gather(&row)?), want, "all_gather");
    let (out, work) = g.all_gather_async(&row)?;
    work.wait()?;
    assert_eq!(values(&out), want, "all_gather_async");
    let into = Tensor::zeros([n as i64, 2], (Kind::Float, dev));
    g.all_gather_into_async(&into, &row)?.wait()?;
    assert_eq!(values(&into), want, "all_gather_into_async");
    let list = g.all_gather_list(&row)?;
    let (async_list, work) = g.all_gather_list_async(&row)?;
    work.wait()?;
    assert_eq!(list.len(), n);
    for (r, (piece, async_piece)) in list.iter().zip(&async_list).enumerate() {
        assert_eq!(values(piece), vec![r as f32, 10.0 * r as f32], "all_gather_list[{r}]");
        assert_eq!(values(async_piece), vec![r as f32, 10.0 * r as f32], "all_gather_list_async[{r}]");
    }
    Ok(())
}

fn check_reduce_scatter(g: &ProcessGroup, dev: Device) -> TestResult {
    let (rank, n) = (g.rank() as i64, g.size() as i64);
    // Rank s contributes rows i + s (i = 0..2n); rank r receives block r summed over s.
    let input = (Tensor::arange(2 * n, (Kind::Float, dev)) + rank as f64).view([n, 2]);
    let shift = (n * (n - 1) / 2) as f32;
    let want = vec![(2 * rank) as f32 * n as f32 + shift, (2 * rank + 1) as f32 * n as f32 + shift];
    assert_eq!(values(&g.reduce_scatter(&input, ReduceOp::Sum)?), want, "reduce_scatter");
    let (out, work) = g.reduce_scatter_async(&input, ReduceOp::Avg)?;
    work.wait()?;
    let avg: Vec<f32> = want.iter().map(|v| v / n as f32).collect();
    assert_eq!(values(&out), avg, "reduce_scatter_async avg");
    Ok(())
}

fn check_all_to_all(g: &ProcessGroup, dev: Device) -> TestResult {
    let (rank, n) = (g.rank(), g.size());
    // Row j of rank r holds 10 r + j and goes to rank j.
    let rows: Vec<f32> = (0..n).map(|j| (10 * rank + j) as f32).collect();
    let want: Vec<f32> = (0..n).map(|j| (10 * j + rank) as f32).collect();
    let x = t(&rows, dev).view([n as i64, 1]);
    assert_eq!(values(&g.all_to_all(&x)?), want, "all_to_all");
    let (out, work) = g.all_to_all_async(&x)?;
    work.wait()?;
    assert_eq!(values(&out), want, "all_to_all_async");
    let into = Tensor::zeros([n as i64, 1], (Kind::Float, dev));
    let splits = vec![1i64; n];
    g.all_to_all_into_async(&into, &x, &splits, &splits)?.wait()?;
    assert_eq!(values(&into), want, "all_to_all_into_async");

    // Uneven: rank r sends j + 1 rows of value 100 r + j to rank j, so it receives r + 1 rows
    // of value 100 j + r from every rank j.
    let in_splits: Vec<i64> = (0..n as i64).map(|j| j + 1).collect();
    let out_splits = vec![rank as i64 + 1; n];
    let sent: Vec<f32> = (0..n).flat_map(|j| vec![(100 * rank + j) as f32; j + 1]).collect();
    let want: Vec<f32> = (0..n).flat_map(|j| vec![(100 * j + rank) as f32; rank + 1]).collect();
    let x = t(&sent, dev).view([-1, 1]);
    assert_eq!(values(&g.all_to_all_uneven(&x, &in_splits, &out_splits)?), want, "uneven all_to_all");
    let (out, work) = g.all_to_all_uneven_async(&x, &in_splits, &out_splits)?;
    work.wait()?;
    assert_eq!(values(&out), want, "uneven all_to_all_async");
    Ok(())
}

fn check_send_recv_barrier(g: &ProcessGroup, dev: Device) -> TestResult {
    let (rank, n) = (g.rank(), g.size());
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    // A ring, both directions in flight at once.
    let out = t(&[rank as f32, -(rank as f32)], dev);
    let inbox = Tensor::zeros([2], (Kind::Float, dev));
    let send = g.send_async(&out, next, 7)?;
    let recv = g.recv_async(&inbox, prev, 7)?;
    send.wait()?;
    recv.wait()?;
    assert_eq!(values(&inbox), vec![prev as f32, -(prev as f32)], "ring send/recv");
    // Blocking form: even ranks send first, odd ranks receive first.
    let box2 = Tensor::zeros([1], (Kind::Float, dev));
    if rank % 2 == 0 {
        g.send(&t(&[rank as f32], dev), next, 8)?;
        g.recv(&box2, prev, 8)?;
    } else {
        g.recv(&box2, prev, 8)?;
        g.send(&t(&[rank as f32], dev), next, 8)?;
    }
    assert_eq!(values(&box2), vec![prev as f32], "blocking send/recv");
    g.barrier()?;
    // is_completed turns true without blocking once every rank has arrived.
    let work = g.barrier_async()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !work.is_completed()? {
        assert!(std::time::Instant::now() < deadline, "barrier_async never completed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    work.wait()?;
    Ok(())
}

fn check_everything(world: &World, dev: Device) -> TestResult {
    let g = &world.group;
    check_all_reduce(g, dev)?;
    check_broadcast_and_gather(g, dev)?;
    check_reduce_scatter(g, dev)?;
    check_all_to_all(g, dev)?;
    if g.size() > 1 {
        check_send_recv_barrier(g, dev)?;
    }
    Ok(())
}

dist_test!(cpu_and_cuda every_collective_on_2_ranks, every_collective_on_2_ranks_cuda, 2, |world, dev| {
    check_everything(world, dev)
});

dist_test!(cpu_and_cuda every_collective_on_4_ranks, every_collective_on_4_ranks_cuda, 4, |world, dev| {
    check_everything(world, dev)
});

dist_test!(cpu_and_cuda one_rank_collectives_are_local, one_rank_collectives_are_local_cuda, 1, |world, dev| {
    check_everything(world, dev)
});

// The group's byte counter, by the conventions in `dist::group`'s docs: an all-reduce counts
// its tensor, an all-gather its gathered output, a barrier nothing; a sub-group's collectives
// count in its own counter and in its parent's.
dist_test!(process_group_counts_the_bytes_it_communicates, 2, |world| {
    let g = &world.group;
    g.reset_bytes_communicated();
    g.all_reduce(&Tensor::ones([2, 3], (Kind::Float, Device::Cpu)), ReduceOp::Sum)?;
    assert_eq!(g.bytes_communicated(), 6 * 4, "all_reduce of 6 fp32 elements");
    assert_eq!(g.all_gather(&Tensor::ones([5], (Kind::Double, Device::Cpu)))?.size(), [10]);
    g.barrier()?;
    assert_eq!(g.bytes_communicated(), 6 * 4 + 2 * 5 * 8, "plus the all-gathered output of 2 x 5 fp64");
    let pair = g.subgroup(&[1, 0], "pair")?.expect("both ranks are members");
    pair.all_reduce(&Tensor::ones([1], (Kind::Float, Device::Cpu)), ReduceOp::Sum)?;
    assert_eq!((pair.bytes_communicated(), g.bytes_communicated()), (4, 6 * 4 + 80 + 4), "sub-group and parent");
    g.reset_bytes_communicated();
    assert_eq!((pair.bytes_communicated(), g.bytes_communicated()), (4, 0), "a reset leaves the sub-group's counter");
    Ok(())
});
