//! Training dropout in the Evoformer stacks: DeepMind's `EvoformerIteration` in training
//! (`is_training=True`, every rate non-zero, a given `SafeKey`; the fixtures of
//! `tests/fixtures/dropout/make_dropout.py`) for the monomer's blocks (chained as its layer
//! stack chains their keys), the Multimer's block (outer product mean first) and an extra-MSA
//! block (global column attention); and on our own tiny stacks, that the masks are the same
//! under DAP (2 ranks against one process), chunking and checkpointed recomputation, that a
//! key draws the same masks twice and that dropout changes the outputs. The template pair
//! stacks too: the monomer's `TemplatePairStack` and AlphaFold-Multimer's whole
//! `TemplateEmbedding` in training; the structure modules (monomer and Multimer) in training;
//! and one pass of the whole AlphaFold-Multimer network in training from a key (its stacks'
//! keys from the network's own chain).
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use engine::dist::World;
use engine::parallel::dap::Dap;
use fastfold::jax_random::Key;
use fastfold::model::dropout::{DropoutRates, Rates};
use fastfold::model::layers::Stream;
use fastfold::model::multimer::structure::load_structure_module;
use fastfold::model::multimer::{
    MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs, MultimerTemplates, TemplateBatch,
};
use fastfold::model::structure::StructureModule;
use fastfold::model::templates::Templates;
use fastfold::model::{BlockDropout, BlockMasks, EvoformerConfig, EvoformerStack, Exec, Params, EVOFORMER, EXTRA_MSA};
use suite_tests::{dist_test, TestResult};
use tch::{Device, Kind, Tensor};

/// Largest allowed difference from AlphaFold, relative to the compared array's largest
/// magnitude (at least 1): both sides compute in fp32, in different summation orders.
const TOLERANCE: f64 = 1e-5;

fn arrays(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_npz(fixture(name)).unwrap().into_iter().collect()
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dropout").join(name)
}

fn key_of(t: &Tensor) -> Key {
    Key([t.int64_value(&[0]) as u32, t.int64_value(&[1]) as u32])
}

/// The fixture's rates, in `make_dropout.py`'s `RATE_NAMES` order.
fn rates_of(t: &Tensor) -> Rates {
    let r = |i: i64| t.double_value(&[i]);
    Rates {
        msa_row_attention: r(0),
        msa_column_attention: r(1),
        msa_transition: r(2),
        outer_product_mean: r(3),
        triangle_multiplication_outgoing: r(4),
        triangle_multiplication_incoming: r(5),
        triangle_attention_starting_node: r(6),
        triangle_attention_ending_node: r(7),
        pair_transition: r(8),
    }
}

fn training(rates: Rates, chunk: Option<i64>) -> Exec {
    Exec::new(Dap::none(), chunk).with_dropout(Some(DropoutRates { evoformer: rates, ..DropoutRates::ALPHAFOLD }))
}

/// One block of `stack` on the fixture `f` with its key as the block's own.
fn one_block(stack: &EvoformerStack, f: &HashMap<String, Tensor>, exec: &Exec) -> (Tensor, Tensor) {
    let (s, r) = (f["msa"].size()[0], f["msa"].size()[1]);
    let masks = BlockMasks::new(&f["msa_mask"], &f["pair_mask"], exec).unwrap();
    let dropout = BlockDropout { key: key_of(&f["key"]), rates: rates_of(&f["rates"]), seqs: s, residues: r };
    assert_eq!(stack.len(), 1);
    tch::no_grad(|| stack.blocks()[0].forward(&f["msa"], &f["pair"], &masks, exec, Some(dropout)).unwrap())
}

#[test]
fn monomer_blocks_in_training_equal_alphafold() {
    let f = arrays("monomer.npz");
    let params = Params::load_npz(fixture("monomer_params.npz")).unwrap();
    let stack = EvoformerStack::main(&params).unwrap();
    assert_eq!(stack.len(), 2);
    let rates = rates_of(&f["rates"]);
    for chunk in [None, Some(3)] {
        let exec = training(rates, chunk);
        let key = Some(key_of(&f["key"]));
        let (msa, pair, key) = tch::no_grad(|| {
            stack.forward(kept(&f["msa"]), kept(&f["pair"]), &f["msa_mask"], &f["pair_mask"], &exec, key)
        })
        .unwrap();
        common::assert_close(&format!("msa (chunk {chunk:?})"), &msa, &f["msa_out"], TOLERANCE);
        common::assert_close(&format!("pair (chunk {chunk:?})"), &pair, &f["pair_out"], TOLERANCE);
        assert_eq!(key, Some(key_of(&f["key_out"])), "the stack's key chain ends where the layer stack's does");
    }
    // Without dropout the same blocks give other outputs: the masks are what matched.
    let (_, pair, _) = tch::no_grad(|| {
        stack.forward(kept(&f["msa"]), kept(&f["pair"]), &f["msa_mask"], &f["pair_mask"], &Exec::serial(), None)
    })
    .unwrap();
    let d = (&pair - &f["pair_out"]).abs().max().double_value(&[]);
    assert!(d > 1e-2, "the outputs without dropout differ from AlphaFold's in training by only {d:e}");
}

