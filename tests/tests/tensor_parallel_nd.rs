//! 2D, 2.5D and 3D tensor parallelism against one process: each layer is built twice from the
//! same seed and module path, once whole (the one-process layers of `tensor`, which are
//! `nn.Linear`, `nn.LayerNorm` and `nn.Embedding`) and once on the grid or cube, and the
//! shards, outputs and every gradient are compared blockwise (fp32, within 1e-5 absolute plus
//! 1e-5 relative). A rank's loss covers its block of the output, so the ranks' losses add up to
//! the one-process loss; the class-split cross-entropy's losses are the same on the ranks that
//! share a batch block (one logical loss, Megatron's convention). Each mode runs as one job
//! (2D on 4 ranks, 2.5D on 8 with depth 2, 3D on 8) to keep the process start-ups few.
//! The linear layers' traffic is counted by the world group (which sees its sub-groups'
//! collectives) and checked against the formula in the `multi_dim` docs.
use engine::dist::World;
use engine::parallel::tensor::multi_dim::{
    Axis, Cube, CubeClassifier, CubeEmbedding, CubeLayerNorm, CubeLinear, Grid, GridClassifier, GridEmbedding,
    GridLayerNorm, GridLinear, LinearConfig, Orientation,
};
use engine::parallel::tensor::{
    init, ColumnConfig, ColumnParallelLinear, EmbeddingConfig, Init, LayerNorm, TensorParallel, VocabParallelEmbedding,
};
use suite_tests::{assert_close, dist_test, seeded, TestResult};
use tch::{nn::VarStore, Device, Kind, Reduction, Tensor};

const TOL: f64 = 1e-5;

fn close(actual: &Tensor, expected: &Tensor, what: &str) {
    assert_close(actual, expected, TOL, TOL, what);
}

fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Block `index` of `parts` along `dim`.
fn block(t: &Tensor, dim: i64, index: i64, parts: i64) -> Tensor {
    let size = t.size()[dim as usize] / parts;
    t.narrow(dim, index * size, size)
}

/// The one-process `nn.Linear` at `path`.
fn serial_linear(vs: &VarStore, path: &str, inf: i64, outf: i64, bias: bool, seed: u64) -> ColumnParallelLinear {
    let cfg = ColumnConfig { bias, seed, ..Default::default() };
    ColumnParallelLinear::new(&(vs.root() / path), inf, outf, cfg, &TensorParallel::none()).expect("serial linear")
}

/// A LayerNorm's weight and bias, random so that their gradients are not trivial.
fn ln_params(width: i64) -> engine::Result<(Tensor, Tensor)> {
    Ok((
        init::full(Init::Normal { std: 1.0 }, 5, "ln.weight", &[width])?,
        init::full(Init::Normal { std: 1.0 }, 5, "ln.bias", &[width])?,
    ))
}

fn expect_err<T>(r: engine::Result<T>, needle: &str) {
    match r {
        Ok(_) => panic!("expected an error saying {needle:?}"),
        Err(e) => assert!(e.to_string().contains(needle), "{e} does not say {needle:?}"),
    }
}

/// The input `[b, s, h]` every check of a mode splits (the same on every rank).
fn data(b: i64, s: i64, h: i64) -> Tensor {
    seeded(1, &[b, s, h])
}

// ---------------------------------------------------------------------------------------------
// 2D and 2.5D

