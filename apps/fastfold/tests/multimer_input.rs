//! What asks `fastfold predict` for AlphaFold-Multimer, which it refuses until the network is
//! wired to it: `--model-preset multimer`, Multimer's parameter files by name (a file or a directory
//! of them) or by their arrays; each refusal says what asked and what is missing, and leaves
//! no output behind. Multimer's options on a monomer run are named.
mod common;

use std::process::Command;

use fastfold::model::Params;
use tch::Tensor;

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
fn multimer_runs_are_refused_saying_what_is_missing() {
    let d = common::scratch("multimer", "refused");
    let file = d.join("params_model_1_multimer_v3.npz");
    std::fs::write(&file, b"").unwrap();
    let cases: [(&[&str], &str); 3] = [
        (&["--params", file.to_str().unwrap()], "params_model_1_multimer_v3.npz (model_1_multimer_v3) asks"),
        (&["--params", d.to_str().unwrap()], "(model_1_multimer_v3) asks for AlphaFold-Multimer"),
        (
            &["--params", common::tiny_params().to_str().unwrap(), "--model-preset", "multimer"],
            "--model-preset multimer asks",
        ),
    ];
    for (args, says) in cases {
        let (ok, text) = predict(&d, args);
        assert!(!ok && text.contains(says), "{args:?}:\n{text}");
        assert!(text.contains("not yet wired to predict"), "{args:?}:\n{text}");
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
