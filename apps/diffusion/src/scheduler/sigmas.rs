//! Noise levels shared by the samplers: a training timestep's sigma `sqrt((1 - a) / a)`, the
//! variance-preserving `alpha_t`, `sigma_t` and log-SNR `lambda` of a sigma, Karras et al.'s
//! sigma ramp and diffusers' map back from a sigma to a timestep.
use super::config::SchedulerConfig;

/// `sqrt((1 - a) / a)` per training timestep.
pub(crate) fn train_sigmas(cfg: &SchedulerConfig) -> Vec<f64> {
    cfg.alphas_cumprod().iter().map(|a| ((1.0 - a) / a).sqrt()).collect()
}

/// numpy's `interp(t, arange(len), table)`: linear between neighbours, clamped at the ends.
pub(crate) fn interp(table: &[f64], t: f64) -> f64 {
    let last = table.len() - 1;
    let t = t.clamp(0.0, last as f64);
    let lo = (t.floor() as usize).min(last);
    let hi = (lo + 1).min(last);
    let w = t - lo as f64;
    table[lo] * (1.0 - w) + table[hi] * w
}

/// `(alpha_t, sigma_t)` of the variance-preserving process at `sigma`.
pub(crate) fn alpha_sigma(sigma: f64) -> (f64, f64) {
    let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
    (alpha, sigma * alpha)
}

/// The log signal-to-noise ratio `log(alpha_t) - log(sigma_t)` at `sigma` (infinite at 0).
pub(crate) fn lambda(sigma: f64) -> f64 {
    let (alpha, sigma) = alpha_sigma(sigma);
    alpha.ln() - sigma.ln()
}

/// Karras et al. (2022), eq. 5 with rho 7: `steps` sigmas from `max` down to `min`.
pub(crate) fn karras(min: f64, max: f64, steps: usize) -> Vec<f64> {
    let (lo, hi) = (min.powf(1.0 / 7.0), max.powf(1.0 / 7.0));
    let ramp = |i: usize| if steps > 1 { i as f64 / (steps - 1) as f64 } else { 0.0 };
    (0..steps).map(|i| (hi + ramp(i) * (lo - hi)).powi(7)).collect()
}

/// diffusers' `_sigma_to_t`: the fractional training timestep whose log-sigma, interpolated
/// linearly in `log_sigmas` (ascending), is `log(sigma)`; clamped to the table.
pub(crate) fn sigma_to_t(sigma: f64, log_sigmas: &[f64]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    let n = log_sigmas.len();
    // The last index whose log-sigma is at most log(sigma) (0 below the table), at most n - 2.
    let low = log_sigmas.iter().rposition(|&l| log_sigma - l >= 0.0).unwrap_or(0).min(n - 2);
    let (l, h) = (log_sigmas[low], log_sigmas[low + 1]);
    let w = ((l - log_sigma) / (l - h)).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * (low + 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigma_to_t_inverts_the_table_and_clamps() {
        let log_sigmas: Vec<f64> = [0.1f64, 0.2, 0.4, 0.8].iter().map(|s| s.ln()).collect();
        assert!((sigma_to_t(0.2, &log_sigmas) - 1.0).abs() < 1e-12);
        // Halfway in log space between 0.2 and 0.4.
        assert!((sigma_to_t((0.2f64 * 0.4).sqrt(), &log_sigmas) - 1.5).abs() < 1e-12);
        assert_eq!(sigma_to_t(0.01, &log_sigmas), 0.0);
        assert_eq!(sigma_to_t(5.0, &log_sigmas), 3.0);
    }

    #[test]
    fn karras_spans_the_range() {
        let s = karras(0.1, 10.0, 5);
        assert!((s[0] - 10.0).abs() < 1e-12 && (s[4] - 0.1).abs() < 1e-12);
        assert!(s.windows(2).all(|w| w[0] > w[1]));
        assert!(lambda(0.0).is_infinite() && lambda(1.0).abs() < 1e-12);
    }
}
