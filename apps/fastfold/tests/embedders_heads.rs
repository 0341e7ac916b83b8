//! The embedders and heads on a tiny model: output shapes, the relative-position and
//! recycling bins of known inputs, a symmetric distogram, key/shape errors naming the key and
//! both shapes, and an npz round trip giving identical outputs.
use engine::parallel::dap::Dap;
use fastfold::model::embedders::{distance_one_hot, relative_position_one_hot, RECYCLE_MAX_BIN, RECYCLE_MIN_BIN};
use fastfold::model::evoformer::StackMsa;
use fastfold::model::exec::{ChunkOp, ChunkPlan, Stage};
use fastfold::model::keys::ITERATION;
use fastfold::model::masked_rows::MsaRows;
use fastfold::model::pair_rows::PairRows;
use fastfold::model::{
    Embedders, Error, EvoformerConfig, Exec, HeadInputs, HeadOutputs, Heads, ModelConfig, Params, Recycled,
};
use tch::{Device, Kind, Tensor};

const F: (Kind, Device) = (Kind::Float, Device::Cpu);
const EMB: &str = "alphafold/alphafold_iteration/evoformer";

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("fastfold-eh-{}-{name}", std::process::id()))
}

fn params(seed: i64) -> Params {
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), seed).unwrap()
}

/// Embeds random features for `s` sequences of `n` residues, recycles random values, and runs
/// every head on the results (the structure module's single is random).
fn run_all(p: &Params, s: i64, n: i64) -> (Tensor, Tensor, Tensor, HeadOutputs) {
    let cfg = *p.config();
    let emb = Embedders::new(p).unwrap();
    let heads = Heads::new(p).unwrap();
    tch::manual_seed(100);
    let target = Tensor::randn([n, 22], F);
    let msa_feat = Tensor::randn([s, n, 49], F);
    let residue_index = Tensor::arange(n, (Kind::Int64, Device::Cpu));
    let prev = Recycled {
        msa_first_row: Tensor::randn([n, cfg.c_m], F),
        pair: Tensor::randn([n, n, cfg.c_z], F),
        pseudo_beta: Tensor::randn([n, 3], F) * 8.0,
    };
    let extra = Tensor::randint(23, [s + 1, n], (Kind::Int64, Device::Cpu));
    let has_del = Tensor::rand([s + 1, n], F).gt(0.5).to_kind(Kind::Float);
    let del_val = Tensor::rand([s + 1, n], F);
    let structure_single = Tensor::randn([n, ModelConfig::tiny().c_s], F);
    tch::no_grad(|| {
        let (m, z) = emb.input.forward(&target, &msa_feat, &residue_index).unwrap();
        let (m, z) = emb.recycling.forward(&m, &z, &prev).unwrap();
        let extra_embedder = emb.extra_msa.as_ref().unwrap();
        let e = extra_embedder.forward(&extra, &has_del, &del_val, &Exec::serial()).unwrap();
        // Rows at a time (2, then the last alone): the same representation, bit for bit.
        let plan = ChunkPlan::uniform(None).with(Stage::Outer, ChunkOp::ExtraMsaEmbedding, Some(2));
        let rows = extra_embedder.forward(&extra, &has_del, &del_val, &Exec::planned(Dap::none(), plan)).unwrap();
        assert!(rows.equal(&e), "the extra-MSA embedder rows at a time differs from its whole pass");
        let rows = MsaRows::all(m.size()[0], m.size()[0]);
        let readout = heads.read_msa(StackMsa::from_whole(m.shallow_clone()), &rows, Device::Cpu).unwrap();
        assert!(readout.first_row.equal(&m.select(0, 0)), "the readout's first row is the MSA's");
        let pair_rows = PairRows::whole(n);
        let inputs = HeadInputs { msa: &readout, pair: &z, pair_rows: &pair_rows, structure_single: &structure_single };
        let out = heads.forward(&inputs);
        (m, z, e, out.unwrap())
    })
}

#[test]
fn every_module_has_the_expected_output_shapes() {
    let p = params(1);
    let (cfg, model) = (*p.config(), ModelConfig::tiny());
    assert_eq!(p.model_config().unwrap(), model, "the sizes are read back from the shapes");
    let (s, n) = (3, 5);
    let (m, z, e, out) = run_all(&p, s, n);
    assert_eq!(m.size(), [s, n, cfg.c_m]);
    assert_eq!(z.size(), [n, n, cfg.c_z]);
    assert_eq!(e.size(), [s + 1, n, cfg.c_e]);
    assert_eq!(out.distogram.size(), [n, n, 64]);
    assert_eq!(out.lddt.size(), [n, 50]);
    assert_eq!(out.masked_msa.size(), [s, n, 23]);
    assert_eq!(out.experimentally_resolved.size(), [n, 37]);
    assert_eq!(out.aligned_error.as_ref().unwrap().size(), [n, n, 64]);
    let plddt = out.plddt();
    assert_eq!(plddt.size(), [n]);
    assert!(plddt.min().double_value(&[]) >= 0.0 && plddt.max().double_value(&[]) <= 100.0);
    let (pae, max) = out.predicted_aligned_error().unwrap().unwrap();
    assert_eq!(pae.size(), [n, n]);
    assert!(pae.max().double_value(&[]) <= max);
    let ptm = out.ptm().unwrap().unwrap();
    assert!((0.0..=1.0).contains(&ptm), "pTM {ptm}");
}

