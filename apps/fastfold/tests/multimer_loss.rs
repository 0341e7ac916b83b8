//! AlphaFold-Multimer's structure-module loss against DeepMind's
//! (`folding_multimer.StructureModule.loss`, run by `fixtures/make_multimer_loss.py`) on a
//! two-chain complex and a prediction of it: every term within 1e-4 relative, the same residues
//! renamed, and the loss's gradient for every predicted input within 1e-3 of that input's
//! largest gradient. The whole training loss (the other heads' terms at Multimer's weights, after
//! the chain permutation alignment) against the same heads' `loss` functions
//! (`fixtures/make_multimer_total_loss.py`): every term and the total within 1e-4 relative, the
//! gradients within 1e-3, with the truth's chains in either order.
use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::geometry::Rigid;
use fastfold::ground_truth::GroundTruth;
use fastfold::loss::chain_permutation;
use fastfold::loss::multimer::{multimer_structure_loss, MultimerStructureLossConfig};
use fastfold::loss::multimer_total::{multimer_total_loss, ComplexLossInputs, MultimerLossConfig};
use fastfold::loss::MaskedMsaTarget;
use fastfold::model::heads::HeadOutputs;
use fastfold::model::structure::StructureOutput;
use tch::{Kind, Tensor};

/// Both sides compute in fp32, summing in other orders.
const VALUE_TOLERANCE: f64 = 1e-4;
/// Of each input's largest gradient.
const GRAD_TOLERANCE: f64 = 1e-3;

fn arrays() -> HashMap<String, Tensor> {
    fixture("structure_loss.npz")
}

fn fixture(name: &str) -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_loss").join(name);
    Tensor::read_npz(path).unwrap().into_iter().collect()
}

/// `[..., 3, 4]` (rotation, translation) as a rigid of `[..., 3, 3]` and `[..., 3]`.
fn rigid(x: &Tensor) -> Rigid {
    Rigid { rot: x.narrow(-1, 0, 3), trans: x.select(-1, 3) }
}

fn assert_term(what: &str, got: &Tensor, want: &Tensor) {
    let (got, want) = (got.double_value(&[]), want.double_value(&[]));
    let rel = (got - want).abs() / want.abs();
    eprintln!("{what}: ours {got:.7}, AlphaFold {want:.7}, relative difference {rel:.1e}");
    assert!(rel <= VALUE_TOLERANCE, "{what}: ours {got}, AlphaFold {want} (relative {rel:.2e})");
}

#[test]
fn multimer_structure_loss_and_its_gradients_equal_alphafold() {
    let a = arrays();
    let leaf = |k: &str| a[k].to_kind(Kind::Float).set_requires_grad(true);
    let (traj, sc_frames, atom14) = (leaf("traj"), leaf("sc_frames"), leaf("atom14"));
    let (angles, unnormalized) = (leaf("angles"), leaf("unnormalized_angles"));
    let (backbone, frames) = (rigid(&traj), rigid(&sc_frames));
    let n = a["aatype"].size()[0];
    let out = StructureOutput {
        single: Tensor::zeros([n, 1], (Kind::Float, tch::Device::Cpu)),
        rotations: backbone.rot,
        translations: backbone.trans,
        angles: angles.shallow_clone(),
        unnormalized_angles: unnormalized.shallow_clone(),
        frames,
        atom14: atom14.shallow_clone(),
        // Not read by the loss.
        atom37: Tensor::zeros([n, 37, 3], (Kind::Float, tch::Device::Cpu)),
        atom37_mask: Tensor::zeros([n, 37], (Kind::Float, tch::Device::Cpu)),
    };
    let aatype = a["aatype"].to_kind(Kind::Int64);
    let truth = GroundTruth::new(&aatype, &a["all_atom_positions"], &a["all_atom_mask"]).unwrap();
    let cfg = MultimerStructureLossConfig::default();
    let l = multimer_structure_loss(&out, &truth, &a["seq_mask"], &a["residue_index"], &a["asym_id"], &cfg).unwrap();

    assert!(
        l.alt_naming_is_better.equal(&a["alt_naming_is_better"]),
        "renamed residues: ours {:?}, AlphaFold {:?}",
        Vec::<f32>::try_from(&l.alt_naming_is_better).unwrap(),
        Vec::<f32>::try_from(&a["alt_naming_is_better"]).unwrap()
    );
    assert!(a["alt_naming_is_better"].sum(Kind::Float).double_value(&[]) > 0.0, "the fixture renames residues");
    assert_term("fape", &l.fape, &a["fape"]);
    assert_term("bb_loss", &l.backbone, &a["bb_loss"]);
    assert_term("sidechain_fape", &l.sidechain_fape, &a["sidechain_fape"]);
    assert_term("chi_loss", &l.chi_loss, &a["chi_loss"]);
    assert_term("angle_norm_loss", &l.angle_norm_loss, &a["angle_norm_loss"]);
    assert_term("violation", &l.violation, &a["violation"]);
    assert_term("loss", &l.loss, &a["loss"]);

    l.loss.backward();
    for (name, input) in [
        ("traj", &traj),
        ("sc_frames", &sc_frames),
        ("atom14", &atom14),
        ("angles", &angles),
        ("unnormalized_angles", &unnormalized),
    ] {
        let want = a[&format!("grad/{name}")].to_kind(Kind::Double);
        let got = input.grad().to_kind(Kind::Double);
        let scale = want.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name}: AlphaFold's gradient is 0");
        let rel = (&got - &want).abs().max().double_value(&[]) / scale;
        eprintln!("gradient of {name}: worst difference {rel:.1e} of its largest");
        assert!(rel <= GRAD_TOLERANCE, "gradient of {name}: differs by {rel:.2e} of its largest value");
    }
}

