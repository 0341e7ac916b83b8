//! DPM-Solver++ multistep (Lu et al. 2022) as diffusers' `DPMSolverMultistepScheduler` with
//! `algorithm_type="dpmsolver++"`: the model's output is turned into a clean-sample prediction,
//! and each step integrates the diffusion ODE in log-SNR `lambda` exactly for the linear part
//! and with a polynomial through the last `solver_order` predictions (order 1 is DDIM; order 2,
//! the default, "2M", by the midpoint or Heun rule). The first steps run at lower order until
//! the history fills; `lower_order_final` (under 15 steps), `euler_at_final` and a final sigma
//! of 0 lower the last steps' order. Sigmas are the training schedule's at the spaced
//! timesteps, or Karras et al.'s ramp with each timestep the nearest training one.
use tch::{Kind, Tensor};

use super::multistep::{clean_sample, Multistep, MultistepSchedule};
use super::sigmas::{alpha_sigma, lambda, train_sigmas};
use super::{FinalSigmas, Scheduler, SchedulerConfig, SolverType};
use crate::error::Result;

/// DPM-Solver++ multistep (see the module docs).
#[derive(Debug)]
pub struct DpmSolverMultistepScheduler {
    cfg: SchedulerConfig,
    train_sigmas: Vec<f64>,
    /// The schedule and the clean-sample predictions of the last `solver_order` steps.
    state: Multistep,
}

impl DpmSolverMultistepScheduler {
    /// A scheduler of `cfg`; call [`Scheduler::set_timesteps`] before stepping.
    pub fn new(cfg: SchedulerConfig) -> DpmSolverMultistepScheduler {
        let train_sigmas = train_sigmas(&cfg);
        DpmSolverMultistepScheduler { cfg, train_sigmas, state: Multistep::default() }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The clean-sample predictions the next step combines, oldest first.
    pub fn model_outputs(&self) -> &[Tensor] {
        &self.state.outputs
    }

    /// `N` less the timesteps whose log-SNR lies below `lambda_min_clipped`.
    fn last_timestep(&self) -> i64 {
        let clip = self.cfg.lambda_min_clipped;
        let below = self.train_sigmas.iter().filter(|&&s| lambda(s) < clip).count();
        self.cfg.num_train_timesteps - below as i64
    }

    /// The order of step `index` of `steps`: the configured one, lowered while the history
    /// fills and in the last steps.
    fn order(&self, index: usize, steps: usize) -> usize {
        let c = &self.cfg;
        let few = c.lower_order_final && steps < 15;
        let last = index + 1 == steps && (c.euler_at_final || few || c.final_sigmas == FinalSigmas::Zero);
        let second_last = index + 2 == steps && few;
        let taken = self.state.lower_order_nums;
        if c.solver_order == 1 || taken < 1 || last {
            1
        } else if c.solver_order == 2 || taken < 2 || second_last {
            2
        } else {
            3
        }
    }

    /// The update from sigma `index` to `index + 1` of the given order, on fp32 `x`.
    fn update(&self, x: &Tensor, index: usize, order: usize) -> Tensor {
        let s = &self.state.sigmas;
        let (alpha_t, sigma_t) = alpha_sigma(s[index + 1]);
        let (_, sigma_s0) = alpha_sigma(s[index]);
        let h = lambda(s[index + 1]) - lambda(s[index]);
        let m = &self.state.outputs;
        let m0 = &m[m.len() - 1];
        // x_t = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) D0 + higher-order terms; at sigma_t 0
        // (h infinite) the first-order update is the prediction itself.
        let phi = (-h).exp_m1();
        let first = x * (sigma_t / sigma_s0) - m0 * (alpha_t * phi);
        if order == 1 {
            return first;
        }
        let h0 = lambda(s[index]) - lambda(s[index - 1]);
        let d1 = (m0 - &m[m.len() - 2]) * (h / h0);
        if order == 2 {
            return match self.cfg.solver_type {
                SolverType::Heun => first + d1 * (alpha_t * (phi / h + 1.0)),
                _ => first - d1 * (0.5 * alpha_t * phi),
            };
        }
        let h1 = lambda(s[index - 1]) - lambda(s[index - 2]);
        let (r0, r1) = (h0 / h, h1 / h);
        let d1_1 = (&m[m.len() - 2] - &m[m.len() - 3]) * (1.0 / r1);
        let d1_0 = d1;
        let d1 = &d1_0 + (&d1_0 - &d1_1) * (r0 / (r0 + r1));
        let d2 = (d1_0 - d1_1) * (1.0 / (r0 + r1));
        first + d1 * (alpha_t * (phi / h + 1.0)) - d2 * (alpha_t * ((phi + h) / (h * h) - 0.5))
    }
}

impl Scheduler for DpmSolverMultistepScheduler {
    fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        let how = MultistepSchedule { last: self.last_timestep(), truncate_cosine: true, karras_own_min: false };
        self.state.reset(&self.cfg, &self.train_sigmas, steps, how)
    }

    fn timesteps(&self) -> &[f64] {
        &self.state.timesteps
    }

    /// One sigma per timestep, then the final sigma.
    fn sigmas(&self) -> &[f64] {
        &self.state.sigmas
    }

    /// Converts the output to a clean-sample prediction, adds it to the history and takes the
    /// step in fp32, returned in the model output's kind.
    fn step(
        &mut self,
        model_output: &Tensor,
        index: usize,
        sample: &Tensor,
        _noise: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.state.begin("DPM-Solver++", index, model_output, sample)?;
        let order = self.order(index, self.state.timesteps.len());
        let x0 = clean_sample(self.cfg.prediction_type, model_output, sample, self.state.sigmas[index]);
        self.state.push(x0, self.cfg.solver_order);
        let prev = self.update(&sample.f_to_kind(Kind::Float)?, index, order);
        self.state.finish(self.cfg.solver_order);
        Ok(prev.f_to_kind(model_output.kind())?)
    }
}
