//! The flags every job command shares, defined once and flattened into each app's commands
//! (`#[command(flatten)]`), so that a flag with one meaning has one name everywhere:
//!
//! | group | flags |
//! |---|---|
//! | [`DeviceArgs`] | `--device` |
//! | [`LaunchArgs`] | `--device --nproc --timeout` (and [`LaunchArgs::launch_or_join`]) |
//! | [`SeedArgs`] | `--seed` |
//! | [`JobArgs`] | a training job's launch, `--quiet`, `--metrics`, `--report-to` and `--logging-dir` (and [`JobArgs::open_metrics`]) |
//! | [`PrecisionArgs`] | `--precision fp32\|bf16\|fp16` |
//! | [`OptimizerArgs`] | `--optimizer --lr --weight-decay --clip-grad --adam-epsilon` (and [`OptimizerArgs::build`]) |
//! | [`ScheduleArgs`] | `--warmup --decay --min-lr-ratio --decay-every --decay-factor --decay-after` |
//!
//! Defaults here are neutral; a command whose users expect others (LAMB at 3e-2 for ViT,
//! AdamW at 1e-5 for diffusion fine-tuning) sets them on its own struct with
//! `#[command(mut_arg("lr", |a| a.default_value("3e-2")))]`, so `--help` shows the command's
//! own defaults. A command that supports only some precisions narrows the flag the same way
//! with [`Precision::parser`].
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use tch::Kind;

use crate::device::DeviceKind;
use crate::dist::{self, InitOptions, World};
use crate::gemini::CpuRule;
use crate::metrics::{Metrics, Record};
use crate::optim::{AdamW, AdamWConfig, Decay, Lamb, LambConfig, Lars, LarsConfig, LrSchedule, Optimizer, Param};
use crate::{Error, Result};

use crate::parse::{count, non_negative, positive, positive_share, seconds, share};

/// `--device`.
#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Device: auto (CUDA when a GPU is visible, else CPU), cpu, or cuda (each rank GPU
    /// LOCAL_RANK % visible devices).
    #[arg(long, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
}

/// Where a multi-rank job runs and how long its ranks wait for each other.
#[derive(clap::Args, Clone, Debug)]
pub struct LaunchArgs {
    /// The device.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Local ranks to spawn (under torchrun, Slurm or mpirun the launcher decides).
    #[arg(long, default_value_t = 1, value_parser = count(1..))]
    pub nproc: usize,
    /// Rendezvous and collective timeout in seconds; under the spawner (--nproc) also the
    /// longest a rank may go without progress (a micro-batch, an evaluation batch, a Gemini
    /// chunk access, a collective) or a heartbeat.
    #[arg(long, default_value_t = 300.0, value_parser = timeout_seconds, env = crate::dist::launch::TIMEOUT_ENV)]
    pub timeout: f64,
}

impl LaunchArgs {
    /// The rendezvous and collective timeout.
    pub fn timeout(&self) -> Duration {
        // `seconds` admitted the flag; a struct built by hand with a value out of range waits
        // the longest time a Duration holds rather than panicking.
        Duration::try_from_secs_f64(self.timeout).unwrap_or(Duration::MAX)
    }

    /// Joins the job as one of its ranks. Run without a launcher and with `--nproc` above 1,
    /// the process instead spawns the ranks, waits for them and returns `None` (its caller
    /// then exits; a failed rank is an error naming it).
    pub fn launch_or_join(&self) -> Result<Option<World>> {
        if dist::maybe_relaunch(self.nproc, self.timeout())? {
            return Ok(None);
        }
        Ok(Some(dist::init(&InitOptions { timeout: self.timeout() })?))
    }

    /// This rank's device in `world`.
    pub fn device(&self, world: &World) -> Result<tch::Device> {
        self.device.device.device(world.env.local_rank, world.env.local_world_size)
    }
}

