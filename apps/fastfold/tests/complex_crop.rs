//! Cropping a complex as AlphaFold-Multimer trains (`fastfold::complex_crop`), on a constructed
//! heterodimer of two 40-residue chains whose Cα atoms lie on two parallel lines 8 Å apart that
//! overlap over a known stretch: chain A at x = 3.8 i (y = 0), chain B at x = 121 + 3.8 j
//! (y = 8), so that with the 10 Å interface exactly A 31..=39 and B 0..=8 touch. The contiguous
//! crop keeps exactly the crop's residues, a contiguous piece of each chain in order, features
//! and truth alike; the spatial crop keeps residues around the interface only; the same seed and
//! example number give the same crop.
mod common;

use std::path::Path;

use fastfold::complex_crop::{crop_inputs, interface_residues, select_residues, ComplexCrop, CropKind};
use fastfold::model::multimer::MultimerInputs;
use fastfold::pdb::Structure;
use fastfold::residue_constants::ATOM_TYPE_NUM;
use tch::{Kind, Tensor};

const LEN: usize = 40;
const CHAIN_A: &str = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRV";
const CHAIN_B: &str = "GSWEDLKKLAEHVGNPTLRCDYLGVKAQNWPELEERTDFK";

/// The heterodimer's features (each chain on its sequence alone) and its truth: Cα only, on
/// the two lines the module describes; residue `k`'s B-factor is `k` (to follow it through a
/// crop).
fn heterodimer(dir: &Path) -> (MultimerInputs, Structure) {
    assert_eq!((CHAIN_A.len(), CHAIN_B.len()), (LEN, LEN));
    let fasta = dir.join("ab.fasta");
    std::fs::write(&fasta, format!(">a\n{CHAIN_A}\n>b\n{CHAIN_B}\n")).unwrap();
    let records = data::fasta::read(&fasta).unwrap();
    let complex = fastfold::multimer::Complex::new(&records, &fasta).unwrap();
    let entities = fastfold::multimer::EntityInput::single_sequences(&complex, &fasta).unwrap();
    let features = fastfold::multimer::features(&complex, &entities).unwrap();
    let inputs = MultimerInputs::from_named(|n| features.get(n).map(|a| a.tensor()), "ab").unwrap();
    let aatype: Vec<i64> = Vec::try_from(inputs.aatype.to_kind(Kind::Int64)).unwrap();
    let ca = |k: usize| match k < LEN {
        true => [3.8 * k as f32, 0.0, 0.0],
        false => [121.0 + 3.8 * (k - LEN) as f32, 8.0, 0.0],
    };
    let truth = Structure {
        aatype: aatype.iter().map(|&a| a as usize).collect(),
        residue_index: (0..2 * LEN).map(|k| (k % LEN) as i64).collect(),
        positions: (0..2 * LEN)
            .map(|k| {
                let mut atoms = [[0.0f32; 3]; ATOM_TYPE_NUM];
                atoms[1] = ca(k);
                atoms
            })
            .collect(),
        mask: (0..2 * LEN)
            .map(|_| {
                let mut m = [0.0f32; ATOM_TYPE_NUM];
                m[1] = 1.0;
                m
            })
            .collect(),
        b_factors: (0..2 * LEN).map(|k| k as f32).collect(),
    };
    (inputs, truth)
}

fn values(t: &Tensor) -> Vec<i64> {
    Vec::try_from(t.to_kind(Kind::Int64)).unwrap()
}

fn asym_id(inputs: &MultimerInputs) -> Vec<i64> {
    values(&inputs.asym_id)
}

/// The contiguous crop keeps exactly 30 of the 80 residues for every example: chain by chain
/// in the complex's order, each chain's kept residues one run of consecutive residue numbers;
/// the cropped features and truth are the same residues (types, numbers, and the B-factor that
/// names each residue), the MSA cut to the same columns. A complex no longer than the crop is
/// kept whole.
#[test]
fn the_contiguous_crop_keeps_the_size_and_each_chains_residues_in_order() {
    let dir = common::scratch("complex_crop", "contiguous");
    let (inputs, truth) = heterodimer(&dir);
    let asym = asym_id(&inputs);
    let crop = ComplexCrop { spatial_probability: 0.0, ..ComplexCrop::new(30) };
    let mut shares = std::collections::BTreeSet::new();
    for number in 1..=40 {
        let (kind, keep) = crop.residues(&asym, &truth, 3, number);
        assert_eq!(kind, CropKind::Contiguous);
        assert_eq!(keep.len(), 30, "example {number}: {keep:?}");
        let cropped = crop_inputs(&inputs, &keep);
        let cut = select_residues(&truth, &keep);
        assert_eq!(cropped.residues().unwrap(), 30);
        assert_eq!(cropped.msa.size(), [inputs.msa.size()[0], 30]);
        let chains = asym_id(&cropped);
        assert!(chains.windows(2).all(|w| w[0] <= w[1]), "example {number}: chains out of order {chains:?}");
        let numbers = values(&cropped.residue_index);
        for c in [1, 2] {
            let run: Vec<i64> = numbers.iter().zip(&chains).filter(|(_, &a)| a == c).map(|(&r, _)| r).collect();
            assert!(run.windows(2).all(|w| w[1] == w[0] + 1), "example {number}: chain {c} keeps {run:?}");
        }
        shares.insert(chains.iter().filter(|&&a| a == 1).count());
        let types: Vec<usize> = values(&cropped.aatype).iter().map(|&a| a as usize).collect();
        assert_eq!(types, cut.aatype, "example {number}: features and truth differ");
        assert_eq!(cut.residue_index, numbers, "example {number}");
        let named: Vec<usize> = cut.b_factors.iter().map(|&b| b as usize).collect();
        assert_eq!(named, keep, "example {number}: the truth's residues are not the kept ones");
    }
    // The pieces' lengths are drawn: the chains share the crop differently across examples.
    assert!(shares.len() > 3, "chain A's share of the crop is always one of {shares:?}");
    let (kind, keep) = ComplexCrop::new(80).residues(&asym, &truth, 3, 1);
    assert_eq!((kind, keep), (CropKind::Whole, (0..80).collect::<Vec<_>>()));
}

