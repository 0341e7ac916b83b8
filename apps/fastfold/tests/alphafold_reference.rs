//! The model against DeepMind's AlphaFold on the same parameters and features, with two
//! template hits and a padding template (`fixtures/make_alphafold_reference.py`: AlphaFold's
//! monomer code in fp32, random parameters of small widths with every `model_1_ptm` module,
//! 8 structure-module iterations, two recycling passes). Each step of the template path is
//! compared on AlphaFold's own inputs to that step, then the whole prediction end to end.
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use engine::parallel::dap::Dap;
use fastfold::features::Features;
use fastfold::model::alphafold::{AlphaFold, Batch, Pass};
use fastfold::model::embedders::{pseudo_beta, Recycled};
use fastfold::model::templates::{torsion_angles, Templates};
use fastfold::model::{Exec, Params};
use tch::{Device, Kind, Tensor};

/// Largest allowed difference from AlphaFold, relative to the compared array's largest
/// magnitude (at least 1): both sides compute in fp32 with different summation orders, and
/// with random weights the trunk's activations reach ~50 and the positions ~60 Å.
const TOLERANCE: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold").join(name)
}

fn reference() -> HashMap<String, Tensor> {
    Tensor::read_npz(fixture("reference.npz")).unwrap().into_iter().collect()
}

fn setup() -> (Params, Features, HashMap<String, Tensor>) {
    let params = Params::load_model(fixture("params.npz")).unwrap();
    let features = Features::load_npz(&fixture("features.npz"), Device::Cpu).unwrap();
    (params, features, reference())
}

/// Fails with the largest difference when `got` is not `want` within [`TOLERANCE`].
fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    common::assert_close(what, got, want, TOLERANCE);
}

/// The last pass's batch (slice 1), where AlphaFold recorded the template path.
fn last_batch(features: &Features) -> Batch {
    Batch::new(features, 1, Kind::Float).unwrap()
}

#[test]
fn template_torsion_angles_equal_alphafold() {
    let (_, features, r) = setup();
    let batch = last_batch(&features);
    let t = batch.templates.as_ref().unwrap();
    let (sin_cos, alt, mask) = torsion_angles(&t.aatype, &t.all_atom_positions, &t.all_atom_masks).unwrap();
    assert_close("torsion_angles_mask", &mask, &r["torsion_mask"]);
    // Undefined angles (mask 0) too: their values are features of the template rows.
    assert_close("torsion_angles_sin_cos", &sin_cos, &r["torsion_sin_cos"]);
    assert_close("alt_torsion_angles_sin_cos", &alt, &r["torsion_alt_sin_cos"]);
}

#[test]
fn template_pair_stack_pointwise_attention_and_msa_rows_equal_alphafold() {
    let (params, features, r) = setup();
    let templates = Templates::new(&params).unwrap().expect("the fixture's parameters have templates");
    let batch = last_batch(&features);
    let t = batch.templates.as_ref().unwrap();
    let mask_2d = &r["template_mask_2d"];
    for chunk in [None, Some(5)] {
        let exec = Exec::new(Dap::none(), chunk);
        let stacked = templates.pair_stack(t, mask_2d, Kind::Float, &exec, None).unwrap();
        assert_close(&format!("template pair stack (chunk {chunk:?})"), &stacked, &r["template_pair_stack"]);
        // The pointwise attention on AlphaFold's own stack output and query.
        let update =
            templates.pointwise_attention(&r["template_query"], &r["template_pair_stack"], &t.mask, &exec).unwrap();
        assert_close(&format!("pointwise attention (chunk {chunk:?})"), &update, &r["template_pair_update"]);
        let whole = templates.pair_update(&r["template_query"], t, mask_2d, &exec).unwrap();
        assert_close(&format!("template pair update (chunk {chunk:?})"), &whole, &r["template_pair_update"]);
    }
    let (rows, _) = templates.msa_rows(t, Kind::Float).unwrap().expect("torsion-angle rows");
    assert_close("template MSA rows", &rows, &r["template_msa_rows"]);
}

/// Every output of `pass` against AlphaFold's last pass.
fn assert_pass_equals_alphafold(pass: &Pass, r: &HashMap<String, Tensor>) {
    let mask = r["final_atom_mask"].unsqueeze(-1);
    assert_close("final_atom_mask", &pass.structure.atom37_mask, &r["final_atom_mask"]);
    assert_close("representations/pair", &pass.recycled.pair, &r["pair"]);
    assert_close("representations/msa_first_row", &pass.recycled.msa_first_row, &r["msa_first_row"]);
    assert_close("representations/single", &pass.single, &r["single"]);
    assert_close("final_atom_positions", &(&pass.structure.atom37 * &mask), &(&r["final_atom_positions"] * &mask));
    let h = &pass.heads;
    // AlphaFold's masked-MSA head sees the MSA rows only, not the template rows.
    assert_close("masked_msa/logits", &h.masked_msa, &r["masked_msa_logits"]);
    assert_close("distogram/logits", &h.distogram, &r["distogram_logits"]);
    assert_close("predicted_lddt/logits", &h.lddt, &r["predicted_lddt_logits"]);
    assert_close("experimentally_resolved/logits", &h.experimentally_resolved, &r["experimentally_resolved_logits"]);
    let pae = h.aligned_error.as_ref().expect("the fixture's parameters have the PAE head");
    assert_close("predicted_aligned_error/logits", pae, &r["predicted_aligned_error_logits"]);
    assert_close("plddt", &h.plddt(), &r["plddt"]);
    let ptm = h.ptm().unwrap().unwrap();
    assert!((ptm - r["ptm"].double_value(&[])).abs() < TOLERANCE, "ptm {ptm} vs {}", r["ptm"].double_value(&[]));
}

#[test]
fn one_pass_with_template_hits_equals_alphafold() {
    let (params, features, r) = setup();
    let model = AlphaFold::new(&params).unwrap();
    let batch = last_batch(&features);
    let prev = Recycled {
        msa_first_row: r["prev_msa_first_row"].shallow_clone(),
        pair: r["prev_pair"].shallow_clone(),
        pseudo_beta: pseudo_beta(&batch.aatype, &r["prev_pos"]).unwrap(),
    };
    let pass = tch::no_grad(|| model.pass(&batch, prev, &Exec::serial(), None)).unwrap();
    assert_pass_equals_alphafold(&pass, &r);
}

#[test]
fn prediction_with_template_hits_equals_alphafold() {
    let (params, features, r) = setup();
    let model = AlphaFold::new(&params).unwrap();
    let pass = tch::no_grad(|| model.predict(&features, 1, Kind::Float, &Exec::serial(), None)).unwrap();
    assert_pass_equals_alphafold(&pass, &r);
}