/// Everything on the grid: Linear (with and without bias; traffic counted), the classifier
/// head with its loss, LayerNorm, the embedding, an MLP block and uneven shapes.
fn grid_mode(world: &World, grid: &Grid) -> TestResult {
    let (q, d) = (grid.q(), grid.depth());
    let (_, r, c) = grid.coords();
    let (b, s, h, hout) = (2 * d * q, 3, 4 * q, 3 * q);
    let x = data(b, s, h);

    // Linear.
    for bias in [true, false] {
        let what = |t: &str| format!("2D linear {t} (q {q}, depth {d}, bias {bias})");
        let cfg = LinearConfig { bias, seed: 11, ..Default::default() };
        let vs1 = VarStore::new(Device::Cpu);
        let serial = serial_linear(&vs1, "fc", h, hout, bias, 11);
        let vs = VarStore::new(Device::Cpu);
        let layer = GridLinear::new(&(vs.root() / "fc"), h, hout, cfg, grid)?;
        let w_block = |w: &Tensor| block(&block(w, 0, c, q), 1, r, q);
        assert!(layer.weight().equal(&w_block(serial.weight())), "{}", what("weight block"));
        assert!(layer.full_weight()?.equal(serial.weight()), "{}", what("full weight"));
        let loaded = GridLinear::from_full(
            &(VarStore::new(Device::Cpu).root() / "fc"),
            &layer.full_weight()?,
            layer.full_bias()?.as_ref(),
            grid,
        )?;
        assert!(loaded.weight().equal(layer.weight()), "{}", what("weight from full tensors"));
        let cot = seeded(2, &[b, s, hout]);
        let x1 = leaf(&x);
        let y1 = serial.forward(&x1)?;
        (&y1 * &cot).sum(Kind::Float).backward();
        let xn = leaf(&grid.split_input(&x)?);
        let before = world.group.bytes_communicated();
        let y = layer.forward(&xn)?;
        close(&y, &grid.split_input(&y1)?, &what("output block"));
        (&y * grid.split_input(&cot)?).sum(Kind::Float).backward();
        // fp32: 4 bytes an element.
        let counted = (world.group.bytes_communicated() - before) as i64 / 4;
        close(&xn.grad(), &grid.split_input(&x1.grad())?, &what("input gradient"));
        close(&layer.weight().grad(), &w_block(&serial.weight().grad()), &what("weight gradient"));
        if bias {
            close(&layer.bias().unwrap().grad(), &block(&serial.bias().unwrap().grad(), 0, c, q), &what("bias grad"));
        }
        // The docs' formula: 3 N h / (d q) + 3 h h' / q, plus h h' / q^2 over depth, plus the
        // bias gradient's sums (h'/q over the column, h'/q over depth).
        let n = b * s;
        let deep = (d > 1) as i64;
        let expected =
            3 * n * h / (d * q) + 3 * h * hout / q + deep * h * hout / (q * q) + bias as i64 * (1 + deep) * hout / q;
        assert_eq!(counted, expected, "{}", what("elements communicated, forward and backward"));
        close(&grid.gather_output(&y)?, &y1, &what("gathered output"));
    }

    // Classifier head and class-split cross-entropy.
    let classes = 2 * q;
    let vs1 = VarStore::new(Device::Cpu);
    let serial = serial_linear(&vs1, "head", h, classes, true, 12);
    let vs = VarStore::new(Device::Cpu);
    let head =
        GridClassifier::new(&(vs.root() / "head"), h, classes, LinearConfig { seed: 12, ..Default::default() }, grid)?;
    let targets = Tensor::from_slice(&(0..b * s).map(|i| (i * 3 + 1) % classes).collect::<Vec<_>>()).view([b, s]);
    let x1 = leaf(&x);
    let logits1 = serial.forward(&x1)?;
    let per_token1 =
        logits1.view([-1, classes]).cross_entropy_loss::<Tensor>(&targets.view([-1]), None, Reduction::None, -100, 0.1);
    (per_token1.sum(Kind::Float) / (b * s) as f64).backward();
    let xn = leaf(&grid.split_input(&x)?);
    let logits = head.forward(&xn)?;
    close(&logits, &grid.split_input(&logits1)?, "2D head: logits block");
    close(&grid.gather_output(&logits)?, &logits1, "2D head: gathered logits");
    let per_token = head.cross_entropy(&logits, &grid.split_batch(&targets)?, 0.1)?;
    close(&per_token, &grid.split_batch(&per_token1.view([b, s]))?, "2D head: per-token losses");
    (per_token.sum(Kind::Float) / (b * s) as f64).backward();
    close(&xn.grad(), &grid.split_input(&x1.grad())?, "2D head: input gradient");
    let w_grad = block(&block(&serial.weight().grad(), 0, c, q), 1, r, q);
    close(&head.linear().weight().grad(), &w_grad, "2D head: weight gradient");
    close(&head.linear().bias().unwrap().grad(), &block(&serial.bias().unwrap().grad(), 0, c, q), "2D head: bias");

    // LayerNorm.
    let (w, bb) = ln_params(h)?;
    let vs = VarStore::new(Device::Cpu);
    let ln = GridLayerNorm::from_full(&(vs.root() / "ln"), &w, &bb, 1e-5, grid)?;
    let (w1, b1, x1) = (leaf(&w), leaf(&bb), leaf(&(&x * 3.0 + 1.0)));
    let y1 = x1.layer_norm([h], Some(&w1), Some(&b1), 1e-5, false);
    let cot = seeded(3, &[b, s, h]);
    (&y1 * &cot).sum(Kind::Float).backward();
    let xn = leaf(&grid.split_input(&(&x * 3.0 + 1.0))?);
    let y = ln.forward(&xn)?;
    close(&y, &grid.split_input(&y1)?, "2D layer norm: output block");
    (&y * grid.split_input(&cot)?).sum(Kind::Float).backward();
    close(&xn.grad(), &grid.split_input(&x1.grad())?, "2D layer norm: input gradient");
    close(&ln.weight().grad(), &block(&w1.grad(), 0, c, q), "2D layer norm: weight gradient");
    close(&ln.bias().grad(), &block(&b1.grad(), 0, c, q), "2D layer norm: bias gradient");

    // Embedding.
    let (vocab, dim) = (5 * q, h);
    let ecfg = EmbeddingConfig { seed: 9, init: Some(Init::Normal { std: 0.5 }), ..Default::default() };
    let vs1 = VarStore::new(Device::Cpu);
    let serial = VocabParallelEmbedding::new(&(vs1.root() / "wte"), vocab, dim, ecfg, &TensorParallel::none())?;
    let vs = VarStore::new(Device::Cpu);
    let emb = GridEmbedding::new(&(vs.root() / "wte"), vocab, dim, 9, ecfg.init, grid)?;
    assert!(emb.weight().equal(&block(&block(serial.weight(), 0, r, q), 1, c, q)), "2D embedding: table block");
    assert!(emb.full_weight()?.equal(serial.weight()), "2D embedding: full table");
    let ids = Tensor::from_slice(&(0..b * s).map(|i| (i * 7 + 3) % vocab).collect::<Vec<_>>()).view([b, s]);
    let cot = seeded(4, &[b, s, dim]);
    let y1 = serial.forward(&ids)?;
    (&y1 * &cot).sum(Kind::Float).backward();
    let y = emb.forward(&ids)?;
    close(&y, &grid.split_input(&y1)?, "2D embedding: output block");
    (&y * grid.split_input(&cot)?).sum(Kind::Float).backward();
    close(&emb.weight().grad(), &block(&block(&serial.weight().grad(), 0, r, q), 1, c, q), "2D embedding: grad");
    let back = GridEmbedding::from_full(&(VarStore::new(Device::Cpu).root() / "wte"), &emb.full_weight()?, grid)?;
    assert!(back.weight().equal(emb.weight()), "2D embedding: from_full keeps this rank's block");

    // MLP block: x + fc2(gelu(fc1(ln(x)))).
    let (w, bb) = ln_params(h)?;
    let vs1 = VarStore::new(Device::Cpu);
    let ln1 = LayerNorm::from_full(&(vs1.root() / "ln"), &w, &bb, 1e-5, false, &TensorParallel::none())?;
    let fc1s = serial_linear(&vs1, "fc1", h, 4 * h, true, 5);
    let fc2s = serial_linear(&vs1, "fc2", 4 * h, h, true, 5);
    let vs = VarStore::new(Device::Cpu);
    let cfg = LinearConfig { seed: 5, ..Default::default() };
    let ln = GridLayerNorm::from_full(&(vs.root() / "ln"), &w, &bb, 1e-5, grid)?;
    let fc1 = GridLinear::new(&(vs.root() / "fc1"), h, 4 * h, cfg, grid)?;
    let fc2 = GridLinear::new(&(vs.root() / "fc2"), 4 * h, h, cfg, grid)?;
    let x1 = leaf(&x);
    let y1 = &x1 + fc2s.forward(&fc1s.forward(&ln1.forward(&x1)?)?.gelu("none"))?;
    let cot = seeded(5, &[b, s, h]);
    (&y1 * &cot).sum(Kind::Float).backward();
    let xn = leaf(&grid.split_input(&x)?);
    let y = &xn + fc2.forward(&fc1.forward(&ln.forward(&xn)?)?.gelu("none"))?;
    close(&y, &grid.split_input(&y1)?, "2D MLP: output block");
    (&y * grid.split_input(&cot)?).sum(Kind::Float).backward();
    close(&xn.grad(), &grid.split_input(&x1.grad())?, "2D MLP: input gradient");
    let wb = |t: &Tensor| block(&block(t, 0, c, q), 1, r, q);
    close(&fc1.weight().grad(), &wb(&fc1s.weight().grad()), "2D MLP: fc1 weight gradient");
    close(&fc2.weight().grad(), &wb(&fc2s.weight().grad()), "2D MLP: fc2 weight gradient");
    close(&fc1.bias().unwrap().grad(), &block(&fc1s.bias().unwrap().grad(), 0, c, q), "2D MLP: fc1 bias gradient");
    close(&fc2.bias().unwrap().grad(), &block(&fc2s.bias().unwrap().grad(), 0, c, q), "2D MLP: fc2 bias gradient");
    close(&ln.weight().grad(), &block(&ln1.weight().grad(), 0, c, q), "2D MLP: layer norm weight gradient");
    close(&ln.bias().grad(), &block(&ln1.bias().grad(), 0, c, q), "2D MLP: layer norm bias gradient");

    grid_uneven_shapes(world, grid)
}

