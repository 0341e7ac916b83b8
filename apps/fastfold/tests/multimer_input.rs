//! `fastfold predict` with AlphaFold-Multimer's parameters: a two-record FASTA file predicted
//! as one complex with tiny random parameters of Multimer v3's layout (the fixture of
//! `tests/multimer_model.rs`), two seeds ranked by `0.8 ipTM + 0.2 pTM`, one PDB chain per
//! record; bf16 within a stated bound of fp32; the written `features.npz` as `--features`
//! giving the FASTA run's prediction; `--max-msa-clusters`/`--max-extra-msa` in place of the
//! preset's sizes; `--models` picking Multimer files; what a multimer run does not take is
//! named and leaves no output behind; Multimer's options on a monomer run are named; the
//! monomer loader names Multimer's arrays.
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use fastfold::model::multimer::{network_key, MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs};
use fastfold::model::recycling::Recycling;
use fastfold::model::{Exec, Params};
use tch::{Kind, Tensor};

use common::BIN;

/// Runs `fastfold predict` on a two-record FASTA file into `<d>/out`; (success, output).
fn predict(d: &Path, extra: &[&str]) -> (bool, String) {
    let fasta = d.join("complex.fasta");
    std::fs::write(&fasta, ">a heavy\nMKTAYIAKQRQISFVK\n>b light\nGSHMLEDPVR\n").unwrap();
    fastfold(d, &[&[fasta.to_str().unwrap()][..], extra].concat())
}

/// Runs `fastfold predict` with `args` (no FASTA file unless they name one) into `<d>/out`.
fn fastfold(d: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["predict", "-o", d.join("out").to_str().unwrap()])
        .args(args)
        .env("FASTFOLD_TEST", "1")
        .output()
        .unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The tiny Multimer v3 parameters copied into `dir` under the release name of `model`.
fn tiny_multimer(dir: &Path, model: &str) -> PathBuf {
    let file = dir.join(format!("params_{model}.npz"));
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network/model_params.npz");
    std::fs::copy(tiny, &file).unwrap();
    file
}

/// A prediction's `--save-outputs` arrays.
fn outputs(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_npz(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).into_iter().collect()
}

/// The largest difference of two arrays.
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