/// The interface is exactly A 31..=39 and B 0..=8 (residues 31..=48). Every spatial crop of 20
/// keeps residues of both chains and at least one interface residue, and none far from the
/// interface (A before 15, B after 25: at least 60 Å from every interface residue); the kept
/// residues are the 20 nearest one interface residue's Cα.
#[test]
fn the_spatial_crop_keeps_residues_around_the_interface() {
    let dir = common::scratch("complex_crop", "spatial");
    let (inputs, truth) = heterodimer(&dir);
    let asym = asym_id(&inputs);
    let ca: Vec<Option<[f64; 3]>> = truth.positions.iter().map(|p| Some(p[1].map(f64::from))).collect();
    let interface = interface_residues(&ca, &asym, 10.0);
    assert_eq!(interface, (31..=48).collect::<Vec<_>>());
    let crop = ComplexCrop { spatial_probability: 1.0, ..ComplexCrop::new(20) };
    let distance = |i: usize, j: usize| {
        let (a, b) = (ca[i].unwrap(), ca[j].unwrap());
        (0..3).map(|k| (a[k] - b[k]).powi(2)).sum::<f64>().sqrt()
    };
    for number in 1..=40 {
        let (kind, keep) = crop.residues(&asym, &truth, 5, number);
        assert_eq!(kind, CropKind::Spatial);
        assert_eq!(keep.len(), 20);
        assert!(keep.iter().any(|&i| i < LEN) && keep.iter().any(|&i| i >= LEN), "example {number}: {keep:?}");
        assert!(keep.iter().any(|i| interface.contains(i)), "example {number}: no interface residue in {keep:?}");
        let far = keep.iter().find(|&&i| !(15..=LEN + 25).contains(&i));
        assert!(far.is_none(), "example {number}: residue {far:?} far from the interface kept: {keep:?}");
        // Some interface residue is the centre: nothing left out is nearer it than what is kept.
        let centred = interface.iter().any(|&c| {
            let reach = keep.iter().map(|&i| distance(i, c)).fold(0.0, f64::max);
            (0..2 * LEN).filter(|i| !keep.contains(i)).all(|i| distance(i, c) >= reach - 1e-9)
        });
        assert!(centred, "example {number}: {keep:?} is not the 20 nearest any interface residue");
    }
}

/// The same seed and example number give the same crop (indices and kind); across 40 examples
/// under AlphaFold-Multimer's mix both crops are taken, and other examples or seeds crop
/// elsewhere.
#[test]
fn the_same_seed_and_example_give_the_same_crop() {
    let dir = common::scratch("complex_crop", "seeded");
    let (inputs, truth) = heterodimer(&dir);
    let asym = asym_id(&inputs);
    let crop = ComplexCrop::new(24);
    let crops: Vec<(CropKind, Vec<usize>)> = (1..=40).map(|n| crop.residues(&asym, &truth, 11, n)).collect();
    let again: Vec<(CropKind, Vec<usize>)> = (1..=40).map(|n| crop.residues(&asym, &truth, 11, n)).collect();
    assert_eq!(crops, again);
    for kind in [CropKind::Contiguous, CropKind::Spatial] {
        assert!(crops.iter().any(|(k, _)| *k == kind), "no {kind:?} crop in 40 examples");
    }
    let distinct: std::collections::BTreeSet<&Vec<usize>> = crops.iter().map(|(_, keep)| keep).collect();
    assert!(distinct.len() > 10, "only {} distinct crops in 40 examples", distinct.len());
    let other_seed: Vec<(CropKind, Vec<usize>)> = (1..=40).map(|n| crop.residues(&asym, &truth, 12, n)).collect();
    assert_ne!(crops, other_seed, "another seed crops the same");
}