/// Sizes the grid does not divide are errors naming them, not panics.
fn grid_uneven_shapes(world: &World, grid: &Grid) -> TestResult {
    let (q, d) = (grid.q(), grid.depth());
    let vs = VarStore::new(Device::Cpu);
    let p = vs.root();
    let blocks = format!("does not divide into {q} blocks (q = {q}, depth = {d})");
    expect_err(
        GridLinear::new(&(&p / "a"), 2 * q + 1, 2 * q, LinearConfig::default(), grid),
        &format!("2D linear a.weight: in_features {} {blocks}", 2 * q + 1),
    );
    expect_err(
        GridLinear::new(&(&p / "b"), 2 * q, 3 * q + 1, LinearConfig::default(), grid),
        &format!("out_features {} {blocks}", 3 * q + 1),
    );
    expect_err(
        GridEmbedding::new(&(&p / "c"), 2 * q + 1, 2 * q, 0, None, grid),
        &format!("2D embedding c.weight: vocabulary size {} {blocks}", 2 * q + 1),
    );
    expect_err(
        grid.split_input(&Tensor::zeros([d * q + 1, 2, 2 * q], (Kind::Float, Device::Cpu))),
        &format!("batch size {} does not divide into {} blocks", d * q + 1, d * q),
    );
    let layer = GridLinear::new(&(&p / "d"), 2 * q, 2 * q, LinearConfig::default(), grid)?;
    expect_err(
        layer.forward(&Tensor::zeros([1, 2, 3], (Kind::Float, Device::Cpu))),
        &format!("input block has shape [1, 2, 3], expected [batch block, .., 2] (in_features {} over q = {q})", 2 * q),
    );
    // A world the mode does not fit.
    let n = world.size();
    match n {
        4 => {
            expect_err(
                Cube::new(&world.group),
                "3D tensor parallelism needs a cube number of ranks (q x q x q), got 4",
            );
            expect_err(Grid::two_p5_d(&world.group, 3), "2.5D tensor parallelism: 4 ranks do not divide into depth 3");
        }
        _ => {
            expect_err(Grid::two_d(&world.group), &format!("needs a square number of ranks (q x q), got {n}"));
            expect_err(
                Grid::two_p5_d(&world.group, 4),
                &format!("{n} ranks over depth 4 leave {}, not a square", n / 4),
            );
        }
    }
    Ok(())
}