/// The two backbone terms split the pairs by chain: moving the second chain 50 Å as a whole
/// leaves the intra-chain FAPE as it was (its frames and points move together) and raises the
/// interface FAPE, whose frames of one chain see the other's points.
#[test]
fn moving_one_chain_changes_the_interface_term_only() {
    let a = arrays();
    let n = a["aatype"].size()[0];
    let aatype = a["aatype"].to_kind(Kind::Int64);
    let truth = GroundTruth::new(&aatype, &a["all_atom_positions"], &a["all_atom_mask"]).unwrap();
    let cfg = MultimerStructureLossConfig::default();
    let chain_b = a["asym_id"].eq(2).to_kind(Kind::Float);
    let loss_with_shift = |shift: f64| {
        let traj = rigid(&a["traj"]);
        let frames = rigid(&a["sc_frames"]);
        let out = StructureOutput {
            single: Tensor::zeros([n, 1], (Kind::Float, tch::Device::Cpu)),
            rotations: traj.rot,
            translations: &traj.trans + chain_b.view([1, n, 1]) * shift,
            angles: a["angles"].shallow_clone(),
            unnormalized_angles: a["unnormalized_angles"].shallow_clone(),
            frames: Rigid { rot: frames.rot, trans: &frames.trans + chain_b.view([n, 1, 1]) * shift },
            atom14: &a["atom14"] + chain_b.view([n, 1, 1]) * shift,
            atom37: Tensor::zeros([n, 37, 3], (Kind::Float, tch::Device::Cpu)),
            atom37_mask: Tensor::zeros([n, 37], (Kind::Float, tch::Device::Cpu)),
        };
        multimer_structure_loss(&out, &truth, &a["seq_mask"], &a["residue_index"], &a["asym_id"], &cfg).unwrap()
    };
    let (here, moved) = (loss_with_shift(0.0), loss_with_shift(50.0));
    let v = |t: &Tensor| t.double_value(&[]);
    let intra = (v(&here.intra_chain), v(&moved.intra_chain));
    assert!((intra.0 - intra.1).abs() <= 1e-5 * intra.0, "intra-chain FAPE {} -> {}", intra.0, intra.1);
    let interface = (v(&here.interface), v(&moved.interface));
    assert!(interface.1 > interface.0 + 1.0, "interface FAPE {} -> {}", interface.0, interface.1);
    assert_eq!(v(&here.chi_loss), v(&moved.chi_loss), "the chi loss sees no positions");
}

