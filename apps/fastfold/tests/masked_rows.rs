//! Leaving fully-masked MSA and extra-MSA rows out of the stacks changes no output: AlphaFold's
//! fixture features (`fixtures/alphafold`, with one padding MSA row, two padding extra rows and
//! a padding template) padded further the way AlphaFold's `make_fixed_size` pads (zero
//! features, zero masks) give the same outputs with and without the rows, the masked-MSA
//! logits of every padding row included, and AlphaFold's own outputs at the real rows; padding
//! templates are left out of the template stack, and with no real template it is skipped.
use std::collections::HashMap;
use std::path::PathBuf;

use engine::parallel::dap::Dap;
use fastfold::features::{Features, TemplateFeatures};
use fastfold::model::alphafold::{AlphaFold, Pass};
use fastfold::model::masked_rows::MsaRows;
use fastfold::model::{Exec, Params};
use tch::{Device, Kind, Tensor};

/// Largest allowed difference between the runs with and without the padding rows in fp64,
/// relative to the compared array's largest magnitude (at least 1). Leaving the rows out
/// removes exact zeros from sums, so only summation order differs: measured 4e-13.
const SAME: f64 = 1e-5;
/// The same in fp32, where summation order alone (as chunking changes it: 1.3e-5 on the
/// positions of this random-weight model after two passes) is already about 1e-5; leaving
/// the rows out measured 1.1e-5.
const SAME_FP32: f64 = 1e-4;
/// Against AlphaFold, as in `alphafold_reference.rs`.
const ALPHAFOLD: f64 = 1e-4;
/// MSA and extra-MSA rows after padding (the fixture has 6 and 5).
const ROWS: i64 = 24;
const EXTRA_ROWS: i64 = 32;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold").join(name)
}

/// `t` [R, rows, ...] with zero rows appended up to `rows`.
fn pad(t: &Tensor, rows: i64) -> Tensor {
    let mut shape = t.size();
    shape[1] = rows - shape[1];
    Tensor::cat(&[t.shallow_clone(), Tensor::zeros(shape, (t.kind(), t.device()))], 1)
}

/// The fixture's features with the MSA padded to `msa` rows and the extra MSA to `extra`.
fn padded_features(msa: i64, extra: i64) -> Features {
    let f = Features::load_npz(&fixture("features.npz"), Device::Cpu).unwrap();
    Features {
        msa_feat: pad(&f.msa_feat, msa),
        msa_mask: pad(&f.msa_mask, msa),
        msa_row_mask: pad(&f.msa_row_mask, msa),
        bert_mask: pad(&f.bert_mask, msa),
        true_msa: pad(&f.true_msa, msa),
        extra_msa: pad(&f.extra_msa, extra),
        extra_has_deletion: pad(&f.extra_has_deletion, extra),
        extra_deletion_value: pad(&f.extra_deletion_value, extra),
        extra_msa_mask: pad(&f.extra_msa_mask, extra),
        extra_msa_row_mask: pad(&f.extra_msa_row_mask, extra),
        ..f
    }
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tolerance: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let (got, want) = (got.to_kind(Kind::Double), want.to_kind(Kind::Double));
    let diff = (&got - &want).abs().max().double_value(&[]);
    let scale = want.abs().max().double_value(&[]).max(1.0);
    eprintln!("{what}: max difference {diff:.2e}, largest magnitude {scale:.2e}");
    assert!(diff <= tolerance * scale, "{what}: max difference {diff:.3e} (largest magnitude {scale:.3e})");
}

/// Every output two passes share.
fn outputs(pass: &Pass) -> Vec<(&'static str, Tensor)> {
    let h = &pass.heads;
    vec![
        ("representations/pair", pass.recycled.pair.shallow_clone()),
        ("representations/msa_first_row", pass.recycled.msa_first_row.shallow_clone()),
        ("representations/single", pass.single.shallow_clone()),
        ("masked_msa/logits", h.masked_msa.shallow_clone()),
        ("distogram/logits", h.distogram.shallow_clone()),
        ("predicted_lddt/logits", h.lddt.shallow_clone()),
        ("experimentally_resolved/logits", h.experimentally_resolved.shallow_clone()),
        ("predicted_aligned_error/logits", h.aligned_error.as_ref().unwrap().shallow_clone()),
        ("final_atom_positions", &pass.structure.atom37 * pass.structure.atom37_mask.unsqueeze(-1)),
    ]
}

