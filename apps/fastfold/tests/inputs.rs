//! Residue tables, PDB output and the feature pipeline of fastfold's input side.
use std::path::{Path, PathBuf};

use data::a3m;
use fastfold::features::{process, FeatureConfig, Features, RawFeatures};
use fastfold::pdb::Structure;
use fastfold::residue_constants as rc;
use tch::{Device, Kind, Tensor};

fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("fastfold-inputs", name)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

// ---------------------------------------------------------------- residue constants

#[test]
fn atom_tables_have_alphafolds_counts() {
    assert_eq!(rc::ATOM_TYPES.len(), 37);
    assert_eq!(rc::atom_order("CA"), Some(1));
    assert_eq!(rc::atom_order("OXT"), Some(36));
    // Heavy atoms per residue type: ALA 5, ARG 11, GLY 4, TRP 14.
    let counts: Vec<usize> = rc::RESIDUE_ATOMS.iter().map(|a| a.len()).collect();
    assert_eq!(counts, [5, 11, 8, 8, 6, 9, 9, 4, 10, 8, 8, 9, 8, 11, 7, 6, 7, 14, 12, 7]);
    assert_eq!(rc::RESTYPE_NAME_TO_ATOM14_NAMES[0][..5], ["N", "CA", "C", "O", "CB"]);
    let m37 = rc::restype_atom37_mask();
    let m14 = rc::restype_atom14_mask();
    for r in 0..21 {
        let n37: f32 = m37[r].iter().sum();
        let n14: f32 = m14[r].iter().sum();
        assert_eq!(n37, n14, "restype {r}");
        assert_eq!(rc::restype_atom14_rigid_group_mask()[r], m14[r], "restype {r}");
    }
    assert_eq!(m37[20].iter().sum::<f32>(), 0.0, "UNK has no atoms");
    // atom14 -> atom37 -> atom14 is the identity on existing atoms.
    let (to37, to14) = (rc::restype_atom14_to_atom37(), rc::restype_atom37_to_atom14());
    for r in 0..20 {
        for k in 0..14 {
            if m14[r][k] > 0.0 {
                assert_eq!(to14[r][to37[r][k]], k, "restype {r} slot {k}");
                assert_eq!(m37[r][to37[r][k]], 1.0);
            }
        }
    }
    // Chi masks follow the chi-angle definitions.
    for r in 0..20 {
        let n: f32 = rc::CHI_ANGLES_MASK[r].iter().sum();
        assert_eq!(n as usize, rc::CHI_ANGLES_ATOMS[r].len(), "restype {r}");
    }
    let chi = rc::chi_angles_atom_indices();
    assert_eq!(chi[1][3], [5, 11, 23, 32], "ARG chi4 = CG CD NE CZ");
    assert_eq!(chi[0], [[0; 4]; 4], "ALA has no chi angles");
}

#[test]
fn hhblits_classes_remap_to_restypes_and_round_trip() {
    let map = rc::map_hhblits_aatype_to_our_aatype();
    // AlphaFold's MAP_HHBLITS_AATYPE_TO_OUR_AATYPE, written out.
    assert_eq!(map, [0, 4, 3, 6, 13, 7, 8, 9, 11, 10, 12, 2, 14, 5, 1, 15, 16, 19, 17, 18, 20, 21]);
    for (ours, &c) in rc::RESTYPES_WITH_X_AND_GAP.iter().enumerate() {
        let id = rc::hhblits_aa_to_id(c).unwrap();
        assert_eq!(rc::ID_TO_HHBLITS_AA[id], c);
        assert_eq!(map[id], ours, "{c}");
        assert_eq!(rc::msa_class_of(c), Some(ours));
    }
    assert_eq!(rc::msa_class_of('B'), Some(3), "B reads as D");
    assert_eq!(rc::msa_class_of('Z'), Some(6), "Z reads as E");
    assert_eq!(rc::msa_class_of('U'), Some(4), "U reads as C");
    assert_eq!(rc::msa_class_of('O'), Some(20));
    assert_eq!(rc::msa_class_of('*'), None);
}

fn det3(m: &[[f32; 4]; 4]) -> f64 {
    let a = |i: usize, j: usize| f64::from(m[i][j]);
    a(0, 0) * (a(1, 1) * a(2, 2) - a(1, 2) * a(2, 1)) - a(0, 1) * (a(1, 0) * a(2, 2) - a(1, 2) * a(2, 0))
        + a(0, 2) * (a(1, 0) * a(2, 1) - a(1, 1) * a(2, 0))
}

