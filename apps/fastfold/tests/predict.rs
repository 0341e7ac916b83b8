//! `fastfold predict` and `fastfold convert` end to end on a tiny random model written with
//! AlphaFold's key names: the files written (PDB columns, confidence JSON, raw outputs), and
//! that chunking, DAP over 2 ranks, safetensors parameters and an equivalent features file all
//! give the plain run's result; AlphaFold's presets set the MSA sizes and must match the
//! parameters. Bad inputs are errors naming the flag, record or key.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use fastfold::features::{process, FeatureConfig, RawFeatures};
use fastfold::input::InputArgs;
use fastfold::model::{EvoformerConfig, ModelConfig, Params};
use fastfold::preset::Preset;
use tch::{Device, Tensor};

use common::BIN;
const SEQ_A: &str = "MKTAYIAKQRQISFVKSHFSRQ";
const SEQ_B: &str = "GSWPEDLK";

fn dir(name: &str) -> PathBuf {
    common::scratch("predict", name)
}

fn fasta(dir: &Path, records: &[(&str, &str)]) -> PathBuf {
    let text: String = records.iter().map(|(name, seq)| format!(">{name} test record\n{seq}\n")).collect();
    let path = dir.join("query.fasta");
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs the binary; returns (success, stdout + stderr).
fn fastfold(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).env("FASTFOLD_TEST", "1").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn predict(extra: &[&str]) -> String {
    let (ok, text) = fastfold(&[&["predict"], extra].concat());
    assert!(ok, "fastfold predict {extra:?} failed:\n{text}");
    text
}

fn outputs(path: &Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_npz(path).unwrap().into_iter().collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

#[test]
fn predict_writes_pdb_confidence_and_raw_outputs() {
    let d = dir("files");
    let fa = fasta(&d, &[("first", SEQ_A), ("second/with:odd", SEQ_B)]);
    let out = d.join("out");
    let params = common::tiny_params().to_str().unwrap();
    let text = predict(&[
        fa.to_str().unwrap(),
        "--params",
        params,
        "--recycles",
        "1",
        "--save-outputs",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(text.contains("first tiny: 22 residues, 1 recycles"), "{text}");
    assert!(text.contains("peak memory"), "{text}");

    for (name, seq) in [("first", SEQ_A), ("second_with_odd", SEQ_B)] {
        let n = seq.len();
        // One folder per record; the files named by the model (`params_tiny.npz`: `tiny`).
        let pdb = std::fs::read_to_string(out.join(name).join("tiny_unrelaxed.pdb")).unwrap();
        let atoms: Vec<&str> = pdb.lines().filter(|l| l.starts_with("ATOM")).collect();
        let raw = outputs(&out.join(name).join("tiny_outputs.npz"));
        let mask = &raw["final_atom_mask"];
        assert_eq!(mask.size(), [n as i64, 37]);
        assert_eq!(atoms.len() as f64, mask.sum(tch::Kind::Double).double_value(&[]), "one ATOM record per atom");
        for line in &atoms {
            assert!(line.len() >= 78, "fixed columns: {line:?}");
            let b: f64 = line[60..66].trim().parse().unwrap();
            assert!((0.0..=100.0).contains(&b), "pLDDT B-factor {b} in {line:?}");
            let x: f64 = line[30..38].trim().parse().unwrap();
            assert!(x.is_finite());
        }
        assert_eq!(pdb.lines().filter(|l| l.starts_with("MODEL")).count(), 1, "one model");
        let first_res = &atoms[0][17..20];
        assert_eq!(first_res, if name == "first" { "MET" } else { "GLY" });

        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(name).join("tiny_confidence.json")).unwrap())
                .unwrap();
        let plddt = json["plddt"].as_array().unwrap();
        assert_eq!(plddt.len(), n);
        assert!(plddt.iter().all(|v| (0.0..=100.0).contains(&v.as_f64().unwrap())));
        assert!(json["ptm"].as_f64().is_some_and(|t| (0.0..=1.0).contains(&t)), "the tiny model has the PAE head");
        assert_eq!(json["pae"].as_array().unwrap().len(), n);

        let n = n as i64;
        let c = EvoformerConfig::tiny();
        for (key, shape) in [
            ("final_atom_positions", vec![n, 37, 3]),
            ("plddt", vec![n]),
            ("distogram/logits", vec![n, n, 64]),
            ("distogram/bin_edges", vec![63]),
            ("predicted_lddt/logits", vec![n, 50]),
            ("experimentally_resolved/logits", vec![n, 37]),
            ("representations/single", vec![n, ModelConfig::tiny().c_s]),
            ("representations/pair", vec![n, n, c.c_z]),
            ("representations/msa_first_row", vec![n, c.c_m]),
            ("predicted_aligned_error", vec![n, n]),
            ("ptm", vec![]),
        ] {
            assert_eq!(raw[key].size(), shape, "{key}");
        }
    }
}

#[test]
fn chunking_dap_safetensors_and_a_features_file_give_the_plain_result() {
    let d = dir("equal");
    let fa = fasta(&d, &[("query", SEQ_A)]);
    let a3m = d.join("query.a3m");
    std::fs::write(&a3m, format!(">query\n{SEQ_A}\n>hit1\nMKTAYIAKQRQIS-VKSHFSRQ\n>hit2\nMKTAaYLAKQRQISFVKSHFcSRE\n>hit3\nMRTAYIAKQ--ISFVKAHFSRQ\n"))
        .unwrap();
    let params = common::tiny_params().to_str().unwrap();
    let run = |name: &str, extra: &[&str]| -> std::collections::HashMap<String, Tensor> {
        let out = d.join(name);
        let base = ["--recycles", "1", "--save-outputs", "-o", out.to_str().unwrap()];
        predict(&[extra, &base].concat());
        outputs(&out.join("query/tiny_outputs.npz"))
    };
    let input = [fa.to_str().unwrap(), "--msa", a3m.to_str().unwrap()];
    let plain = run("plain", &[&input[..], &["--params", params]].concat());

    let safetensors = d.join("params_tiny.safetensors");
    let (ok, text) = fastfold(&["convert", params, safetensors.to_str().unwrap()]);
    assert!(ok, "{text}");
    let back = d.join("back.npz");
    assert!(fastfold(&["convert", safetensors.to_str().unwrap(), back.to_str().unwrap()]).0);
    let pt = d.join("params.pt");
    let (ok, text) = fastfold(&["convert", params, pt.to_str().unwrap()]);
    assert!(!ok && text.contains("params.pt: the output must end in .npz or .safetensors") && !pt.exists(), "{text}");
    let original = outputs(common::tiny_params());
    let round = outputs(&back);
    assert_eq!(original.len(), round.len());
    for (k, t) in &original {
        assert!(t.equal(&round[k]), "{k} changed in the npz -> safetensors -> npz round trip");
    }

    let features = d.join("query_features.npz");
    let sequence = data::a3m::read(&a3m).unwrap();
    let raw = RawFeatures::new(SEQ_A, Some((&sequence, &a3m))).unwrap();
    let config = FeatureConfig { num_recycle: 1, ..FeatureConfig::default() };
    process(&raw, &config, 0, Device::Cpu).unwrap().save_npz(&features).unwrap();

    let from_features = |file: &Path, name: &str, extra: &[&str]| {
        let out = d.join(name);
        let base =
            ["--features", file.to_str().unwrap(), "--params", params, "--save-outputs", "-o", out.to_str().unwrap()];
        predict(&[&base[..], extra].concat());
        let stem = file.file_stem().unwrap().to_str().unwrap();
        outputs(&out.join(stem).join("tiny_outputs.npz"))
    };
    let variants = [
        ("chunked", run("chunked", &[&input[..], &["--params", params, "--chunk-size", "3"]].concat())),
        ("2 ranks", run("dap", &[&input[..], &["--params", params, "--nproc", "2"]].concat())),
        ("safetensors", run("st", &[&input[..], &["--params", safetensors.to_str().unwrap()]].concat())),
        ("features file", from_features(&features, "feat", &[])),
        // The raw features the plain run saved, as AlphaFold users rerun from features.pkl:
        // processed here again, with the same seed, to the same batch.
        ("raw features file", from_features(&d.join("plain/query/features.npz"), "raw", &["--recycles", "1"])),
    ];
    for (what, got) in &variants {
        // fp32; reordered sums (chunks, all-to-alls) differ in the last bits, which eight
        // structure-module iterations turn into ~1e-4 Å (the PDB writes 1e-3 Å).
        for (key, tol) in [
            ("final_atom_positions", 1e-3),
            ("distogram/logits", 1e-4),
            ("predicted_lddt/logits", 1e-4),
            ("representations/pair", 1e-4),
        ] {
            let diff = max_diff(&plain[key], &got[key]);
            assert!(diff < tol, "{what}: {key} differs from the plain run by {diff} (tolerance {tol})");
        }
    }
}

#[test]
fn bf16_prediction_stays_in_range() {
    let d = dir("bf16");
    let fa = fasta(&d, &[("query", SEQ_B)]);
    let out = d.join("out");
    let params = common::tiny_params().to_str().unwrap();
    predict(&[
        fa.to_str().unwrap(),
        "--params",
        params,
        "--precision",
        "bf16",
        "--save-outputs",
        "-o",
        out.to_str().unwrap(),
    ]);
    let raw = outputs(&out.join("query/tiny_outputs.npz"));
    assert!(bool::try_from(raw["final_atom_positions"].isfinite().all()).unwrap());
    let plddt = &raw["plddt"];
    assert!(plddt.min().double_value(&[]) >= 0.0 && plddt.max().double_value(&[]) <= 100.0);
}

#[test]
fn bad_inputs_are_named() {
    let d = dir("bad");
    let params = common::tiny_params().to_str().unwrap();
    let out = d.join("out");
    let o = out.to_str().unwrap();

    let two = fasta(&d, &[("a", SEQ_A), ("b", SEQ_B)]);
    let a3m = d.join("a.a3m");
    std::fs::write(&a3m, format!(">a\n{SEQ_A}\n")).unwrap();
    let (ok, text) =
        fastfold(&["predict", two.to_str().unwrap(), "--params", params, "--msa", a3m.to_str().unwrap(), "-o", o]);
    assert!(!ok && text.contains("--msa") && text.contains("2 records"), "{text}");

    let bad = d.join("bad.fasta");
    std::fs::write(&bad, ">broken\nMKT*AY\n").unwrap();
    let (ok, text) = fastfold(&["predict", bad.to_str().unwrap(), "--params", params, "-o", o]);
    assert!(!ok && text.contains("broken") && text.contains('4') && text.contains('*'), "{text}");

    let one = fasta(&d, &[("a", SEQ_B)]);
    let (ok, text) = fastfold(&["predict", one.to_str().unwrap(), "--params", params, "--chunk-size", "0", "-o", o]);
    assert!(!ok && text.contains("--chunk-size"), "{text}");
    let (ok, text) = fastfold(&[
        "predict",
        one.to_str().unwrap(),
        "--params",
        params,
        "--kernels",
        "fused",
        "--device",
        "cpu",
        "-o",
        o,
    ]);
    assert!(!ok && text.contains("--kernels fused needs a CUDA device"), "{text}");

    let mut arrays = outputs(common::tiny_params());
    let key = "alphafold/alphafold_iteration/predicted_lddt_head/logits//weights";
    assert!(arrays.remove(key).is_some());
    let named: Vec<(String, Tensor)> = arrays.into_iter().collect();
    let partial = d.join("partial.npz");
    data::checkpoint::save_npz(&named, &partial).unwrap();
    let (ok, text) = fastfold(&["predict", one.to_str().unwrap(), "--params", partial.to_str().unwrap(), "-o", o]);
    assert!(!ok && text.contains(key) && text.contains("partial.npz"), "{text}");
    assert!(!out.join("a").exists(), "nothing written after a failure");
}

#[test]
fn presets_set_alphafold_msa_sizes_and_must_match_the_parameters() {
    // AlphaFold's CONFIG_DIFFS: clusters, extra rows, templates.
    for (name, clusters, extra, templates) in [
        ("model_1", 508, 5120, true),
        ("model_2_ptm", 508, 1024, true),
        ("model_3", 512, 5120, false),
        ("model_4_ptm", 512, 5120, false),
        ("model_5", 512, 1024, false),
    ] {
        let p: Preset = name.parse().unwrap();
        assert_eq!(
            (p.max_msa_clusters(), p.max_extra_msa(), p.templates(), p.to_string()),
            (clusters, extra, templates, name.to_string())
        );
    }
    let from_name = Preset::from_params_path(Path::new("params/params_model_2_ptm.safetensors"));
    assert_eq!(from_name, Some("model_2_ptm".parse().unwrap()));
    assert_eq!(Preset::from_params_path(Path::new("params_tiny.npz")), None);
    let err = "model_6".parse::<Preset>().unwrap_err();
    assert!(err.contains("model_6") && err.contains("model_5"), "{err}");

    // The tiny set (no templates, a PAE head) under model_5_ptm's release name, and an
    // alignment of 1600 distinct rows: 512 clusters and 1024 extra rows.
    let d = dir("preset");
    let named = d.join("params_model_5_ptm.npz");
    std::fs::copy(common::tiny_params(), &named).unwrap();
    let fa = fasta(&d, &[("q", SEQ_B)]);
    let letters: Vec<char> = "ACDEFGHIKLMNPQRSTVWY".chars().collect();
    let mut a3m = format!(">q\n{SEQ_B}\n");
    for i in 1..1600usize {
        let row: String = (0..SEQ_B.len()).map(|k| letters[(i / 20usize.pow(k as u32)) % 20]).collect();
        a3m.push_str(&format!(">r{i}\n{row}\n"));
    }
    let msa = d.join("q.a3m");
    std::fs::write(&msa, a3m).unwrap();
    let input = InputArgs {
        fasta: Some(fa.clone()),
        msa: Some(msa),
        features: None,
        preset: None,
        max_msa_clusters: None,
        max_extra_msa: None,
        seed: engine::job::SeedArgs { seed: 0 },
    };
    let rows = |input: &InputArgs, path: &Path| {
        let params = Params::load_model(path).unwrap();
        let preset = input.preset(&params, path).unwrap();
        let (_, f) = input.load(0, preset, Device::Cpu).unwrap().remove(0);
        (f.msa_feat.size()[1], f.extra_msa.size()[1])
    };
    assert_eq!(rows(&input, &named), (512, 1024), "model_5_ptm from the file name");
    let model_3 = InputArgs { preset: Some("model_3_ptm".parse().unwrap()), ..input.clone() };
    assert_eq!(rows(&model_3, &named), (512, 1600 - 512), "--preset model_3_ptm: up to 5120 extra rows");
    let capped = InputArgs { max_extra_msa: Some(100), ..model_3 };
    assert_eq!(rows(&capped, &named), (512, 100), "--max-extra-msa wins over the preset");

    // A preset that is not the parameters' network is an error naming where it came from.
    let wrong_name = d.join("params_model_3.npz");
    std::fs::copy(common::tiny_params(), &wrong_name).unwrap();
    let out = d.join("out");
    let (fa, o) = (fa.to_str().unwrap(), out.to_str().unwrap());
    let (ok, text) = fastfold(&["predict", fa, "--params", wrong_name.to_str().unwrap(), "-o", o]);
    let expected = "params_model_3.npz is not model_3 (its file name): model_3 has no predicted-aligned-error head";
    assert!(!ok && text.contains(expected), "{text}");
    let (ok, text) = fastfold(&[
        "predict",
        fa,
        "--params",
        common::tiny_params().to_str().unwrap(),
        "--preset",
        "model_1_ptm",
        "-o",
        o,
    ]);
    assert!(!ok && text.contains("(--preset)") && text.contains("has a template embedding"), "{text}");
    assert!(!out.exists(), "nothing written after a failure");
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

#[test]
fn a_params_directory_runs_every_model_in_turn_ranked_by_ptm_with_timings() {
    // Two tiny sets (no templates, a PAE head) under release names of models without
    // templates, and a file that is not a release name (ignored).
    let d = dir("models");
    let params = d.join("params");
    std::fs::create_dir_all(&params).unwrap();
    std::fs::copy(common::tiny_params(), params.join("params_model_3_ptm.npz")).unwrap();
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 8)
        .unwrap()
        .save(params.join("params_model_5_ptm.safetensors"))
        .unwrap();
    std::fs::copy(common::tiny_params(), params.join("other.npz")).unwrap();
    let fa = fasta(&d, &[("first", SEQ_A), ("second", SEQ_B)]);
    let out = d.join("out");
    let (fa, p, o) = (fa.to_str().unwrap(), params.to_str().unwrap(), out.to_str().unwrap());
    let text = predict(&[fa, "--params", p, "--num-recycle", "1", "-o", o]);
    for name in ["first", "second"] {
        let q = out.join(name);
        assert!(text.contains(&format!("{name} model_3_ptm:")) && text.contains(&format!("{name} model_5_ptm:")));
        let ranking = json(&q.join("ranking_debug.json"));
        let scores = ranking["ptm"].as_object().expect("ranked by pTM: every set has the PAE head");
        let order: Vec<&str> = ranking["order"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(scores.len(), 2);
        assert!(scores[order[0]].as_f64().unwrap() >= scores[order[1]].as_f64().unwrap(), "{ranking}");
        for (i, model) in order.iter().enumerate() {
            let ranked = std::fs::read(q.join(format!("ranked_{i}.pdb"))).unwrap();
            assert_eq!(ranked, std::fs::read(q.join(format!("{model}_unrelaxed.pdb"))).unwrap());
            let confidence = json(&q.join(format!("{model}_confidence.json")));
            assert_eq!(confidence["ptm"].as_f64(), scores[*model].as_f64());
        }
        let timings = json(&q.join("timings.json"));
        let keys: Vec<&String> = timings.as_object().unwrap().keys().collect();
        for key in [
            "features",
            "process_features_model_3_ptm",
            "predict_and_compile_model_3_ptm",
            "process_features_model_5_ptm",
            "predict_and_compile_model_5_ptm",
        ] {
            assert!(timings[key].as_f64().is_some_and(|t| t >= 0.0), "timings.json has {keys:?}");
        }
    }

    // --models picks; a number the directory lacks is an error naming the flag.
    let out5 = d.join("out5");
    predict(&[fa, "--params", p, "--models", "5", "--num-recycle", "0", "-o", out5.to_str().unwrap()]);
    let ranking = json(&out5.join("first/ranking_debug.json"));
    assert_eq!(ranking["order"], serde_json::json!(["model_5_ptm"]));
    let (ok, text) = fastfold(&["predict", fa, "--params", p, "--models", "1", "-o", o]);
    assert!(!ok && text.contains("--models 1") && text.contains("no parameter file"), "{text}");
    let (ok, text) =
        fastfold(&["predict", fa, "--params", common::tiny_params().to_str().unwrap(), "--models", "3", "-o", o]);
    assert!(!ok && text.contains("--models 3") && text.contains("is a file"), "{text}");
}

#[test]
fn recycling_stops_early_once_the_ca_distances_settle() {
    let d = dir("early");
    let fa = fasta(&d, &[("query", SEQ_B)]);
    let params = common::tiny_params().to_str().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = d.join(name);
        let text = predict(
            &[&[fa.to_str().unwrap(), "--params", params, "--save-outputs", "-o", out.to_str().unwrap()][..], extra]
                .concat(),
        );
        (text, outputs(&out.join("query/tiny_outputs.npz")))
    };
    // A tolerance no change is below runs every pass; one every change is below stops after
    // the second pass (ColabFold never stops after the first), as --num-recycle 1 does.
    let (text, _) = run("all", &["--num-recycle", "3", "--recycle-early-stop-tolerance", "1e-12"]);
    assert!(text.contains("3 recycles"), "{text}");
    let (text, early) = run("early", &["--num-recycle", "3", "--recycle-early-stop-tolerance", "1e9"]);
    assert!(text.contains("1 recycles"), "{text}");
    let (_, one) = run("one", &["--num-recycle", "1"]);
    assert!(max_diff(&early["final_atom_positions"], &one["final_atom_positions"]) < 1e-4);

    let o = d.join("bad").to_str().unwrap().to_string();
    for (flag, value) in [
        ("--recycle-early-stop-tolerance", "-1"),
        ("--recycle-early-stop-tolerance", "nan"),
        ("--structure-iterations", "0"),
        ("--structure-iterations", "1001"),
        ("--num-recycle", "18446744073709551615"),
        ("--max-msa-clusters", "0"),
        ("--timeout", "-1"),
    ] {
        let flag_value = format!("{flag}={value}");
        let (ok, text) = fastfold(&["predict", fa.to_str().unwrap(), "--params", params, &flag_value, "-o", &o]);
        assert!(!ok && text.contains(flag), "{text}");
    }
    let features = d.join("two_slices.npz");
    let raw = RawFeatures::new(SEQ_B, None).unwrap();
    let config = FeatureConfig { num_recycle: 1, ..FeatureConfig::default() };
    process(&raw, &config, 0, Device::Cpu).unwrap().save_npz(&features).unwrap();
    let (ok, text) = fastfold(&[
        "predict",
        "--features",
        features.to_str().unwrap(),
        "--params",
        params,
        "--num-recycle",
        "5",
        "-o",
        &o,
    ]);
    assert!(!ok && text.contains("--num-recycle 5") && text.contains("has 2"), "{text}");
    // The query's folder, made for the run, goes with it.
    let left: Vec<_> = std::fs::read_dir(&o).map(|d| d.map(|e| e.unwrap().file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "a failed prediction left {left:?} in {o}");
    // Names that become the same folder name.
    let two = fasta(&d, &[("a/b", SEQ_A), ("a:b", SEQ_B)]);
    let (ok, text) = fastfold(&["predict", two.to_str().unwrap(), "--params", params, "-o", &o]);
    assert!(!ok && text.contains("records 1 and 2") && text.contains("\"a_b\""), "{text}");
}