#[test]
fn multimer_parameters_predict_the_fasta_file_as_one_complex_ranked_by_iptm_ptm() {
    let d = common::scratch("multimer", "complex");
    let params = d.join("params");
    std::fs::create_dir_all(&params).unwrap();
    let file = tiny_multimer(&params, "model_1_multimer_v3");
    let flags = ["--num-multimer-predictions-per-model", "2", "--num-recycle", "1", "--seed", "3", "--save-outputs"];
    let (ok, text) = predict(&d, &[&["--params", params.to_str().unwrap()][..], &flags[..]].concat());
    assert!(ok, "{text}");
    let dir = d.join("out").join("complex");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let ranking: serde_json::Value = serde_json::from_str(&read("ranking_debug.json")).unwrap();
    let names = ["model_1_multimer_v3_pred_0", "model_1_multimer_v3_pred_1"];
    let score = |n: &str| ranking["iptm+ptm"][n].as_f64().unwrap();
    let order: Vec<&str> = ranking["order"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(order.len(), 2);
    assert!(score(order[0]) >= score(order[1]), "{ranking}");
    for name in names {
        let c: serde_json::Value = serde_json::from_str(&read(&format!("{name}_confidence.json"))).unwrap();
        let (iptm, ptm) = (c["iptm"].as_f64().unwrap(), c["ptm"].as_f64().unwrap());
        assert!((c["ranking_confidence"].as_f64().unwrap() - (0.8 * iptm + 0.2 * ptm)).abs() < 1e-12, "{c}");
        assert!((score(name) - (0.8 * iptm + 0.2 * ptm)).abs() < 1e-12);
        let raw: HashMap<String, Tensor> =
            Tensor::read_npz(dir.join(format!("{name}_outputs.npz"))).unwrap().into_iter().collect();
        for (key, want) in [("iptm", iptm), ("ptm", ptm), ("ranking_confidence", score(name))] {
            assert!((raw[key].double_value(&[]) - want).abs() < 1e-6, "{name} {key}");
        }
        assert_eq!(c["plddt"].as_array().unwrap().len(), 26);
        // One PDB chain per record, each ended by TER.
        let pdb = read(&format!("{name}_unrelaxed.pdb"));
        let chain_of = |l: &&str| l.chars().nth(21);
        let atoms: Vec<&str> = pdb.lines().filter(|l| l.starts_with("ATOM")).collect();
        assert_eq!(chain_of(&atoms[0]), Some('A'));
        assert_eq!(chain_of(atoms.last().unwrap()), Some('B'));
        assert_eq!(pdb.lines().filter(|l| l.starts_with("TER")).count(), 2, "{pdb}");
    }
    assert_eq!(read("ranked_0.pdb"), read(&format!("{}_unrelaxed.pdb", order[0])));
    // The files are the library's prediction on the features written beside them, from the
    // run's seed (`k + seed * runs`: 6 and 7) as AlphaFold's haiku model takes its key.
    let features: HashMap<String, Tensor> = Tensor::read_npz(dir.join("features.npz")).unwrap().into_iter().collect();
    let inputs = MultimerInputs::from_named(|n| features.get(n).map(|t| t.shallow_clone()), "features.npz").unwrap();
    let sampling = MsaSampling { num_msa: 508, num_extra_msa: 2048, masked: MaskedMsaConfig::default() };
    let net = MultimerAlphaFold::load(&file).unwrap().with_sampling(sampling);
    let recycling = Recycling { max: 1, early_stop_tolerance: 0.5 };
    for (name, seed) in [(names[0], 6), (names[1], 7)] {
        let (pass, _) = tch::no_grad(|| net.predict(&inputs, recycling, network_key(seed), &Exec::serial())).unwrap();
        let pdb = read(&format!("{name}_unrelaxed.pdb"));
        let ca: Vec<f64> = pdb
            .lines()
            .filter(|l| l.starts_with("ATOM") && &l[12..16] == " CA ")
            .flat_map(|l| [&l[30..38], &l[38..46], &l[46..54]].map(|v| v.trim().parse::<f64>().unwrap()))
            .collect();
        let want =
            Vec::<f64>::try_from(pass.structure.atom37.select(1, 1).to_kind(Kind::Double).flatten(0, -1)).unwrap();
        let d = ca.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(ca.len() == 78 && d < 1e-3, "{name}: CA atoms differ from the library's by {d} Å");
    }
    assert_ne!(read("ranked_0.pdb"), read("ranked_1.pdb"), "each prediction has its own seed");
    // On 2 ranks (DAP) the same atoms, to the PDB's rounding.
    let d2 = common::scratch("multimer", "complex-2-ranks");
    let flags2 = [&flags[..], &["--nproc", "2"][..]].concat();
    let (ok, text) = predict(&d2, &[&["--params", file.to_str().unwrap()][..], &flags2[..]].concat());
    assert!(ok, "{text}");
    let atoms = |path: &Path| -> Vec<f64> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("ATOM"))
            .flat_map(|l| [&l[30..38], &l[38..46], &l[46..54]].map(|v| v.trim().parse::<f64>().unwrap()))
            .collect()
    };
    for name in names {
        let pdb = format!("{name}_unrelaxed.pdb");
        let (one, two) = (atoms(&dir.join(&pdb)), atoms(&d2.join("out/complex").join(&pdb)));
        let diff = one.iter().zip(&two).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(one.len() == two.len() && diff <= 2e-3, "{name} on 2 ranks: atoms differ by {diff} Å");
    }
    let timings: serde_json::Value = serde_json::from_str(&read("timings.json")).unwrap();
    assert!(timings["predict_and_compile_model_1_multimer_v3_pred_1"].is_number(), "{timings}");
    assert!(dir.join("features.npz").exists());
    for plot in ["complex_pae.png", "complex_plddt.png", "complex_coverage.png"] {
        assert!(dir.join(plot).is_file(), "{plot}");
    }
}

