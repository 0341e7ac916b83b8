//! Dynamic axial parallelism on 2 and 4 CPU ranks (Gloo) against one process: outputs of the
//! Evoformer and extra-MSA stacks, and gradients of a scalar loss with respect to the inputs
//! and every parameter, with sequence and residue counts the rank counts do not divide; the
//! Evoformer stack also as AlphaFold-Multimer v3's (outer product mean first, fused triangle
//! projections); the stacks' inference forward in place, the outer product mean taking the MSA
//! in batches of sequences, also with the streams offloaded in turn; and the assembled
//! AlphaFold-Multimer network with recycling on 2 ranks.
use engine::dist::World;
use engine::parallel::dap::Dap;
use fastfold::model::exec::{ChunkOp, ChunkPlan, Stage};
use fastfold::model::layers::Stream;
use fastfold::model::{EvoformerConfig, EvoformerStack, Exec, Params, EVOFORMER, EXTRA_MSA};
use suite_tests::{dist_test, TestResult};
use tch::{Device, Kind, Tensor};

struct Run {
    msa: Tensor,
    pair: Tensor,
    grads: Vec<(String, Tensor)>,
}

/// One forward and backward of a stack on fresh copies of `params` and `x`.
fn run(params: &Params, extra: bool, x: &[Tensor; 4], exec: &Exec) -> anyhow::Result<Run> {
    let params = params.to_device(Device::Cpu, true)?;
    let stack = if extra { EvoformerStack::extra(&params)? } else { EvoformerStack::main(&params)? };
    let msa = x[0].detach().set_requires_grad(true);
    let pair = x[1].detach().set_requires_grad(true);
    let streams = (Stream::new(msa.shallow_clone(), false), Stream::new(pair.shallow_clone(), false));
    let (m, z, _) = stack.forward(streams.0, streams.1, &x[2], &x[3], exec, None)?;
    // Fixed weights make every output element matter to the loss.
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

/// The stack's inference forward (no autograd: the streams, its own copies, updated in place)
/// under `exec`.
fn run_in_place(params: &Params, extra: bool, x: &[Tensor; 4], exec: &Exec) -> anyhow::Result<(Tensor, Tensor)> {
    let stack = if extra { EvoformerStack::extra(params)? } else { EvoformerStack::main(params)? };
    tch::no_grad(|| {
        let streams = (Stream::new(x[0].copy(), true), Stream::new(x[1].copy(), true));
        let (m, z, _) = stack.forward(streams.0, streams.1, &x[2], &x[3], exec, None)?;
        Ok((m, z))
    })
}

fn inputs(s: i64, r: i64, c_m: i64, c_z: i64) -> [Tensor; 4] {
    tch::manual_seed(21);
    let opts = (Kind::Float, Device::Cpu);
    let msa_mask = Tensor::rand([s, r], opts).gt(0.2).to_kind(Kind::Float);
    let _ = msa_mask.narrow(0, 0, 1).fill_(1.0);
    let pair_mask = Tensor::rand([r, r], opts).gt(0.2).to_kind(Kind::Float).maximum(&Tensor::eye(r, opts));
    [Tensor::randn([s, r, c_m], opts), Tensor::randn([r, r, c_z], opts), msa_mask, pair_mask]
}

fn compare(world: &World) -> TestResult {
    let dap = Dap::new(world.group.clone());
    let cfg = EvoformerConfig::tiny();
    let params = Params::random(&cfg, 31)?;
    // AlphaFold-Multimer v3's block: the outer product mean first, reading the block's input
    // MSA, and fused triangle projections.
    let v3 = EvoformerConfig { outer_product_mean_first: true, fused_triangle_projections: true, ..cfg };
    let multimer = Params::random(&v3, 31)?;
    // (outer product mean first, stack, sequences, residues, chunk): 5, 6 and 7 leave
    // remainders on 2 and 4 ranks.
    let cases = [
        (false, false, 5, 7, None),
        (false, false, 6, 5, Some(2)),
        (false, true, 7, 6, None),
        (true, false, 5, 7, Some(2)),
    ];
    for (first, extra, s, r, chunk) in cases {
        let params = if first { &multimer } else { &params };
        let stack = if extra {
            "extra"
        } else if first {
            "main (outer product mean first)"
        } else {
            "main"
        };
        let what = format!("{stack} stack, {s} x {r}, {} ranks", dap.size());
        let c_m = if extra { cfg.c_e } else { cfg.c_m };
        let x = inputs(s, r, c_m, cfg.c_z);
        let one = run(params, extra, &x, &Exec::serial())?;
        let many = run(params, extra, &x, &Exec::new(dap.clone(), chunk))?;
        // Inference in place, the outer product mean's sequences 2 at a time.
        let op = ChunkOp::OuterProductMeanSequences;
        let plan = ChunkPlan::uniform(chunk).with(Stage::ExtraMsa, op, Some(2)).with(Stage::Evoformer, op, Some(2));
        let offloaded = plan.clone().offloading(Stage::ExtraMsa, true).offloading(Stage::Evoformer, true);
        let (lean_msa, lean_pair) = run_in_place(params, extra, &x, &Exec::planned(dap.clone(), plan))?;
        // And with the streams off the device in turn (on the CPU the moves are the identity,
        // the layout switches and the outer product mean's reads of the host MSA are not).
        let (off_msa, off_pair) = run_in_place(params, extra, &x, &Exec::planned(dap.clone(), offloaded))?;
        for (name, a, b) in [
            ("msa", &many.msa, &one.msa),
            ("pair", &many.pair, &one.pair),
            ("msa in place", &lean_msa, &one.msa),
            ("pair in place", &lean_pair, &one.pair),
            ("msa offloaded", &off_msa, &one.msa),
            ("pair offloaded", &off_pair, &one.pair),
        ] {
            let d = (a - b).abs().max().double_value(&[]);
            anyhow::ensure!(d <= 1e-5, "{what}: output {name} differs by {d:e} (tolerance 1e-5 abs)");
        }
        anyhow::ensure!(many.grads.len() == one.grads.len(), "{what}: gradient counts differ");
        let overall = one.grads.iter().map(|(_, g)| g.abs().max().double_value(&[])).fold(0.0, f64::max);
        for ((name, a), (_, b)) in many.grads.iter().zip(&one.grads) {
            anyhow::ensure!(a.defined() && b.defined(), "{what}: {name} has no gradient");
            if name.ends_with("msa_row_attention_with_pair_bias/feat_2d_norm//offset") {
                // The offset adds one constant per head to every logit of a row, which softmax
                // ignores: its gradient is zero up to rounding on both sides.
                let d = a.abs().max().double_value(&[]).max(b.abs().max().double_value(&[]));
                anyhow::ensure!(d <= 1e-4 * overall, "{what}: {name} has gradient {d:e}, expected ~0");
                continue;
            }
            let scale = b.abs().max().double_value(&[]);
            anyhow::ensure!(scale > 0.0, "{what}: {name}'s reference gradient is zero");
            let d = (a - b).abs().max().double_value(&[]);
            anyhow::ensure!(
                d <= 1e-4 * scale,
                "{what}: gradient of {name} differs by {d:e} (max |g| {scale:e}, rtol 1e-4)"
            );
        }
    }
    Ok(())
}

dist_test!(two_ranks_match_one_rank, 2, |world| { compare(world) });

dist_test!(four_ranks_match_one_rank, 4, |world| { compare(world) });

/// The assembled AlphaFold-Multimer network (`MultimerAlphaFold::predict`, the fixture of
/// `tests/multimer_model.rs`: tiny v3-layout parameters, the pipeline's heterodimer, 2
/// recycles) under DAP equals one process's: every rank samples the same MSA from the same
/// key, and holds only its rows of the pair from the embedders to the heads.
fn multimer_network(world: &World) -> TestResult {
    use fastfold::jax_random::Key;
    use fastfold::model::multimer::{MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs};
    use fastfold::model::recycling::Recycling;
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network");
    let f: std::collections::HashMap<String, Tensor> = Tensor::read_npz(dir.join("model.npz"))?.into_iter().collect();
    let inputs = MultimerInputs::from_named(|n| f.get(n).map(|t| t.shallow_clone()), "model.npz")?;
    let sampling = MsaSampling { num_msa: 6, num_extra_msa: 8, masked: MaskedMsaConfig::default() };
    let net = MultimerAlphaFold::load(dir.join("model_params.npz"))?.with_sampling(sampling);
    let recycling = Recycling { max: 2, early_stop_tolerance: 0.0 };
    let key = Key::from_seed(f["seed"].int64_value(&[]));
    let one = tch::no_grad(|| net.predict(&inputs, recycling, key, &Exec::serial()))?.0;
    let exec = Exec::new(Dap::new(world.group.clone()), Some(3));
    let many = tch::no_grad(|| net.predict(&inputs, recycling, key, &exec))?.0;
    anyhow::ensure!(many.pair_rows.is_split(), "{} ranks: the pass held the whole pair", world.size());
    let d = (&many.structure.atom37 - &one.structure.atom37).abs().max().double_value(&[]);
    anyhow::ensure!(d <= 1e-3, "{} ranks: atoms differ from one process's by {d:e} Å", world.size());
    anyhow::ensure!(many.heads.distogram.size()[0] == many.pair_rows.real(), "the heads held their rows");
    let d = (&many.heads.whole()?.distogram - &one.heads.distogram).abs().max().double_value(&[]);
    anyhow::ensure!(d <= 1e-4, "{} ranks: distogram logits differ by {d:e}", world.size());
    // The MSA's readout: each rank projects its rows of the sampled MSA, the logits gathered.
    for (name, a, b) in [
        ("masked-MSA logits", &many.heads.masked_msa, &one.heads.masked_msa),
        ("MSA first row", &many.recycled.msa_first_row, &one.recycled.msa_first_row),
        ("single representation", &many.single, &one.single),
    ] {
        anyhow::ensure!(a.size() == b.size(), "{name}: {:?} against {:?}", a.size(), b.size());
        let (d, scale) = ((a - b).abs().max().double_value(&[]), b.abs().max().double_value(&[]));
        anyhow::ensure!(d <= 1e-5 * scale.max(1.0), "{name} differ by {d:e} (largest {scale:e})");
    }
    // pTM and ipTM from the ranks' rows of the aligned-error logits.
    use fastfold::confidence::predicted_tm_score_of_chains;
    let weights = inputs.seq_mask.to_kind(Kind::Float);
    let asym = inputs.asym_id.to_kind(Kind::Int64);
    for chains in [None, Some(&asym)] {
        let score = |p: &fastfold::model::alphafold::Pass| -> anyhow::Result<f64> {
            let logits = p.heads.aligned_error.as_ref().ok_or_else(|| anyhow::anyhow!("no PAE"))?;
            predicted_tm_score_of_chains(logits, &p.heads.rows, 31.0, &weights, chains)
        };
        let (a, b) = (score(&many)?, score(&one)?);
        anyhow::ensure!(
            (a - b).abs() <= 1e-5,
            "{} ranks: TM-score (chains {}) {a} against {b}",
            world.size(),
            chains.is_some()
        );
    }
    Ok(())
}

dist_test!(multimer_network_on_two_ranks_matches_one_rank, 2, |world| { multimer_network(world) });

/// Template features of one random template over `n` residues for `slices` recycling slices.
fn random_template(n: i64, slices: i64) -> fastfold::features::TemplateFeatures {
    let f = (Kind::Float, Device::Cpu);
    tch::manual_seed(8);
    let positions = Tensor::randn([n, 37, 3], f) * 6.0;
    let t = fastfold::features::TemplateFeatures {
        aatype: Tensor::randint(20, [n], (Kind::Int64, Device::Cpu)),
        pseudo_beta: positions.select(1, 3),
        all_atom_positions: positions,
        all_atom_masks: Tensor::ones([n, 37], f),
        pseudo_beta_mask: Tensor::ones([n], f),
        mask: Tensor::ones([], f),
    };
    t.map(|x| x.unsqueeze(0).unsqueeze(0).expand([&[slices, 1][..], &x.size()[..]].concat(), false).contiguous())
}

/// `seq` with residue `i % len` and every third after it replaced by another amino acid.
fn mutated(seq: &str, i: usize) -> String {
    let letters = b"ARNDCQEGHILKMFPSTWYV";
    seq.bytes()
        .enumerate()
        .map(|(k, c)| match (k + i).is_multiple_of(3) {
            true => letters[(k * 7 + i) % letters.len()] as char,
            false => c as char,
        })
        .collect()
}

/// The assembled monomer network (`AlphaFold::predict_recycling`: templates, the extra-MSA
/// stack, the aligned-error head, 2 recycles) under DAP equals one process's, where each rank
/// holds only its rows of the pair from the embedders to the heads (`PairRows`): residue
/// counts the ranks divide and do not, down to a rank whose rows are all padding (6 residues
/// on 4 ranks), chunked and not; and training's forward, whose last pass takes the whole pair
/// from a recycle that held rows.
fn monomer_network(world: &World) -> TestResult {
    use fastfold::features::{process, FeatureConfig, RawFeatures};
    use fastfold::model::alphafold::AlphaFold;
    use fastfold::model::recycling::Recycling;
    use fastfold::model::{ModelConfig, TemplateConfig};
    let model =
        ModelConfig { templates: Some(TemplateConfig::tiny()), aligned_error_bins: Some(7), ..ModelConfig::tiny() };
    let net = AlphaFold::new(&Params::random_model(&EvoformerConfig::tiny(), &model, 23)?)?;
    let recycling = Recycling { max: 2, early_stop_tolerance: 0.0 };
    let dap = Dap::new(world.group.clone());
    // The last case pads the MSA with 5 fully-masked rows, as AlphaFold pads its clusters: the
    // rows that run (one stand-in for the padding) then the template's row are split over
    // the ranks, and the padding's logits restored from the stand-in's. At 12 residues, which
    // the ranks divide: a fully-masked row's row attention (every key masked) is uniform over
    // its keys, so where DAP pads the residues its padding rows' masked-MSA logits (which no
    // loss or measure reads) differ from one process's.
    for (seq, chunk, padding) in
        [("MRFKGS", None, 0), ("MKTAYIAKQRQIS", Some(2), 0), ("MKTAYIAKQRQIS", None, 0), ("MKTAYIAKQRQI", None, 5)]
    {
        // An alignment of 9 hits: 2 cluster centres, the rest the extra MSA (rows the ranks
        // embed a block each of).
        let hits: String = (0..9).map(|i| format!(">hit{i}\n{}\n", mutated(seq, i))).collect();
        let source = std::path::Path::new("hits.a3m");
        let msa = data::a3m::parse(&format!(">query\n{seq}\n{hits}"), source)?;
        let raw = RawFeatures::new(seq, Some((&msa, source)))?;
        let config = FeatureConfig { num_recycle: 2, max_msa_clusters: 3, ..FeatureConfig::default() };
        let mut features = process(&raw, &config, 0, Device::Cpu)?;
        features.templates = Some(random_template(seq.len() as i64, 3));
        if padding > 0 {
            // [slices, rows, ...] with `padding` zero rows appended.
            let pad = |t: &Tensor| {
                let mut shape = t.size();
                shape[1] = padding;
                Tensor::cat(&[t.shallow_clone(), Tensor::zeros(shape, (t.kind(), t.device()))], 1)
            };
            features.msa_feat = pad(&features.msa_feat);
            features.msa_mask = pad(&features.msa_mask);
        }
        let run = |exec: &Exec| tch::no_grad(|| net.predict_recycling(&features, recycling, Kind::Float, exec));
        let (one, _) = run(&Exec::new(Dap::none(), chunk))?;
        let (many, _) = run(&Exec::new(dap.clone(), chunk))?;
        let what = format!("{} residues, chunk {chunk:?}, {padding} padding rows, {} ranks", seq.len(), world.size());
        anyhow::ensure!(many.pair_rows.is_split(), "{what}: the pass held the whole pair");
        anyhow::ensure!(many.heads.distogram.size()[0] == many.pair_rows.real(), "{what}: the heads held every row");
        // The confidence measures from the ranks' rows of the logits (collectives).
        use fastfold::confidence::Confidence;
        let measures = |p: &fastfold::model::alphafold::Pass| {
            Confidence::from_logits(&p.heads.lddt, p.heads.aligned_error.as_ref(), &p.heads.rows)
        };
        let (c_many, c_one) = (measures(&many)?, measures(&one)?);
        let (ptm_many, ptm_one) = (c_many.ptm.unwrap_or(f64::NAN), c_one.ptm.unwrap_or(f64::NAN));
        anyhow::ensure!((ptm_many - ptm_one).abs() <= 1e-5, "{what}: pTM {ptm_many} against {ptm_one}");
        let pae = |c: &Confidence| Tensor::from_slice2(c.pae.as_deref().unwrap_or_default());
        let d = (pae(&c_many) - pae(&c_one)).abs().max().double_value(&[]);
        anyhow::ensure!(d <= 1e-4, "{what}: PAE differs by {d:e} Å");
        // What `--save-outputs` writes: the pair and the logits whole on rank 0's host, a
        // rank's block at a time; nothing on the other ranks.
        let whole = many.whole_on_host()?;
        anyhow::ensure!(
            whole.is_some() == (world.rank() == 0),
            "{what}: rank {} got {}",
            world.rank(),
            whole.is_some()
        );
        let no_pae = || anyhow::anyhow!("no PAE");
        let mut compared = vec![];
        if let Some(whole) = &whole {
            anyhow::ensure!(
                whole.pair.device() == Device::Cpu && whole.heads.distogram.device() == Device::Cpu,
                "{what}: on a device"
            );
            let (a, b) = (whole.heads.aligned_error.as_ref(), one.heads.aligned_error.as_ref());
            compared.push(("aligned-error logits", a.ok_or_else(no_pae)?, b.ok_or_else(no_pae)?));
            compared.push(("distogram logits", &whole.heads.distogram, &one.heads.distogram));
            compared.push(("pair", &whole.pair, &one.recycled.pair));
        }
        // Sums in another order: on 2 ranks at 13 residues up to 2e-7 of the largest value
        // (1.2e-4 on distogram logits up to 625: random parameters), 5e-5 Å.
        let atoms = (&many.structure.atom37 - &one.structure.atom37).abs().max().double_value(&[]);
        anyhow::ensure!(atoms <= 1e-3, "{what}: atom positions differ by {atoms:e} Å (tolerance 1e-3)");
        let rows = one.heads.masked_msa.size()[0];
        anyhow::ensure!(rows == 3 + padding, "{what}: masked-MSA logits of {rows} rows");
        for (name, a, b) in [
            ("pLDDT logits", &many.heads.lddt, &one.heads.lddt),
            ("masked-MSA logits", &many.heads.masked_msa, &one.heads.masked_msa),
            ("MSA first row", &many.recycled.msa_first_row, &one.recycled.msa_first_row),
            ("single representation", &many.single, &one.single),
        ]
        .into_iter()
        .chain(compared)
        {
            let (d, scale) = ((a - b).abs().max().double_value(&[]), b.abs().max().double_value(&[]));
            anyhow::ensure!(d <= 1e-5 * scale, "{what}: {name} differ by {d:e} (largest {scale:e}, rtol 1e-5)");
        }
        // Training's forward: the recycle without autograd holds the rank's rows, the last
        // pass (recording gradients) the whole pair, gathered from them.
        let train = |exec: &Exec| net.predict(&features, 1, Kind::Float, exec, None);
        let (one, many) = (train(&Exec::new(Dap::none(), chunk))?, train(&Exec::new(dap.clone(), chunk))?);
        anyhow::ensure!(!many.pair_rows.is_split(), "{what}: the pass recording gradients held the pair's rows");
        let d = (&many.heads.distogram - &one.heads.distogram).abs().max().double_value(&[]);
        let scale = one.heads.distogram.abs().max().double_value(&[]);
        anyhow::ensure!(d <= 1e-5 * scale, "{what}, training: distogram logits differ by {d:e} (largest {scale:e})");
    }
    Ok(())
}

dist_test!(monomer_network_on_two_ranks_matches_one_rank, 2, |world| { monomer_network(world) });

dist_test!(monomer_network_on_four_ranks_matches_one_rank, 4, |world| { monomer_network(world) });

/// Without autograd the triangle multiplications pass the other endpoint's projection around
/// the ranks a piece at a time instead of gathering it whole on every rank (FastFold's issue
/// #115: per-rank memory that does not fall with the ranks): a rank's peak over an Evoformer
/// block stays well under the whole projection. A block whose triangle projections dominate
/// its memory (64 channels over a pair of 8), in pieces of 2 rows, its peak from the CPU
/// allocator's counter: 0.49 of the projection on 4 ranks; gathering it, 1.16.
fn projection_never_whole(world: &World) -> TestResult {
    use engine::host_memory;
    host_memory::track()?;
    let exec = Exec::new(Dap::new(world.group.clone()), Some(2));
    let cfg = EvoformerConfig { num_blocks: 1, c_z: 8, tri_mul_channels: 64, ..EvoformerConfig::tiny() };
    let stack = EvoformerStack::main(&Params::random(&cfg, 5)?)?;
    let (s, r) = (2, 64);
    let x = inputs(s, r, cfg.c_m, cfg.c_z);
    let whole = (r * r * cfg.tri_mul_channels * 4) as f64;
    let peak = tch::no_grad(|| -> anyhow::Result<f64> {
        let streams = (Stream::new(x[0].copy(), true), Stream::new(x[1].copy(), true));
        let before = host_memory::stats()?.current;
        host_memory::reset_peak()?;
        let out = stack.forward(streams.0, streams.1, &x[2], &x[3], &exec, None)?;
        let peak = host_memory::stats()?.peak - before;
        drop(out);
        Ok(peak as f64)
    })?;
    let ranks = world.size();
    anyhow::ensure!(
        peak <= 0.75 * whole,
        "{ranks} ranks: the block's peak is {:.2} of the whole triangle projection (at most 0.75)",
        peak / whole
    );
    Ok(())
}

dist_test!(four_ranks_never_hold_a_whole_triangle_projection, 4, |world| { projection_never_whole(world) });
