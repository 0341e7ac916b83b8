//! Sequence-parallel attention on 2 and 4 ranks against one process: ring attention and
//! all-to-all (Ulysses) attention over sequence blocks equal the serial softmax attention on
//! the whole sequence, outputs and the gradients of q, k and v (fp32, within 1e-5 absolute
//! plus 1e-5 relative), without masks, causal, with boolean and additive key-padding masks
//! (including a query that sees no key at all). And the activation memory each rank holds
//! for backward, counted in bytes by the host allocator counter, falls as 1/sp.
use engine::dist::World;
use engine::host_memory;
use engine::parallel::sequence::{attention, ring_attention, ulysses_attention, AttentionMask, SequenceParallel};
use suite_tests::{assert_close, dist_test, seeded, settled_host_memory, TestResult};
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-5;

type Attention = fn(&Tensor, &Tensor, &Tensor, &AttentionMask, &SequenceParallel) -> engine::Result<Tensor>;

const METHODS: [(&str, Attention); 2] = [("ring", ring_attention), ("all-to-all", ulysses_attention)];

fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

fn block(t: &Tensor, dim: i64, rank: i64, n: i64) -> Tensor {
    let size = t.size()[dim as usize] / n;
    t.narrow(dim, rank * size, size)
}

/// The masks every method is checked under, over a whole sequence of `seq` for batch 2 (on
/// the CPU: the attention moves them to its device).
fn masks(seq: i64) -> Vec<(&'static str, AttentionMask)> {
    // Batch 0 pads the last quarter; batch 1 pads key 0 and every third key, so with
    // causality its query 0 sees no key (its output and gradients must be zero).
    let keep: Vec<bool> = (0..seq).map(|j| j < seq * 3 / 4).chain((0..seq).map(|j| j != 0 && j % 3 != 0)).collect();
    let keep = Tensor::from_slice(&keep).view([2, seq]);
    let additive = seeded(90, &[2, seq]) * 2.0;
    vec![
        ("no mask", AttentionMask::none()),
        ("causal", AttentionMask::causal()),
        ("boolean padding", AttentionMask { causal: false, key_padding: Some(keep.shallow_clone()) }),
        ("causal and boolean padding", AttentionMask { causal: true, key_padding: Some(keep) }),
        ("additive key bias", AttentionMask { causal: false, key_padding: Some(additive) }),
    ]
}

fn matches_serial(world: &World, dev: Device) -> TestResult {
    let (sp, r, n) = (SequenceParallel::new(world.group.clone()), world.rank() as i64, world.size() as i64);
    let (b, h, seq, d) = (2, 4, 3 * n, 8);
    let shape = [b, h, seq, d];
    let on = |seed| seeded(seed, &shape).to_device(dev);
    let (q, k, v, c) = (on(1), on(2), on(3), on(4));
    for (mask_name, mask) in masks(seq) {
        let (q1, k1, v1) = (leaf(&q), leaf(&k), leaf(&v));
        let want = attention(&q1, &k1, &v1, &mask)?;
        (&want * &c).sum(Kind::Float).backward();
        for (method, run) in METHODS {
            let what = |s: &str| format!("{method} attention, {mask_name}: {s}");
            let (qn, kn, vn) = (leaf(&block(&q, 2, r, n)), leaf(&block(&k, 2, r, n)), leaf(&block(&v, 2, r, n)));
            let out = run(&qn, &kn, &vn, &mask, &sp)?;
            assert_close(&out, &block(&want, 2, r, n), TOL, TOL, &what("output block"));
            // The ranks' losses add up to the one-process loss.
            (&out * block(&c, 2, r, n)).sum(Kind::Float).backward();
            for (name, got, whole) in [("q", &qn, &q1), ("k", &kn, &k1), ("v", &vn, &v1)] {
                assert_close(&got.grad(), &block(&whole.grad(), 2, r, n), TOL, TOL, &what(&format!("{name} gradient")));
            }
        }
    }
    // Heads that do not split over the group, and a mask that does not cover the sequence.
    let small = |seed| seeded(seed, &[1, 3, 2, 4]).to_device(dev);
    let (q3, k3, v3) = (small(5), small(6), small(7));
    let err = ulysses_attention(&q3, &k3, &v3, &AttentionMask::none(), &sp).unwrap_err().to_string();
    assert!(err.contains(&format!("3 heads do not divide by the sequence-parallel size {n}")), "{err}");
    let short = AttentionMask { causal: false, key_padding: Some(Tensor::ones([1, 2], (Kind::Bool, Device::Cpu))) };
    let err = ring_attention(&q3, &k3, &v3, &short, &sp).unwrap_err().to_string();
    assert!(err.contains(&format!("expected [batch 1, whole sequence {}]", 2 * n)), "{err}");
    // A sequence that does not split evenly: rank 0 holds one token more than the others.
    let s = if r == 0 { 3 } else { 2 };
    let x = seeded(8, &[1, n, s, 4]).to_device(dev);
    for (method, run) in METHODS {
        let err = run(&x, &x, &x, &AttentionMask::none(), &sp).unwrap_err().to_string();
        let needle = format!("the ranks hold blocks of different shapes (rank 0 [1, {n}, 3, 4], rank 1 [1, {n}, 2, 4]");
        assert!(err.contains(&needle), "{method}: {err}");
    }
    Ok(())
}

