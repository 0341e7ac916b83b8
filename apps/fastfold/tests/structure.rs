//! The structure module: invariant point attention is invariant to global rigid motions;
//! torsion angles put through the rigid groups and read back from the atoms by AlphaFold's
//! independent torsion extraction come back unchanged; bond lengths of every residue type
//! are the literature ones; a zero backbone update keeps identity frames; the parameters load
//! back to identical outputs and a missing array is named.
use fastfold::geometry::Rigid;
use fastfold::model::structure::{atom14_to_atom37, frames_to_atom14, torsion_angles_to_frames, StructureModule};
use fastfold::model::templates::torsion_angles;
use fastfold::model::{EvoformerConfig, ModelConfig, Params};
use fastfold::residue_constants::{atom_order, Tables};
use tch::{Device, Kind, Tensor};

const F: (Kind, Device) = (Kind::Float, Device::Cpu);

/// Deterministic pseudo-random values in [-1, 1) (no global generator: tests run in parallel).
fn noise(shape: &[i64], seed: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (((i as f64 + 1.0) * 12.9898 + seed).sin() * 43758.5453).fract() as f32).collect();
    Tensor::from_slice(&v).reshape(shape)
}

/// Random rigid motions: rotations from normalised quaternions, translations.
fn rigid(n: i64, seed: f64, scale: f64) -> Rigid {
    Rigid::from_quaternion(&noise(&[n, 4], seed), &(noise(&[n, 3], seed + 1.0) * scale))
}

fn params() -> Params {
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 23).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn invariant_point_attention_ignores_a_global_rigid_motion() {
    let p = params();
    let m = StructureModule::new(&p).unwrap();
    let (n, c) = (7, ModelConfig::tiny());
    let act = noise(&[n, c.c_s], 1.0);
    let pair = noise(&[n, n, EvoformerConfig::tiny().c_z], 2.0);
    let mask = Tensor::ones([n], F);
    let frames = rigid(n, 3.0, 2.0);
    let motion = rigid(1, 9.0, 5.0);
    let moved = motion.compose(&frames);
    let a = m.invariant_point_attention(&act, &pair, &mask, &frames).unwrap();
    let b = m.invariant_point_attention(&act, &pair, &mask, &moved).unwrap();
    let d = max_diff(&a, &b);
    assert!(d < 1e-4, "IPA changed by {d} under a global rotation and translation (fp32)");
    assert!(a.abs().max().double_value(&[]) > 1e-2, "the update is not trivially zero");
}

#[test]
fn torsions_through_the_rigid_groups_come_back_from_the_atoms() {
    let tables = Tables::new(Device::Cpu);
    let aatype = Tensor::arange(20, (Kind::Int64, Device::Cpu));
    let n = 20;
    let raw = noise(&[n, 7, 2], 4.0);
    let angles = &raw / (raw.square().sum_dim_intlist(-1, true, Kind::Float).sqrt());
    let backbone = rigid(n, 5.0, 10.0);
    let frames = torsion_angles_to_frames(&tables, &aatype, &backbone, &angles).unwrap();
    let atom14 = frames_to_atom14(&tables, &aatype, &frames).unwrap();
    let (atom37, mask) = atom14_to_atom37(&tables, &aatype, &atom14).unwrap();
    let (back, _, back_mask) = torsion_angles(&aatype.unsqueeze(0), &atom37.unsqueeze(0), &mask.unsqueeze(0)).unwrap();
    let (back, back_mask) = (back.squeeze_dim(0), back_mask.squeeze_dim(0));
    // psi (2) and chi1..chi4 (3..6) place atoms; omega and phi groups hold no heavy atom.
    for k in 2..7 {
        let m = back_mask.select(1, k).unsqueeze(-1);
        let d = max_diff(&(back.select(1, k) * &m), &(angles.select(1, k) * &m));
        assert!(d < 1e-4, "torsion {k}: read back differently by {d}");
    }
    let chis = back_mask.narrow(1, 3, 4).sum(Kind::Float).double_value(&[]);
    assert_eq!(chis, 39.0, "the 20 residue types have 39 chi angles");

    // Bond lengths, whatever the torsions.
    let pos = |a: &str| atom37.select(1, atom_order(a).unwrap() as i64);
    let length = |a: &str, b: &str| (pos(a) - pos(b)).square().sum_dim_intlist(-1, false, Kind::Float).sqrt();
    for (a, b, want) in [("N", "CA", 1.46), ("CA", "C", 1.525), ("C", "O", 1.23)] {
        let d = (length(a, b) - want).abs().max().double_value(&[]);
        assert!(d < 0.02, "{a}-{b} bond off by {d} Å");
    }
    let has_cb = mask.select(1, atom_order("CB").unwrap() as i64);
    let cb = ((length("CA", "CB") - 1.53).abs() * &has_cb).max().double_value(&[]);
    assert!(cb < 0.02, "CA-CB bond off by {cb} Å");
    assert_eq!(has_cb.sum(Kind::Float).double_value(&[]), 19.0, "every type but glycine has CB");
    let absent = mask.ones_like() - &mask;
    let outside = (atom37.abs().sum_dim_intlist(-1, false, Kind::Float) * absent).max().double_value(&[]);
    assert_eq!(outside, 0.0, "atoms a residue type lacks stay at zero");
}

