//! Noise schedulers read from a diffusers `scheduler/scheduler_config.json` ([`raw`]: its keys;
//! [`config`]: the file and the validated config; [`class`]: the diffusers class it is read
//! for), DDPM's training quantities in [`ddpm`], and the samplers people use, each as diffusers
//! 0.42.1 defines it: DDIM, Euler, Euler ancestral, PNDM, DPM-Solver++ multistep and UniPC.
//! Every sampler implements [`Scheduler`], so one loop drives them all. Schedules are computed
//! in f64 from the config; the tensors they touch keep their own device and kind.
pub mod class;
pub mod config;
pub mod ddim;
pub mod ddpm;
pub mod dpm;
pub mod euler;
pub mod euler_ancestral;
pub(crate) mod multistep;
pub mod options;
pub mod pndm;
pub mod raw;
pub(crate) mod sigmas;
pub mod unipc;

pub use class::SchedulerClass;
pub use config::{PredictionType, SchedulerConfig, SchedulerFile, TimestepSpacing};
pub use ddim::{DdimScheduler, DdimStep};
pub use ddpm::DdpmScheduler;
pub use dpm::DpmSolverMultistepScheduler;
pub use euler::EulerDiscreteScheduler;
pub use euler_ancestral::EulerAncestralDiscreteScheduler;
pub use options::{FinalSigmas, SolverType};
pub use pndm::PndmScheduler;
pub use raw::SchedulerConfigFile;
pub use unipc::UniPcMultistepScheduler;

use tch::Tensor;

use crate::error::{Error, Result};

/// A sampler as diffusers' pipelines drive one: [`Scheduler::set_timesteps`], then for each
/// step `i` in order the model is run on [`Scheduler::scale_model_input`] at
/// `timesteps()[i]` and its output handed to [`Scheduler::step`]. Multistep samplers keep
/// their history between steps (so steps run in order), and `set_timesteps` clears it.
pub trait Scheduler {
    /// Spaces `steps` inference steps and resets any multistep state. PNDM runs more model
    /// evaluations than `steps` (see [`Scheduler::timesteps`]).
    fn set_timesteps(&mut self, steps: usize) -> Result<()>;

    /// The timestep the model is given at each step, in order (empty before `set_timesteps`;
    /// integers for every class but the Euler ones).
    fn timesteps(&self) -> &[f64];

    /// The noise level of each step, then the final one (empty for DDIM and PNDM, which step
    /// in alpha products).
    fn sigmas(&self) -> &[f64] {
        &[]
    }

    /// The initial noise's standard deviation (1 but for the Euler samplers, which work in
    /// sigma rather than alpha-scaled samples).
    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// The model's input at step `index` (the sample itself but for the Euler samplers).
    fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        let _ = index;
        Ok(sample.shallow_clone())
    }

    /// Whether [`Scheduler::step`] needs fresh standard normal noise (ancestral sampling).
    fn needs_noise(&self) -> bool {
        false
    }

    /// Step `index`: the sample at the next (less noisy) level from the model's output on
    /// `sample`. `noise` (the shape of `sample`) is required where [`Scheduler::needs_noise`].
    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: Option<&Tensor>) -> Result<Tensor>;
}

/// The sampler of `cfg`'s class; DDPM, used for training noise here, has none.
pub fn build(cfg: SchedulerConfig) -> Result<Box<dyn Scheduler>> {
    Ok(match cfg.class {
        SchedulerClass::Ddim => Box::new(DdimScheduler::new(cfg)),
        SchedulerClass::EulerDiscrete => Box::new(EulerDiscreteScheduler::new(cfg)),
        SchedulerClass::EulerAncestralDiscrete => Box::new(EulerAncestralDiscreteScheduler::new(cfg)),
        SchedulerClass::Pndm => Box::new(PndmScheduler::new(cfg)),
        SchedulerClass::DpmSolverMultistep => Box::new(DpmSolverMultistepScheduler::new(cfg)),
        SchedulerClass::UniPcMultistep => Box::new(UniPcMultistepScheduler::new(cfg)),
        SchedulerClass::Ddpm => {
            return Err(Error::Invalid("DDPMScheduler is used for training noise here, not for sampling".into()))
        }
    })
}

/// Errors unless `a` and `b` have the same shape (`what` names them).
pub(crate) fn same_shape(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if a.size() != b.size() {
        return Err(Error::Invalid(format!("{what}: shapes {:?} and {:?} differ", a.size(), b.size())));
    }
    Ok(())
}