#[test]
fn multimer_runs_name_what_they_do_not_take() {
    let d = common::scratch("multimer", "refused");
    let file = d.join("params_model_1_multimer_v3.npz");
    std::fs::write(&file, b"").unwrap();
    let params = file.to_str().unwrap();
    let monomer_features = d.join("monomer.npz");
    Tensor::write_npz(&[("aatype", Tensor::zeros([4], (Kind::Int, tch::Device::Cpu)))], &monomer_features).unwrap();
    let missing = d.join("missing.npz");
    let cases: [(&[&str], &str); 8] = [
        (&["--params", params, "--model-preset", "monomer"], "--model-preset monomer, but --params"),
        (
            &["--params", common::tiny_params().to_str().unwrap(), "--model-preset", "multimer"],
            "name the file as its release is named",
        ),
        (&["--params", params, "--msa", "a.a3m"], "--msa a.a3m is one chain's alignment"),
        (&["--params", params, "--msa", "a.a3m"], "--use-precomputed-msas"),
        (&["--params", params, "--preset", "model_1"], "--preset model_1 is a monomer model's"),
        (&["--params", params, "--models", "1"], "--models 1 picks files from a directory"),
        (&["--params", params, "--features", monomer_features.to_str().unwrap()], "monomer.npz: the feature"),
        (&["--params", params, "--features", missing.to_str().unwrap()], "missing.npz"),
    ];
    for (args, says) in cases {
        // --features replaces the FASTA file.
        let (ok, text) = match args.contains(&"--features") {
            true => fastfold(&d, args),
            false => predict(&d, args),
        };
        assert!(!ok && text.contains(says), "{args:?}:\n{text}");
        assert!(!d.join("out").exists(), "{args:?} left an output folder");
    }
    let (ok, text) =
        predict(&d, &["--params", common::tiny_params().to_str().unwrap(), "--uniprot-database-path", "u.fasta"]);
    assert!(!ok && text.contains("--uniprot-database-path applies to AlphaFold-Multimer"), "{text}");
}

#[test]
fn multimer_arrays_under_another_name_are_recognised() {
    let d = common::scratch("multimer", "arrays");
    let path = d.join("renamed.npz");
    let key = "alphafold/alphafold_iteration/evoformer/~_relative_encoding/position_activations//weights";
    Tensor::write_npz(&[(key, Tensor::zeros([73, 8], (tch::Kind::Float, tch::Device::Cpu)))], &path).unwrap();
    let err = Params::load_model(&path).err().expect("Multimer's arrays are refused").to_string();
    assert!(err.contains("renamed.npz holds AlphaFold-Multimer's parameters"), "{err}");
}

#[test]
fn bf16_complex_prediction_stays_within_a_bound_of_fp32() {
    let d = common::scratch("multimer", "bf16");
    let file = tiny_multimer(&d, "model_1_multimer_v3");
    let flags = ["--num-multimer-predictions-per-model", "1", "--num-recycle", "2", "--save-outputs", "--no-plots"];
    let mut runs = Vec::new();
    for precision in ["fp32", "bf16"] {
        let dir = d.join(precision);
        std::fs::create_dir_all(&dir).unwrap();
        let (ok, text) =
            predict(&dir, &[&["--params", file.to_str().unwrap(), "--precision", precision][..], &flags[..]].concat());
        assert!(ok, "{precision}: {text}");
        runs.push(outputs(&dir.join("out/complex/model_1_multimer_v3_pred_0_outputs.npz")));
    }
    let (fp32, bf16) = (&runs[0], &runs[1]);
    let key = "structure_module/final_atom_positions";
    let mask = fp32["structure_module/final_atom_mask"].unsqueeze(-1);
    let largest = (&fp32[key] * &mask).abs().max().double_value(&[]);
    let moved = max_diff(&(&fp32[key] * &mask), &(&bf16[key] * &mask));
    // Measured: 8.1 Å of 264 Å (3.1%; 3.0-3.5% over three seeds), pLDDT 0.2, ipTM equal.
    assert!(moved <= 0.06 * largest, "bf16 atoms moved {moved} Å, more than 6% of the largest coordinate {largest} Å");
    assert!(max_diff(&fp32["plddt"], &bf16["plddt"]) <= 1.0, "pLDDT");
    assert!(max_diff(&fp32["iptm"], &bf16["iptm"]) <= 0.01, "ipTM");
    assert!(bool::try_from(bf16[key].isfinite().all()).unwrap());
}

