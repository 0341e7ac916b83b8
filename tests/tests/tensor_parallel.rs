//! 1D tensor parallelism on 2 and 4 ranks against one process: every layer is built twice
//! from the same seed and module path, once whole (`TensorParallel::none`) and once sharded
//! over the world, and the shards, outputs and every gradient are compared (fp32, within
//! 1e-5 absolute plus 1e-5 relative). A rank's loss covers its block of a split output, so
//! the sum of the ranks' losses is the one-process loss; replicated outputs carry the whole
//! loss on every rank (one logical loss, Megatron's convention).
use engine::dist::World;
use engine::host_memory;
use engine::parallel::tensor::{
    dropout, init, vocab_parallel_cross_entropy, ColumnConfig, ColumnParallelLinear, DropoutKey, EmbeddingConfig, Init,
    LayerNorm, RowConfig, RowParallelLinear, TensorParallel, VocabParallelEmbedding, IGNORE_INDEX,
};
use suite_tests::{assert_close, dist_test, seeded, settled_host_memory, TestResult};
use tch::{nn::VarStore, Device, Kind, Reduction, Tensor};

const TOL: f64 = 1e-5;

fn close(actual: &Tensor, expected: &Tensor, what: &str) {
    assert_close(actual, expected, TOL, TOL, what);
}

fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Block `rank` of `n` along `dim`.
fn block(t: &Tensor, dim: i64, rank: i64, n: i64) -> Tensor {
    let size = t.size()[dim as usize] / n;
    t.narrow(dim, rank * size, size)
}

fn tp_of(world: &World) -> (TensorParallel, i64, i64) {
    (TensorParallel::new(world.group.clone()), world.rank() as i64, world.size() as i64)
}

/// Column-parallel linear on `[seq, batch, in]`: output split or gathered, with and without
/// bias, input replicated or split along the sequence; and its full tensors load back.
fn column_linear(world: &World) -> TestResult {
    let (tp, r, n) = tp_of(world);
    let (seq, inf, outf) = (2 * n, 6, 4 * n);
    let modes =
        [(false, true, false), (true, true, false), (false, false, false), (false, true, true), (true, true, true)];
    for (gather_output, bias, sequence_parallel) in modes {
        let what = |s: &str| {
            format!("{s} (gather_output {gather_output}, bias {bias}, sequence_parallel {sequence_parallel})")
        };
        let cfg = ColumnConfig { gather_output, bias, sequence_parallel, seed: 11, ..Default::default() };
        let (vs1, vsn) = (VarStore::new(Device::Cpu), VarStore::new(Device::Cpu));
        let serial = ColumnParallelLinear::new(&(vs1.root() / "fc"), inf, outf, cfg, &TensorParallel::none())?;
        let layer = ColumnParallelLinear::new(&(vsn.root() / "fc"), inf, outf, cfg, &tp)?;
        // The shard is exactly the slice of the one-process weight, gathers back to it, and
        // is what a layer built from the full tensors holds.
        assert!(layer.weight().equal(&block(serial.weight(), 0, r, n)), "{}", what("weight shard"));
        assert!(layer.full_weight()?.equal(serial.weight()), "{}", what("full weight"));
        let loaded = ColumnParallelLinear::from_full(
            &(VarStore::new(Device::Cpu).root() / "fc"),
            &layer.full_weight()?,
            layer.full_bias()?.as_ref(),
            cfg,
            &tp,
        )?;
        assert!(loaded.weight().equal(layer.weight()), "{}", what("weight from full tensors"));
        if bias {
            assert!(layer.bias().unwrap().equal(&block(serial.bias().unwrap(), 0, r, n)), "{}", what("bias shard"));
        }
        let (x, c) = (seeded(1, &[seq, 3, inf]), seeded(2, &[seq, 3, outf]));
        let x1 = leaf(&x);
        let y1 = serial.forward(&x1)?;
        (&y1 * &c).sum(Kind::Float).backward();
        let xn = if sequence_parallel { leaf(&block(&x, 0, r, n)) } else { leaf(&x) };
        let y = layer.forward(&xn)?;
        if gather_output {
            close(&y, &y1, &what("gathered output"));
            (&y * &c).sum(Kind::Float).backward();
        } else {
            close(&y, &block(&y1, 2, r, n), &what("output block"));
            (&y * block(&c, 2, r, n)).sum(Kind::Float).backward();
        }
        let x_grad = if sequence_parallel { block(&x1.grad(), 0, r, n) } else { x1.grad() };
        close(&xn.grad(), &x_grad, &what("input gradient"));
        close(&layer.weight().grad(), &block(&serial.weight().grad(), 0, r, n), &what("weight gradient"));
        if bias {
            let want = block(&serial.bias().unwrap().grad(), 0, r, n);
            close(&layer.bias().unwrap().grad(), &want, &what("bias gradient"));
        }
    }
    Ok(())
}