#[test]
fn relative_positions_land_in_clipped_bins() {
    // Offsets i - j: 0, -1, -40 (clipped to -32), 100 (clipped to +32), 31.
    let ri = Tensor::from_slice(&[10i64, 11, 50, 150, 119]);
    let oh = relative_position_one_hot(&ri, 32, Kind::Float).unwrap();
    assert_eq!(oh.size(), [5, 5, 65]);
    let bin = |i: i64, j: i64| oh.get(i).get(j).argmax(0, false).int64_value(&[]);
    assert_eq!(bin(0, 0), 32);
    assert_eq!(bin(0, 1), 31);
    assert_eq!(bin(0, 2), 0, "offset -40 is clipped to the first bin");
    assert_eq!(bin(3, 0), 64, "offset +140 is clipped to the last bin");
    assert_eq!(bin(4, 3), 1, "offset -31 is not clipped");
    assert_eq!(bin(3, 4), 63, "offset +31 is not clipped");
    assert_eq!(oh.sum(Kind::Float).double_value(&[]), 25.0, "exactly one bin per pair");
}

#[test]
fn recycled_distances_land_in_their_bins() {
    // Distances from residue 0: 0 (no bin), 3.0 (below 3.25: no bin), 3.3 (bin 0), 4.6 (bin 1;
    // edges every 1.25 Å), 20.0 (bin 13), 25.0 (open last bin 14).
    let xs = [0.0f32, 3.0, 3.3, 4.6, 20.0, 25.0];
    let pos = Tensor::from_slice(&xs).unsqueeze(1) * Tensor::from_slice(&[1.0f32, 0.0, 0.0]).unsqueeze(0);
    let d = distance_one_hot(&pos, 15, RECYCLE_MIN_BIN, RECYCLE_MAX_BIN).unwrap();
    assert_eq!(d.size(), [6, 6, 15]);
    let row = d.get(0);
    let expected: [Option<i64>; 6] = [None, None, Some(0), Some(1), Some(13), Some(14)];
    for (j, want) in expected.iter().enumerate() {
        let r = row.get(j as i64);
        let total = r.sum(Kind::Float).double_value(&[]);
        match want {
            None => assert_eq!(total, 0.0, "distance {} falls in no bin", xs[j]),
            Some(b) => {
                assert_eq!(total, 1.0, "distance {} falls in one bin", xs[j]);
                assert_eq!(r.argmax(0, false).int64_value(&[]), *b, "distance {}", xs[j]);
            }
        }
    }
    assert!(d.equal(&d.transpose(0, 1)), "distances are symmetric");
}

#[test]
fn distogram_logits_are_symmetric() {
    let (_, _, _, out) = run_all(&params(2), 2, 6);
    let diff = (&out.distogram - out.distogram.transpose(0, 1)).abs().max().double_value(&[]);
    assert!(diff <= 1e-6, "distogram asymmetric by {diff:e} (tolerance 1e-6)");
    assert!(out.distogram.abs().max().double_value(&[]) > 0.1, "non-trivial logits");
}

#[test]
fn mis_shaped_inputs_name_the_input_and_both_shapes() {
    let p = params(3);
    let emb = Embedders::new(&p).unwrap();
    let ri = Tensor::arange(4, (Kind::Int64, Device::Cpu));
    let err = emb.input.forward(&Tensor::zeros([4, 21], F), &Tensor::zeros([2, 4, 49], F), &ri).unwrap_err();
    assert!(err.to_string().contains("target_feat: expected shape [residues, 22], found [4, 21]"), "{err}");
    let err = emb.input.forward(&Tensor::zeros([4, 22], F), &Tensor::zeros([2, 5, 49], F), &ri).unwrap_err();
    assert!(err.to_string().contains("msa_feat: expected shape [sequences, 4, 49], found [2, 5, 49]"), "{err}");
    // The extra MSA: a class out of range, a mis-shaped deletion input.
    let (classes, zero) = (Tensor::from_slice(&[0i64, 22, 23, 1]).view([2, 2]), Tensor::zeros([2, 2], F));
    let plan = ChunkPlan::uniform(None).with(Stage::Outer, ChunkOp::ExtraMsaEmbedding, Some(1));
    let (exec, extra) = (Exec::planned(Dap::none(), plan), emb.extra_msa.as_ref().unwrap());
    let err = extra.forward(&classes, &zero, &zero, &exec).unwrap_err();
    assert!(err.to_string().contains("extra_msa: classes must lie in [0, 23), found values from 0 to 23"), "{err}");
    let err = extra.forward(&classes.clamp(0, 22), &zero, &Tensor::zeros([2, 3], F), &exec).unwrap_err();
    assert!(err.to_string().contains("extra_deletion_value: expected shape [2, 2], found [2, 3]"), "{err}");
    let heads = Heads::new(&p).unwrap();
    let err = heads.distogram.forward(&Tensor::zeros([4, 3, 10], F)).unwrap_err();
    assert!(err.to_string().contains("pair: expected shape [4, 4, 10], found [4, 3, 10]"), "{err}");
}