/// The fixture's true Cα positions and mask of `copies` copies of its chain (entity 1) and,
/// with `other`, a third chain of its first 8 residues (entity 2), each copy turned about its
/// centre and moved 30 Å from the last; and the chains' `asym_id` and `entity_id`.
fn complex(copies: usize, other: bool) -> (Tensor, Tensor, Tensor, Tensor) {
    let a = arrays();
    let ca = a["all_atom_positions"].narrow(0, 0, 12).select(1, 1);
    let mask = a["all_atom_mask"].narrow(0, 0, 12).select(1, 1);
    let turn = |k: f64| {
        let (c, s) = ((0.9 * k).cos() as f32, (0.9 * k).sin() as f32);
        Tensor::from_slice(&[c, -s, 0.0, s, c, 0.0, 0.0, 0.0, 1.0]).view([3, 3])
    };
    let mut positions = Vec::new();
    let (mut masks, mut asym, mut entity) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..copies {
        let centre = (&ca * mask.unsqueeze(-1)).sum_dim_intlist(0, true, Kind::Float) / mask.sum(Kind::Float);
        let placed = (&ca - &centre).matmul(&turn(k as f64).tr()) + &centre;
        positions.push(placed + Tensor::from_slice(&[30.0 * k as f32, 0.0, 0.0]));
        masks.push(mask.shallow_clone());
        asym.extend([k as i64 + 1; 12]);
        entity.extend([1i64; 12]);
    }
    if other {
        positions.push(ca.narrow(0, 0, 8) + Tensor::from_slice(&[0.0f32, 40.0, 0.0]));
        masks.push(mask.narrow(0, 0, 8));
        asym.extend([copies as i64 + 1; 8]);
        entity.extend([2i64; 8]);
    }
    (Tensor::cat(&positions, 0), Tensor::cat(&masks, 0), Tensor::from_slice(&asym), Tensor::from_slice(&entity))
}

/// A prediction of the complex that places chain `order[p]`'s true atoms in chain `p`'s
/// residues, the whole turned and moved, with 0.3 Å noise.
fn predicted(truth: &Tensor, chains: &[chain_permutation::Chain], order: &[usize]) -> Tensor {
    let rows: Vec<i64> = chain_permutation::residue_order(chains, order);
    let placed = truth.index_select(0, &Tensor::from_slice(&rows));
    let (c, s) = (0.4f32.cos(), 0.4f32.sin());
    let turn = Tensor::from_slice(&[1.0, 0.0, 0.0, 0.0, c, -s, 0.0, s, c]).view([3, 3]);
    tch::manual_seed(3);
    placed.matmul(&turn.tr())
        + Tensor::from_slice(&[5.0f32, -3.0, 2.0])
        + Tensor::randn(placed.size(), tch::kind::FLOAT_CPU) * 0.3
}

/// Chain permutation alignment (supplement 7.3): a homodimer predicted with its copies swapped
/// compares each predicted chain with the true chain it models; with a third, unique chain the
/// anchor is that chain and the copies are still sorted out; in order, nothing moves.
#[test]
fn chain_permutation_alignment_matches_swapped_copies() {
    for (copies, other, order) in
        [(2, false, vec![1, 0]), (2, false, vec![0, 1]), (2, true, vec![1, 0, 2]), (3, false, vec![2, 0, 1])]
    {
        let (truth, mask, asym, entity) = complex(copies, other);
        let chains = chain_permutation::chains(&asym, &entity).unwrap();
        let pred = predicted(&truth, &chains, &order);
        let assignment = chain_permutation::align_chains(&chains, &pred, &truth, &mask).unwrap();
        assert_eq!(assignment, order, "{copies} copies, a unique chain: {other}");
    }
}

