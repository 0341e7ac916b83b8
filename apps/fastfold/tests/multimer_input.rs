//! `fastfold predict` with AlphaFold-Multimer's parameters: a two-record FASTA file predicted
//! as one complex with tiny random parameters of Multimer v3's layout (the fixture of
//! `tests/multimer_model.rs`), two seeds ranked by `0.8 ipTM + 0.2 pTM`, one PDB chain per
//! record; what a multimer run does not take is named and leaves no output behind; Multimer's
//! options on a monomer run are named; the monomer loader names Multimer's arrays.
mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use fastfold::model::multimer::{network_key, MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs};
use fastfold::model::recycling::Recycling;
use fastfold::model::{Exec, Params};
use tch::{Kind, Tensor};

use common::BIN;

/// Runs `fastfold predict` on a two-record FASTA file into `<d>/out`; (success, output).
fn predict(d: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let fasta = d.join("complex.fasta");
    std::fs::write(&fasta, ">a heavy\nMKTAYIAKQRQISFVK\n>b light\nGSHMLEDPVR\n").unwrap();
    let out = Command::new(BIN)
        .args(["predict", fasta.to_str().unwrap(), "-o", d.join("out").to_str().unwrap()])
        .args(extra)
        .env("FASTFOLD_TEST", "1")
        .output()
        .unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn multimer_parameters_predict_the_fasta_file_as_one_complex_ranked_by_iptm_ptm() {
    let d = common::scratch("multimer", "complex");
    let params = d.join("params");
    std::fs::create_dir_all(&params).unwrap();
    let file = params.join("params_model_1_multimer_v3.npz");
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network/model_params.npz");
    std::fs::copy(tiny, &file).unwrap();
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
    let atoms = |path: &std::path::Path| -> Vec<f64> {
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
    let cases: [(&[&str], &str); 3] = [
        (&["--params", file.to_str().unwrap(), "--model-preset", "monomer"], "--model-preset monomer, but --params"),
        (&["--params", file.to_str().unwrap(), "--precision", "bf16"], "fp32 only"),
        (
            &["--params", common::tiny_params().to_str().unwrap(), "--model-preset", "multimer"],
            "name the file as its release is named",
        ),
    ];
    for (args, says) in cases {
        let (ok, text) = predict(&d, args);
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