/// Row-parallel linear with its input split or replicated (`input_is_parallel`), its output
/// replicated or reduce-scattered along the sequence; and its full tensors load back.
fn row_linear(world: &World) -> TestResult {
    let (tp, r, n) = tp_of(world);
    let (seq, inf, outf) = (2 * n, 4 * n, 6);
    for (input_is_parallel, sequence_parallel) in [(true, false), (false, false), (true, true), (false, true)] {
        let what =
            |s: &str| format!("{s} (input_is_parallel {input_is_parallel}, sequence_parallel {sequence_parallel})");
        let cfg = RowConfig { input_is_parallel, sequence_parallel, seed: 12, ..Default::default() };
        let (vs1, vsn) = (VarStore::new(Device::Cpu), VarStore::new(Device::Cpu));
        let serial = RowParallelLinear::new(&(vs1.root() / "proj"), inf, outf, cfg, &TensorParallel::none())?;
        let layer = RowParallelLinear::new(&(vsn.root() / "proj"), inf, outf, cfg, &tp)?;
        assert!(layer.weight().equal(&block(serial.weight(), 1, r, n)), "{}", what("weight shard"));
        assert!(layer.bias().unwrap().equal(serial.bias().unwrap()), "{}", what("bias is whole"));
        assert!(layer.full_weight()?.equal(serial.weight()), "{}", what("full weight"));
        let loaded = RowParallelLinear::from_full(
            &(VarStore::new(Device::Cpu).root() / "proj"),
            &layer.full_weight()?,
            layer.bias(),
            cfg,
            &tp,
        )?;
        assert!(loaded.weight().equal(layer.weight()), "{}", what("weight from full tensors"));
        let (x, c) = (seeded(3, &[seq, 3, inf]), seeded(4, &[seq, 3, outf]));
        let x1 = leaf(&x);
        let y1 = serial.forward(&x1)?;
        (&y1 * &c).sum(Kind::Float).backward();
        let xn = if input_is_parallel { leaf(&block(&x, 2, r, n)) } else { leaf(&x) };
        let y = layer.forward(&xn)?;
        if sequence_parallel {
            close(&y, &block(&y1, 0, r, n), &what("output block"));
            (&y * block(&c, 0, r, n)).sum(Kind::Float).backward();
        } else {
            close(&y, &y1, &what("output"));
            (&y * &c).sum(Kind::Float).backward();
        }
        let want = if input_is_parallel { block(&x1.grad(), 2, r, n) } else { x1.grad() };
        close(&xn.grad(), &want, &what("input gradient"));
        close(&layer.weight().grad(), &block(&serial.weight().grad(), 1, r, n), &what("weight gradient"));
        close(&layer.bias().unwrap().grad(), &serial.bias().unwrap().grad(), &what("bias gradient"));
    }
    Ok(())
}

/// Megatron's MLP block in the `[seq, batch, hidden]` layout:
/// `x + dropout(fc2(gelu(fc1(ln(x)))))`, with the LayerNorm, dropout and residual replicated,
/// or with sequence parallelism split along the sequence (all-gather into fc1, reduce-scatter
/// out of fc2).
struct Mlp {
    ln: LayerNorm,
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
    sequence_parallel: bool,
    tp: TensorParallel,
}

impl Mlp {
    fn new(vs: &VarStore, hidden: i64, sequence_parallel: bool, tp: &TensorParallel) -> engine::Result<Mlp> {
        let p = vs.root() / "mlp";
        let fc1 = ColumnConfig { sequence_parallel, seed: 5, ..Default::default() };
        let fc2 = RowConfig { sequence_parallel, seed: 5, ..Default::default() };
        Ok(Mlp {
            ln: LayerNorm::from_full(
                &(&p / "ln"),
                &init::full(Init::Normal { std: 1.0 }, 5, "ln.weight", &[hidden])?,
                &init::full(Init::Normal { std: 1.0 }, 5, "ln.bias", &[hidden])?,
                1e-5,
                sequence_parallel,
                tp,
            )?,
            fc1: ColumnParallelLinear::new(&(&p / "fc1"), hidden, 4 * hidden, fc1, tp)?,
            fc2: RowParallelLinear::new(&(&p / "fc2"), 4 * hidden, hidden, fc2, tp)?,
            sequence_parallel,
            tp: tp.clone(),
        })
    }

