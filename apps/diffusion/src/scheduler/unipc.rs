//! UniPC (Zhao et al. 2023) as diffusers' `UniPCMultistepScheduler`: a multistep predictor
//! (UniP) on clean-sample predictions (or noise predictions without `predict_x0`), each step
//! first correcting the sample it starts from with the new model output (UniC) unless the step
//! is listed in `disable_corrector`. The coefficients solve the order conditions in log-SNR
//! with `B(h) = h` (bh1) or `e^h - 1` (bh2, the default); order 2 is the default, lowered while
//! the history fills and, with `lower_order_final`, in the last steps. Sigmas as DPM-Solver's
//! (Karras sigmas end at the ramp's own minimum under `final_sigmas_type="sigma_min"`).
//!
//! At the step to sigma 0, diffusers 0.42.1 multiplies 0 by infinity under bh1 and noise
//! prediction (NaN); this takes that step's limit, the clean-sample prediction.
use tch::Tensor;

use super::multistep::{clean_sample, noise, Multistep, MultistepSchedule};
use super::sigmas::{alpha_sigma, lambda, train_sigmas};
use super::{Scheduler, SchedulerConfig, SolverType};
use crate::error::{Error, Result};

/// UniPC (see the module docs).
#[derive(Debug)]
pub struct UniPcMultistepScheduler {
    cfg: SchedulerConfig,
    train_sigmas: Vec<f64>,
    /// The schedule and the converted outputs of the last `solver_order` steps.
    state: Multistep,
    /// The sample the last predictor started from (what the corrector revises).
    last_sample: Option<Tensor>,
    /// The last predictor's order (the corrector's).
    this_order: usize,
}

/// The order conditions of one update: `R rho = b` over the history's log-SNR offsets.
struct Conditions {
    /// `e^hh - 1`, `hh` being `-h` predicting clean samples, else `h`.
    h_phi_1: f64,
    /// `B(h)`.
    b_h: f64,
    r: Vec<Vec<f64>>,
    b: Vec<f64>,
}