/// `--seed`.
#[derive(clap::Args, Clone, Debug)]
pub struct SeedArgs {
    /// Seed of every random draw (initial weights, data order, augmentations, noise): the
    /// same seed repeats the run.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// What every training command shares: launch, progress and the training log.
#[derive(clap::Args, Clone, Debug)]
pub struct JobArgs {
    /// Device, ranks and timeout.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// The training log's file name in the output folder (`.csv` for CSV, else JSON lines).
    #[arg(long, default_value = "metrics.jsonl")]
    pub metrics: PathBuf,
    /// Also log to: tensorboard (event files under --logging-dir), or none (diffusers' flag).
    #[arg(long, value_enum, default_value_t = ReportTo::None)]
    pub report_to: ReportTo,
    /// TensorBoard's folder, in the output folder unless absolute (diffusers' flag); the event
    /// files go to `<logging-dir>/<command>`, as accelerate's tracker puts them under the run's
    /// name.
    #[arg(long, default_value = "logs")]
    pub logging_dir: PathBuf,
}

/// Where a training log goes besides the metrics file (`--report-to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ReportTo {
    /// Only the metrics file.
    None,
    /// Also TensorBoard event files.
    Tensorboard,
}

impl JobArgs {
    /// Opens the training log for records of `R` in the output folder `out` (rank 0's): the
    /// metrics file, and under `--report-to tensorboard` event files in
    /// `<out>/<logging-dir>/<run>` (`run`: the command, e.g. `vit-pretrain`). `resume_step`: as
    /// for [`Metrics::open`].
    pub fn open_metrics<R: Record>(&self, out: &Path, resume_step: Option<usize>, run: &str) -> Result<Metrics> {
        let metrics = Metrics::open::<R>(&out.join(&self.metrics), resume_step)?;
        match self.report_to {
            ReportTo::None => Ok(metrics),
            ReportTo::Tensorboard => metrics
                .with_tensorboard(&out.join(&self.logging_dir).join(run), resume_step)
                .map_err(|e| Error::Invalid(format!("--logging-dir {}: {e}", self.logging_dir.display()))),
        }
    }
}

/// Arithmetic precision of a model's weights and activations (`--precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// 32-bit floats throughout.
    Fp32,
    /// bfloat16 weights and activations (training: fp32 master weights and optimizer state).
    Bf16,
    /// IEEE half precision (training: fp32 masters and dynamic loss scaling).
    Fp16,
}

impl Precision {
    /// The tensor kind.
    pub fn kind(self) -> Kind {
        match self {
            Precision::Fp32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
            Precision::Fp16 => Kind::Half,
        }
    }

    /// The flag's name for it (`fp32`, `bf16`, `fp16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// A value parser for `--precision` accepting only `allowed`, for commands that support
    /// fewer precisions (`--help` then lists only those).
    pub fn parser(allowed: &[Precision]) -> impl TypedValueParser<Value = Precision> {
        let names: Vec<&'static str> = allowed.iter().map(|p| p.name()).collect();
        // Only the allowed names get past the parser, and each is one of the enum's.
        PossibleValuesParser::new(names)
            .map(|s| <Precision as clap::ValueEnum>::from_str(&s, false).unwrap_or(Precision::Fp32))
    }
}

/// `--precision`.
#[derive(clap::Args, Clone, Debug)]
pub struct PrecisionArgs {
    /// Arithmetic precision.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
}

/// Which optimizer steps the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerKind {
    /// AdamW (decoupled weight decay).
    Adamw,
    /// LAMB: Adam with layer-wise trust ratios, for large batches.
    Lamb,
    /// LARS: SGD with momentum and layer-wise trust ratios.
    Lars,
}

impl OptimizerKind {
    /// The flag's name for it (`adamw`, `lamb`, `lars`).
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Lamb => "lamb",
            OptimizerKind::Lars => "lars",
        }
    }
}

/// The optimizer and its hyper-parameters.
#[derive(clap::Args, Clone, Debug)]
pub struct OptimizerArgs {
    /// The optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3, value_parser = positive)]
    pub lr: f64,
    /// Weight decay (vit: not on biases and norm weights, as timm; diffusion: on every
    /// parameter, as diffusers' scripts).
    #[arg(long, default_value_t = 0.0, value_parser = non_negative)]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value (diffusers' --max-grad-norm).
    #[arg(long, visible_alias = "max-grad-norm", value_parser = positive)]
    pub clip_grad: Option<f64>,
    /// Adam's epsilon, added to the denominator (AdamW and LAMB; default: PyTorch's 1e-8 for
    /// AdamW, the paper's 1e-6 for LAMB; diffusers' --adam-epsilon).
    #[arg(long, value_parser = positive)]
    pub adam_epsilon: Option<f64>,
}