dist_test!(two_d_layers_match_one_process_on_4_ranks, 4, |world| {
    let grid = Grid::two_d(&world.group)?;
    assert_eq!((grid.q(), grid.depth()), (2, 1));
    grid_mode(world, &grid)
});

dist_test!(two_p5_d_layers_match_one_process_on_8_ranks_depth_2, 8, |world| {
    let grid = Grid::two_p5_d(&world.group, 2)?;
    assert_eq!((grid.q(), grid.depth()), (2, 2));
    grid_mode(world, &grid)
});

// ---------------------------------------------------------------------------------------------
// 3D

/// Everything on the cube, as [`grid_mode`] does on the grid, in both orientations where the
/// layer takes one.
fn cube_mode(world: &World, cube: &Cube) -> TestResult {
    use Orientation::{Normal, Swapped};
    let q = cube.q();
    let (b, s, h, hout) = (q * q, 3, 2 * q * q, 3 * q);
    let x = data(b, s, h);
    let i = cube.coord(Axis::I);

    // Linear, from each orientation.
    for (orientation, bias) in [(Normal, true), (Swapped, false), (Normal, false)] {
        let what = |t: &str| format!("3D linear {t} (q {q}, input {orientation:?}, bias {bias})");
        let cfg = LinearConfig { bias, seed: 11, ..Default::default() };
        let vs1 = VarStore::new(Device::Cpu);
        let serial = serial_linear(&vs1, "fc", h, hout, bias, 11);
        let vs = VarStore::new(Device::Cpu);
        let layer = CubeLinear::new(&(vs.root() / "fc"), h, hout, orientation, cfg, cube)?;
        let (a, bh) = (cube.coord(orientation.batch_axis()), cube.coord(orientation.hidden_axis()));
        let w_block = |w: &Tensor| block(&block(w, 0, a, q), 1, bh * q + i, q * q);
        assert!(layer.weight().equal(&w_block(serial.weight())), "{}", what("weight block"));
        assert!(layer.full_weight()?.equal(serial.weight()), "{}", what("full weight"));
        let loaded = CubeLinear::from_full(
            &(VarStore::new(Device::Cpu).root() / "fc"),
            &layer.full_weight()?,
            layer.full_bias()?.as_ref(),
            orientation,
            cube,
        )?;
        assert!(loaded.weight().equal(layer.weight()), "{}", what("weight from full tensors"));
        let cot = seeded(2, &[b, s, hout]);
        let x1 = leaf(&x);
        let y1 = serial.forward(&x1)?;
        (&y1 * &cot).sum(Kind::Float).backward();
        let out = orientation.flip();
        let xn = leaf(&cube.split_input(&x, orientation)?);
        let before = world.group.bytes_communicated();
        let y = layer.forward(&xn)?;
        close(&y, &cube.split_input(&y1, out)?, &what("output block"));
        (&y * cube.split_input(&cot, out)?).sum(Kind::Float).backward();
        // fp32: 4 bytes an element.
        let counted = (world.group.bytes_communicated() - before) as i64 / 4;
        close(&xn.grad(), &cube.split_input(&x1.grad(), orientation)?, &what("input gradient"));
        close(&layer.weight().grad(), &w_block(&serial.weight().grad()), &what("weight gradient"));
        if bias {
            close(&layer.bias().unwrap().grad(), &block(&serial.bias().unwrap().grad(), 0, a, q), &what("bias grad"));
        }
        // The docs' formula: (3 N h + 2 N h' + 3 h h') / q^2, plus the bias gradient's two sums.
        let n = b * s;
        let expected = (3 * n * h + 2 * n * hout + 3 * h * hout) / (q * q) + bias as i64 * 2 * hout / q;
        assert_eq!(counted, expected, "{}", what("elements communicated, forward and backward"));
        close(&cube.gather_output(&y, out)?, &y1, &what("gathered output"));
    }

    // Classifier head and class-split cross-entropy.
    let classes = 2 * q;
    let vs1 = VarStore::new(Device::Cpu);
    let serial = serial_linear(&vs1, "head", h, classes, true, 12);
    let vs = VarStore::new(Device::Cpu);
    let cfg = LinearConfig { seed: 12, ..Default::default() };
    let head = CubeClassifier::new(&(vs.root() / "head"), h, classes, Normal, cfg, cube)?;
    let targets = Tensor::from_slice(&(0..b * s).map(|i| (i * 3 + 1) % classes).collect::<Vec<_>>()).view([b, s]);
    let x1 = leaf(&x);
    let logits1 = serial.forward(&x1)?;
    let per_token1 =
        logits1.view([-1, classes]).cross_entropy_loss::<Tensor>(&targets.view([-1]), None, Reduction::None, -100, 0.1);
    (per_token1.sum(Kind::Float) / (b * s) as f64).backward();
    let xn = leaf(&cube.split_input(&x, Normal)?);
    let logits = head.forward(&xn)?;
    close(&logits, &cube.split_input(&logits1, Swapped)?, "3D head: logits block");
    close(&cube.gather_output(&logits, Swapped)?, &logits1, "3D head: gathered logits");
    let per_token = head.cross_entropy(&logits, &cube.split_batch(&targets, Swapped)?, 0.1)?;
    close(&per_token, &cube.split_batch(&per_token1.view([b, s]), Swapped)?, "3D head: per-token losses");
    (per_token.sum(Kind::Float) / (b * s) as f64).backward();
    close(&xn.grad(), &cube.split_input(&x1.grad(), Normal)?, "3D head: input gradient");
    let (a, bh) = (cube.coord(Axis::J), cube.coord(Axis::L));
    let w_grad = block(&block(&serial.weight().grad(), 0, a, q), 1, bh * q + i, q * q);
    close(&head.linear().weight().grad(), &w_grad, "3D head: weight gradient");
    close(&head.linear().bias().unwrap().grad(), &block(&serial.bias().unwrap().grad(), 0, a, q), "3D head: bias");

    // LayerNorm in each orientation.
    let (w, bb) = ln_params(h)?;
    for orientation in [Normal, Swapped] {
        let what = |t: &str| format!("3D layer norm {t} ({orientation:?})");
        let vs = VarStore::new(Device::Cpu);
        let ln = CubeLayerNorm::from_full(&(vs.root() / "ln"), &w, &bb, 1e-5, orientation, cube)?;
        let (w1, b1, x1) = (leaf(&w), leaf(&bb), leaf(&(&x * 3.0 + 1.0)));
        let y1 = x1.layer_norm([h], Some(&w1), Some(&b1), 1e-5, false);
        let cot = seeded(3, &[b, s, h]);
        (&y1 * &cot).sum(Kind::Float).backward();
        let xn = leaf(&cube.split_input(&(&x * 3.0 + 1.0), orientation)?);
        let y = ln.forward(&xn)?;
        close(&y, &cube.split_input(&y1, orientation)?, &what("output block"));
        (&y * cube.split_input(&cot, orientation)?).sum(Kind::Float).backward();
        close(&xn.grad(), &cube.split_input(&x1.grad(), orientation)?, &what("input gradient"));
        let hb = cube.coord(orientation.hidden_axis());
        close(&ln.weight().grad(), &block(&w1.grad(), 0, hb, q), &what("weight gradient"));
        close(&ln.bias().grad(), &block(&b1.grad(), 0, hb, q), &what("bias gradient"));
    }

    // Embedding.
    let (vocab, dim) = (3 * q * q, h);
    let ecfg = EmbeddingConfig { seed: 9, init: Some(Init::Normal { std: 0.5 }), ..Default::default() };
    let vs1 = VarStore::new(Device::Cpu);
    let serial = VocabParallelEmbedding::new(&(vs1.root() / "wte"), vocab, dim, ecfg, &TensorParallel::none())?;
    let vs = VarStore::new(Device::Cpu);
    let emb = CubeEmbedding::new(&(vs.root() / "wte"), vocab, dim, 9, ecfg.init, Normal, cube)?;
    let t_block = |t: &Tensor| block(&block(t, 0, i * q + cube.coord(Axis::J), q * q), 1, cube.coord(Axis::L), q);
    assert!(emb.weight().equal(&t_block(serial.weight())), "3D embedding: table block");
    assert!(emb.full_weight()?.equal(serial.weight()), "3D embedding: full table");
    let ids = Tensor::from_slice(&(0..b * s).map(|i| (i * 7 + 3) % vocab).collect::<Vec<_>>()).view([b, s]);
    let cot = seeded(4, &[b, s, dim]);
    let y1 = serial.forward(&ids)?;
    (&y1 * &cot).sum(Kind::Float).backward();
    let y = emb.forward(&ids)?;
    close(&y, &cube.split_input(&y1, Normal)?, "3D embedding: output block");
    (&y * cube.split_input(&cot, Normal)?).sum(Kind::Float).backward();
    close(&emb.weight().grad(), &t_block(&serial.weight().grad()), "3D embedding: table gradient");
    let back =
        CubeEmbedding::from_full(&(VarStore::new(Device::Cpu).root() / "wte"), &emb.full_weight()?, Normal, cube)?;
    assert!(back.weight().equal(emb.weight()), "3D embedding: from_full keeps this rank's block");

    // MLP block: x + fc2(gelu(fc1(ln(x)))), fc1 from Normal to Swapped and fc2 back.
    let (w, bb) = ln_params(h)?;
    let vs1 = VarStore::new(Device::Cpu);
    let ln1 = LayerNorm::from_full(&(vs1.root() / "ln"), &w, &bb, 1e-5, false, &TensorParallel::none())?;
    let fc1s = serial_linear(&vs1, "fc1", h, 4 * h, true, 5);
    let fc2s = serial_linear(&vs1, "fc2", 4 * h, h, true, 5);
    let vs = VarStore::new(Device::Cpu);
    let cfg = LinearConfig { seed: 5, ..Default::default() };
    let ln = CubeLayerNorm::from_full(&(vs.root() / "ln"), &w, &bb, 1e-5, Normal, cube)?;
    let fc1 = CubeLinear::new(&(vs.root() / "fc1"), h, 4 * h, Normal, cfg, cube)?;
    let fc2 = CubeLinear::new(&(vs.root() / "fc2"), 4 * h, h, Swapped, cfg, cube)?;
    let x1 = leaf(&x);
    let y1 = &x1 + fc2s.forward(&fc1s.forward(&ln1.forward(&x1)?)?.gelu("none"))?;
    let cot = seeded(5, &[b, s, h]);
    (&y1 * &cot).sum(Kind::Float).backward();
    let xn = leaf(&cube.split_input(&x, Normal)?);
    let y = &xn + fc2.forward(&fc1.forward(&ln.forward(&xn)?)?.gelu("none"))?;
    close(&y, &cube.split_input(&y1, Normal)?, "3D MLP: output block");
    (&y * cube.split_input(&cot, Normal)?).sum(Kind::Float).backward();
    close(&xn.grad(), &cube.split_input(&x1.grad(), Normal)?, "3D MLP: input gradient");
    let (j, l) = (cube.coord(Axis::J), cube.coord(Axis::L));
    let fc1_block = block(&block(&fc1s.weight().grad(), 0, j, q), 1, l * q + i, q * q);
    let fc2_block = block(&block(&fc2s.weight().grad(), 0, l, q), 1, j * q + i, q * q);
    close(&fc1.weight().grad(), &fc1_block, "3D MLP: fc1 weight gradient");
    close(&fc2.weight().grad(), &fc2_block, "3D MLP: fc2 weight gradient");
    close(&fc1.bias().unwrap().grad(), &block(&fc1s.bias().unwrap().grad(), 0, j, q), "3D MLP: fc1 bias gradient");
    close(&fc2.bias().unwrap().grad(), &block(&fc2s.bias().unwrap().grad(), 0, l, q), "3D MLP: fc2 bias gradient");
    close(&ln.weight().grad(), &block(&ln1.weight().grad(), 0, l, q), "3D MLP: layer norm weight gradient");
    close(&ln.bias().grad(), &block(&ln1.bias().grad(), 0, l, q), "3D MLP: layer norm bias gradient");

    cube_uneven_shapes(world, cube)
}