#[test]
fn multimer_block_in_training_equals_alphafold() {
    let f = arrays("multimer.npz");
    let params = Params::load_npz(fixture("multimer_params.npz")).unwrap().with_outer_product_mean_first(true);
    let stack = EvoformerStack::main(&params).unwrap();
    for chunk in [None, Some(2)] {
        let (msa, pair) = one_block(&stack, &f, &training(rates_of(&f["rates"]), chunk));
        common::assert_close(&format!("msa (chunk {chunk:?})"), &msa, &f["msa_out"], TOLERANCE);
        common::assert_close(&format!("pair (chunk {chunk:?})"), &pair, &f["pair_out"], TOLERANCE);
    }
}

#[test]
fn extra_msa_block_in_training_equals_alphafold() {
    let f = arrays("extra.npz");
    let params = Params::load_npz(fixture("extra_params.npz")).unwrap();
    let stack = EvoformerStack::extra(&params).unwrap();
    for chunk in [None, Some(2)] {
        let (msa, pair) = one_block(&stack, &f, &training(rates_of(&f["rates"]), chunk));
        common::assert_close(&format!("msa (chunk {chunk:?})"), &msa, &f["msa_out"], TOLERANCE);
        common::assert_close(&format!("pair (chunk {chunk:?})"), &pair, &f["pair_out"], TOLERANCE);
    }
}

/// The template stacks' fixture rates (`TEMPLATE_RATE_NAMES`' order) as a [`DropoutRates`].
fn template_training(t: &Tensor, chunk: Option<i64>) -> Exec {
    let r = |i: i64| t.double_value(&[i]);
    let rates = Rates {
        triangle_attention_starting_node: r(0),
        triangle_attention_ending_node: r(1),
        triangle_multiplication_outgoing: r(2),
        triangle_multiplication_incoming: r(3),
        pair_transition: r(4),
        ..Rates::NONE
    };
    Exec::new(Dap::none(), chunk)
        .with_dropout(Some(DropoutRates { template_pair_stack: rates, ..DropoutRates::ALPHAFOLD }))
}

#[test]
fn monomer_template_pair_stack_in_training_equals_alphafold() {
    let f = arrays("template_stack.npz");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold");
    let params = Params::load_model_npz(dir.join("params.npz")).unwrap();
    let templates = Templates::new(&params).unwrap().expect("the fixture's parameters have templates");
    for chunk in [None, Some(2)] {
        let exec = template_training(&f["rates"], chunk);
        let out = tch::no_grad(|| templates.pair_stack_blocks(&f["act"], &f["mask"], &exec, Some(key_of(&f["key"]))))
            .unwrap();
        common::assert_close(&format!("template pair stack (chunk {chunk:?})"), &out, &f["out"], TOLERANCE);
    }
    let plain = tch::no_grad(|| templates.pair_stack_blocks(&f["act"], &f["mask"], &Exec::serial(), None)).unwrap();
    let d = (&plain - &f["out"]).abs().max().double_value(&[]);
    assert!(d > 1e-2, "without dropout the stack differs from AlphaFold's in training by only {d:e}");
}

#[test]
fn multimer_template_embedding_in_training_equals_alphafold() {
    let f = arrays("template_embedding_multimer.npz");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network");
    let x: HashMap<String, Tensor> =
        Tensor::read_npz(dir.join("template_embedding.npz")).unwrap().into_iter().collect();
    let templates = MultimerTemplates::load(dir.join("template_embedding_params.npz")).unwrap();
    let batch = TemplateBatch {
        aatype: &x["template_aatype"],
        positions: &x["template_all_atom_positions"],
        mask: &x["template_all_atom_mask"],
    };
    for chunk in [None, Some(4)] {
        let exec = template_training(&f["rates"], chunk);
        let key = Some(key_of(&f["key"]));
        let out = tch::no_grad(|| {
            let averaged = templates.average(&x["query"], &batch, &x["pair_mask"], &x["asym_id"], &exec, key);
            templates.project(&averaged.unwrap()).unwrap()
        });
        common::assert_close(&format!("template embedding (chunk {chunk:?})"), &out, &f["output"], TOLERANCE);
    }
}

