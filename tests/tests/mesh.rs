//! Device meshes on 4 ranks: each axis's group holds the ranks the layout says, and
//! collectives on one axis leave the others alone.
use engine::dist::{DeviceMesh, ParallelDims, ReduceOp};
use suite_tests::dist_test;
use tch::{Device, Kind, Tensor};

dist_test!(dp_by_tp_mesh_groups, 4, |world| {
    let rank = world.rank();
    let mesh = ParallelDims { pp: 1, dp: 2, sp: 1, tp: 2 }.build(&world.group)?;
    // tp varies fastest: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}.
    let tp = mesh.group("tp").unwrap();
    let dp = mesh.group("dp").unwrap();
    assert_eq!(tp.global_ranks(), &[rank / 2 * 2, rank / 2 * 2 + 1]);
    assert_eq!(dp.global_ranks(), &[rank % 2, rank % 2 + 2]);
    assert_eq!((mesh.coord("dp"), mesh.coord("tp"), mesh.size("pp")), (Some(rank / 2), Some(rank % 2), Some(1)));
    assert_eq!(mesh.group("pp").unwrap().size(), 1);
    let x = Tensor::from_slice(&[rank as f32]).to_device(Device::Cpu);
    tp.all_reduce(&x, ReduceOp::Sum)?;
    assert_eq!(x.double_value(&[0]), ((rank / 2 * 2) * 2 + 1) as f64, "sum over the tp pair");
    let y = Tensor::from_slice(&[rank as f32]);
    dp.all_reduce(&y, ReduceOp::Sum)?;
    assert_eq!(y.double_value(&[0]), (2 * (rank % 2) + 2) as f64, "sum over the dp pair");
    let _ = Kind::Float;
    Ok(())
});

dist_test!(three_axis_mesh_on_4_ranks, 4, |world| {
    let mesh = DeviceMesh::new(&world.group, &[("pp", 2), ("dp", 1), ("tp", 2)])?;
    let pp = mesh.group("pp").unwrap();
    assert_eq!(pp.global_ranks(), &[world.rank() % 2, world.rank() % 2 + 2]);
    // Pipeline neighbours exchange activations point to point.
    let stage = mesh.coord("pp").unwrap();
    let act = Tensor::from_slice(&[world.rank() as f32]);
    if stage == 0 {
        pp.send(&act, 1, 0)?;
    } else {
        let inbox = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        pp.recv(&inbox, 0, 0)?;
        assert_eq!(inbox.double_value(&[0]), (world.rank() - 2) as f64);
    }
    Ok(())
});

// Every rank builds a mesh and drops it at once, as a job does when every rank reaches the same
// configuration error right after building its groups. A rank that finishes connecting first
// must not close its sockets while a slower member is still in Gloo's handshake with it
// (that failed CI once as "Connection closed by peer" on the slower rank).
dist_test!(meshes_dropped_right_after_creation_never_break_a_slower_member, 4, |world| {
    for round in 0..40 {
        let mesh = DeviceMesh::new(&world.group, &[("row", 2), ("col", 2)]);
        mesh.map_err(|e| anyhow::anyhow!("round {round}: {e}"))?;
    }
    Ok(())
});