impl OptimizerArgs {
    /// The rule at learning rate `lr` (the other hyper-parameters, and epsilon unless given,
    /// are each optimizer's defaults: PyTorch's for AdamW, the paper's for LAMB, timm's for
    /// LARS).
    pub fn rule(&self, lr: f64) -> CpuRule {
        let weight_decay = self.weight_decay;
        match self.optimizer {
            OptimizerKind::Adamw => {
                let d = AdamWConfig::default();
                CpuRule::AdamW(AdamWConfig { lr, weight_decay, eps: self.adam_epsilon.unwrap_or(d.eps), ..d })
            }
            OptimizerKind::Lamb => {
                let d = LambConfig::default();
                CpuRule::Lamb(LambConfig { lr, weight_decay, eps: self.adam_epsilon.unwrap_or(d.eps), ..d })
            }
            OptimizerKind::Lars => CpuRule::Lars(LarsConfig { lr, weight_decay, ..Default::default() }),
        }
    }

    /// The tensor optimizer of [`OptimizerArgs::rule`] over `params`.
    pub fn build(&self, params: Vec<Param>, lr: f64) -> Box<dyn Optimizer> {
        match self.rule(lr) {
            CpuRule::AdamW(c) => Box::new(AdamW::new(params, c)),
            CpuRule::Lamb(c) => Box::new(Lamb::new(params, c)),
            CpuRule::Lars(c) => Box::new(Lars::new(params, c)),
        }
    }
}

/// How the learning rate falls after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DecayKind {
    /// Stay at the peak.
    Constant,
    /// Half a cosine down to the floor.
    Cosine,
    /// A straight line down to the floor.
    Linear,
    /// AlphaFold's: times --decay-factor after --decay-after steps and every --decay-every
    /// steps from there, not below the floor.
    Step,
}

/// The learning-rate schedule: linear warmup, then a decay. AlphaFold's recipe (OpenFold's
/// `AlphaFoldLRScheduler`) is `--lr 1e-3 --warmup 1000 --decay step` with the step flags'
/// defaults.
#[derive(clap::Args, Clone, Debug)]
pub struct ScheduleArgs {
    /// Linear warmup steps to the peak learning rate (diffusers' --lr-warmup-steps).
    #[arg(long, visible_alias = "lr-warmup-steps", default_value_t = 0)]
    pub warmup: usize,
    /// Decay after warmup.
    #[arg(long, value_enum, default_value_t = DecayKind::Constant)]
    pub decay: DecayKind,
    /// Final learning rate as a share of the peak (cosine and linear decay; step decay's floor).
    #[arg(long, default_value_t = 0.0, value_parser = share)]
    pub min_lr_ratio: f64,
    /// Steps between two cuts of --decay step [default: 50000, AlphaFold's].
    #[arg(long, value_parser = count(1..))]
    pub decay_every: Option<usize>,
    /// Each cut's factor under --decay step [default: 0.95, AlphaFold's].
    #[arg(long, value_parser = positive_share)]
    pub decay_factor: Option<f64>,
    /// Steps at the peak before --decay step's first cut, counted from the first step
    /// [default: 50000, AlphaFold's, warm-up included].
    #[arg(long, value_parser = count(0..))]
    pub decay_after: Option<usize>,
}

/// [`seconds`] for `--timeout`, whose error says when the value came from
/// `ENGINE_DIST_TIMEOUT` (clap names only the flag).
fn timeout_seconds(s: &str) -> std::result::Result<f64, String> {
    let env = crate::dist::launch::TIMEOUT_ENV;
    seconds(s).map_err(|e| match std::env::var(env) {
        Ok(v) if v == s => format!("{e} (the value of {env}, which --timeout defaults to)"),
        _ => e,
    })
}