/// Sizes the cube does not divide are errors naming them, not panics.
fn cube_uneven_shapes(world: &World, cube: &Cube) -> TestResult {
    use Orientation::Normal;
    let q = cube.q();
    let vs = VarStore::new(Device::Cpu);
    let p = vs.root();
    expect_err(
        CubeLinear::new(&(&p / "a"), q * q + q, 2 * q, Normal, LinearConfig::default(), cube),
        &format!("3D linear a.weight: in_features {} does not divide into {} blocks (q = {q})", q * q + q, q * q),
    );
    expect_err(
        CubeLinear::new(&(&p / "b"), q * q, 2 * q + 1, Normal, LinearConfig::default(), cube),
        &format!("out_features {} does not divide into {q} blocks", 2 * q + 1),
    );
    expect_err(
        CubeEmbedding::new(&(&p / "c"), q * q + 1, 2 * q, 0, None, Normal, cube),
        &format!("3D embedding c.weight: vocabulary size {} does not divide into {} blocks", q * q + 1, q * q),
    );
    expect_err(
        cube.split_input(&Tensor::zeros([q, 2, 2 * q], (Kind::Float, Device::Cpu)), Normal),
        &format!("3D layout: batch size {q} does not divide into {} blocks", q * q),
    );
    let layer = CubeLinear::new(&(&p / "d"), q * q, 2 * q, Normal, LinearConfig::default(), cube)?;
    expect_err(
        layer.forward(&Tensor::zeros([1, 2, q + 1], (Kind::Float, Device::Cpu))),
        &format!("expected [batch block, .., {q}] (in_features {} over q = {q})", q * q),
    );
    expect_err(Grid::two_d(&world.group), "2D tensor parallelism needs a square number of ranks (q x q), got 8");
    Ok(())
}

dist_test!(three_d_layers_match_one_process_on_8_ranks, 8, |world| {
    let cube = Cube::new(&world.group)?;
    assert_eq!(cube.q(), 2);
    cube_mode(world, &cube)
});