/// Rows `dim` of `t` of the residues `seq_mask` keeps (a padding residue's attention is
/// rounding noise on both sides; see `tests/multimer_network.rs`).
fn real_residues(t: &Tensor, seq_mask: &Tensor, dim: i64) -> Tensor {
    t.index_select(dim, &seq_mask.nonzero().squeeze_dim(-1))
}

#[test]
fn multimer_structure_module_in_training_equals_alphafold() {
    let f = arrays("structure_multimer.npz");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network");
    let x: HashMap<String, Tensor> = Tensor::read_npz(dir.join("structure_module.npz")).unwrap().into_iter().collect();
    let module = load_structure_module(dir.join("structure_module_params.npz"), 8).unwrap();
    let mask = &x["seq_mask"];
    let dropout = Some((key_of(&f["key"]), f["rate"].double_value(&[])));
    let out = tch::no_grad(|| module.run(&x["single"], &x["pair"], &x["aatype"], mask, None, dropout)).unwrap();
    let check = |what: &str, got: &Tensor, want: &Tensor, dim: i64| {
        let (got, want) = (real_residues(got, mask, dim), real_residues(want, mask, dim));
        common::assert_close(what, &got, &want, TOLERANCE);
    };
    check("translations", &out.translations, &f["traj"].select(-1, 3), 1);
    check("rotations", &out.rotations, &f["traj"].narrow(-1, 0, 3), 1);
    check("single", &out.single, &f["act"], 0);
    let plain = tch::no_grad(|| module.run(&x["single"], &x["pair"], &x["aatype"], mask, None, None)).unwrap();
    let d = (&plain.single - &f["act"]).abs().max().double_value(&[]);
    assert!(d > 1e-2, "without dropout the single differs from AlphaFold's in training by only {d:e}");
}

#[test]
fn monomer_structure_module_in_training_equals_alphafold() {
    let f = arrays("structure_monomer.npz");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold");
    let module = StructureModule::new(&Params::load_model(dir.join("params.npz")).unwrap()).unwrap();
    let mask = &f["seq_mask"];
    let dropout = Some((key_of(&f["key"]), f["rate"].double_value(&[])));
    let out = tch::no_grad(|| module.run(&f["single"], &f["pair"], &f["aatype"], mask, None, dropout)).unwrap();
    let check = |what: &str, got: &Tensor, want: &Tensor, dim: i64| {
        let (got, want) = (real_residues(got, mask, dim), real_residues(want, mask, dim));
        common::assert_close(what, &got, &want, TOLERANCE);
    };
    // AlphaFold's affine: the quaternion, then the translation in nm (ours in Å).
    let scale = module.config().position_scale;
    check("translations", &out.translations, &(f["affine"].narrow(-1, 4, 3) * scale), 1);
    check("single", &out.single, &f["act"], 0);
}

/// One training pass of the whole Multimer network (`tests/multimer_model.rs`'s fixture) from
/// the pass key DeepMind's `AlphaFoldIteration` was given: the MSA sampling's, templates',
/// extra-MSA stack's and Evoformer's keys split from it as DeepMind's network splits them,
/// the structure module not dropping on either side (its key is ours). The bounds of
/// `tests/multimer_model.rs`: 1e-3 Å, logits 1e-4.
#[test]
fn a_multimer_training_pass_drops_as_alphafold_multimer() {
    let f = arrays("multimer_pass.npz");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network");
    let m: HashMap<String, Tensor> = Tensor::read_npz(dir.join("model.npz")).unwrap().into_iter().collect();
    let inputs = MultimerInputs::from_named(|n| m.get(n).map(|t| t.shallow_clone()), "model.npz").unwrap();
    let sampling = MsaSampling { num_msa: 6, num_extra_msa: 8, masked: MaskedMsaConfig::default() };
    let net = MultimerAlphaFold::load(dir.join("model_params.npz")).unwrap().with_sampling(sampling);
    let rates = DropoutRates { structure_module: 0.0, ..DropoutRates::ALPHAFOLD };
    let key = key_of(&f["key"]);
    let run = |exec: &Exec| tch::no_grad(|| net.pass(&inputs, net.initial_state(&inputs)?, key, exec)).unwrap();
    let pass = run(&Exec::serial().with_dropout(Some(rates)));
    let within = |what: &str, got: &Tensor, want: &Tensor, bound: f64| {
        let d = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[]);
        eprintln!("{what}: max |ours - AlphaFold| = {d:.2e}");
        assert!(d <= bound, "{what}: max |ours - AlphaFold| = {d:.3e} > {bound:.0e}");
        d
    };
    within("final atom positions (Å)", &pass.structure.atom37, &f["final_atom_positions"], 1e-3);
    within("distogram", &pass.heads.distogram, &f["distogram"], 1e-4);
    // Without dropout the pass is another: the masks are what matched.
    let plain = run(&Exec::serial());
    let d = (&plain.heads.distogram - &f["distogram"]).abs().max().double_value(&[]);
    assert!(d > 1e-2, "without dropout the distogram differs from AlphaFold's in training by only {d:e}");
}