#[test]
fn zero_backbone_updates_keep_identity_frames() {
    let mut p = params();
    for key in ["weights", "bias"] {
        let k = format!("alphafold/alphafold_iteration/structure_module/fold_iteration/affine_update//{key}");
        let zeros = p.get(&k).unwrap().zeros_like();
        p.set(&k, zeros).unwrap();
    }
    let m = StructureModule::new(&p).unwrap();
    let n = 5;
    let c = ModelConfig::tiny();
    let out = tch::no_grad(|| {
        m.forward(
            &noise(&[n, c.c_s], 6.0),
            &noise(&[n, n, EvoformerConfig::tiny().c_z], 7.0),
            &Tensor::from_slice(&[0i64, 7, 12, 19, 4]),
            &Tensor::ones([n], F),
        )
    })
    .unwrap();
    assert_eq!(out.rotations.size(), [c.structure.layers, n, 3, 3]);
    assert_eq!(out.translations.abs().max().double_value(&[]), 0.0);
    let eye = Tensor::eye(3, F).expand([c.structure.layers, n, 3, 3], false);
    assert!(max_diff(&out.rotations, &eye) < 1e-6);
    // Every CA sits at the origin of its (identity) frame.
    let ca = out.atom37.select(1, atom_order("CA").unwrap() as i64);
    assert!(ca.abs().max().double_value(&[]) < 1e-6);
    assert_eq!(out.atom37_mask.select(0, 1).sum(Kind::Float).double_value(&[]), 4.0, "glycine has 4 heavy atoms");
}

#[test]
fn parameters_round_trip_and_a_missing_array_is_named() {
    let dir = std::env::temp_dir().join(format!("fastfold-structure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("p.npz");
    let p = params();
    p.save(&path).unwrap();
    let loaded = Params::load_model(&path).unwrap();
    assert_eq!(loaded.model_config().unwrap().structure, ModelConfig::tiny().structure);
    let n = 6;
    let c = ModelConfig::tiny();
    let inputs = (
        noise(&[n, c.c_s], 8.0),
        noise(&[n, n, EvoformerConfig::tiny().c_z], 9.0),
        Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6]),
        Tensor::ones([n], F),
    );
    let run = |p: &Params| {
        let m = StructureModule::new(p).unwrap();
        tch::no_grad(|| m.forward(&inputs.0, &inputs.1, &inputs.2, &inputs.3)).unwrap().atom37
    };
    assert!(run(&p).equal(&run(&loaded)), "identical positions after the round trip");

    let mut arrays: Vec<(String, Tensor)> = Tensor::read_npz(&path).unwrap();
    let key = "alphafold/alphafold_iteration/structure_module/fold_iteration/rigid_sidechain/resblock2_1//weights";
    arrays.retain(|(k, _)| k != key);
    let partial = dir.join("partial.npz");
    data::checkpoint::save_npz(&arrays, &partial).unwrap();
    let err = Params::load_model(&partial).err().unwrap().to_string();
    assert!(err.contains(key) && err.contains("partial.npz"), "{err}");
}