/// Writes `params` with `key` replaced by `value` (or dropped) and loads the file back.
fn load_modified(params: &Params, key: &str, value: Option<Tensor>, name: &str) -> Result<Params, Error> {
    let mut arrays: Vec<(String, Tensor)> = params.iter().map(|(k, t)| (k.to_string(), t.shallow_clone())).collect();
    arrays.retain(|(k, _)| k != key);
    if let Some(v) = value {
        arrays.push((key.to_string(), v));
    }
    let path = temp(name);
    Tensor::write_npz(&arrays, &path).unwrap();
    let result = Params::load_model_npz(&path);
    std::fs::remove_file(&path).unwrap();
    result
}

#[test]
fn a_missing_or_mis_shaped_array_is_named() {
    let p = params(4);
    let key = format!("{EMB}/prev_pair_norm//scale");
    let err = load_modified(&p, &key, None, "missing.npz").err().expect("a missing array fails");
    assert!(matches!(&err, Error::Missing { key: k, .. } if *k == key), "{err}");
    assert!(err.to_string().contains(&key), "{err}");

    let key = format!("{ITERATION}/predicted_lddt_head/act_1//weights");
    let err = load_modified(&p, &key, Some(Tensor::zeros([11, 12], F)), "shape.npz").err().expect("fails");
    let msg = err.to_string();
    assert!(msg.contains(&key) && msg.contains("[11, 11]") && msg.contains("[11, 12]"), "{msg}");
    assert!(msg.contains("shape.npz"), "the message names the file: {msg}");
    // An array whose rank the sizes are read from, as a scalar: named with the file too.
    let key = format!("{ITERATION}/distogram_head/half_logits//weights");
    let err = load_modified(&p, &key, Some(Tensor::from(1.0f32)), "scalar.npz").err().expect("fails").to_string();
    assert!(err.contains("scalar.npz") && err.contains(&key) && err.contains("expected 2 dimensions"), "{err}");

    // Without the aligned-error head (a non-_ptm set) the store loads, without that head.
    let key = format!("{ITERATION}/predicted_aligned_error_head/logits//weights");
    let bias = format!("{ITERATION}/predicted_aligned_error_head/logits//bias");
    let mut arrays: Vec<(String, Tensor)> = p.iter().map(|(k, t)| (k.to_string(), t.shallow_clone())).collect();
    arrays.retain(|(k, _)| *k != key && *k != bias);
    let path = temp("noptm.npz");
    Tensor::write_npz(&arrays, &path).unwrap();
    let loaded = Params::load_model_npz(&path);
    std::fs::remove_file(&path).unwrap();
    let loaded = loaded.unwrap();
    assert_eq!(loaded.model_config().unwrap().aligned_error_bins, None);
    assert!(Heads::new(&loaded).unwrap().aligned_error.is_none());

    // Without only its weights, the head's bias has no user: an error, not a silent non-_ptm.
    let err = load_modified(&p, &key, None, "half_ptm.npz").err().expect("a half head fails").to_string();
    assert!(err.contains("half_ptm.npz") && err.contains("1 arrays no module uses") && err.contains(&bias), "{err}");
}

#[test]
fn npz_round_trip_gives_identical_outputs() {
    let p = params(5);
    let path = temp("roundtrip.npz");
    p.save(&path).unwrap();
    let loaded = Params::load_model_npz(&path);
    std::fs::remove_file(&path).unwrap();
    let loaded = loaded.unwrap();
    assert_eq!(loaded.len(), p.len());
    assert_eq!(loaded.model_config().unwrap(), p.model_config().unwrap());
    let (a, b) = (run_all(&p, 2, 4), run_all(&loaded, 2, 4));
    assert!(a.0.equal(&b.0) && a.1.equal(&b.1) && a.2.equal(&b.2), "embeddings differ after the round trip");
    let (x, y) = (&a.3, &b.3);
    assert!(x.distogram.equal(&y.distogram) && x.lddt.equal(&y.lddt) && x.masked_msa.equal(&y.masked_msa));
    assert!(x.experimentally_resolved.equal(&y.experimentally_resolved));
    assert!(x.aligned_error.as_ref().unwrap().equal(y.aligned_error.as_ref().unwrap()));
}
