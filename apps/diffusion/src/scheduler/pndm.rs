//! PNDM (Liu et al. 2022, pseudo numerical methods) as diffusers' `PNDMScheduler`, Stable
//! Diffusion 1.x's default: a linear multistep (PLMS) method on the model's noise predictions,
//! each step the transfer of the paper's eq. 9. Unless `skip_prk_steps`, the first three steps
//! are a Runge-Kutta warm-up (four model evaluations each, at the step's start, midpoint twice
//! and end); with it (SD 1.5's file) the second evaluation repeats the first timestep, as
//! crowsonkb's PLMS sampler does. diffusers' step counter is the index of the step here.
use tch::Tensor;

use super::multistep::check_next;
use super::{same_shape, PredictionType, Scheduler, SchedulerConfig};
use crate::error::{Error, Result};

/// PNDM (see the module docs).
#[derive(Debug)]
pub struct PndmScheduler {
    cfg: SchedulerConfig,
    alphas_cumprod: Vec<f64>,
    final_alpha_cumprod: f64,
    /// Inference steps asked for (the step size is `N / steps`).
    steps: usize,
    /// The Runge-Kutta evaluations' timesteps, then the PLMS ones.
    timesteps: Vec<f64>,
    prk_len: usize,
    /// The next step (diffusers' `counter`).
    counter: usize,
    /// The noise predictions the multistep formula combines, oldest first (diffusers' `ets`).
    ets: Vec<Tensor>,
    /// The Runge-Kutta weighted sum of this step's evaluations so far.
    rk_sum: Option<Tensor>,
    /// The sample a Runge-Kutta step (or PLMS's repeated first step) starts from.
    cur_sample: Option<Tensor>,
}