    fn forward(&self, x: &Tensor) -> engine::Result<Tensor> {
        let h = self.fc1.forward(&self.ln.forward(x)?)?.gelu("none");
        let key = DropoutKey { seed: 3, step: 7, name: "mlp.drop" };
        let seq_dim = self.sequence_parallel.then_some(0);
        Ok(x + dropout(&self.fc2.forward(&h)?, 0.25, key, seq_dim, &self.tp)?)
    }
}

fn mlp_block(world: &World) -> TestResult {
    let (tp, r, n) = tp_of(world);
    let (seq, hidden) = (2 * n, 8);
    let (x, c) = (seeded(6, &[seq, 3, hidden]), seeded(7, &[seq, 3, hidden]));
    let vs1 = VarStore::new(Device::Cpu);
    let serial = Mlp::new(&vs1, hidden, false, &TensorParallel::none())?;
    let x1 = leaf(&x);
    let y1 = serial.forward(&x1)?;
    (&y1 * &c).sum(Kind::Float).backward();
    for sequence_parallel in [false, true] {
        let vsn = VarStore::new(Device::Cpu);
        let mlp = Mlp::new(&vsn, hidden, sequence_parallel, &tp)?;
        let what = |s: &str| format!("{s} (sequence parallel {sequence_parallel})");
        let (xn, y) = if sequence_parallel {
            let xn = leaf(&block(&x, 0, r, n));
            let y = mlp.forward(&xn)?;
            close(&y, &block(&y1, 0, r, n), &what("output block"));
            (&y * block(&c, 0, r, n)).sum(Kind::Float).backward();
            (xn, y)
        } else {
            let xn = leaf(&x);
            let y = mlp.forward(&xn)?;
            close(&y, &y1, &what("output"));
            (&y * &c).sum(Kind::Float).backward();
            (xn, y)
        };
        let _ = y;
        let x_grad = if sequence_parallel { block(&x1.grad(), 0, r, n) } else { x1.grad() };
        close(&xn.grad(), &x_grad, &what("input gradient"));
        close(&mlp.fc1.weight().grad(), &block(&serial.fc1.weight().grad(), 0, r, n), &what("fc1 weight gradient"));
        close(&mlp.fc1.bias().unwrap().grad(), &block(&serial.fc1.bias().unwrap().grad(), 0, r, n), &what("fc1 bias"));
        close(&mlp.fc2.weight().grad(), &block(&serial.fc2.weight().grad(), 1, r, n), &what("fc2 weight gradient"));
        // Replicated parameters: under sequence parallelism their gradients are summed over
        // the sequence blocks in backward, and equal the one-process gradients either way.
        close(&mlp.fc2.bias().unwrap().grad(), &serial.fc2.bias().unwrap().grad(), &what("fc2 bias gradient"));
        close(&mlp.ln.weight().grad(), &serial.ln.weight().grad(), &what("layer norm weight gradient"));
        close(&mlp.ln.bias().grad(), &serial.ln.bias().grad(), &what("layer norm bias gradient"));
    }
    Ok(())
}

