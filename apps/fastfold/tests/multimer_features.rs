//! AlphaFold-Multimer's feature pipeline against DeepMind's: each complex of
//! `fixtures/multimer/` (a monomer, a homodimer, a heterodimer whose second chain has no
//! homologue and no template, an A2B trimer, and three distinct chains with a small MSA crop),
//! its entities' saved alignments and template hits read as the search reads them, must give
//! every feature `pipeline_multimer.DataPipeline.process` gives on the same files
//! (`make_multimer_fixtures.py`): the same names, shapes and dtypes, integer features equal and
//! float features within 1e-6.
use std::path::{Path, PathBuf};

use data::a3m::Msa;
use fastfold::features::RawFeatures;
use fastfold::multimer::pipeline::features_with_crop;
use fastfold::multimer::{Complex, EntityInput, MultimerFeatures, PairingMsa};
use fastfold::residue_constants::{ATOM_TYPE_NUM, ID_TO_HHBLITS_AA};
use fastfold::search::templates::TemplateHitFeatures;
use fastfold::search::{msa, stockholm};
use serde_json::Value;
use tch::{Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer").join(name)
}

fn sto(path: &Path) -> Msa {
    stockholm::parse(&std::fs::read_to_string(path).unwrap(), path).unwrap()
}

/// The entity's template hits from `templates.npz` (HHblits classes, positions, masks).
fn templates(entity: &str, n: usize) -> Vec<TemplateHitFeatures> {
    let path = fixture(entity).join("templates.npz");
    if !path.exists() {
        return Vec::new();
    }
    let arrays: std::collections::HashMap<String, Tensor> = data::npz::read(&path).unwrap().into_iter().collect();
    let ids = Vec::<i64>::try_from(arrays["template_aatype"].flatten(0, -1)).unwrap();
    let positions = Vec::<f32>::try_from(arrays["template_all_atom_positions"].flatten(0, -1)).unwrap();
    let masks = Vec::<f32>::try_from(arrays["template_all_atom_masks"].flatten(0, -1)).unwrap();
    let k = ATOM_TYPE_NUM;
    (0..ids.len() / n)
        .map(|t| TemplateHitFeatures {
            sequence: ids[t * n..(t + 1) * n].iter().map(|&i| ID_TO_HHBLITS_AA[i as usize]).collect(),
            positions: (0..n)
                .map(|r| std::array::from_fn(|a| std::array::from_fn(|x| positions[((t * n + r) * k + a) * 3 + x])))
                .collect(),
            masks: (0..n).map(|r| std::array::from_fn(|a| masks[(t * n + r) * k + a])).collect(),
            domain_name: format!("{entity}_{t}"),
            sum_probs: 0.0,
        })
        .collect()
}

/// What the searches give for one entity, read from its folder.
fn entity_input(entity: &str, sequence: &str, pair: bool) -> EntityInput {
    let dir = fixture(entity);
    let uniref90 = sto(&dir.join("uniref90_hits.sto"));
    let mgnify = sto(&dir.join("mgnify_hits.sto"));
    let bfd = data::a3m::read(&dir.join("bfd_uniref_hits.a3m")).unwrap();
    let merged = msa::merge(&[&uniref90, &bfd, &mgnify]);
    let mut raw = RawFeatures::new(sequence, Some((&merged, &dir))).unwrap();
    raw.templates = Some(templates(entity, sequence.len()));
    let uniprot = dir.join("uniprot_hits.sto");
    let pairing = pair.then(|| PairingMsa::new(sequence, &sto(&uniprot), &uniprot).unwrap());
    EntityInput { raw, pairing }
}

/// The case's complex and its features by our pipeline.
fn ours(case: &Value) -> (Complex, MultimerFeatures) {
    let name = case["name"].as_str().unwrap();
    let fasta = fixture(&format!("{name}.fasta"));
    let complex = Complex::new(&data::fasta::read(&fasta).unwrap(), &fasta).unwrap();
    let entities: Vec<&str> = case["entities"].as_array().unwrap().iter().map(|e| e.as_str().unwrap()).collect();
    let pair = !complex.is_homomer_or_monomer();
    let inputs: Vec<EntityInput> = complex
        .entity_representatives()
        .iter()
        .map(|c| entity_input(entities[complex.chains.iter().position(|x| x.id == c.id).unwrap()], &c.sequence, pair))
        .collect();
    let crop = case["msa_crop_size"].as_u64().unwrap() as usize;
    let features = features_with_crop(&complex, &inputs, crop).unwrap();
    (complex, features)
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture("cases.json")).unwrap();
    serde_json::from_str::<Value>(&text).unwrap().as_array().unwrap().clone()
}