#[test]
fn a_complex_from_its_written_features_equals_the_fasta_prediction_and_msa_sizes_override_the_preset() {
    let d = common::scratch("multimer", "features");
    let file = tiny_multimer(&d, "model_1_multimer_v3");
    let params = ["--params", file.to_str().unwrap()];
    let flags = ["--num-multimer-predictions-per-model", "1", "--num-recycle", "1", "--save-outputs", "--no-plots"];
    let from_fasta = d.join("fasta");
    std::fs::create_dir_all(&from_fasta).unwrap();
    let (ok, text) = predict(&from_fasta, &[&params[..], &flags[..]].concat());
    assert!(ok, "{text}");
    let written = from_fasta.join("out/complex/features.npz");
    let run = |name: &str, features: &Path, extra: &[&str]| -> HashMap<String, Tensor> {
        let dir = d.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let args = [&params[..], &["--features", features.to_str().unwrap()][..], &flags[..], extra].concat();
        let (ok, text) = fastfold(&dir, &args);
        assert!(ok, "{name}: {text}");
        // The folder is named after the features file, which is written there again.
        let stem = features.file_stem().unwrap();
        let folder = dir.join("out").join(stem);
        assert!(folder.join("features.npz").is_file(), "{name}: no features.npz");
        outputs(&folder.join("model_1_multimer_v3_pred_0_outputs.npz"))
    };
    let fasta = outputs(&from_fasta.join("out/complex/model_1_multimer_v3_pred_0_outputs.npz"));
    let features = run("features", &written, &[]);
    // Measured: equal bit for bit.
    for key in ["structure_module/final_atom_positions", "plddt", "predicted_aligned_error", "iptm", "ptm"] {
        let diff = max_diff(&fasta[key], &features[key]);
        assert!(diff <= 1e-5, "{key} from features.npz differs from the FASTA run's by {diff}");
    }

    // The pipeline's heterodimer (10 real MSA rows) from AlphaFold-Multimer's `RunModel.predict`
    // at the fixture's seed (tests/multimer_model.rs): its atoms and pLDDT logits.
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let heterodimer = fixtures.join("multimer/heterodimer.npz");
    let alphafold = outputs(&fixtures.join("multimer_network/model.npz"));
    let seed = alphafold["preset_seed"].int64_value(&[]).to_string();
    let preset = run("alphafold", &heterodimer, &["--seed", &seed]);
    let key = "structure_module/final_atom_positions";
    let diff = max_diff(&preset[key], &alphafold["preset_final_atom_positions"]);
    assert!(diff <= 1e-3, "--features heterodimer.npz: atoms differ from AlphaFold's by {diff} Å");
    let diff = max_diff(&preset["predicted_lddt/logits"], &alphafold["preset_predicted_lddt"]);
    assert!(diff <= 1e-4, "--features heterodimer.npz: pLDDT logits differ from AlphaFold's by {diff}");

    // --max-msa-clusters and --max-extra-msa in place of v3's num_msa 508 and num_extra_msa 2048:
    // the library's network sampling those sizes, from the run's seed.
    let fewer = run("fewer", &heterodimer, &["--seed", &seed, "--max-msa-clusters", "3", "--max-extra-msa", "2"]);
    let arrays = outputs(&heterodimer);
    let inputs = MultimerInputs::from_named(|n| arrays.get(n).map(|t| t.shallow_clone()), "heterodimer.npz").unwrap();
    let sampling = MsaSampling { num_msa: 3, num_extra_msa: 2, masked: MaskedMsaConfig::default() };
    let net = MultimerAlphaFold::load(&file).unwrap().with_sampling(sampling);
    let recycling = Recycling { max: 1, early_stop_tolerance: 0.5 };
    let seed = alphafold["preset_seed"].int64_value(&[]) as u64;
    let (pass, _) = tch::no_grad(|| net.predict(&inputs, recycling, network_key(seed), &Exec::serial())).unwrap();
    let diff = max_diff(&fewer[key], &pass.structure.atom37);
    assert!(diff <= 1e-4, "--max-msa-clusters 3 --max-extra-msa 2: atoms differ from the library's by {diff} Å");
    let changed = max_diff(&fewer[key], &preset[key]);
    assert!(changed > 1e-2, "the MSA sizes changed nothing ({changed} Å)");
}