/// The vocabulary-split embedding, its output replicated or reduce-scattered along the
/// sequence; and the checkpoint path: full tensors written at tp=N load at tp=1 and back.
fn embedding(world: &World) -> TestResult {
    let (tp, r, n) = tp_of(world);
    let (vocab, dim, seq) = (5 * n, 4, 2 * n);
    let ids = Tensor::from_slice(&(0..seq * 3).map(|i| (i * 7 + 3) % vocab).collect::<Vec<_>>()).view([seq, 3]);
    let c = seeded(8, &[seq, 3, dim]);
    for sequence_parallel in [false, true] {
        let cfg = EmbeddingConfig {
            sequence_parallel,
            seed: 9,
            init: Some(Init::Normal { std: 0.02 }),
            ..Default::default()
        };
        let (vs1, vsn) = (VarStore::new(Device::Cpu), VarStore::new(Device::Cpu));
        let serial = VocabParallelEmbedding::new(&(vs1.root() / "wte"), vocab, dim, cfg, &TensorParallel::none())?;
        let emb = VocabParallelEmbedding::new(&(vsn.root() / "wte"), vocab, dim, cfg, &tp)?;
        assert!(emb.weight().equal(&block(serial.weight(), 0, r, n)), "table shard");
        let y1 = serial.forward(&ids)?;
        (&y1 * &c).sum(Kind::Float).backward();
        let y = emb.forward(&ids)?;
        if sequence_parallel {
            close(&y, &block(&y1, 0, r, n), "sequence block of the embeddings");
            (&y * block(&c, 0, r, n)).sum(Kind::Float).backward();
        } else {
            close(&y, &y1, "embeddings");
            (&y * &c).sum(Kind::Float).backward();
        }
        close(&emb.weight().grad(), &block(&serial.weight().grad(), 0, r, n), "table gradient");
        // A checkpoint of full tensors moves between layouts.
        let full = emb.full_weight()?;
        assert!(full.equal(serial.weight()), "full table");
        let back = VocabParallelEmbedding::from_full(&(VarStore::new(Device::Cpu).root() / "wte"), &full, cfg, &tp)?;
        assert!(back.weight().equal(emb.weight()), "from_full keeps this rank's rows");
    }
    let err = emb_error(&tp, 5 * n, &Tensor::from_slice(&[0i64, 5 * n]))?;
    assert!(err.contains(&format!("ids range over 0..={}, outside the vocabulary 0..{}", 5 * n, 5 * n)), "{err}");
    Ok(())
}

fn emb_error(tp: &TensorParallel, vocab: i64, ids: &Tensor) -> engine::Result<String> {
    let e = VocabParallelEmbedding::new(&VarStore::new(Device::Cpu).root(), vocab, 2, EmbeddingConfig::default(), tp)?;
    Ok(e.forward(ids).expect_err("ids outside the vocabulary").to_string())
}

/// Cross-entropy over vocabulary-split logits equals PyTorch's over whole logits, with
/// ignored targets and label smoothing, values and logit gradients.
fn cross_entropy(world: &World) -> TestResult {
    let (tp, r, n) = tp_of(world);
    let (tokens, vocab) = (7, 3 * n);
    let logits = seeded(10, &[tokens, vocab]) * 3.0;
    let mut t: Vec<i64> = (0..tokens).map(|i| (i * 5 + 1) % vocab).collect();
    t[2] = IGNORE_INDEX;
    let targets = Tensor::from_slice(&t);
    let kept = (tokens - 1) as f64;
    for smoothing in [0.0, 0.1] {
        let l1 = leaf(&logits);
        let want = l1.cross_entropy_loss::<Tensor>(&targets, None, Reduction::Mean, IGNORE_INDEX, smoothing);
        want.backward();
        let per_token =
            l1.detach().cross_entropy_loss::<Tensor>(&targets, None, Reduction::None, IGNORE_INDEX, smoothing);
        let ln = leaf(&block(&logits, 1, r, n));
        let losses = vocab_parallel_cross_entropy(&ln, &targets, smoothing, &tp)?;
        close(&losses, &per_token, &format!("per-token losses (smoothing {smoothing})"));
        let loss = losses.sum(Kind::Float) / kept;
        close(&loss, &want, &format!("mean loss (smoothing {smoothing})"));
        loss.backward();
        close(&ln.grad(), &block(&l1.grad(), 1, r, n), &format!("logit gradient (smoothing {smoothing})"));
    }
    let bad = Tensor::from_slice(&[0i64, vocab]);
    let err = vocab_parallel_cross_entropy(&block(&logits, 1, r, n).narrow(0, 0, 2), &bad, 0.0, &tp).unwrap_err();
    assert!(
        err.to_string().contains(&format!("targets range over 0..={vocab}, outside the vocabulary 0..{vocab}")),
        "{err}"
    );
    Ok(())
}