#[test]
fn default_frames_are_rigid_and_place_the_defining_atoms() {
    let frames = rc::restype_rigid_group_default_frame();
    for (r, groups) in frames.iter().enumerate().take(20) {
        for (g, m) in groups.iter().enumerate() {
            let exists = g < 4 || rc::CHI_ANGLES_MASK[r][g - 4] > 0.0;
            if !exists {
                assert!(m.iter().flatten().all(|&v| v == 0.0), "restype {r} group {g} absent");
                continue;
            }
            // Rotation part orthonormal with det +1 (tolerance 1e-5, f32 storage).
            for i in 0..3 {
                for j in 0..3 {
                    let d: f64 = (0..3).map(|k| f64::from(m[k][i]) * f64::from(m[k][j])).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((d - want).abs() < 1e-5, "restype {r} group {g} R^T R [{i}][{j}] = {d}");
                }
            }
            assert!((det3(m) - 1.0).abs() < 1e-5, "restype {r} group {g}");
            assert_eq!(m[3], [0.0, 0.0, 0.0, 1.0]);
        }
    }
    // Spot values computed with numpy from AlphaFold's definitions (tolerance 1e-6):
    // TRP chi2 frame and ARG chi4 frame (rotation about z, origin at the axis-end atom).
    let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
    let trp = &frames[17][5];
    assert!(close(trp[0][0], 0.406_200_35) && close(trp[0][1], -0.913_784) && close(trp[1][0], 0.913_784));
    assert!(close(trp[0][3], 0.609) && close(trp[1][3], 1.37) && close(trp[2][2], 1.0));
    let arg = &frames[1][7];
    assert!(close(arg[0][0], 0.369_146_05) && close(arg[0][1], -0.929_371_4));
    assert!(close(arg[0][3], 0.539) && close(arg[1][3], 1.357));
    // psi frame of ALA: origin at C (1.526, 0, 0), x along CA->C.
    let psi = &frames[0][3];
    assert!((psi[0][3] - 1.526).abs() < 1e-6 && psi[1][3].abs() < 1e-6);
    assert!((psi[0][0] - 1.0).abs() < 1e-6);
    // chi1 of SER: origin at CB, x along CA->CB; OG's ideal position maps into the backbone
    // frame at bond length 1.417 from CB (|(0.503, 1.325, 0)|).
    let ser = rc::RESTYPES.iter().position(|&c| c == 'S').unwrap();
    let chi1 = &frames[ser][4];
    let cb = [-0.518f32, -0.777, -1.211];
    for i in 0..3 {
        assert!((chi1[i][3] - cb[i]).abs() < 1e-6);
    }
    let lit = rc::restype_atom14_rigid_group_positions();
    let og = lit[ser][5];
    assert_eq!(rc::restype_atom14_to_rigid_group()[ser][5], 4);
    let world: Vec<f32> = (0..3).map(|i| (0..3).map(|k| chi1[i][k] * og[k]).sum::<f32>() + chi1[i][3]).collect();
    let bond = ((world[0] - cb[0]).powi(2) + (world[1] - cb[1]).powi(2) + (world[2] - cb[2]).powi(2)).sqrt();
    assert!((bond - 1.417).abs() < 1e-3, "CB-OG {bond}");
}

#[test]
fn tables_as_tensors_have_alphafolds_shapes() {
    let t = rc::Tables::new(Device::Cpu);
    assert_eq!(t.default_frames.size(), [21, 8, 4, 4]);
    assert_eq!(t.group_idx.size(), [21, 14]);
    assert_eq!(t.atom14_mask.size(), [21, 14]);
    assert_eq!(t.lit_positions.size(), [21, 14, 3]);
    assert_eq!(t.atom37_to_atom14.size(), [21, 37]);
    assert_eq!(t.chi_angles_atom_indices.size(), [21, 4, 4]);
    assert_eq!(t.group_idx.kind(), Kind::Int64);
    assert_eq!(t.atom14_mask.sum(Kind::Float).double_value(&[]), 167.0, "heavy atoms of the 20 types");
    let frame = rc::restype_rigid_group_default_frame()[17][5];
    assert_eq!(t.default_frames.get(17).get(5).get(0).get(3).double_value(&[]) as f32, frame[0][3]);
}

// ---------------------------------------------------------------- PDB