dist_test!(cpu_and_cuda sequence_parallel_attention_matches_one_process_on_2_ranks,
    sequence_parallel_attention_matches_one_process_on_2_ranks_cuda, 2, |world, dev| { matches_serial(world, dev) });
dist_test!(cpu_and_cuda sequence_parallel_attention_matches_one_process_on_4_ranks,
    sequence_parallel_attention_matches_one_process_on_4_ranks_cuda, 4, |world, dev| { matches_serial(world, dev) });

/// What attention keeps for backward: the bytes alive after a forward that were not before it,
/// with q, k and v made inside and their handles dropped, so they count only where the graph
/// saves them; and the forward's peak above the start.
fn held_and_peak(
    world: &World,
    inputs: impl FnOnce() -> [Tensor; 3],
    run: impl FnOnce(&Tensor, &Tensor, &Tensor) -> engine::Result<Tensor>,
) -> engine::Result<(i64, i64, Tensor)> {
    let before = settled_host_memory(&world.group)?;
    host_memory::reset_peak()?;
    let out = {
        let [q, k, v] = inputs();
        run(&q, &k, &v)?
    };
    let after = settled_host_memory(&world.group)?;
    Ok((after.current - before.current, after.peak - before.current, out))
}

/// Per rank, attention's activation memory at sp = n is 1/n of the same attention on one
/// process (5% slack), for ring attention and for the all-to-all form, whose one-process form
/// is the serial softmax attention; and the forward's peak falls as 1/n too (20% slack: the
/// all-to-all form's causal mask covers the whole sequence on every rank).
///
/// One allowance is not activation memory: Gloo's worker threads let go of a finished
/// collective's input and output buffers a moment after `wait` returns, so the readings wait
/// for the counter to settle, and the bounds still allow the buffers of one all-to-all of
/// this rank's q, k and v; an attention whose memory did not fall would be over them by
/// about (n - 1)/n of the one-process figure.
fn memory_falls_as_one_over_sp(world: &World) -> TestResult {
    host_memory::track()?;
    let (sp, r, n) = (SequenceParallel::new(world.group.clone()), world.rank() as i64, world.size() as i64);
    let (b, h, seq, d) = (1, 4, 128, 16);
    let shape = [b, h, seq, d];
    let (q, k, v) = (seeded(1, &shape), seeded(2, &shape), seeded(3, &shape));
    let mask = AttentionMask::causal();
    for (method, run) in METHODS {
        // Inputs as a projection makes them: fresh tensors on the graph that are not leaves
        // (autograd keeps every leaf alive, saved or not).
        let projected = |x: &Tensor| x + Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let whole = || [projected(&q), projected(&k), projected(&v)];
        let blocks =
            || [projected(&block(&q, 2, r, n)), projected(&block(&k, 2, r, n)), projected(&block(&v, 2, r, n))];
        let (held1, peak1, out1) =
            held_and_peak(world, whole, |q, k, v| run(q, k, v, &mask, &SequenceParallel::none()))?;
        let (heldn, peakn, outn) = held_and_peak(world, blocks, |q, k, v| run(q, k, v, &mask, &sp))?;
        eprintln!(
            "rank {r}: {method} attention [b {b}, h {h}, seq {seq}, d {d}], causal: held for backward {held1} bytes \
             at sp=1, {heldn} at sp={n} (ratio {:.3}); forward peak {peak1} at sp=1, {peakn} at sp={n} (ratio {:.3})",
            heldn as f64 / held1 as f64,
            peakn as f64 / peak1 as f64
        );
        assert!(held1 > 0 && heldn > 0, "{method}: nothing measured ({held1}, {heldn})");
        let in_transit = 2 * 3 * b * h * (seq / n) * d * 4;
        assert!(
            heldn as f64 <= held1 as f64 * 1.05 / n as f64 + in_transit as f64,
            "{method} attention holds {heldn} bytes per rank at sp={n}, more than 1/{n} of {held1} at sp=1 \
             (+{in_transit} in transit)"
        );
        assert!(
            peakn as f64 <= peak1 as f64 * 1.2 / n as f64 + in_transit as f64,
            "{method} attention peaks at {peakn} bytes per rank at sp={n}, more than 1/{n} of {peak1} at sp=1 \
             (+{in_transit} in transit)"
        );
        drop((out1, outn));
    }
    Ok(())
}

dist_test!(attention_memory_per_rank_falls_as_one_over_sp_on_2_ranks, 2, |world| {
    memory_falls_as_one_over_sp(world)
});
dist_test!(attention_memory_per_rank_falls_as_one_over_sp_on_4_ranks, 4, |world| {
    memory_falls_as_one_over_sp(world)
});

// The counter itself: a tensor's bytes while it lives, none after.
dist_test!(host_memory_counts_live_tensors, 1, |_world| {
    host_memory::track()?;
    let before = host_memory::stats()?;
    let t = Tensor::zeros([1000, 250], (Kind::Float, Device::Cpu));
    assert_eq!(host_memory::stats()?.current - before.current, 1_000_000);
    drop(t);
    let after = host_memory::stats()?;
    assert_eq!(after.current, before.current);
    assert!(after.peak >= before.current + 1_000_000);
    Ok(())
});