struct Run {
    msa: Tensor,
    pair: Tensor,
    grads: Vec<(String, Tensor)>,
}

fn inputs(s: i64, r: i64, c_m: i64, c_z: i64) -> [Tensor; 4] {
    tch::manual_seed(23);
    let opts = (Kind::Float, Device::Cpu);
    let msa_mask = Tensor::rand([s, r], opts).gt(0.2).to_kind(Kind::Float);
    let _ = msa_mask.narrow(0, 0, 1).fill_(1.0);
    let pair_mask = Tensor::rand([r, r], opts).gt(0.2).to_kind(Kind::Float).maximum(&Tensor::eye(r, opts));
    [Tensor::randn([s, r, c_m], opts), Tensor::randn([r, r, c_z], opts), msa_mask, pair_mask]
}

/// A forward and backward of a tiny stack in training with `key` (`None`: no dropout).
fn run(params: &Params, extra: bool, x: &[Tensor; 4], exec: &Exec, key: Option<Key>) -> anyhow::Result<Run> {
    let params = params.to_device(Device::Cpu, true)?;
    let stack = if extra { EvoformerStack::extra(&params)? } else { EvoformerStack::main(&params)? };
    let msa = x[0].detach().set_requires_grad(true);
    let pair = x[1].detach().set_requires_grad(true);
    let (m, z, _) = stack.forward(kept(&msa), kept(&pair), &x[2], &x[3], exec, key)?;
    tch::manual_seed(99);
    let (wm, wz) =
        (Tensor::randn(m.size(), (Kind::Float, Device::Cpu)), Tensor::randn(z.size(), (Kind::Float, Device::Cpu)));
    let loss = (&m * wm).sum(Kind::Float) + (&z * wz).sum(Kind::Float);
    loss.backward();
    exec.dap().reduce_gradients(params.iter().map(|(_, t)| t))?;
    let mut grads = vec![("input msa".to_string(), msa.grad()), ("input pair".to_string(), pair.grad())];
    let prefix = if extra { EXTRA_MSA } else { EVOFORMER };
    grads.extend(params.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(k, t)| (k.to_string(), t.grad())));
    Ok(Run { msa: m.detach(), pair: z.detach(), grads })
}

/// `a` equals `b`: outputs within 1e-5, each gradient within 1e-4 of its largest reference
/// value (the bounds of `tests/dap.rs`); the softmax-invariant offset, whose gradient is zero up
/// to rounding, within 1e-4 of the largest gradient overall.
fn ensure_same(what: &str, a: &Run, b: &Run) -> TestResult {
    for (name, x, y) in [("msa", &a.msa, &b.msa), ("pair", &a.pair, &b.pair)] {
        let d = (x - y).abs().max().double_value(&[]);
        anyhow::ensure!(d <= 1e-5, "{what}: output {name} differs by {d:e} (tolerance 1e-5 abs)");
    }
    anyhow::ensure!(a.grads.len() == b.grads.len(), "{what}: gradient counts differ");
    let overall = b.grads.iter().map(|(_, g)| g.abs().max().double_value(&[])).fold(0.0, f64::max);
    let mut worst = 0.0f64;
    for ((name, x), (_, y)) in a.grads.iter().zip(&b.grads) {
        anyhow::ensure!(x.defined() && y.defined(), "{what}: {name} has no gradient");
        let mut scale = y.abs().max().double_value(&[]);
        if name.ends_with("msa_row_attention_with_pair_bias/feat_2d_norm//offset") {
            // The offset adds one constant per head to every logit of a row, which softmax
            // ignores: its gradient is zero up to rounding on both sides.
            scale = overall;
        }
        let d = (x - y).abs().max().double_value(&[]);
        worst = worst.max(d / scale);
        anyhow::ensure!(
            d <= 1e-4 * scale,
            "{what}: gradient of {name} differs by {d:e} (max |g| {scale:e}, rtol 1e-4)"
        );
    }
    eprintln!("{what}: worst relative gradient difference {worst:.2e}");
    Ok(())
}

