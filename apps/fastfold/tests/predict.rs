//! `fastfold predict` and `fastfold convert` end to end on a tiny random model written with
//! AlphaFold's key names: the files written (PDB columns, confidence JSON, raw outputs), and
//! that chunking, DAP over 2 ranks, safetensors parameters and an equivalent features file all
//! give the plain run's result; AlphaFold's presets set the MSA sizes and must match the
//! parameters. Bad inputs are errors naming the flag, record or key.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use fastfold::features::{process, FeatureConfig, Features, RawFeatures};
use fastfold::input::InputArgs;
use fastfold::model::alphafold::AlphaFold;
use fastfold::model::{EvoformerConfig, Exec, ModelConfig, Params};
use fastfold::pdb::Structure;
use fastfold::preset::Preset;
use tch::{Device, Kind, Tensor};

use common::BIN;
const SEQ_A: &str = "MKTAYIAKQRQISFVKSHFSRQ";
const SEQ_B: &str = "GSWPEDLK";

fn dir(name: &str) -> suite_tests::Scratch {
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
        let mask = &raw["structure_module/final_atom_mask"];
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
        // AlphaFold's result dictionary (RunModel.predict) as result_model_*.pkl holds it: the
        // old file had final_atom_positions and final_atom_mask at the top level and lacked
        // ranking_confidence, num_recycles and aligned_confidence_probs.
        for (key, shape) in [
            ("structure_module/final_atom_positions", vec![n, 37, 3]),
            ("structure_module/final_atom_mask", vec![n, 37]),
            ("plddt", vec![n]),
            ("ranking_confidence", vec![]),
            ("num_recycles", vec![]),
            ("aligned_confidence_probs", vec![n, n, 64]),
            ("predicted_aligned_error/logits", vec![n, n, 64]),
            ("predicted_aligned_error/breaks", vec![63]),
            ("max_predicted_aligned_error", vec![]),
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
            let t = raw.get(key).unwrap_or_else(|| panic!("no {key} in {:?}", raw.keys()));
            assert_eq!(t.size(), shape, "{key}");
        }
        assert!(!raw.contains_key("final_atom_positions") && !raw.contains_key("final_atom_mask"));
        let mean_plddt = json["mean_plddt"].as_f64().unwrap();
        assert!((raw["ranking_confidence"].double_value(&[]) - mean_plddt).abs() < 1e-3, "mean pLDDT");
        assert_eq!(raw["num_recycles"].int64_value(&[]), 1);
        let probs = &raw["aligned_confidence_probs"];
        assert!((probs.sum_dim_intlist(-1, false, tch::Kind::Double) - 1.0).abs().max().double_value(&[]) < 1e-5);
        let want = raw["predicted_aligned_error/logits"].softmax(-1, tch::Kind::Float);
        assert!(max_diff(probs, &want) < 1e-6, "softmax of the PAE logits");
        let breaks = &raw["predicted_aligned_error/breaks"];
        assert_eq!((breaks.double_value(&[0]), breaks.double_value(&[62])), (0.0, 31.0));
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
    // bfloat16 parameters (which predict reads) into an .npz: float32, the same values, said.
    let bf16: Vec<(String, Tensor)> = original.iter().map(|(k, t)| (k.clone(), t.to_kind(Kind::BFloat16))).collect();
    let bf16_file = d.join("params_bf16.safetensors");
    data::checkpoint::save_tensors(&bf16, &bf16_file).unwrap();
    let widened = d.join("widened.npz");
    let (ok, text) = fastfold(&["convert", bf16_file.to_str().unwrap(), widened.to_str().unwrap()]);
    assert!(ok && text.contains(&format!("{} bfloat16 arrays written as float32", bf16.len())), "{text}");
    let widened = outputs(&widened);
    for (k, t) in &bf16 {
        assert!(widened[k].kind() == Kind::Float && widened[k].equal(&t.to_kind(Kind::Float)), "{k} widened");
    }
    // A file with no arrays is no parameter set: refused, nothing written.
    let empty = d.join("empty.safetensors");
    data::checkpoint::save_tensors(&[], &empty).unwrap();
    let nothing = d.join("nothing.npz");
    let (ok, text) = fastfold(&["convert", empty.to_str().unwrap(), nothing.to_str().unwrap()]);
    assert!(!ok && text.contains("empty.safetensors: holds no arrays") && !nothing.exists(), "{text}");

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
            ("structure_module/final_atom_positions", 1e-3),
            ("distogram/logits", 1e-4),
            ("predicted_lddt/logits", 1e-4),
            ("representations/pair", 1e-4),
        ] {
            let diff = max_diff(&plain[key], &got[key]);
            assert!(diff < tol, "{what}: {key} differs from the plain run by {diff} (tolerance {tol})");
        }
    }
}

