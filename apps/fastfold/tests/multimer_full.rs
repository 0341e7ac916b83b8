//! AlphaFold-Multimer at full size against DeepMind's code
//! (`fixtures/multimer_network/make_multimer_full.py`, `modules_multimer` of
//! alphafold-colabfold, fp32 on CPU): `model_1_multimer_v3`'s widths and depths (48 Evoformer
//! blocks, 4 extra-MSA blocks, v3's template stack, 8 structure iterations) on random
//! parameters, a heteromer with templates and a homomer without, one recycle and the last
//! pass. The 93M parameters are not committed: the test redraws them from the script's
//! counter-based hash and its manifest of names, shapes and scales.
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::confidence::predicted_tm_score_of_chains;
use fastfold::jax_random::Key;
use fastfold::model::alphafold::Pass;
use fastfold::model::heads::MAX_ERROR_BIN;
use fastfold::model::multimer::{
    MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs, MULTIMER_STRUCTURE_ITERATIONS,
};
use fastfold::model::recycling::Recycling;
use fastfold::model::Exec;
use tch::{Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network").join(name)
}

/// Wellons' `lowbias32` hash, on one number.
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// `(x * m) mod 2^32` of int64 tensors holding 32-bit values, in products below 2^48 (the
/// multiplier split in 16-bit halves, so nothing overflows an int64).
fn mul32(x: &Tensor, m: u32) -> Tensor {
    let low = x * i64::from(m & 0xffff);
    let high = (x * i64::from(m >> 16)).bitwise_and(0xffff).bitwise_left_shift_tensor_scalar(16);
    (low + high).bitwise_and(0xffff_ffff)
}

/// `lowbias32` on every element of an int64 tensor of 32-bit values.
fn lowbias32_tensor(x: &Tensor) -> Tensor {
    let shift = |x: &Tensor, s: i64| x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(s));
    let x = mul32(&shift(x, 16), 0x7feb_352d);
    let x = mul32(&shift(&x, 15), 0x846c_a68b);
    shift(&x, 16)
}

/// Array `index` of the manifest as the fixture script draws it: at flat index `i`,
/// `(2 u - 1) * scale + offset` in float32, `u = (h(i ^ k) >> 8) / 2^24`, `k = h(h(index) ^ seed)`.
/// Every step is exact in float32 but the last two, each rounded once as numpy rounds it.
/// Drawn in pieces of 2^16 elements, which stay in the cache through the hash's 20 passes.
fn draw(seed: u32, index: u32, shape: &[i64], scale: f32, offset: f32) -> Tensor {
    const PIECE: i64 = 1 << 16;
    let k = i64::from(lowbias32(lowbias32(index) ^ seed));
    let n: i64 = shape.iter().product();
    let (scale, offset) = (Tensor::from(scale), Tensor::from(offset));
    let pieces: Vec<Tensor> = (0..n)
        .step_by(PIECE as usize)
        .map(|start| {
            let i = Tensor::arange_start(start, n.min(start + PIECE), (Kind::Int64, tch::Device::Cpu));
            let bits = lowbias32_tensor(&i.bitwise_xor(k));
            let u = bits.bitwise_right_shift_tensor_scalar(8).to_kind(Kind::Float) * 2f64.powi(-24);
            (u * 2.0 - 1.0) * &scale + &offset
        })
        .collect();
    Tensor::cat(&pieces, 0).reshape(shape)
}

