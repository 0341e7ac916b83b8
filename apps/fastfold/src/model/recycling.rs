//! How many recycling passes a prediction runs: at most `num_recycle` after the first, and,
//! as ColabFold offers (`recycle_early_stop_tolerance`, after AF2Complex), fewer once the
//! structure stops moving: the RMS change of the CA-CA distance matrix between consecutive
//! passes (ColabFold's `confidence.compute_tol`) falling below a tolerance.
use tch::{Kind, Tensor};

use crate::model::Result;

/// atom37 index of CA.
const CA: i64 = 1;

/// The recycling schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recycling {
    /// Passes after the first, at most (`num_recycle`).
    pub max: usize,
    /// Stop after a pass (not the first) whose CA distance change, Å, is below this; 0 runs
    /// every pass (ColabFold's default for monomers).
    pub early_stop_tolerance: f64,
}

/// ColabFold's `compute_tol`: `sqrt(mean over residue pairs of (d_prev - d_now)^2 + 1e-8)`,
/// with `d` the CA-CA distances of `prev` and `now` (atom37 positions [N, 37, 3]) and the mean
/// over pairs of `seq_mask` `[N]` residues. The first pass compares with all-zero positions, as
/// ColabFold's zero `prev_pos` does.
pub fn ca_distance_change(prev: &Tensor, now: &Tensor, seq_mask: &Tensor) -> Result<f64> {
    let dist = |x: &Tensor| -> Result<Tensor> {
        let ca = x.f_select(1, CA)?.f_to_kind(Kind::Double)?;
        Ok(ca.f_unsqueeze(1)?.f_sub(&ca.f_unsqueeze(0)?)?.f_square()?.f_sum_dim_intlist(-1, false, None)?.f_sqrt()?)
    };
    let sq = dist(prev)?.f_sub(&dist(now)?)?.f_square()?;
    let m = seq_mask.f_to_kind(Kind::Double)?;
    let mask_2d = m.f_unsqueeze(1)?.f_mul(&m.f_unsqueeze(0)?)?;
    let mean = sq.f_mul(&mask_2d)?.f_sum(Kind::Double)?.f_div(&mask_2d.f_sum(Kind::Double)?)?;
    Ok(mean.f_add_scalar(1e-8)?.f_sqrt()?.f_double_value(&[])?)
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    #[test]
    fn change_is_the_rms_of_the_ca_distance_change_over_real_pairs() {
        let opts = (Kind::Float, Device::Cpu);
        let prev = Tensor::zeros([3, 37, 3], opts);
        let now = Tensor::zeros([3, 37, 3], opts);
        // CA of residue 1 moves 2 Å away from the others; residue 2 is masked.
        let _ = now.get(1).get(CA).get(0).fill_(2.0);
        let mask = Tensor::from_slice(&[1f32, 1., 0.]);
        // Real pairs: (0,0) (0,1) (1,0) (1,1); two of them change by 2 Å.
        let want = (2.0 * 4.0 / 4.0 + 1e-8f64).sqrt();
        assert!((ca_distance_change(&prev, &now, &mask).unwrap() - want).abs() < 1e-9);
        assert!(ca_distance_change(&now, &now, &mask).unwrap() < 1e-3);
    }
}
