//! What the benchmarks of our prediction against DeepMind's AlphaFold share
//! (`versus_alphafold.rs`, `versus_alphafold_multimer.rs`): the options that name AlphaFold's
//! Python and our side's process, each side's figures, AlphaFold's atoms to compare ours with,
//! and running each side in a process of its own (so that each peak memory is that side's). On
//! a GPU (`--device cuda`) both sides run there and each peak is the card's use through the
//! side's process, as `nvidia-smi` counts it (ours by `engine::process::CardPeak`,
//! AlphaFold's by NVML: `card_memory.py`).
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use engine::device::DeviceKind;
use engine::fp32_matmul::Fp32Matmul;
use engine::process::CardPeak;
use tch::{Device, Kind, Tensor};

/// The options besides the sizes.
#[derive(clap::Args)]
pub struct Sides {
    /// The Python with alphafold-colabfold, jax and dm-haiku.
    #[arg(long, env = "ALPHAFOLD_PYTHON", default_value = ".venv-alphafold/bin/python")]
    pub python: PathBuf,
    /// Internal: run our side on the files in this folder and print its figures.
    #[arg(long, hide = true)]
    pub ours: Option<PathBuf>,
    /// Where both sides run: the CPU, or a GPU (AlphaFold's JAX on CUDA, ours on CUDA).
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Both sides' fp32 matrix products on a GPU: `tf32`, each side's default there (JAX's
    /// default precision, `fastfold predict --fp32-matmul tf32`), or `ieee` (JAX's `highest`,
    /// ours `ieee`), the two sides' strict arithmetic for parity. No effect on the CPU.
    #[arg(long, value_enum, default_value_t = Fp32Matmul::Tf32)]
    pub fp32_matmul: Fp32Matmul,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

impl Sides {
    /// Where both sides run, for the table's title: the CPU's threads, or the GPU's products.
    pub fn place(&self) -> String {
        match self.device.resolve() {
            DeviceKind::Cuda => {
                format!("GPU (fp32 products {}; the peaks are the card's use)", self.fp32_matmul.name())
            }
            _ => format!("CPU ({} threads)", tch::get_num_threads()),
        }
    }
}

/// The head of the table whose rows are a length's cell, [`cells`] and the atom difference.
pub const TABLE_HEAD: &str =
    "| residues | AlphaFold s (first, with jit) | ours s | AlphaFold / ours | AlphaFold peak MiB \
                              | ours peak MiB | max atom difference Å |\n|---:|---:|---:|---:|---:|---:|---:|";

/// One side's figures.
pub struct Figures {
    pub seconds: f64,
    pub peak_bytes: u64,
}

impl Figures {
    /// AlphaFold's figures (and its first, compiling, call's seconds) from the last JSON line
    /// of `script` run by the sides' Python with `args`, JAX held to their device (so that a
    /// missing GPU is an error, not a silent CPU run; on a GPU the CPU backend too, on which
    /// AlphaFold's feature pipeline draws its random numbers) and, on a GPU, growing its memory as it
    /// needs it rather than taking most of the card at start, so that its peak is its use; its
    /// fp32 products at `highest` under `--fp32-matmul ieee`.
    pub fn alphafold(sides: &Sides, script: &str, args: &[&OsStr]) -> anyhow::Result<(Figures, f64)> {
        let mut command = Command::new(&sides.python);
        command.arg(script).args(args);
        match sides.device.resolve() {
            DeviceKind::Cuda => command.env("JAX_PLATFORMS", "cuda,cpu").env("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
            _ => command.env("JAX_PLATFORMS", "cpu"),
        };
        if sides.fp32_matmul == Fp32Matmul::Ieee {
            command.env("JAX_DEFAULT_MATMUL_PRECISION", "highest");
        }
        let stdout = engine::baseline::run(&mut command, script)?;
        let json = engine::baseline::last_json(&stdout, script)?;
        let number = |key: &str| engine::baseline::number(&json, key);
        let figures = Figures { seconds: number("seconds")?, peak_bytes: number("peak_bytes")? as u64 };
        Ok((figures, number("first_seconds")?))
    }

    /// Our figures from this benchmark run again with `--ours dir`, the sides' `--device` and
    /// `--fp32-matmul`, and `args`, and the further words of the line it printed
    /// ([`Figures::print_ours`]).
    pub fn ours(dir: &Path, sides: &Sides, args: &[String]) -> anyhow::Result<(Figures, Vec<String>)> {
        let me = std::env::current_exe()?;
        let mut command = Command::new(me);
        command.arg("--ours").arg(dir).args(["--device", &sides.device.to_string()]);
        command.args(["--fp32-matmul", sides.fp32_matmul.name()]).args(args);
        let stdout = engine::baseline::run(&mut command, "our side")?;
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

/// Our side's device, and on a GPU the card's use read from before anything is put there.
pub struct OurDevice {
    pub device: Device,
    card: Option<CardPeak>,
}

impl OurDevice {
    /// The sides' device, its fp32 products as `--fp32-matmul` says.
    pub fn start(sides: &Sides) -> anyhow::Result<OurDevice> {
        let device = sides.device.device(0, 1)?;
        engine::fp32_matmul::set(sides.fp32_matmul)?;
        let card = match device {
            Device::Cuda(d) => Some(CardPeak::start(d)?),
            _ => None,
        };
        Ok(OurDevice { device, card })
    }

    /// Waits for the device's queued work (a GPU's timing ends here).
    pub fn synchronize(&self) -> anyhow::Result<()> {
        if let Device::Cuda(d) = self.device {
            engine::cuda::synchronize(d)?;
        }
        Ok(())
    }

    /// The side's peak: the card's use on a GPU, the resident set on the CPU.
    pub fn peak_bytes(self) -> anyhow::Result<u64> {
        match self.card {
            Some(card) => Ok(card.finish()?),
            None => engine::process::peak_memory(Device::Cpu).context("no peak memory reading"),
        }
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

/// AlphaFold's final atoms (`positions.npz`) and their mask.
pub struct AlphaFoldAtoms {
    positions: Tensor,
    mask: Tensor,
}

impl AlphaFoldAtoms {
    /// What AlphaFold's side wrote into `dir`.
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let mut arrays: std::collections::HashMap<String, Tensor> =
            Tensor::read_npz(dir.join("positions.npz"))?.into_iter().collect();
        let mut take = |name: &str| arrays.remove(name).with_context(|| format!("positions.npz: no {name}"));
        let positions = take("final_atom_positions")?.to_kind(Kind::Double);
        Ok(AlphaFoldAtoms { positions, mask: take("final_atom_mask")?.to_kind(Kind::Double).unsqueeze(-1) })
    }

    /// The largest difference of `a` from `b` (AlphaFold's positions when `None`) over
    /// AlphaFold's atom mask, in Å.
    pub fn distance(&self, a: &Tensor, b: Option<&Tensor>) -> f64 {
        let b = b.map_or_else(|| self.positions.shallow_clone(), |b| b.to_kind(Kind::Double));
        ((a.to_kind(Kind::Double) - b) * &self.mask).abs().max().double_value(&[])
    }
}