impl ScheduleArgs {
    /// The schedule from `peak` over `total` steps. The step flags without `--decay step` are
    /// an error: another decay would ignore them, silently.
    pub fn schedule(&self, peak: f64, total: usize) -> Result<LrSchedule> {
        let decay = match self.decay {
            DecayKind::Constant => Decay::Constant,
            DecayKind::Cosine => Decay::Cosine,
            DecayKind::Linear => Decay::Linear,
            DecayKind::Step => Decay::Step {
                every: self.decay_every.unwrap_or(50_000),
                factor: self.decay_factor.unwrap_or(0.95),
                after: self.decay_after.unwrap_or(50_000),
            },
        };
        let step_flags = [
            ("--decay-every", self.decay_every.is_some()),
            ("--decay-factor", self.decay_factor.is_some()),
            ("--decay-after", self.decay_after.is_some()),
        ];
        if let (false, Some((flag, _))) = (self.decay == DecayKind::Step, step_flags.iter().find(|(_, given)| *given)) {
            let kind = format!("{:?}", self.decay).to_lowercase();
            return Err(Error::Invalid(format!("{flag} applies to --decay step only (the decay is {kind})")));
        }
        Ok(LrSchedule { peak, floor: peak * self.min_lr_ratio, warmup: self.warmup, total, decay })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    #[command(
        mut_arg("lr", |a| a.default_value("3e-2")),
        mut_arg("optimizer", |a| a.default_value("lamb")),
        mut_arg("precision", |a| a.value_parser(Precision::parser(&[Precision::Fp32, Precision::Bf16]))),
    )]
    struct Command {
        #[command(flatten)]
        job: JobArgs,
        #[command(flatten)]
        seed: SeedArgs,
        #[command(flatten)]
        optimizer: OptimizerArgs,
        #[command(flatten)]
        precision: PrecisionArgs,
        #[command(flatten)]
        schedule: ScheduleArgs,
    }

    #[test]
    fn groups_flatten_with_the_commands_own_defaults() {
        let c = Command::try_parse_from(["x"]).unwrap();
        assert_eq!((c.optimizer.optimizer, c.optimizer.lr), (OptimizerKind::Lamb, 3e-2));
        assert_eq!((c.job.launch.nproc, c.seed.seed, c.precision.precision), (1, 0, Precision::Fp32));
        let c = Command::try_parse_from(["x", "--max-grad-norm", "1", "--lr-warmup-steps", "5", "--precision", "bf16"])
            .unwrap();
        assert_eq!((c.optimizer.clip_grad, c.schedule.warmup, c.precision.precision), (Some(1.0), 5, Precision::Bf16));
        let err = Command::try_parse_from(["x", "--precision", "fp16"]).err().unwrap().to_string();
        assert!(err.contains("fp16") && err.contains("fp32, bf16"), "{err}");
        let s = c.schedule.schedule(1.0, 10).unwrap();
        assert_eq!((s.at(0), s.at(1), s.at(9)), (0.0, 0.2, 1.0));
    }

    /// `--decay step` with its flags is AlphaFold's schedule; the defaults are AlphaFold's numbers.
    #[test]
    fn step_decay_flags_build_alphafolds_schedule() {
        let c = Command::try_parse_from(["x", "--warmup", "1000", "--decay", "step"]).unwrap();
        let s = c.schedule.schedule(1e-3, 10).unwrap();
        assert_eq!(s.decay, Decay::Step { every: 50_000, factor: 0.95, after: 50_000 });
        assert_eq!((s.at(1000), s.at(50_000)), (1e-3, 1e-3));
        assert!((s.at(50_001) - 0.95e-3).abs() < 1e-15, "{}", s.at(50_001));
        let flags = ["x", "--decay", "step", "--decay-every", "2", "--decay-factor", "0.5", "--decay-after", "4"];
        let c = Command::try_parse_from(flags).unwrap();
        let s = c.schedule.schedule(1.0, 10).unwrap();
        assert_eq!(s.decay, Decay::Step { every: 2, factor: 0.5, after: 4 });
        assert_eq!([s.at(4), s.at(5), s.at(6), s.at(7), s.at(8)], [1.0, 0.5, 0.25, 0.25, 0.125]);
        // Under another decay the step flags would do nothing: an error names the flag.
        let c = Command::try_parse_from(["x", "--decay", "cosine", "--decay-factor", "0.5"]).unwrap();
        let err = c.schedule.schedule(1.0, 10).err().unwrap().to_string();
        assert!(err.contains("--decay-factor") && err.contains("--decay step") && err.contains("cosine"), "{err}");
    }

    #[test]
    fn report_to_tensorboard_logs_under_the_logging_dir() {
        let c = Command::try_parse_from(["x"]).unwrap();
        assert_eq!((c.job.report_to, c.job.logging_dir.as_path()), (ReportTo::None, Path::new("logs")));
        let err = Command::try_parse_from(["x", "--report-to", "wandb"]).err().unwrap().to_string();
        assert!(err.contains("wandb") && err.contains("none, tensorboard"), "{err}");
        let dir = std::env::temp_dir().join(format!("engine-job-logs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = Command::try_parse_from(["x", "--report-to", "tensorboard", "--logging-dir", "tb"]).unwrap();
        drop(c.job.open_metrics::<Step>(&dir, None, "run").unwrap());
        assert!(dir.join("tb/run").is_dir());
        // A logging folder that cannot be made is named with its flag.
        std::fs::write(dir.join("file"), "").unwrap();
        let c = Command::try_parse_from(["x", "--report-to", "tensorboard", "--logging-dir", "file"]).unwrap();
        let err = c.job.open_metrics::<Step>(&dir, None, "run").err().unwrap().to_string();
        assert!(err.contains("--logging-dir file") && err.contains("file/run"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[derive(serde::Serialize)]
    struct Step {
        step: usize,
    }

    impl Record for Step {
        const CSV_HEADER: &'static str = "step";
        fn csv_row(&self) -> String {
            self.step.to_string()
        }
        fn step(&self) -> usize {
            self.step
        }
        fn scalars(&self) -> Vec<(&'static str, f64)> {
            vec![]
        }
    }

    #[test]
    fn numeric_flags_out_of_range_are_errors_naming_the_flag() {
        for (flag, value) in [
            ("--timeout", "-1"),
            ("--timeout", "0"),
            ("--timeout", "nan"),
            ("--timeout", "1e30"),
            ("--nproc", "0"),
            ("--nproc", "-1"),
            ("--nproc", "two"),
            ("--nproc", "99999999999999999999"),
            ("--lr", "nan"),
            ("--lr", "-1"),
            ("--lr", "0"),
            ("--lr", "inf"),
            ("--weight-decay", "-5"),
            ("--weight-decay", "nan"),
            ("--clip-grad", "0"),
            ("--clip-grad", "-1"),
            ("--max-grad-norm", "nan"),
            ("--min-lr-ratio", "1.5"),
            ("--min-lr-ratio", "-0.1"),
            ("--decay-every", "0"),
            ("--decay-every", "-5"),
            ("--decay-factor", "0"),
            ("--decay-factor", "1.5"),
            ("--decay-factor", "nan"),
            ("--decay-after", "-1"),
            ("--decay-after", "1.5"),
            ("--adam-epsilon", "0"),
            ("--adam-epsilon", "nan"),
        ] {
            let err =
                Command::try_parse_from(["x".to_string(), format!("{flag}={value}")]).err().map(|e| e.to_string());
            let err = err.unwrap_or_else(|| panic!("{flag} {value} was accepted"));
            let named = if flag == "--max-grad-norm" { "--clip-grad" } else { flag };
            assert!(err.contains(named) && err.contains(value), "{flag} {value}: {err}");
        }
        let err = Command::try_parse_from(["x", "--nproc", "0"]).err().unwrap().to_string();
        assert!(err.contains("must be at least 1"), "{err}");
        let c =
            Command::try_parse_from(["x", "--timeout", "0.5", "--weight-decay", "0", "--min-lr-ratio", "1"]).unwrap();
        assert_eq!((c.job.launch.timeout(), c.optimizer.weight_decay), (Duration::from_millis(500), 0.0));
    }

    #[test]
    fn the_rule_and_the_tensor_optimizer_agree() {
        let args = OptimizerArgs {
            optimizer: OptimizerKind::Lars,
            lr: 0.5,
            weight_decay: 0.1,
            clip_grad: None,
            adam_epsilon: None,
        };
        match args.rule(0.25) {
            CpuRule::Lars(c) => assert_eq!((c.lr, c.weight_decay, c.momentum), (0.25, 0.1, 0.9)),
            other => panic!("{other:?}"),
        }
        let p = Param::new("w", &tch::Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true));
        assert_eq!(args.build(vec![p], 0.25).lr(), 0.25);
        // Adam's epsilon: each optimizer's own unless given.
        let eps = |optimizer, adam_epsilon| match (OptimizerArgs { optimizer, adam_epsilon, ..args.clone() }).rule(1.0)
        {
            CpuRule::AdamW(c) => c.eps,
            CpuRule::Lamb(c) => c.eps,
            other => panic!("{other:?}"),
        };
        assert_eq!((eps(OptimizerKind::Adamw, None), eps(OptimizerKind::Lamb, None)), (1e-8, 1e-6));
        assert_eq!((eps(OptimizerKind::Adamw, Some(1e-6)), eps(OptimizerKind::Lamb, Some(1e-5))), (1e-6, 1e-5));
    }
}
