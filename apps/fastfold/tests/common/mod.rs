//! What the fastfold test binaries share: scratch folders and one tiny parameter file.
#![allow(dead_code)] // each binary uses its own part
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