impl UniPcMultistepScheduler {
    /// A scheduler of `cfg`; call [`Scheduler::set_timesteps`] before stepping.
    pub fn new(cfg: SchedulerConfig) -> UniPcMultistepScheduler {
        let train_sigmas = train_sigmas(&cfg);
        UniPcMultistepScheduler { cfg, train_sigmas, state: Multistep::default(), last_sample: None, this_order: 0 }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The converted model outputs the next step combines, oldest first.
    pub fn model_outputs(&self) -> &[Tensor] {
        &self.state.outputs
    }

    /// The sample the last predictor started from.
    pub fn last_sample(&self) -> Option<&Tensor> {
        self.last_sample.as_ref()
    }

    /// The conditions of an update of order `p` with log-SNR step `h` and the history offsets
    /// `rks` (`(lambda_i - lambda_s0) / h` of the `p - 1` earlier outputs).
    fn conditions(&self, h: f64, rks: &[f64], p: usize) -> Conditions {
        let hh = if self.cfg.predict_x0 { -h } else { h };
        let h_phi_1 = hh.exp_m1();
        let b_h = if self.cfg.solver_type == SolverType::Bh1 { hh } else { h_phi_1 };
        let rks: Vec<f64> = rks.iter().copied().chain([1.0]).collect();
        let (mut r, mut b) = (Vec::with_capacity(p), Vec::with_capacity(p));
        let (mut h_phi_k, mut factorial) = (h_phi_1 / hh - 1.0, 1.0);
        for i in 1..=p {
            r.push(rks.iter().map(|x| x.powi(i as i32 - 1)).collect());
            b.push(h_phi_k * factorial / b_h);
            factorial *= (i + 1) as f64;
            h_phi_k = h_phi_k / hh - 1.0 / factorial;
        }
        Conditions { h_phi_1, b_h, r, b }
    }

    /// The history's offsets `r_k` and divided differences `(m_k - m0) / r_k` for an update of
    /// order `p` from sigma `from`, the newest output `m0` taken there and `m_k` at `from - k`.
    fn differences(&self, from: usize, h: f64, p: usize) -> (Vec<f64>, Vec<Tensor>) {
        let m = &self.state.outputs;
        let m0 = &m[m.len() - 1];
        let lambda_s0 = lambda(self.state.sigmas[from]);
        (1..p)
            .map(|k| {
                let rk = (lambda(self.state.sigmas[from - k]) - lambda_s0) / h;
                (rk, (&m[m.len() - 1 - k] - m0) / rk)
            })
            .unzip()
    }

    /// `x` carried from sigma `from` to `to` by the first-order (exponential-integrator) step
    /// on the newest output, and the factor of its higher-order terms.
    fn first_order(&self, x: &Tensor, from: usize, to: usize, c: &Conditions) -> (Tensor, f64) {
        let m0 = &self.state.outputs[self.state.outputs.len() - 1];
        let ((alpha_s0, sigma_s0), (alpha_t, sigma_t)) =
            (alpha_sigma(self.state.sigmas[from]), alpha_sigma(self.state.sigmas[to]));
        if self.cfg.predict_x0 {
            (x * (sigma_t / sigma_s0) - m0 * (alpha_t * c.h_phi_1), alpha_t * c.b_h)
        } else {
            // sigma_t (e^h - 1) = alpha_t sigma_s0 / alpha_s0 - sigma_t, finite at sigma_t 0.
            let eps_coeff = alpha_t * sigma_s0 / alpha_s0 - sigma_t;
            (x * (alpha_t / alpha_s0) - m0 * eps_coeff, sigma_t * c.b_h)
        }
    }

    /// UniP of order `p` from sigma `index` to `index + 1`.
    fn predict(&self, x: &Tensor, index: usize, p: usize) -> Result<Tensor> {
        let h = lambda(self.state.sigmas[index + 1]) - lambda(self.state.sigmas[index]);
        if h.is_infinite() && p > 1 {
            return Err(Error::Invalid(format!("UniPC: an order-{p} step to sigma 0 diverges")));
        }
        let (rks, d1s) = self.differences(index, h, p);
        let c = self.conditions(h, &rks, p);
        let (x_t, scale) = self.first_order(x, index, index + 1, &c);
        if d1s.is_empty() {
            return Ok(x_t);
        }
        let rhos = match p {
            2 => vec![0.5],
            _ => solve(c.r[..p - 1].iter().map(|row| row[..p - 1].to_vec()).collect(), c.b[..p - 1].to_vec())?,
        };
        Ok(x_t - combine(&rhos, &d1s) * scale)
    }

    /// UniC of order `p`: the sample at sigma `index` revised with its own model output `m_t`.
    fn correct(&self, m_t: &Tensor, last: &Tensor, index: usize, p: usize) -> Result<Tensor> {
        let h = lambda(self.state.sigmas[index]) - lambda(self.state.sigmas[index - 1]);
        let (rks, d1s) = self.differences(index - 1, h, p);
        let c = self.conditions(h, &rks, p);
        let rhos = match p {
            1 => vec![0.5],
            _ => solve(c.r.clone(), c.b.clone())?,
        };
        let (x_t, scale) = self.first_order(last, index - 1, index, &c);
        let m0 = &self.state.outputs[self.state.outputs.len() - 1];
        let mut res = (m_t - m0) * rhos[p - 1];
        if !d1s.is_empty() {
            res += combine(&rhos[..p - 1], &d1s);
        }
        Ok(x_t - res * scale)
    }
}

/// `sum_k w_k t_k`.
fn combine(weights: &[f64], tensors: &[Tensor]) -> Tensor {
    let mut terms = weights.iter().zip(tensors).map(|(w, t)| t * *w);
    let first = terms.next().expect("at least one term");
    terms.fold(first, |acc, t| acc + t)
}

/// Solves the small system `a x = b` by Gaussian elimination with partial pivoting.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Result<Vec<f64>> {
    let n = b.len();
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs())).unwrap_or(col);
        if a[pivot][col] == 0.0 || a[pivot][col].is_nan() {
            return Err(Error::Invalid("UniPC: the order conditions are singular (repeated sigmas?)".into()));
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (done, rest) = a.split_at_mut(col + 1);
        let p = &done[col];
        for (r, row) in rest.iter_mut().enumerate() {
            let f = row[col] / p[col];
            row[col..].iter_mut().zip(&p[col..]).for_each(|(x, y)| *x -= f * y);
            b[col + 1 + r] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for row in (0..n).rev() {
        let s: f64 = (row + 1..n).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    Ok(x)
}

impl Scheduler for UniPcMultistepScheduler {
    fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        let how =
            MultistepSchedule { last: self.cfg.num_train_timesteps, truncate_cosine: false, karras_own_min: true };
        self.state.reset(&self.cfg, &self.train_sigmas, steps, how)?;
        self.last_sample = None;
        self.this_order = 0;
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.state.timesteps
    }

    /// One sigma per timestep, then the final sigma.
    fn sigmas(&self) -> &[f64] {
        &self.state.sigmas
    }

    /// Corrects `sample` with the new output (UniC), then predicts the next one (UniP).
    fn step(
        &mut self,
        model_output: &Tensor,
        index: usize,
        sample: &Tensor,
        _noise: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.state.begin("UniPC", index, model_output, sample)?;
        let steps = self.state.timesteps.len();
        let (kind, sigma) = (self.cfg.prediction_type, self.state.sigmas[index]);
        let m_t = match self.cfg.predict_x0 {
            true => clean_sample(kind, model_output, sample, sigma),
            false => noise(kind, model_output, sample, sigma),
        };
        let corrector_on = index > 0 && !self.cfg.disable_corrector.contains(&(index as i64 - 1));
        let sample = match (&self.last_sample, corrector_on) {
            (Some(last), true) => self.correct(&m_t, last, index, self.this_order)?,
            _ => sample.shallow_clone(),
        };
        let order = self.cfg.solver_order;
        self.state.push(m_t, order);
        let this_order = if self.cfg.lower_order_final { order.min(steps - index) } else { order };
        self.this_order = this_order.min(self.state.lower_order_nums + 1);
        let prev = self.predict(&sample, index, self.this_order)?;
        self.last_sample = Some(sample);
        self.state.finish(order);
        Ok(prev)
    }
}