impl PndmScheduler {
    /// A scheduler of `cfg` (epsilon or v-prediction); call [`Scheduler::set_timesteps`] first.
    pub fn new(cfg: SchedulerConfig) -> PndmScheduler {
        let alphas_cumprod = cfg.alphas_cumprod();
        let final_alpha_cumprod = if cfg.set_alpha_to_one { 1.0 } else { alphas_cumprod[0] };
        PndmScheduler {
            cfg,
            alphas_cumprod,
            final_alpha_cumprod,
            steps: 0,
            timesteps: Vec::new(),
            prk_len: 0,
            counter: 0,
            ets: Vec::new(),
            rk_sum: None,
            cur_sample: None,
        }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The noise predictions kept for the multistep formula, oldest first.
    pub fn ets(&self) -> &[Tensor] {
        &self.ets
    }

    /// The step size in training timesteps.
    fn ratio(&self) -> i64 {
        self.cfg.num_train_timesteps / self.steps as i64
    }

    /// The paper's eq. 9: the sample at `prev` from the one at `t` and the noise `eps` (a
    /// velocity under v-prediction, converted first).
    fn transfer(&self, sample: &Tensor, t: i64, prev: i64, eps: &Tensor) -> Result<Tensor> {
        let n = self.alphas_cumprod.len();
        let a_t = *usize::try_from(t)
            .ok()
            .and_then(|t| self.alphas_cumprod.get(t))
            .ok_or_else(|| Error::Invalid(format!("PNDM timestep {t} outside 0..{n}")))?;
        let a_prev = if prev >= 0 { self.alphas_cumprod[prev as usize] } else { self.final_alpha_cumprod };
        let b_t = 1.0 - a_t;
        let eps = match self.cfg.prediction_type {
            PredictionType::VPrediction => eps * a_t.sqrt() + sample * b_t.sqrt(),
            _ => eps.shallow_clone(),
        };
        let sample_coeff = (a_prev / a_t).sqrt();
        let eps_denom = a_t * (1.0 - a_prev).sqrt() + (a_t * b_t * a_prev).sqrt();
        Ok(sample * sample_coeff - eps * ((a_prev - a_t) / eps_denom))
    }

    /// A Runge-Kutta evaluation: the step from the group's start to its midpoint (twice) and
    /// end, with the classic 1/6, 1/3, 1/3, 1/6 weights summed over the group.
    fn step_prk(&mut self, out: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let c = self.counter;
        let half = self.ratio() / 2;
        let prev = self.timesteps[c] as i64 - if c % 2 == 1 { 0 } else { half };
        let t = self.timesteps[c / 4 * 4] as i64;
        let add = |sum: &Option<Tensor>, w: f64| match sum {
            Some(s) => s + out * w,
            None => out * w,
        };
        let eps = match c % 4 {
            0 => {
                self.rk_sum = Some(add(&self.rk_sum, 1.0 / 6.0));
                self.ets.push(out.shallow_clone());
                self.cur_sample = Some(sample.shallow_clone());
                out.shallow_clone()
            }
            1 | 2 => {
                self.rk_sum = Some(add(&self.rk_sum, 1.0 / 3.0));
                out.shallow_clone()
            }
            _ => add(&self.rk_sum.take(), 1.0 / 6.0),
        };
        let start = self.cur_sample.as_ref().unwrap_or(sample).shallow_clone();
        self.transfer(&start, t, prev, &eps)
    }

    /// A PLMS step: Adams-Bashforth on the kept noise predictions (order growing to 4); under
    /// `skip_prk_steps` the second evaluation averages the first two from the first sample.
    fn step_plms(&mut self, out: &Tensor, sample: &Tensor) -> Result<Tensor> {
        if !self.cfg.skip_prk_steps && self.ets.len() < 3 {
            return Err(Error::Invalid("PNDM: PLMS steps need the three Runge-Kutta steps first".into()));
        }
        let c = self.counter;
        let mut t = self.timesteps[c] as i64;
        let mut prev = t - self.ratio();
        if c != 1 {
            let keep = self.ets.len().saturating_sub(3);
            self.ets.drain(..keep);
            self.ets.push(out.shallow_clone());
        } else {
            prev = t;
            t += self.ratio();
        }
        let e = &self.ets;
        let k = e.len();
        let (eps, start) = match (k, c) {
            (1, 1) => {
                let start = self.cur_sample.take().unwrap_or_else(|| sample.shallow_clone());
                ((out + &e[0]) / 2.0, start)
            }
            (1, _) => {
                self.cur_sample = Some(sample.shallow_clone());
                (out.shallow_clone(), sample.shallow_clone())
            }
            (2, _) => ((&e[1] * 3.0 - &e[0]) / 2.0, sample.shallow_clone()),
            (3, _) => ((&e[2] * 23.0 - &e[1] * 16.0 + &e[0] * 5.0) / 12.0, sample.shallow_clone()),
            _ => {
                let eps = (&e[k - 1] * 55.0 - &e[k - 2] * 59.0 + &e[k - 3] * 37.0 - &e[k - 4] * 9.0) / 24.0;
                (eps, sample.shallow_clone())
            }
        };
        self.transfer(&start, t, prev, &eps)
    }
}

impl Scheduler for PndmScheduler {
    /// `steps` + 1 PLMS evaluations under `skip_prk_steps` (the second repeats the first
    /// timestep), else 12 Runge-Kutta evaluations and `steps - 3` PLMS ones (at least 4 steps).
    fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        // diffusers' `_timesteps`, ascending.
        let mut base: Vec<i64> = self.cfg.spaced_timesteps(steps, true)?.iter().map(|&t| t as i64).collect();
        base.reverse();
        let k = base.len();
        let (prk, plms): (Vec<i64>, Vec<i64>) = if self.cfg.skip_prk_steps {
            let mut plms = base[..k - 1].to_vec();
            plms.extend_from_slice(&base[k.saturating_sub(2)..k - 1]);
            plms.push(base[k - 1]);
            (Vec::new(), plms.into_iter().rev().collect())
        } else {
            if k < 4 {
                return Err(Error::Invalid(format!(
                    "PNDM's Runge-Kutta warm-up needs at least 4 steps, got {steps} (skip_prk_steps is false)"
                )));
            }
            // The largest four timesteps t0 < t1 < t2 < t3 give three groups of four evaluations:
            // t3, t2+h, t2+h, t2 | t2, t1+h, t1+h, t1 | t1, t0+h, t0+h, t0 (h half a step).
            let half = self.cfg.num_train_timesteps / steps as i64 / 2;
            let pairs: Vec<i64> = base[k - 4..].iter().flat_map(|&t| [t, t + half]).take(7).collect();
            let doubled: Vec<i64> = pairs.iter().flat_map(|&t| [t, t]).collect();
            let prk = doubled[1..doubled.len() - 1].iter().rev().copied().collect();
            (prk, base[..k - 3].iter().rev().copied().collect())
        };
        self.steps = steps;
        self.prk_len = prk.len();
        self.timesteps = prk.into_iter().chain(plms).map(|t| t as f64).collect();
        self.counter = 0;
        self.ets.clear();
        self.rk_sum = None;
        self.cur_sample = None;
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn step(
        &mut self,
        model_output: &Tensor,
        index: usize,
        sample: &Tensor,
        _noise: Option<&Tensor>,
    ) -> Result<Tensor> {
        check_next("PNDM", index, self.counter, self.timesteps.len())?;
        same_shape(model_output, sample, "PNDM model output and sample")?;
        let prev = match self.counter < self.prk_len {
            true => self.step_prk(model_output, sample)?,
            false => self.step_plms(model_output, sample)?,
        };
        self.counter += 1;
        Ok(prev)
    }
}