#[test]
fn dropping_masked_rows_changes_no_output_of_padded_features() {
    // The fixture's templates (two real, one padding), then none real: the template
    // embedding then adds exactly 0 and every template row is masked.
    let no_templates = {
        let f = padded_features(ROWS, EXTRA_ROWS);
        let t = f.templates.as_ref().unwrap();
        let [a, b, c, _, e, g] = t.named().map(|(_, x)| x.shallow_clone());
        let templates = TemplateFeatures::from_array([a, b.zeros_like(), c.zeros_like(), t.mask.zeros_like(), e, g]);
        Features { templates: Some(templates), ..f }
    };
    let cases = [
        ("templates", padded_features(ROWS, EXTRA_ROWS), Kind::Double, SAME, &[None, Some(3)][..]),
        ("templates", padded_features(ROWS, EXTRA_ROWS), Kind::Float, SAME_FP32, &[None][..]),
        ("no real template", no_templates, Kind::Double, SAME, &[None][..]),
    ];
    for (what, features, kind, tolerance, chunks) in cases {
        let params = Params::load_model(fixture("params.npz")).unwrap().to_kind(kind).unwrap();
        let all = AlphaFold::new(&params).unwrap().drop_masked_rows(false);
        let dropped = AlphaFold::new(&params).unwrap();
        for &chunk in chunks {
            let run = |m: &AlphaFold| {
                tch::no_grad(|| m.predict(&features, 1, kind, &Exec::new(Dap::none(), chunk), None)).unwrap()
            };
            let (want, got) = (run(&all), run(&dropped));
            assert_eq!(got.heads.masked_msa.size()[0], ROWS, "the masked-MSA logits keep the padded rows");
            for ((name, g), (_, w)) in outputs(&got).iter().zip(outputs(&want)) {
                assert_close(&format!("{name} ({what}, {kind:?}, chunk {chunk:?})"), g, &w, tolerance);
            }
        }
    }
}

#[test]
fn dropping_masked_rows_of_padded_features_equals_alphafold() {
    let params = Params::load_model(fixture("params.npz")).unwrap();
    let r: HashMap<String, Tensor> = Tensor::read_npz(fixture("reference.npz")).unwrap().into_iter().collect();
    let pass = tch::no_grad(|| {
        AlphaFold::new(&params).unwrap().predict(
            &padded_features(ROWS, EXTRA_ROWS),
            1,
            Kind::Float,
            &Exec::serial(),
            None,
        )
    })
    .unwrap();
    let mask = r["final_atom_mask"].unsqueeze(-1);
    assert_close(
        "final_atom_positions",
        &(&pass.structure.atom37 * &mask),
        &(&r["final_atom_positions"] * &mask),
        ALPHAFOLD,
    );
    assert_close("representations/pair", &pass.recycled.pair, &r["pair"], ALPHAFOLD);
    assert_close("representations/single", &pass.single, &r["single"], ALPHAFOLD);
    // AlphaFold's rows, then the added padding rows, which equal AlphaFold's own padding row.
    let logits = &pass.heads.masked_msa;
    let own = r["masked_msa_logits"].size()[0];
    assert_close("masked_msa/logits", &logits.narrow(0, 0, own), &r["masked_msa_logits"], ALPHAFOLD);
    let last = r["masked_msa_logits"].get(own - 1).unsqueeze(0).expand([ROWS - own, -1, -1], false);
    assert_close("masked_msa/logits of the added rows", &logits.narrow(0, own, ROWS - own), &last, ALPHAFOLD);
}

fn rows(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t).unwrap()
}

#[test]
fn alike_masked_rows_run_once_and_masked_template_rows_not_at_all() {
    // Rows: 0 real, 1 masked (stand-in), 2 masked and alike, 3 masked but different, 4 real,
    // then template rows 5 (masked) and 6 (real).
    let msa = Tensor::zeros([7, 3, 2], (Kind::Float, Device::Cpu));
    let _ = msa.get(3).fill_(1.0);
    let mask = Tensor::from_slice(&[1f32, 0., 0., 0., 1., 0., 1.]).unsqueeze(1).expand([7, 3], false).contiguous();
    let selection = MsaRows::new(&msa, &mask, 5).unwrap();
    let ids = Tensor::arange(7, (Kind::Int64, Device::Cpu)).unsqueeze(-1);
    let kept = selection.select(&ids).unwrap().squeeze_dim(-1);
    assert_eq!(rows(&kept), [0, 1, 3, 4, 6]);
    assert_eq!(rows(&selection.restore(&kept).unwrap().squeeze_dim(-1)), [0, 1, 1, 3, 4]);
    // A residue column masked in every row: column attention then averages over all rows, so
    // every row runs.
    let _ = mask.select(1, 2).fill_(0.0);
    assert_eq!(
        rows(&MsaRows::new(&msa, &mask, 5).unwrap().select(&ids).unwrap().squeeze_dim(-1)),
        [0, 1, 2, 3, 4, 5, 6]
    );
}