/// Sizes the group does not divide are errors naming the sizes, not panics.
fn uneven_shapes(world: &World) -> TestResult {
    let (tp, _, n) = tp_of(world);
    let vs = VarStore::new(Device::Cpu);
    let p = vs.root();
    let expect = |r: engine::Result<()>, needle: String| {
        let err = r.expect_err(&needle).to_string();
        assert!(err.contains(&needle), "{err} does not say {needle:?}");
    };
    let tpn = format!("does not divide by the tensor-parallel size {n}");
    expect(
        ColumnParallelLinear::new(&(&p / "a"), 4, 5, ColumnConfig::default(), &tp).map(|_| ()),
        format!("column-parallel linear a.weight: out_features 5 {tpn}"),
    );
    expect(
        RowParallelLinear::new(&(&p / "b"), 5, 4, RowConfig::default(), &tp).map(|_| ()),
        format!("row-parallel linear b.weight: in_features 5 {tpn}"),
    );
    expect(
        VocabParallelEmbedding::new(&(&p / "c"), 7, 4, EmbeddingConfig::default(), &tp).map(|_| ()),
        format!("vocab-parallel embedding c.weight: vocabulary size 7 {tpn}"),
    );
    expect(
        ColumnParallelLinear::from_full(
            &(&p / "d"),
            &Tensor::zeros([6 * n + 1, 3], (Kind::Float, Device::Cpu)),
            None,
            ColumnConfig { bias: false, ..Default::default() },
            &tp,
        )
        .map(|_| ()),
        format!("out_features {} {tpn}", 6 * n + 1),
    );
    // A sequence that does not split leaving a sequence-parallel row layer.
    let cfg = RowConfig { sequence_parallel: true, ..Default::default() };
    let row = RowParallelLinear::new(&(&p / "e"), 2 * n, 4, cfg, &tp)?;
    expect(
        row.forward(&Tensor::zeros([5, 1, 2], (Kind::Float, Device::Cpu))).map(|_| ()),
        format!("sequence length 5 (dim 0) {tpn}"),
    );
    expect(
        row.forward(&Tensor::zeros([4, 1, 3], (Kind::Float, Device::Cpu))).map(|_| ()),
        "input has 3 features in its last dimension, expected 2".into(),
    );
    Ok(())
}

fn all(world: &World) -> TestResult {
    column_linear(world)?;
    row_linear(world)?;
    mlp_block(world)?;
    embedding(world)?;
    cross_entropy(world)?;
    uneven_shapes(world)
}

dist_test!(tensor_parallel_layers_match_one_process_on_2_ranks, 2, |world| { all(world) });
dist_test!(tensor_parallel_layers_match_one_process_on_4_ranks, 4, |world| { all(world) });

/// What sequence parallelism is for: the MLP block's activations outside the tensor-parallel
/// region (the block's input, the LayerNorm's output and the block's output, three fp32
/// `[seq, batch, hidden]` tensors, and the dropout's one-byte mask) are held as sequence
/// blocks, 1/tp per rank, so a rank holds `(1 - 1/tp)` of them fewer than without it (at
/// least 95% of that, counted in bytes by the host allocator counter). Keeping the gathered
/// input for fc1's weight gradient instead of gathering it again in backward would give one
/// whole fp32 tensor back and fail.
fn sequence_parallel_saves_activations(world: &World) -> TestResult {
    host_memory::track()?;
    let (tp, r, n) = tp_of(world);
    let (seq, batch, hidden) = (16 * n, 4, 32);
    let x = seeded(6, &[seq, batch, hidden]);
    let mut held = vec![];
    for sequence_parallel in [false, true] {
        let vs = VarStore::new(Device::Cpu);
        let mlp = Mlp::new(&vs, hidden, sequence_parallel, &tp)?;
        let input = if sequence_parallel { block(&x, 0, r, n) } else { x.shallow_clone() };
        let before = settled_host_memory(&world.group)?;
        // The input as a previous layer makes it: a fresh tensor on the graph, not a leaf.
        let out = mlp.forward(&(&input + Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true)))?;
        let after = settled_host_memory(&world.group)?;
        held.push(after.current - before.current);
        drop(out);
    }
    let outside = seq * batch * hidden * (3 * 4 + 1);
    let (saved, expected) = (held[0] - held[1], outside * (n - 1) / n);
    eprintln!(
        "rank {r}: MLP block [seq {seq}, batch {batch}, hidden {hidden}] at tp={n} holds {} bytes for backward, {} with \
         sequence parallelism: {saved} fewer ({expected} expected)",
        held[0], held[1]
    );
    assert!(
        saved as f64 >= 0.95 * expected as f64,
        "sequence parallelism saves {saved} bytes per rank at tp={n}, expected {expected} ({} vs {})",
        held[0],
        held[1]
    );
    Ok(())
}

dist_test!(sequence_parallel_holds_fewer_activations_on_2_ranks, 2, |world| {
    sequence_parallel_saves_activations(world)
});
dist_test!(sequence_parallel_holds_fewer_activations_on_4_ranks, 4, |world| {
    sequence_parallel_saves_activations(world)
});