/// A PNG file's pixels as RGB, with its size.
fn png_rgb(path: &Path) -> (u32, u32, Vec<u8>) {
    let img = image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_rgb8();
    (img.width(), img.height(), img.into_raw())
}

#[test]
fn plots_show_every_model_and_the_msa_as_colabfold_names_them() {
    use fastfold::plots::{self, PAE_PANEL, WIDE};
    let d = dir("plots");
    let params = d.join("params");
    std::fs::create_dir_all(&params).unwrap();
    std::fs::copy(common::tiny_params(), params.join("params_model_3_ptm.npz")).unwrap();
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 9)
        .unwrap()
        .save(params.join("params_model_5_ptm.npz"))
        .unwrap();
    let fa = fasta(&d, &[("query", SEQ_A)]);
    let a3m = d.join("query.a3m");
    std::fs::write(&a3m, format!(">query\n{SEQ_A}\n>hit1\nMKTAYIAKQRQIS-VKSHFSRQ\n>hit2\n--TAYLAKQRQISFVKSHFSRE\n"))
        .unwrap();
    let out = d.join("out");
    let (fa, a3m_s, p, o) =
        (fa.to_str().unwrap(), a3m.to_str().unwrap(), params.to_str().unwrap(), out.to_str().unwrap());
    predict(&[fa, "--msa", a3m_s, "--params", p, "--num-recycle", "0", "-o", o]);
    let q = out.join("query");

    // The models best first, as the ranking has them; each file is the figure drawn from what
    // the confidence files and the MSA hold, pixel for pixel.
    let order: Vec<String> = json(&q.join("ranking_debug.json"))["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    let confidences: Vec<serde_json::Value> =
        order.iter().map(|m| json(&q.join(format!("{m}_confidence.json")))).collect();
    let numbers =
        |v: &serde_json::Value| -> Vec<f64> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let paes: Vec<Vec<Vec<f64>>> =
        confidences.iter().map(|c| c["pae"].as_array().unwrap().iter().map(numbers).collect()).collect();
    let plddts: Vec<Vec<f64>> = confidences.iter().map(|c| numbers(&c["plddt"])).collect();
    let n = SEQ_A.len();

    let (w, h, pixels) = png_rgb(&q.join("query_pae.png"));
    assert_eq!((w, h), (2 * PAE_PANEL.0, PAE_PANEL.1), "one panel per model");
    let labelled: Vec<(String, &[Vec<f64>])> =
        paes.iter().enumerate().map(|(i, m)| (format!("rank_{}", i + 1), &m[..])).collect();
    let drawn = plots::pae(&labelled, &[n]).unwrap();
    assert!(pixels == drawn.rgb, "query_pae.png is not the PAE of the ranked models");
    // Its pixels follow the data: each cell of rank_1's map has the colour of its PAE.
    let panel = &drawn.panels[0];
    for (i, row) in paes[0].iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            let (x, y) = panel.at((j as f64 + 0.5) / n as f64, (i as f64 + 0.5) / n as f64);
            let at = 3 * (y as usize * w as usize + x as usize);
            let want = plots::bwr(v, plots::PAE_MAX);
            let got = &pixels[at..at + 3];
            assert!(
                got.iter().zip([want.0, want.1, want.2]).all(|(a, b)| a.abs_diff(b) <= 2),
                "PAE ({i}, {j}) = {v}: {got:?}"
            );
        }
    }

    let (w, h, pixels) = png_rgb(&q.join("query_plddt.png"));
    assert_eq!((w, h), WIDE);
    let labelled: Vec<(String, &[f64])> =
        plddts.iter().enumerate().map(|(i, p)| (format!("rank_{}", i + 1), &p[..])).collect();
    assert!(pixels == plots::plddt(&labelled, &[n]).unwrap().rgb, "query_plddt.png is not the models' pLDDT");

    let (w, h, pixels) = png_rgb(&q.join("query_coverage.png"));
    assert_eq!((w, h), WIDE);
    let msa = data::a3m::read(&a3m).unwrap();
    let raw = RawFeatures::new(SEQ_A, Some((&msa, &a3m))).unwrap();
    assert_eq!(raw.msa.len(), 3);
    assert!(pixels == plots::coverage(&raw.msa, &[n]).unwrap().rgb, "query_coverage.png is not the MSA's coverage");

    // --no-plots writes none; a processed features file has no MSA to show, but the models'
    // plots.
    let quiet = d.join("quiet");
    predict(&[
        fa,
        "--msa",
        a3m_s,
        "--params",
        p,
        "--models",
        "3",
        "--num-recycle",
        "0",
        "--no-plots",
        "-o",
        quiet.to_str().unwrap(),
    ]);
    let pngs = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".png"))
            .collect();
        names.sort();
        names
    };
    assert!(pngs(&quiet.join("query")).is_empty());
    let features = d.join("feats.npz");
    let config = FeatureConfig { num_recycle: 0, ..FeatureConfig::default() };
    process(&raw, &config, 0, Device::Cpu).unwrap().save_npz(&features).unwrap();
    let processed = d.join("processed");
    predict(&[
        "--features",
        features.to_str().unwrap(),
        "--params",
        p,
        "--models",
        "3",
        "-o",
        processed.to_str().unwrap(),
    ]);
    assert_eq!(pngs(&processed.join("feats")), ["feats_pae.png", "feats_plddt.png"]);
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
    assert!(bool::try_from(raw["structure_module/final_atom_positions"].isfinite().all()).unwrap());
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
    assert!(!ok && text.contains("'0' for '--chunk-size") && text.contains("must be at least 1"), "{text}");
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
    let (ok, text) = fastfold(&["predict", one.to_str().unwrap(), "--params", params, "--attention", "flash", "-o", o]);
    assert!(!ok && text.contains("--attention flash runs on the fused kernels"), "{text}");

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
fn a_params_directory_runs_every_model_in_turn_ranked_by_mean_plddt_with_timings() {
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
        // AlphaFold ranks monomer models by mean pLDDT, `_ptm` sets included (not by pTM).
        assert!(ranking.get("ptm").is_none(), "{ranking}");
        let scores = ranking["plddts"].as_object().expect("ranked by mean pLDDT");
        let order: Vec<&str> = ranking["order"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(scores.len(), 2);
        assert!(scores[order[0]].as_f64().unwrap() >= scores[order[1]].as_f64().unwrap(), "{ranking}");
        for (i, model) in order.iter().enumerate() {
            let ranked = std::fs::read(q.join(format!("ranked_{i}.pdb"))).unwrap();
            assert_eq!(ranked, std::fs::read(q.join(format!("{model}_unrelaxed.pdb"))).unwrap());
            let confidence = json(&q.join(format!("{model}_confidence.json")));
            assert_eq!(confidence["mean_plddt"].as_f64(), scores[*model].as_f64());
            assert!(confidence["ptm"].as_f64().is_some(), "pTM still reported");
        }
        let timings = json(&q.join("timings.json"));
        let keys: Vec<&String> = timings.as_object().unwrap().keys().collect();
        let ran = [
            "features",
            "process_features_model_3_ptm",
            "predict_and_compile_model_3_ptm",
            "process_features_model_5_ptm",
            "predict_and_compile_model_5_ptm",
        ];
        for key in ran {
            assert!(timings[key].as_f64().is_some_and(|t| t >= 0.0), "timings.json has {keys:?}");
        }
        // In the order they ran, as AlphaFold's json.dump of its dict writes them (the old
        // file had them sorted).
        let text = std::fs::read_to_string(q.join("timings.json")).unwrap();
        let at: Vec<usize> = ran.iter().map(|k| text.find(&format!("\"{k}\"")).unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
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
    let positions = "structure_module/final_atom_positions";
    assert!(max_diff(&early[positions], &one[positions]) < 1e-4);
    assert_eq!((early["num_recycles"].int64_value(&[]), one["num_recycles"].int64_value(&[])), (1, 1));

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

/// The residue axis of each processed feature (none for `seq_length` and the row masks).
fn residue_axis(name: &str) -> Option<i64> {
    match name {
        "seq_length" | "msa_row_mask" | "extra_msa_row_mask" => None,
        n if n.starts_with("msa_") || n.starts_with("extra_") || n == "bert_mask" || n == "true_msa" => Some(2),
        _ => Some(1),
    }
}

/// `f` padded to `n` residues as AlphaFold's `make_fixed_size` pads (zeros: `aatype` 0,
/// `residue_index` 0, `seq_mask` 0), `seq_length` unchanged.
fn pad_residues(f: &Features, n: i64) -> Vec<(&'static str, Tensor)> {
    f.named()
        .into_iter()
        .map(|(name, t)| match residue_axis(name) {
            Some(axis) => {
                let mut shape = t.size();
                shape[axis as usize] = n - shape[axis as usize];
                (name, Tensor::cat(&[t.shallow_clone(), Tensor::zeros(shape, (t.kind(), t.device()))], axis))
            }
            None => (name, t.shallow_clone()),
        })
        .collect()
}

/// The processed batch of `named` as it is (the loader would cut residue padding).
fn uncut(named: Vec<(&'static str, Tensor)>) -> Features {
    let mut m: std::collections::HashMap<&str, Tensor> = named.into_iter().collect();
    let mut take = |k: &str| m.remove(k).unwrap();
    Features {
        aatype: take("aatype"),
        residue_index: take("residue_index"),
        seq_length: take("seq_length"),
        seq_mask: take("seq_mask"),
        target_feat: take("target_feat"),
        msa_feat: take("msa_feat"),
        msa_mask: take("msa_mask"),
        msa_row_mask: take("msa_row_mask"),
        bert_mask: take("bert_mask"),
        true_msa: take("true_msa"),
        extra_msa: take("extra_msa"),
        extra_has_deletion: take("extra_has_deletion"),
        extra_deletion_value: take("extra_deletion_value"),
        extra_msa_mask: take("extra_msa_mask"),
        extra_msa_row_mask: take("extra_msa_row_mask"),
        residx_atom14_to_atom37: take("residx_atom14_to_atom37"),
        residx_atom37_to_atom14: take("residx_atom37_to_atom14"),
        atom14_atom_exists: take("atom14_atom_exists"),
        atom37_atom_exists: take("atom37_atom_exists"),
        templates: None,
    }
}

#[test]
fn padded_features_give_the_unpadded_result_without_padding_residues() {
    // processed_features.npz (3 residues) padded to 5 as ColabFold pads its queries.
    let d = dir("padded");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/processed_features.npz");
    let f = Features::load_npz(&fixture, Device::Cpu).unwrap();
    let padded_npz = d.join("padded.npz");
    Tensor::write_npz(&pad_residues(&f, 5), &padded_npz).unwrap();

    // Cutting the padding before the model is sound: the model's masks keep the padded
    // residues from changing the real ones (the padded batch run as it is, not cut).
    let net = AlphaFold::new(&Params::load_model(common::tiny_params()).unwrap()).unwrap();
    let run = |f: &Features| tch::no_grad(|| net.predict(f, 1, Kind::Float, &Exec::serial(), None)).unwrap();
    let (want, got) = (run(&f), run(&uncut(pad_residues(&f, 5))));
    let real = |t: &Tensor| t.narrow(0, 0, 3);
    let positions = |p: &fastfold::model::alphafold::Pass| &p.structure.atom37 * p.structure.atom37_mask.unsqueeze(-1);
    for (what, w, g) in [
        ("final_atom_positions", positions(&want), real(&positions(&got))),
        ("plddt", want.heads.plddt(), real(&got.heads.plddt())),
        ("pair", want.recycled.pair.shallow_clone(), real(&got.recycled.pair).narrow(1, 0, 3)),
    ] {
        let diff = max_diff(&w, &g);
        eprintln!("{what}: padded and unpadded differ by {diff:.2e}");
        assert!(diff < 1e-3, "{what}: the padded run differs at the real residues by {diff}");
    }

    // End to end: the padding is gone from every output, which equal the unpadded run's.
    let params = common::tiny_params().to_str().unwrap();
    let run = |file: &Path, name: &str| {
        let out = d.join(name);
        predict(&["--features", file.to_str().unwrap(), "--params", params, "-o", out.to_str().unwrap()]);
        let q = out.join(file.file_stem().unwrap());
        (std::fs::read_to_string(q.join("tiny_unrelaxed.pdb")).unwrap(), json(&q.join("tiny_confidence.json")))
    };
    let (pdb, confidence) = run(&padded_npz, "padded");
    let (want_pdb, want_confidence) = run(&fixture, "unpadded");
    assert_eq!(pdb, want_pdb, "the padded input's PDB is the unpadded one's");
    assert_eq!(confidence, want_confidence);
    assert_eq!(confidence["plddt"].as_array().unwrap().len(), 3, "no pLDDT for padding");
    assert_eq!(confidence["pae"].as_array().unwrap().len(), 3, "no PAE for padding");
    let s = Structure::parse(&pdb, Path::new("padded.pdb"), None).unwrap();
    // The third residue is X (no atoms to write); the old output added ALA A 1 after it.
    assert_eq!(s.residue_index, [0, 1], "no padded residue");

    // Padding not at the end (a hole in seq_mask) cannot be cut: an error naming the key.
    let mut holes = pad_residues(&f, 5);
    let mask = Tensor::from_slice(&[1f32, 0., 1., 1., 0.]).unsqueeze(0).repeat([2, 1]);
    holes.iter_mut().find(|(k, _)| *k == "seq_mask").unwrap().1 = mask;
    let holes_npz = d.join("holes.npz");
    Tensor::write_npz(&holes, &holes_npz).unwrap();
    let out = d.join("holes");
    let (ok, text) = fastfold(&[
        "predict",
        "--features",
        holes_npz.to_str().unwrap(),
        "--params",
        params,
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && text.contains("holes.npz") && text.contains("key seq_mask: residue 2 is masked"), "{text}");
}

/// Every file under `dir` (relative path) with its bytes.
fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            for (rel, bytes) in snapshot(&path) {
                files.insert(Path::new(path.file_name().unwrap()).join(rel), bytes);
            }
        } else {
            files.insert(PathBuf::from(path.file_name().unwrap()), std::fs::read(&path).unwrap());
        }
    }
    files
}

/// The tiny parameters with `key` changed by `change`, saved as `path`.
fn changed_params(path: &Path, key: &str, change: impl Fn(&Tensor) -> Tensor) {
    let named: Vec<(String, Tensor)> = outputs(common::tiny_params())
        .into_iter()
        .map(|(k, t)| if k == key { (k, change(&t)) } else { (k, t) })
        .collect();
    data::checkpoint::save_npz(&named, path).unwrap();
}

#[test]
fn a_rerun_replaces_the_earlier_runs_files() {
    let d = dir("rerun");
    let params = d.join("params");
    std::fs::create_dir_all(&params).unwrap();
    for name in ["params_model_3_ptm.npz", "params_model_5_ptm.npz"] {
        std::fs::copy(common::tiny_params(), params.join(name)).unwrap();
    }
    let fa = fasta(&d, &[("q", SEQ_B)]);
    let out = d.join("out");
    let (fa, p, o) = (fa.to_str().unwrap(), params.to_str().unwrap(), out.to_str().unwrap());
    predict(&[fa, "--params", p, "--num-recycle", "0", "--save-outputs", "-o", o]);
    let q = out.join("q");
    assert!(q.join("ranked_1.pdb").exists() && q.join("model_3_ptm_outputs.npz").exists());
    std::fs::write(q.join("notes.txt"), "the user's").unwrap();
    // The user's own file, named like a model's (the old rule removed it), and the staging
    // folder of a run killed outright (here a process that has exited).
    std::fs::write(q.join("af_reference_confidence.json"), "{}").unwrap();
    let mut exited = Command::new("true").spawn().unwrap();
    exited.wait().unwrap();
    let killed = out.join(format!(".q.partial-{}", exited.id()));
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::write(killed.join("model_3_ptm_unrelaxed.pdb"), "half").unwrap();

    assert!(q.join("q_pae.png").exists() && q.join("q_plddt.png").exists() && q.join("q_coverage.png").exists());
    // Again with one model, no raw outputs and no plots: nothing of the first run's models or
    // plots stays (the old code left model_3_ptm's files, ranked_1.pdb and the raw outputs
    // beside the new run).
    predict(&[fa, "--params", p, "--models", "5", "--num-recycle", "0", "--no-plots", "-o", o]);
    let names: std::collections::BTreeSet<String> =
        std::fs::read_dir(&q).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    let want = [
        "af_reference_confidence.json",
        "features.npz",
        "model_5_ptm_confidence.json",
        "model_5_ptm_unrelaxed.pdb",
        "notes.txt",
        "ranked_0.pdb",
        "ranking_debug.json",
        "timings.json",
    ];
    assert_eq!(names, want.iter().map(|s| s.to_string()).collect(), "only this run's files (and the user's)");
    assert_eq!(json(&q.join("ranking_debug.json"))["order"], serde_json::json!(["model_5_ptm"]));
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["q"], "no staging folder left in {o}, the killed run's included");
}

#[test]
fn a_failed_run_leaves_no_half_written_folder_and_the_earlier_run_as_it_was() {
    let d = dir("failed");
    let fa = fasta(&d, &[("q", SEQ_B)]);
    let out = d.join("out");
    let (fa, o) = (fa.to_str().unwrap(), out.to_str().unwrap());
    // Translations of 10^6 Å per structure-module iteration: coordinates that do not fit the
    // PDB's 8.3f columns, an error only once the model has run.
    let far = d.join("params_far.npz");
    let key = "alphafold/alphafold_iteration/structure_module/fold_iteration/affine_update//bias";
    changed_params(&far, key, |b| b.ones_like() * 1e5);
    let far = far.to_str().unwrap();

    // A new query's folder: the old code left it with only features.npz.
    let (ok, text) = fastfold(&["predict", fa, "--params", far, "--num-recycle", "0", "-o", o]);
    assert!(!ok && text.contains("do not fit 8.3f"), "{text}");
    assert!(!out.exists(), "a failed run left {:?}", snapshot(&out));

    // A folder from an earlier run keeps its files, unchanged.
    let params = common::tiny_params().to_str().unwrap();
    predict(&[fa, "--params", params, "--num-recycle", "0", "-o", o]);
    let before = snapshot(&out);
    let (ok, text) = fastfold(&["predict", fa, "--params", far, "--num-recycle", "1", "-o", o]);
    assert!(!ok && text.contains("do not fit 8.3f"), "{text}");
    assert!(snapshot(&out) == before, "the failed run changed the earlier run's files");

    // A NaN weight is named when the parameters load, not as NaN coordinates.
    let nan = d.join("params_nan.npz");
    changed_params(&nan, key, |b| b.full_like(f64::NAN));
    let (ok, text) = fastfold(&["predict", fa, "--params", nan.to_str().unwrap(), "-o", o]);
    assert!(!ok && text.contains("params_nan.npz") && text.contains(key) && text.contains("NaN"), "{text}");
}

#[test]
fn small_input_mistakes_are_read_or_named() {
    let d = dir("small");
    let params = common::tiny_params().to_str().unwrap();
    let out = d.join("out");
    let o = out.to_str().unwrap();
    // A byte-order mark before the first header is skipped (it was "sequence data before the
    // first '>' header").
    let bom = d.join("bom.fasta");
    std::fs::write(&bom, format!("\u{feff}>bom\n{SEQ_B}\n")).unwrap();
    predict(&[bom.to_str().unwrap(), "--params", params, "--num-recycle", "0", "-o", o]);

    // --msa in Stockholm (jackhmmer's output) is read as such, to the A3M's rows.
    let fa = fasta(&d, &[("sto", SEQ_B)]);
    let sto = d.join("sto.sto");
    std::fs::write(&sto, format!("# STOCKHOLM 1.0\n\nsto {SEQ_B}\nhit GSWPE-LK\n//\n")).unwrap();
    predict(&[fa.to_str().unwrap(), "--msa", sto.to_str().unwrap(), "--params", params, "--num-recycle", "0", "-o", o]);
    let msa = &outputs(&out.join("sto/features.npz"))["msa"];
    assert_eq!(msa.size(), [2, SEQ_B.len() as i64], "the query and the hit");

    // A header too long for a folder name is named with its record when the FASTA is read.
    let long = fasta(&d, &[(&"L".repeat(300), SEQ_B)]);
    let (ok, text) = fastfold(&["predict", long.to_str().unwrap(), "--params", params, "-o", o]);
    assert!(!ok && text.contains("record 1") && text.contains("300 characters"), "{text}");

    // convert into a folder that does not exist names it (was IoError(Os {..}) of a staging file).
    let missing = d.join("missing/dir/x.safetensors");
    let (ok, text) = fastfold(&["convert", params, missing.to_str().unwrap()]);
    assert!(!ok && text.contains("missing/dir does not exist") && !text.contains("IoError"), "{text}");
}