fn tiny() -> (EvoformerConfig, Params) {
    let cfg = EvoformerConfig::tiny();
    let params = Params::random(&cfg, 37).unwrap();
    (cfg, params)
}

#[test]
fn checkpointed_blocks_draw_the_same_masks_on_recomputation() {
    let (cfg, params) = tiny();
    let key = Some(Key::from_seed(5));
    for extra in [false, true] {
        let c_m = if extra { cfg.c_e } else { cfg.c_m };
        let x = inputs(5, 6, c_m, cfg.c_z);
        let exec = Exec::serial().with_dropout(Some(DropoutRates::ALPHAFOLD));
        let plain = run(&params, extra, &x, &exec, key).unwrap();
        let checkpointed = run(&params, extra, &x, &exec.clone().with_checkpointed_blocks(true), key).unwrap();
        ensure_same(&format!("checkpointed (extra {extra})"), &checkpointed, &plain).unwrap();
    }
}

#[test]
fn a_key_draws_the_same_masks_twice_and_dropout_changes_the_outputs() {
    let (cfg, params) = tiny();
    let x = inputs(5, 6, cfg.c_m, cfg.c_z);
    let exec = Exec::serial().with_dropout(Some(DropoutRates::ALPHAFOLD));
    let a = run(&params, false, &x, &exec, Some(Key::from_seed(5))).unwrap();
    let b = run(&params, false, &x, &exec, Some(Key::from_seed(5))).unwrap();
    assert!(a.pair.equal(&b.pair) && a.msa.equal(&b.msa), "the same key gives the same outputs");
    let off = run(&params, false, &x, &Exec::serial(), Some(Key::from_seed(5))).unwrap();
    let other = run(&params, false, &x, &exec, Some(Key::from_seed(6))).unwrap();
    for (what, r) in [("without dropout", &off), ("with another key", &other)] {
        let d = (&r.pair - &a.pair).abs().max().double_value(&[]);
        assert!(d > 1e-2, "{what}: the pair differs by only {d:e}");
    }
    // Without a key nothing is drawn, whatever the rates.
    let keyless = run(&params, false, &x, &exec, None).unwrap();
    assert!(keyless.pair.equal(&off.pair), "no key, no dropout");
}

/// Under DAP every rank draws the whole mask and cuts its block: the outputs and gradients are
/// one process's, with sizes the rank count does not divide (so the padding is cut too).
fn dap_matches_one_process(world: &World) -> TestResult {
    let dap = Dap::new(world.group.clone());
    let (cfg, params) = tiny();
    let v3 = EvoformerConfig { outer_product_mean_first: true, fused_triangle_projections: true, ..cfg };
    let multimer = Params::random(&v3, 37)?;
    let key = Some(Key::from_seed(41));
    for (first, extra, s, r, chunk) in
        [(false, false, 5, 7, None), (true, false, 6, 5, Some(2)), (false, true, 7, 5, None)]
    {
        let params = if first { &multimer } else { &params };
        let what = format!("first {first}, extra {extra}, {s} x {r}, {} ranks", dap.size());
        let c_m = if extra { cfg.c_e } else { cfg.c_m };
        let x = inputs(s, r, c_m, cfg.c_z);
        let rates = Some(DropoutRates::ALPHAFOLD);
        let one = run(params, extra, &x, &Exec::serial().with_dropout(rates), key)?;
        let exec = Exec::new(dap.clone(), chunk).with_dropout(rates).with_checkpointed_blocks(true);
        let many = run(params, extra, &x, &exec, key)?;
        ensure_same(&what, &many, &one)?;
    }
    Ok(())
}

dist_test!(two_ranks_drop_as_one_process, 2, |world| { dap_matches_one_process(world) });

/// `t` for a stack that leaves it as it is.
fn kept(t: &Tensor) -> Stream {
    Stream::new(t.shallow_clone(), false)
}