/// Multimer's whole training loss against DeepMind's heads on the fixture's homodimer: every
/// term and the weighted total within 1e-4 relative and the gradient of every predicted input
/// within 1e-3 of its largest, with the truth's chains as predicted and with the two copies
/// swapped (the alignment puts them back, so nothing changes).
#[test]
fn multimer_total_loss_and_its_gradients_equal_alphafold() {
    let mut a = arrays();
    a.extend(fixture("total_loss.npz"));
    let n = a["aatype"].size()[0];
    let half = n / 2;
    // The two copies' rows swapped: chain 2's residues first.
    let swap = Tensor::cat(
        &[Tensor::arange_start(half, n, tch::kind::INT64_CPU), Tensor::arange(half, tch::kind::INT64_CPU)],
        0,
    );
    let aatype = a["aatype"].to_kind(Kind::Int64);
    assert!(aatype.narrow(0, 0, half).equal(&aatype.narrow(0, half, half)), "the fixture is a homodimer");
    for (order, swapped) in [("as predicted", false), ("swapped", true)] {
        // Fresh leaves in each order (a copy: `to_kind` of an fp32 array is the array itself,
        // whose gradient would accumulate over both).
        let leaf = |k: &str| a[k].to_kind(Kind::Float).copy().set_requires_grad(true);
        let names = [
            "traj",
            "sc_frames",
            "atom14",
            "angles",
            "unnormalized_angles",
            "distogram",
            "masked_msa",
            "lddt",
            "experimentally_resolved",
            "aligned_error",
        ];
        let leaves: HashMap<&str, Tensor> = names.iter().map(|&k| (k, leaf(k))).collect();
        let (backbone, frames) = (rigid(&leaves["traj"]), rigid(&leaves["sc_frames"]));
        let structure = StructureOutput {
            single: Tensor::zeros([n, 1], (Kind::Float, tch::Device::Cpu)),
            rotations: backbone.rot,
            translations: backbone.trans,
            angles: leaves["angles"].shallow_clone(),
            unnormalized_angles: leaves["unnormalized_angles"].shallow_clone(),
            frames,
            atom14: leaves["atom14"].shallow_clone(),
            atom37: a["atom37"].shallow_clone(),
            atom37_mask: a["atom37_atom_exists"].shallow_clone(),
        };
        let heads = HeadOutputs {
            distogram: leaves["distogram"].shallow_clone(),
            lddt: leaves["lddt"].shallow_clone(),
            masked_msa: leaves["masked_msa"].shallow_clone(),
            experimentally_resolved: leaves["experimentally_resolved"].shallow_clone(),
            aligned_error: Some(leaves["aligned_error"].shallow_clone()),
            rows: fastfold::model::pair_rows::PairRows::whole(leaves["distogram"].size()[0]),
        };
        let rows = |t: &Tensor| if swapped { t.index_select(0, &swap) } else { t.shallow_clone() };
        let truth =
            GroundTruth::new(&rows(&aatype), &rows(&a["all_atom_positions"]), &rows(&a["all_atom_mask"])).unwrap();
        let entity_id = a["asym_id"].ones_like();
        let inputs = ComplexLossInputs {
            truth: &truth,
            msa: MaskedMsaTarget { true_msa: &a["true_msa"], bert_mask: &a["bert_mask"] },
            asym_id: &a["asym_id"],
            entity_id: &entity_id,
            residue_index: &a["residue_index"],
            seq_mask: &a["seq_mask"],
            resolution: a["resolution"].double_value(&[]),
            whole: None,
        };
        let l = multimer_total_loss(&heads, &structure, &inputs, &MultimerLossConfig::default()).unwrap();
        let want_assignment = if swapped { vec![1, 0] } else { vec![0, 1] };
        assert_eq!(l.assignment, want_assignment, "truth {order}: the true chain compared with each predicted one");
        let h = &l.heads;
        assert_term(&format!("{order}: structure_module"), &l.structure.loss, &a["loss/structure_module"]);
        assert_term(&format!("{order}: distogram"), &h.distogram, &a["loss/distogram"]);
        assert_term(&format!("{order}: masked_msa"), &h.masked_msa, &a["loss/masked_msa"]);
        assert_term(&format!("{order}: predicted_lddt"), &h.plddt, &a["loss/predicted_lddt"]);
        assert_term(
            &format!("{order}: experimentally_resolved"),
            &h.experimentally_resolved,
            &a["loss/experimentally_resolved"],
        );
        let pae = h.aligned_error.as_ref().unwrap();
        assert_term(&format!("{order}: predicted_aligned_error"), pae, &a["loss/predicted_aligned_error"]);
        assert_term(&format!("{order}: loss"), &l.total, &a["loss"]);

        l.total.backward();
        for name in names {
            let want = a[&format!("grad/{name}")].to_kind(Kind::Double);
            let got = leaves[name].grad().to_kind(Kind::Double);
            let scale = want.abs().max().double_value(&[]);
            assert!(scale > 0.0, "{name}: AlphaFold's gradient is 0");
            let rel = (&got - &want).abs().max().double_value(&[]) / scale;
            eprintln!("truth {order}: gradient of {name}: worst difference {rel:.1e} of its largest");
            assert!(rel <= GRAD_TOLERANCE, "truth {order}: gradient of {name} differs by {rel:.2e} of its largest");
        }
    }
}
