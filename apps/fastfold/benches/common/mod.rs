//! What the benchmarks of our prediction against DeepMind's AlphaFold share
//! (`versus_alphafold.rs`, `versus_alphafold_multimer.rs`): the options that name AlphaFold's
//! Python and our side's process, each side's figures, and running each side in a process of
//! its own (so that each peak resident memory is that side's).
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

/// The options besides the sizes.
#[derive(clap::Args)]
pub struct Sides {
    /// The Python with alphafold-colabfold, jax and dm-haiku.
    #[arg(long, env = "ALPHAFOLD_PYTHON", default_value = ".venv-alphafold/bin/python")]
    pub python: PathBuf,
    /// Internal: run our side on the files in this folder and print its figures.
    #[arg(long, hide = true)]
    pub ours: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

/// One side's figures.
pub struct Figures {
    pub seconds: f64,
    pub peak_bytes: u64,
}

impl Figures {
    /// AlphaFold's figures (and its first, compiling, call's seconds) from the last JSON line
    /// of `script` run by `python` with `args`.
    pub fn alphafold(python: &Path, script: &str, args: &[&OsStr]) -> anyhow::Result<(Figures, f64)> {
        let stdout = engine::baseline::run(Command::new(python).arg(script).args(args), script)?;
        let json = engine::baseline::last_json(&stdout, script)?;
        let number = |key: &str| engine::baseline::number(&json, key);
        let figures = Figures { seconds: number("seconds")?, peak_bytes: number("peak_bytes")? as u64 };
        Ok((figures, number("first_seconds")?))
    }

    /// Our figures from this benchmark run again with `--ours dir` and `args`, and the further
    /// words of the line it printed ([`Figures::print_ours`]).
    pub fn ours(dir: &Path, args: &[String]) -> anyhow::Result<(Figures, Vec<String>)> {
        let me = std::env::current_exe()?;
        let stdout = engine::baseline::run(Command::new(me).arg("--ours").arg(dir).args(args), "our side")?;
        let line = stdout.lines().find_map(|l| l.strip_prefix("ours ")).context("our side printed no figures")?;
        let mut words = line.split(' ').map(str::to_string);
        let mut next = || words.next().context("short figures line");
        let figures = Figures { seconds: next()?.parse()?, peak_bytes: next()?.parse()? };
        Ok((figures, words.collect()))
    }

    /// Our side's line, which [`Figures::ours`] reads: the figures, then `more`.
    pub fn print_ours(&self, more: &[String]) {
        let words = [vec![self.seconds.to_string(), self.peak_bytes.to_string()], more.to_vec()].concat();
        println!("ours {}", words.join(" "));
    }
}

/// A table row's cells of both sides' figures: AlphaFold's seconds (its first call's in
/// brackets), ours, the ratio AlphaFold / ours, and each side's peak MiB.
pub fn cells(theirs: &Figures, first: f64, mine: &Figures) -> String {
    let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
    format!(
        "{:.1} ({first:.1}) | {:.1} | {:.2} | {:.0} | {:.0}",
        theirs.seconds,
        mine.seconds,
        theirs.seconds / mine.seconds,
        mib(theirs.peak_bytes),
        mib(mine.peak_bytes)
    )
}