#[test]
fn models_pick_multimer_files_by_number_or_name() {
    let d = common::scratch("multimer", "models");
    let params = d.join("params");
    std::fs::create_dir_all(&params).unwrap();
    for model in ["model_1_multimer_v3", "model_2_multimer_v3"] {
        tiny_multimer(&params, model);
    }
    let dir = ["--params", params.to_str().unwrap()];
    let flags = ["--num-multimer-predictions-per-model", "1", "--num-recycle", "0", "--no-plots"];
    let (ok, text) = predict(&d, &[&dir[..], &flags[..], &["--models", "model_2_multimer_v3"][..]].concat());
    assert!(ok, "{text}");
    let ranking: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("out/complex/ranking_debug.json")).unwrap()).unwrap();
    assert_eq!(ranking["order"], serde_json::json!(["model_2_multimer_v3_pred_0"]), "{ranking}");

    let empty = common::scratch("multimer", "models-refused");
    let monomer = empty.join("monomer");
    std::fs::create_dir_all(&monomer).unwrap();
    std::fs::write(monomer.join("params_model_1.npz"), b"").unwrap();
    let cases: [(&[&str], &str); 4] = [
        (&[&dir[..], &["--models", "3"][..]].concat(), "--models 3: "),
        (&[&dir[..], &["--models", "model_1_ptm"][..]].concat(), "--models model_1_ptm is a monomer model"),
        (&[&dir[..], &["--models", "1,model_1_multimer_v3"][..]].concat(), "--models names model_1_multimer_v3 twice"),
        (
            &["--params", monomer.to_str().unwrap(), "--models", "model_1_multimer_v3"],
            "--models model_1_multimer_v3 is AlphaFold-Multimer's",
        ),
    ];
    for (args, says) in cases {
        let (ok, text) = predict(&empty, args);
        assert!(!ok && text.contains(says), "{args:?}:\n{text}");
        assert!(!empty.join("out").exists(), "{args:?} left an output folder");
    }
}

/// `--gpu-mem` on a complex (the CPU's allocator): the plan said, the measured peak beside the
/// planned one and under the budget, the structure the unplanned run's within 1e-4 Å; a budget
/// no plan meets is an error naming the flag.
#[test]
fn a_complex_predicts_under_a_memory_budget() {
    let d = common::scratch("multimer", "budget");
    let file = tiny_multimer(&d, "model_1_multimer_v3");
    let fasta = d.join("long.fasta");
    let chain =
        |n: usize, k: usize| -> String { (0..n).map(|i| b"ACDEFGHIKLMNPQRSTVWY"[(i * k + 3) % 20] as char).collect() };
    std::fs::write(&fasta, format!(">a\n{}\n>b\n{}\n", chain(110, 7), chain(100, 11))).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let dir = d.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let flags = [
            "--params",
            file.to_str().unwrap(),
            "--num-multimer-predictions-per-model",
            "1",
            "--num-recycle",
            "0",
            "--max-msa-clusters",
            "32",
            "--max-extra-msa",
            "64",
            "--save-outputs",
            "--no-plots",
        ];
        let (ok, text) = fastfold(&dir, &[&[fasta.to_str().unwrap()][..], &flags[..], extra].concat());
        (ok, text, dir.join("out/long/model_1_multimer_v3_pred_0_outputs.npz"))
    };
    let (ok, plain, plain_npz) = run("plain", &[]);
    assert!(ok, "{plain}");
    let (ok, text, planned_npz) = run("planned", &["--gpu-mem", "34M"]);
    assert!(ok, "{text}");
    assert!(text.contains("memory plan for 34.0 MiB") && text.contains("chunks: Outer/"), "the plan is said:\n{text}");
    let (measured, planned, line) = common::summary_peaks(&text);
    eprintln!("{line}");
    // The line's MiB have one decimal: within half the last of it. The plan is under the
    // budget; the run within the Multimer profile's accuracy of it (5%: tests/memory.rs).
    let budget = (34.0 + 0.05) / 1024.0;
    assert!(planned <= budget && measured <= 1.05 * budget, "under the budget: {line}");
    assert!((measured - planned).abs() <= 0.05 * planned.max(measured) + 0.002, "planned and measured agree: {line}");
    let key = "structure_module/final_atom_positions";
    let moved = max_diff(&outputs(&plain_npz)[key], &outputs(&planned_npz)[key]);
    assert!(moved <= 1e-4, "the planned run's atoms differ by {moved} Å from the plain run's");
    let (ok, text, _) = run("tiny", &["--gpu-mem", "1M"]);
    assert!(!ok && text.contains("--gpu-mem") && text.contains("at the least") && text.contains("long with"), "{text}");
}