fn two_residues() -> Structure {
    let mut positions = vec![[[0.0f32; 3]; 37]; 2];
    let mut mask = vec![[0.0f32; 37]; 2];
    for (a, p) in positions[0].iter_mut().enumerate() {
        *p = [a as f32 + 0.1234, -(a as f32) - 10.5, 123.4567];
    }
    for a in [0, 1, 2, 3, 4] {
        mask[0][a] = 1.0; // ALA: N CA C CB O
    }
    for a in [0, 1, 2, 4, 36] {
        mask[1][a] = 1.0; // GLY N CA C O and an OXT
    }
    mask[1][3] = 0.4; // below 0.5: skipped
    Structure { aatype: vec![0, 7], residue_index: vec![0, 1], positions, mask, b_factors: vec![87.25, 45.5] }
}

#[test]
fn pdb_records_have_the_right_columns() {
    let s = two_residues();
    let dir = scratch("pdb");
    let path = dir.join("out.pdb");
    s.write(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.iter().all(|l| l.len() == 80), "every line is 80 columns");
    let atoms: Vec<&str> = lines.iter().copied().filter(|l| l.starts_with("ATOM  ")).collect();
    assert_eq!(atoms.len(), 10, "5 ALA atoms + 5 GLY atoms (masked CB skipped)");
    let col = |l: &str, a: usize, b: usize| l[a - 1..b].to_string();
    let first = atoms[0];
    assert_eq!(col(first, 7, 11), "    1");
    assert_eq!(col(first, 13, 16), " N  ");
    assert_eq!(col(first, 17, 17), " ");
    assert_eq!(col(first, 18, 20), "ALA");
    assert_eq!(col(first, 22, 22), "A");
    assert_eq!(col(first, 23, 26), "   1");
    assert_eq!(col(first, 27, 27), " ");
    assert_eq!(col(first, 31, 38), "   0.123");
    assert_eq!(col(first, 39, 46), " -10.500");
    assert_eq!(col(first, 47, 54), " 123.457");
    assert_eq!(col(first, 55, 60), "  1.00");
    assert_eq!(col(first, 61, 66), " 87.25");
    assert_eq!(col(first, 77, 78), " N");
    assert_eq!(col(atoms[1], 13, 16), " CA ");
    assert_eq!(col(atoms[1], 77, 78), " C");
    let last = atoms[9];
    assert_eq!(col(last, 7, 11), "   10");
    assert_eq!(col(last, 13, 16), " OXT");
    assert_eq!(col(last, 18, 20), "GLY");
    assert_eq!(col(last, 23, 26), "   2");
    assert_eq!(col(last, 61, 66), " 45.50");
    assert_eq!(col(last, 77, 78), " O");
    let ter = lines.iter().find(|l| l.starts_with("TER")).unwrap();
    assert_eq!(col(ter, 7, 11), "   11");
    assert_eq!(col(ter, 18, 20), "GLY");
    assert_eq!(col(ter, 23, 26), "   2");
    assert_eq!(lines.first().map(|l| l.trim_end()), Some("MODEL        1"));
    assert_eq!(lines[lines.len() - 2].trim_end(), "ENDMDL");
    assert_eq!(lines[lines.len() - 1].trim_end(), "END");
}