/// The parameter file the manifest describes, written under a scratch folder, its largest
/// array's first values checked to be the script's bit for bit (`drawn` in `f`).
fn full_params(f: &HashMap<String, Tensor>) -> PathBuf {
    let start = std::time::Instant::now();
    let text = std::fs::read_to_string(fixture("full_manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let seed = manifest["seed"].as_u64().unwrap() as u32;
    let arrays: Vec<(String, Tensor)> = manifest["arrays"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(index, a)| {
            let shape: Vec<i64> = a[1].as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect();
            let (scale, offset) = (a[2].as_f64().unwrap() as f32, a[3].as_f64().unwrap() as f32);
            (a[0].as_str().unwrap().to_string(), draw(seed, index as u32, &shape, scale, offset))
        })
        .collect();
    let (_, largest) = &arrays[f["drawn_index"].int64_value(&[]) as usize];
    let want = &f["drawn"];
    assert!(largest.flatten(0, -1).narrow(0, 0, want.size()[0]).equal(want), "the draws differ from the script's");
    eprintln!("parameters drawn in {:.1} s", start.elapsed().as_secs_f64());
    let path = common::scratch("multimer_full", "params").until_exit().join("params_model_1_multimer_v3.npz");
    Tensor::write_npz(&arrays, &path).unwrap();
    path
}

/// What the outputs may differ by, absolute: atoms in Å, logits, pTM and ipTM, and the last
/// pass's single and MSA-first-row representations.
struct Tolerances {
    positions: f64,
    logits: f64,
    tm: f64,
    representations: f64,
}

/// In fp32, final atom positions within 1e-3 Å and logits within 1e-4, absolute (the issue's
/// bounds; observed 2.2e-4 Å of up to 81 Å and 8.4e-5 of up to 85): both sides sum in other
/// orders, and through 48 blocks, one recycle and the last pass fp32's rounding alone moves the
/// outputs by as much (ours in fp32 against ours in float64: the ignored test below).
/// pTM and ipTM are expectations over the PAE logits' softmax, so within their error (observed
/// 5e-8). The representations (observed 2.8e-5 of their largest values, about 30) say where a
/// difference starts; the outputs are the requirement.
const FP32: Tolerances = Tolerances { positions: 1e-3, logits: 1e-4, tm: 1e-5, representations: 1e-4 };

fn assert_within(what: &str, got: &Tensor, want: &Tensor, tolerance: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let diff = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[]);
    let largest = want.abs().max().double_value(&[]);
    eprintln!("{what}: max |ours - AlphaFold| = {diff:.2e} (largest |AlphaFold| {largest:.2e})");
    assert!(diff <= tolerance, "{what}: max |ours - AlphaFold| = {diff:.3e} > {tolerance:.0e}");
}

/// The network over the drawn parameters in `kind`, sampling as the script does.
fn network(f: &HashMap<String, Tensor>, kind: Kind) -> MultimerAlphaFold {
    let start = std::time::Instant::now();
    let path = full_params(f);
    let torch = (kernels::Backend::Torch, fastfold::model::AttentionKernel::Logits);
    let network = MultimerAlphaFold::load_on(path, MULTIMER_STRUCTURE_ITERATIONS, tch::Device::Cpu, Some(kind), torch)
        .unwrap()
        .with_sampling(MsaSampling { num_msa: 8, num_extra_msa: 8, masked: MaskedMsaConfig::default() });
    let c = network.config();
    assert_eq!((c.num_blocks, c.num_extra_blocks, c.c_m, c.c_z), (48, 4, 256, 128), "model_1_multimer_v3's sizes");
    eprintln!("parameters drawn, written and loaded in {:.1} s", start.elapsed().as_secs_f64());
    network
}

/// Runs case `case` of `f` (one recycle, then the last pass) and compares every output.
fn compare(network: &MultimerAlphaFold, f: &HashMap<String, Tensor>, case: &str, tol: &Tolerances) -> Pass {
    let g = |k: &str| &f[&format!("{case}_{k}")];
    let features =
        MultimerInputs::from_named(|name| f.get(&format!("{case}_{name}")).map(|t| t.shallow_clone()), "the fixture")
            .unwrap();
    assert_eq!(features.template_aatype.is_some(), case == "hetero", "{case}: templates");
    let recycling = Recycling { max: 1, early_stop_tolerance: 0.0 };
    let (pass, recycles) =
        tch::no_grad(|| network.predict(&features, recycling, Key::from_seed(39), &Exec::serial())).unwrap();
    assert_eq!(recycles, 1, "{case}: one recycle, then the last pass");
    let s = &pass.structure;
    let mask = g("final_atom_mask");
    assert!(s.atom37_mask.to_kind(Kind::Float).equal(&mask.to_kind(Kind::Float)), "{case}: atom mask");
    let masked = |x: &Tensor| x.to_kind(Kind::Double) * mask.to_kind(Kind::Double).unsqueeze(-1);
    let positions = &masked(g("final_atom_positions"));
    assert_within(&format!("{case} final atom positions (Å)"), &masked(&s.atom37), positions, tol.positions);
    let h = &pass.heads;
    let pae = h.aligned_error.as_ref().unwrap();
    for (what, got, want) in [
        ("distogram", &h.distogram, "distogram"),
        ("masked msa", &h.masked_msa, "masked_msa"),
        ("plddt", &h.lddt, "predicted_lddt"),
        ("aligned error", pae, "predicted_aligned_error"),
        ("experimentally resolved", &h.experimentally_resolved, "experimentally_resolved"),
    ] {
        assert_within(&format!("{case} {what} logits"), got, g(want), tol.logits);
    }
    let weights = features.seq_mask.to_kind(pae.kind());
    let asym_id = features.asym_id.to_kind(Kind::Int64);
    let ptm = predicted_tm_score_of_chains(pae, &pass.heads.rows, MAX_ERROR_BIN, &weights, None).unwrap();
    let iptm = predicted_tm_score_of_chains(pae, &pass.heads.rows, MAX_ERROR_BIN, &weights, Some(&asym_id)).unwrap();
    for (what, got, want) in [("ptm", ptm, g("ptm")), ("iptm", iptm, g("iptm"))] {
        let want = want.double_value(&[]);
        eprintln!("{case} {what}: ours {got:.8}, AlphaFold {want:.8}");
        assert!((got - want).abs() <= tol.tm, "{case} {what}: ours {got}, AlphaFold {want}");
    }
    for (what, got, want) in
        [("single", &pass.single, "single"), ("msa first row", &pass.recycled.msa_first_row, "msa_first_row")]
    {
        assert_within(&format!("{case} {what}"), got, g(want), tol.representations);
    }
    pass
}

#[test]
fn full_size_multimer_v3_equals_alphafold_multimer() {
    let start = std::time::Instant::now();
    let f: HashMap<String, Tensor> = Tensor::read_npz(fixture("full.npz")).unwrap().into_iter().collect();
    let network = network(&f, Kind::Float);
    for case in ["hetero", "homo"] {
        compare(&network, &f, case, &FP32);
    }
    eprintln!("whole test {:.1} s", start.elapsed().as_secs_f64());
}

/// Ours in float64 (the same fp32 draws, widened) against DeepMind's fp32, and against ours
/// in fp32: DeepMind's code cannot run in float64 (its `geometry` asserts float32 arrays), so
/// this measures what fp32 rounding alone moves: ours in fp32 lies as far from ours in float64
/// as from DeepMind's fp32, and ours in float64 as far from DeepMind's (observed: atoms 1.9e-4
/// and 1.5e-4 Å fp32 against float64, distogram 6.3e-5 and 5.8e-5; float64 against DeepMind's
/// fp32 1.3e-4 and 1.6e-4 Å, 6.6e-5 and 5.4e-5). About 7 minutes on the 2-core machine and
/// 1.1 GB of parameters, so it runs on request:
/// `cargo test -p fastfold --test multimer_full -- --ignored --nocapture`.
#[test]
#[ignore]
fn full_size_multimer_v3_in_float64_is_within_fp32_rounding_of_alphafold_multimer() {
    let f: HashMap<String, Tensor> = Tensor::read_npz(fixture("full.npz")).unwrap().into_iter().collect();
    let (single, double) = (network(&f, Kind::Float), network(&f, Kind::Double));
    for case in ["hetero", "homo"] {
        eprintln!("ours in fp32 against AlphaFold's fp32:");
        let ours32 = compare(&single, &f, case, &FP32);
        eprintln!("ours in float64 against AlphaFold's fp32:");
        let ours64 = compare(&double, &f, case, &FP32);
        let mask = f[&format!("{case}_final_atom_mask")].to_kind(Kind::Double).unsqueeze(-1);
        let atoms = |p: &Pass| p.structure.atom37.to_kind(Kind::Double) * &mask;
        // Fp32's rounding through the network: nonzero, and within the bounds fp32 is held to.
        for (what, a, b, tolerance) in [
            ("final atom positions (Å)", atoms(&ours32), atoms(&ours64), FP32.positions),
            ("distogram logits", ours32.heads.distogram, ours64.heads.distogram, FP32.logits),
        ] {
            let d = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[]);
            eprintln!("{case} {what}: max |ours fp32 - ours float64| = {d:.2e}");
            assert!(d > 0.0 && d <= tolerance, "{case} {what}: fp32 against float64 {d:e}");
        }
    }
}
