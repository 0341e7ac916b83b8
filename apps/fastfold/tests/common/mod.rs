//! What the fastfold test binaries share: scratch folders and one tiny parameter file.
#![allow(dead_code)] // each binary uses its own part
pub mod layout;
pub mod loss;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use fastfold::model::{EvoformerConfig, ModelConfig, Params};

/// The `fastfold` binary.
pub const BIN: &str = env!("CARGO_BIN_EXE_fastfold");

/// An empty scratch folder `fastfold-<binary>-<pid>-<name>` under the temp dir.
pub fn scratch(binary: &str, name: &str) -> suite_tests::Scratch {
    suite_tests::scratch(&format!("fastfold-{binary}"), name)
}

/// One tiny parameter file shared by every test of a binary (drawn once: the draw uses
/// torch's global generator, which parallel tests share).
pub fn tiny_params() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = scratch("params", "tiny").until_exit().join("params_tiny.npz");
        Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 7).unwrap().save(&path).unwrap();
        path
    })
}

/// Fails with the largest difference unless `got` equals `want` within `tolerance` times the
/// larger of 1 and `want`'s largest magnitude (a relative bound for arrays of large values, an
/// absolute one for small ones); prints the difference either way.
pub fn assert_close(what: &str, got: &tch::Tensor, want: &tch::Tensor, tolerance: f64) {
    use tch::Kind;
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let got = got.detach().to_kind(Kind::Double);
    let want = want.to_kind(Kind::Double);
    let diff = (&got - &want).abs().max().double_value(&[]);
    let scale = want.abs().max().double_value(&[]).max(1.0);
    eprintln!("{what}: max |ours - AlphaFold| = {diff:.2e}, largest |AlphaFold| {scale:.2e}");
    assert!(
        diff <= tolerance * scale,
        "{what}: max |ours - AlphaFold| = {diff:.3e} (largest |AlphaFold| {scale:.3e}, tolerance {tolerance:.0e})"
    );
}

/// The worst difference of `grads` from `reference` (every parameter's gradient by name, in the
/// same order), as a fraction of the array's largest reference gradient; an array whose
/// reference is zero up to rounding (a softmax-invariant offset) is measured against 1e-3 of the
/// largest overall. Returns the fraction, its array and how many arrays were compared (those
/// with a gradient); an error where one side alone has a gradient, or the reference's are all
/// zero.
pub fn worst_gradient(
    grads: &[(String, tch::Tensor)],
    reference: &[(String, tch::Tensor)],
) -> anyhow::Result<(f64, String, usize)> {
    let largest = |g: &tch::Tensor| g.abs().max().double_value(&[]);
    let overall = reference.iter().filter(|(_, g)| g.defined()).map(|(_, g)| largest(g)).fold(0.0, f64::max);
    anyhow::ensure!(overall > 0.0 && overall.is_finite(), "the reference gradients are all {overall}");
    let (mut compared, mut worst) = (0, (0.0, String::new()));
    for ((name, a), (_, b)) in grads.iter().zip(reference) {
        anyhow::ensure!(a.defined() == b.defined(), "{name}: gradient defined on one side only");
        if !b.defined() {
            continue;
        }
        let d = largest(&(a - b)) / largest(b).max(1e-3 * overall);
        if d > worst.0 {
            worst = (d, name.clone());
        }
        compared += 1;
    }
    Ok((worst.0, worst.1, compared))
}

/// The measured and planned peaks (GiB) of a `predict --gpu-mem` run's summary line in `text`
/// (`peak memory P GiB (planned Q GiB)`), and the line.
pub fn summary_peaks(text: &str) -> (f64, f64, String) {
    let line = text.lines().find(|l| l.contains("peak memory")).expect("a summary line");
    let number = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        let mut words = rest.split_whitespace();
        let value: f64 = words.next().unwrap().parse().unwrap();
        let unit = words.next().unwrap().trim_end_matches(')');
        let scale = match unit {
            "B" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            _ => panic!("a size unit after {key} in {line}"),
        };
        value * scale / (1u64 << 30) as f64
    };
    (number("peak memory"), number("(planned"), line.to_string())
}

/// Each step's record of the training log `log.jsonl` of a `fastfold train` run in `out`.
pub fn step_log(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}