#[test]
fn pdb_from_tensors_and_bad_input() {
    let s = two_residues();
    let pos: Vec<f32> = s.positions.iter().flatten().flatten().copied().collect();
    let mask: Vec<f32> = s.mask.iter().flatten().copied().collect();
    let from = Structure::from_tensors(
        &Tensor::from_slice(&[0i64, 7]),
        &Tensor::from_slice(&[0i64, 1]),
        &Tensor::from_slice(&pos).reshape([2, 37, 3]),
        &Tensor::from_slice(&mask).reshape([2, 37]),
        &Tensor::from_slice(&[87.25f32, 45.5]),
    )
    .unwrap();
    assert_eq!(from.to_pdb().unwrap(), s.to_pdb().unwrap());
    let err = Structure::from_tensors(
        &Tensor::from_slice(&[0i64, 7]),
        &Tensor::from_slice(&[0i64, 1]),
        &Tensor::zeros([2, 14, 3], (Kind::Float, Device::Cpu)),
        &Tensor::from_slice(&mask).reshape([2, 37]),
        &Tensor::from_slice(&[87.25f32, 45.5]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("atom positions has shape [2, 14, 3], expected [2, 37, 3]"), "{err}");
    let mut far = two_residues();
    far.positions[0][0][0] = -1000.0; // "-1000.000" is 9 columns
    let dir = scratch("pdb-bad");
    let err = far.write(&dir.join("far.pdb")).unwrap_err().to_string();
    assert!(err.contains("far.pdb") && err.contains("do not fit 8.3f"), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing written");
}

// ---------------------------------------------------------------- features

const QUERY: &str = "MKTAYIAKQR";
const A3M: &str = ">query\nMKTAYIAKQR\n>h1\nMKTAYLAKQ-\n>h2\nMRTAaYIGKQR\n>h3\n--TAYIAKQK\n>h4\nMKSAYIAKQR\n";

fn raw_with_msa() -> RawFeatures {
    let msa = a3m::parse(A3M, Path::new("small.a3m")).unwrap();
    RawFeatures::new(QUERY, Some((&msa, Path::new("small.a3m")))).unwrap()
}

#[test]
fn raw_features_follow_alphafolds_data_pipeline() {
    let raw = raw_with_msa();
    assert_eq!(raw.aatype, [12, 11, 16, 0, 18, 9, 0, 11, 5, 1]);
    assert_eq!(raw.residue_index, (0..10).collect::<Vec<i64>>());
    assert_eq!((raw.seq_length, raw.num_alignments), (10, 5));
    assert_eq!(raw.msa[0], raw.aatype, "the query row is the sequence");
    assert_eq!(raw.msa[3][0], 21, "gap class");
    assert_eq!(raw.deletion_matrix[2][4], 1.0, "the insertion before column 5 of h2");
    let single = RawFeatures::new(QUERY, None).unwrap();
    assert_eq!((single.num_alignments, single.msa.len()), (1, 1));
    let other = a3m::parse(">q\nMKTAYIAKQK\n", Path::new("other.a3m")).unwrap();
    let err = RawFeatures::new(QUERY, Some((&other, Path::new("other.a3m")))).unwrap_err().to_string();
    assert!(err.contains("other.a3m: query row differs from the sequence at position 10"), "{err}");
}

#[test]
fn non_standard_letters_keep_their_msa_class_with_or_without_an_alignment() {
    // AlphaFold's aatype reads B, Z, U, O, J as X, but its MSA (query row included) reads
    // B, Z, U as D, E, C: single-sequence mode and an A3M of the query alone must agree. The
    // old FASTA reader turned them into X first, so the single-sequence query row had X.
    let text = ">u\nMKTAYUAKQRBZOJ\n";
    let record = data::fasta::parse(text, Path::new("u.fa")).unwrap().remove(0);
    assert_eq!(record.sequence, "MKTAYUAKQRBZOJ");
    let msa = a3m::parse(text, Path::new("u.a3m")).unwrap();
    let single = RawFeatures::new(&record.sequence, None).unwrap();
    let aligned = RawFeatures::new(&record.sequence, Some((&msa, Path::new("u.a3m")))).unwrap();
    assert_eq!(single, aligned);
    let class = |c: char| rc::RESTYPES_WITH_X_AND_GAP.iter().position(|&r| r == c).unwrap() as i64;
    let x = class('X');
    assert_eq!((single.aatype[4], single.aatype[5]), (class('Y'), x), "U's residue type is X");
    assert_eq!(single.aatype[10..], [x; 4], "B Z O J");
    assert_eq!(single.msa[0][5], class('C'), "U is C in the MSA");
    assert_eq!(single.msa[0][10..], [class('D'), class('E'), x, x], "B Z O J");
}

fn small_config() -> FeatureConfig {
    FeatureConfig { max_msa_clusters: 3, max_extra_msa: 1, num_recycle: 1, ..FeatureConfig::default() }
}

#[test]
fn processed_features_have_alphafolds_shapes() {
    let raw = raw_with_msa();
    let f = process(&raw, &small_config(), 7, Device::Cpu).unwrap();
    let (r, n, s, e) = (2, 10, 3, 1);
    let expect: [(&str, Vec<i64>); 19] = [
        ("aatype", vec![r, n]),
        ("residue_index", vec![r, n]),
        ("seq_length", vec![r]),
        ("seq_mask", vec![r, n]),
        ("target_feat", vec![r, n, 22]),
        ("msa_feat", vec![r, s, n, 49]),
        ("msa_mask", vec![r, s, n]),
        ("msa_row_mask", vec![r, s]),
        ("bert_mask", vec![r, s, n]),
        ("true_msa", vec![r, s, n]),
        ("extra_msa", vec![r, e, n]),
        ("extra_has_deletion", vec![r, e, n]),
        ("extra_deletion_value", vec![r, e, n]),
        ("extra_msa_mask", vec![r, e, n]),
        ("extra_msa_row_mask", vec![r, e]),
        ("residx_atom14_to_atom37", vec![r, n, 14]),
        ("residx_atom37_to_atom14", vec![r, n, 37]),
        ("atom14_atom_exists", vec![r, n, 14]),
        ("atom37_atom_exists", vec![r, n, 37]),
    ];
    for ((name, t), (want_name, want)) in f.named().iter().zip(&expect) {
        assert_eq!(name, want_name);
        assert_eq!(t.size(), *want, "{name}");
    }
    let sum = |t: &Tensor| Vec::<f32>::try_from(t.sum_dim_intlist(-1, false, Kind::Float).flatten(0, -1)).unwrap();
    // One-hot blocks sum to 1 per row: target_feat's aatype, msa_feat's msa and profile.
    assert!(sum(&f.target_feat.narrow(-1, 1, 21)).iter().all(|&v| v == 1.0));
    assert!(sum(&f.msa_feat.narrow(-1, 0, 23)).iter().all(|&v| v == 1.0));
    assert!(sum(&f.msa_feat.narrow(-1, 25, 23)).iter().all(|&v| (v - 1.0).abs() < 1e-5), "profiles sum to 1 (1e-5)");
    assert_eq!(f.atom14_atom_exists.get(0).get(0).sum(Kind::Float).double_value(&[]), 8.0, "MET has 8 atoms");
    assert_eq!(f.residx_atom14_to_atom37.get(0).get(3).int64_value(&[4]), 3, "ALA CB is atom37 3");
    // The first row of every iteration is the query (before masking).
    for i in 0..r {
        assert_eq!(Vec::<i64>::try_from(f.true_msa.get(i).get(0)).unwrap(), raw.aatype);
    }
    let one = f.iteration(1).unwrap();
    assert_eq!(one.msa_feat.size(), [1, s, n, 49]);
    assert!(one.msa_feat.equal(&f.msa_feat.narrow(0, 1, 1)));
    assert!(f.iteration(2).is_err());
}

#[test]
fn msa_feat_channels_are_in_alphafolds_order() {
    // Single sequence with known deletions, nothing masked: every channel is predictable.
    let msa = a3m::parse(">q\nMKaaaTA\n", Path::new("d.a3m")).unwrap();
    let raw = RawFeatures::new("MKTA", Some((&msa, Path::new("d.a3m")))).unwrap();
    let config = FeatureConfig { masked_msa_replace_fraction: 0.0, num_recycle: 0, ..FeatureConfig::default() };
    let f = process(&raw, &config, 0, Device::Cpu).unwrap();
    let feat = f.msa_feat.get(0).get(0); // [N, 49]
    let at = |j: i64, c: i64| feat.double_value(&[j, c]);
    let value = 2.0 / std::f64::consts::PI * (3.0f64 / 3.0).atan();
    // Residue 2 (T, restype 16) follows 3 deleted residues.
    assert_eq!(at(2, 16), 1.0, "one-hot msa at channel = class");
    assert_eq!(at(2, 23), 1.0, "has_deletion at 23");
    assert!((at(2, 24) - value).abs() < 1e-6, "deletion_value at 24 (1e-6)");
    assert!((at(2, 25 + 16) - 1.0).abs() < 1e-5, "cluster_profile at 25..48 (1e-5)");
    assert!((at(2, 48) - value).abs() < 1e-5, "cluster deletion_mean_value at 48 (1e-5)");
    assert_eq!((at(1, 23), at(1, 24), at(1, 48)), (0.0, 0.0, 0.0), "no deletion at residue 1");
    assert_eq!(f.extra_msa.size(), [1, 0, 4], "single sequence: no extra rows without padding");
    let padded = process(&raw, &FeatureConfig { pad_msa: true, ..config }, 0, Device::Cpu).unwrap();
    assert_eq!(padded.msa_feat.size(), [1, 512, 4, 49]);
    assert_eq!(padded.extra_msa_mask.size(), [1, 1024, 4]);
    assert_eq!(padded.msa_mask.sum(Kind::Float).double_value(&[]), 4.0, "padded rows are masked out");
}

#[test]
fn equal_seeds_give_equal_batches() {
    let raw = raw_with_msa();
    let config = small_config();
    let a = process(&raw, &config, 11, Device::Cpu).unwrap();
    let b = process(&raw, &config, 11, Device::Cpu).unwrap();
    for ((name, x), (_, y)) in a.named().iter().zip(b.named().iter()) {
        assert!(x.equal(y), "{name} differs between equal seeds");
    }
    let c = process(&raw, &config, 12, Device::Cpu).unwrap();
    let differs = a.named().iter().zip(c.named().iter()).any(|((_, x), (_, y))| !x.equal(y));
    assert!(differs, "another seed samples another batch");
    // The two recycling iterations sample the MSA independently.
    assert!(!a.msa_feat.get(0).equal(&a.msa_feat.get(1)) || !a.bert_mask.get(0).equal(&a.bert_mask.get(1)));
}

#[test]
fn npz_fixture_loads_under_alphafolds_names() {
    let f = Features::load_npz(&fixture("processed_features.npz"), Device::Cpu).unwrap();
    assert_eq!(f.msa_feat.size(), [2, 2, 3, 49]);
    assert_eq!(f.aatype.kind(), Kind::Int64, "int32 in the file, int64 here");
    assert_eq!(Vec::<i64>::try_from(f.aatype.get(1)).unwrap(), [0, 7, 20]);
    // Values written by make_features_npz.py: (flat index % 7), msa_feat divided by 10.
    assert!((f.msa_feat.double_value(&[1, 0, 2, 24]) - 0.3).abs() < 1e-6);
    assert_eq!(f.target_feat.double_value(&[0, 1, 5]), 6.0);
    // Round trip through save_npz.
    let dir = scratch("npz");
    let path = dir.join("again.npz");
    f.save_npz(&path).unwrap();
    let g = Features::load_npz(&path, Device::Cpu).unwrap();
    for ((name, x), (_, y)) in f.named().iter().zip(g.named().iter()) {
        assert!(x.equal(y), "{name}");
    }
}

#[test]
fn npz_errors_name_the_key_and_both_shapes() {
    let f = Features::load_npz(&fixture("processed_features.npz"), Device::Cpu).unwrap();
    let dir = scratch("npz-bad");
    let write = |drop: &str, replace: Option<Tensor>| {
        let path = dir.join(format!("{drop}.npz"));
        let mut named: Vec<(&str, Tensor)> =
            f.named().iter().filter(|(n, _)| *n != drop).map(|(n, t)| (*n, t.shallow_clone())).collect();
        if let Some(t) = replace {
            named.push((drop, t));
        }
        Tensor::write_npz(&named, &path).unwrap();
        Features::load_npz(&path, Device::Cpu).unwrap_err().to_string()
    };
    let err = write("msa_feat", None);
    assert!(err.contains("missing key msa_feat (expected shape [R, S, N, 49])"), "{err}");
    let err = write("msa_feat", Some(Tensor::zeros([2, 3, 49], (Kind::Float, Device::Cpu))));
    assert!(err.contains("key msa_feat: expected shape [2, S, 3, 49], found [2, 3, 49]"), "{err}");
    let err = write("extra_msa_mask", Some(Tensor::zeros([2, 1, 4], (Kind::Float, Device::Cpu))));
    assert!(err.contains("key extra_msa_mask: expected shape [2, 1, 3], found [2, 1, 4]"), "{err}");
    let err = Features::load_npz(Path::new("/no/such/f.npz"), Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("/no/such/f.npz") && err.contains("No such file"), "{err}");

    // Values the model cannot take are named by key before any model runs: out-of-range
    // classes (libtorch's one_hot would fail without naming them), NaN, an empty dimension.
    let named = |key: &str| f.named().into_iter().find(|(n, _)| *n == key).unwrap().1.shallow_clone();
    let err = write("aatype", Some(named("aatype").fill(21)));
    assert!(
        err.contains("npz-bad/aatype.npz") && err.contains("key aatype: values from 21 to 21, the model takes 0 to 20"),
        "{err}"
    );
    let err = write("extra_msa", Some(named("extra_msa").fill(-1)));
    assert!(err.contains("key extra_msa: values from -1 to -1, the model takes 0 to 22"), "{err}");
    let msa_feat = named("msa_feat").copy();
    let _ = msa_feat.get(0).get(0).get(0).get(0).fill_(f64::NAN);
    let err = write("msa_feat", Some(msa_feat));
    assert!(err.contains("key msa_feat: NaN or infinite values"), "{err}");
    let err = write("msa_feat", Some(named("msa_feat").narrow(1, 0, 0)));
    assert!(err.contains("key msa_feat: shape [2, 0, 3, 49] has no MSA row (S)"), "{err}");
}

/// One fixed-column PDB atom record.
fn atom_record(record: &str, name: &str, altloc: char, resname: &str, res_seq: i64, x: f32, occupancy: f32) -> String {
    format!("{record:<6}{:>5}  {name:<3}{altloc}{resname:>3} A{res_seq:>4}    {x:>8.3}{:>8.3}{:>8.3}{occupancy:>6.2}{:>6.2}\n", 1, 0.0, 0.0, 50.0)
}

#[test]
fn pdb_target_keeps_the_most_occupied_location_and_hetatm_amino_acids() {
    // Alternative locations as Biopython (under AlphaFold's readers) picks them: the old
    // reader kept altloc ' ' or 'A' only and skipped HETATM records, so it lost residue 2's
    // atoms and the MSE.
    let text = [
        atom_record("ATOM", "N", ' ', "ALA", 1, 1.0, 1.0),
        atom_record("ATOM", "CA", 'A', "ALA", 1, 2.0, 0.3),
        atom_record("ATOM", "CA", 'B', "ALA", 1, 3.0, 0.7),
        atom_record("ATOM", "CA", 'C', "ALA", 1, 4.0, 0.7),
        atom_record("ATOM", "N", 'B', "GLY", 2, 5.0, 0.5),
        atom_record("ATOM", "CA", 'B', "GLY", 2, 6.0, 0.5),
        atom_record("HETATM", "N", ' ', "MSE", 3, 7.0, 1.0),
        atom_record("HETATM", "CA", ' ', "MSE", 3, 8.0, 1.0),
        atom_record("HETATM", "SE", ' ', "MSE", 3, 9.0, 1.0),
        atom_record("HETATM", "C1", ' ', "NAG", 4, 10.0, 1.0),
        atom_record("HETATM", "O", ' ', "HOH", 5, 11.0, 1.0),
    ]
    .concat();
    let s = Structure::parse(&text, Path::new("target.pdb"), None).unwrap();
    let (ca, n, sd) = (rc::atom_order("CA").unwrap(), rc::atom_order("N").unwrap(), rc::atom_order("SD").unwrap());
    assert_eq!(s.positions[0][ca][0], 3.0, "the more occupied B, not A, and not the equally occupied C");
    assert_eq!(s.residue_index, [0, 1, 2], "ALA, GLY (altloc B only), MSE; the ligand and the water are not read");
    assert_eq!((s.mask[1][n], s.mask[1][ca]), (1.0, 1.0), "altloc B alone is read");
    assert_eq!(s.aatype[2], rc::aatype_of('M'), "MSE is MET");
    assert_eq!((s.positions[2][ca][0], s.positions[2][sd][0], s.mask[2][sd]), (8.0, 9.0, 1.0), "MSE's SE is SD");
}

#[test]
fn pdb_target_reads_a_crystal_structures_chain_as_its_polymer_residues() {
    // A chain as crystal structures list it: selenomethionine first, then the protein, then
    // an acetate, a calcium ion (atom CA) and waters under the same chain. The old reader
    // made MSE an X ("residue 1 is UNK in the structure, MET in the input") and the acetate
    // and the ion residues ("24 residues, the input has 22" for a 22-residue protein).
    let text = [
        atom_record("HETATM", "N", ' ', "MSE", 1, 1.0, 1.0),
        atom_record("HETATM", "CA", ' ', "MSE", 1, 2.0, 1.0),
        atom_record("HETATM", "CG", ' ', "MSE", 1, 3.0, 1.0),
        atom_record("HETATM", "SE", ' ', "MSE", 1, 4.0, 1.0),
        atom_record("ATOM", "N", ' ', "LYS", 2, 5.0, 1.0),
        atom_record("ATOM", "CA", ' ', "LYS", 2, 6.0, 1.0),
        // A phosphoserine: a modified amino acid with its backbone, X as AlphaFold reads it.
        atom_record("HETATM", "N", ' ', "SEP", 3, 6.5, 1.0),
        atom_record("HETATM", "CA", ' ', "SEP", 3, 6.6, 1.0),
        atom_record("HETATM", "C", ' ', "SEP", 3, 6.7, 1.0),
        atom_record("HETATM", "CA", ' ', "ALA", 4, 7.0, 1.0),
        "TER       1      ALA A   4\n".to_string(),
        // After the chain's TER: not its residues, amino acid or not.
        atom_record("HETATM", "N", ' ', "GLY", 501, 8.0, 1.0),
        atom_record("HETATM", "CA", ' ', "GLY", 501, 8.1, 1.0),
        atom_record("HETATM", "C", ' ', "GLY", 501, 8.2, 1.0),
        atom_record("HETATM", "C", ' ', "ACT", 201, 10.0, 1.0),
        atom_record("HETATM", "O", ' ', "ACT", 201, 11.0, 1.0),
        atom_record("HETATM", "CA", ' ', " CA", 202, 12.0, 1.0),
        atom_record("HETATM", "O", ' ', "HOH", 301, 13.0, 1.0),
        // A ligand's record too short for coordinates is not read, so not an error.
        "HETATM 1001  C1  NAG A 401\n".to_string(),
    ]
    .concat();
    let s = Structure::parse(&text, Path::new("crystal.pdb"), None).unwrap();
    let aa = |c: char| rc::aatype_of(c);
    let x = rc::UNK_RESTYPE_INDEX;
    assert_eq!(s.aatype, [aa('M'), aa('K'), x, aa('A')], "MSE, LYS, SEP and a HETATM ALA; nothing after TER");
    assert_eq!(s.residue_index, [0, 1, 2, 3]);
    let (ca, sd) = (rc::atom_order("CA").unwrap(), rc::atom_order("SD").unwrap());
    assert_eq!((s.positions[0][sd][0], s.positions[3][ca][0]), (4.0, 7.0));
    assert_eq!(s.mask.iter().map(|m| m.iter().sum::<f32>()).collect::<Vec<_>>(), [4.0, 2.0, 3.0, 1.0]);
}

#[test]
fn pdb_reads_back_what_it_writes_and_names_bad_lines() {
    let s = two_residues();
    let text = s.to_pdb().unwrap();
    let back = Structure::parse(&text, Path::new("two.pdb"), None).unwrap();
    assert_eq!(back.aatype, s.aatype);
    assert_eq!(back.residue_index, s.residue_index);
    assert_eq!(back.b_factors, s.b_factors);
    for r in 0..2 {
        for a in 0..37 {
            let written = s.mask[r][a] >= 0.5;
            assert_eq!(back.mask[r][a] == 1.0, written, "residue {r} atom {a}");
            if written {
                for k in 0..3 {
                    // 8.3f columns: 0.0005 Å rounding.
                    assert!((back.positions[r][a][k] - s.positions[r][a][k]).abs() <= 5e-4);
                }
            }
        }
    }
    // Hydrogens, other chains, alternate locations and later models are skipped; an unknown
    // residue name is X.
    let extra = "ATOM      1  N   PTR B   5      11.000  12.000  13.000  1.00 50.00           N\n\
                 ATOM      2  H   GLY A   2       1.000   2.000   3.000  1.00 10.00           H\n";
    let mixed = format!("{}{extra}", text.replace("ENDMDL", "ENDMDX"));
    let back = Structure::parse(&mixed, Path::new("mixed.pdb"), Some('A')).unwrap();
    assert_eq!(back.aatype, s.aatype, "chain B's residue and the hydrogen are not read");
    let only_b = Structure::parse(&mixed, Path::new("mixed.pdb"), Some('B')).unwrap();
    assert_eq!(only_b.aatype, vec![rc::UNK_RESTYPE_INDEX]);
    assert_eq!(only_b.residue_index, vec![4]);

    let broken = text.replacen("   0.123", "   0.1x3", 1);
    let err = Structure::parse(&broken, Path::new("broken.pdb"), None).unwrap_err().to_string();
    assert!(err.contains("broken.pdb") && err.contains("line 2") && err.contains("0.1x3"), "{err}");
    // A coordinate that parses but is not finite would train to NaN weights.
    let nan = text.replacen("   0.123", "     nan", 1);
    let err = Structure::parse(&nan, Path::new("nan.pdb"), None).unwrap_err().to_string();
    assert!(err.contains("nan.pdb") && err.contains("line 2") && err.contains("not a finite number"), "{err}");
    let err = Structure::parse("HEADER nothing\n", Path::new("empty.pdb"), None).unwrap_err().to_string();
    assert!(err.contains("empty.pdb") && err.contains("no ATOM records"), "{err}");
}