#[test]
fn every_feature_equals_alphafold_multimers() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let (_, features) = ours(&case);
        let expected = data::npz::read(&fixture(&format!("{name}.npz"))).unwrap();
        let mut want: Vec<&str> = expected.iter().map(|(k, _)| k.as_str()).collect();
        want.sort();
        let have: Vec<&str> = features.arrays.iter().map(|(k, _)| *k).collect();
        assert_eq!(have, want, "{name}: feature names");
        for (key, e) in &expected {
            let o = features.get(key).unwrap().tensor();
            assert_eq!(o.kind(), e.kind(), "{name}: {key} dtype");
            assert_eq!(o.size(), e.size(), "{name}: {key} shape");
            if e.is_floating_point() {
                let diff = if e.numel() == 0 { 0.0 } else { (&o - e).abs().max().double_value(&[]) };
                assert!(diff <= 1e-6, "{name}: {key} differs by {diff}");
            } else {
                assert!(o.equal(e), "{name}: {key} differs:\n ours {o}\n AlphaFold's {e}");
            }
        }
    }
}

/// What the fixtures are there to exercise, so that a regenerated fixture keeps doing it.
#[test]
fn the_fixtures_pair_crop_pad_and_fill_as_intended() {
    let by_name = |n: &str| cases().into_iter().find(|c| c["name"] == n).unwrap();
    let get = |f: &MultimerFeatures, k: &str| f.get(k).unwrap().tensor();
    let (complex, f) = ours(&by_name("a2b"));
    // A2B: chains A and C are copies, so the residues go A, C, B.
    let order: Vec<char> = complex.assembly_order().iter().map(|c| c.id).collect();
    assert_eq!(order, ['A', 'C', 'B']);
    let rows = get(&f, "num_alignments").int64_value(&[]);
    assert_eq!(get(&f, "msa").size(), [512, 46]);
    let bias = get(&f, "cluster_bias_mask");
    assert_eq!(bias.sum(Kind::Double).double_value(&[]), 1.0, "paired: only the queries' row is a forced centre");
    // Rows paired across all three chains, rows of A's species only (B's part gap), A's own
    // rows and B's own rows below them.
    let msa = get(&f, "msa").narrow(0, 0, rows);
    let gap_in_b = msa.narrow(1, 36, 10).eq(21).all_dim(1, false);
    let gap_in_a = msa.narrow(1, 0, 36).eq(21).all_dim(1, false);
    assert!(gap_in_b.sum(Kind::Int64).int64_value(&[]) > 3 && gap_in_a.sum(Kind::Int64).int64_value(&[]) > 3);
    assert_eq!(get(&f, "template_aatype").size(), [4, 46]);
    assert_eq!(get(&f, "num_templates").int64_value(&[]), 4, "entity 1 has five hits, cropped to four");

    let (_, f) = ours(&by_name("heterodimer"));
    // The second chain: no homologue, so no own rows once its query is paired; its one
    // template is Multimer's all-zero one.
    let rows = get(&f, "num_alignments").int64_value(&[]);
    let own_b = get(&f, "msa").narrow(0, 1, rows - 1).narrow(1, 14, 8);
    assert!(own_b.eq(21).all().int64_value(&[]) == 1);
    assert_eq!(get(&f, "template_all_atom_mask").narrow(1, 14, 8).abs().sum(Kind::Double).double_value(&[]), 0.0);

    let (_, f) = ours(&by_name("homodimer"));
    let bert = get(&f, "bert_mask");
    let rows = get(&f, "num_alignments").int64_value(&[]);
    assert!(bert.narrow(0, 0, rows).eq(1.0).all().int64_value(&[]) == 1, "one entity: one dense block");
}
