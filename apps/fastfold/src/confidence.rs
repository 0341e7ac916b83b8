//! Confidence measures from the heads' logits, as AlphaFold defines them
//! (`alphafold/common/confidence.py`): per-residue pLDDT from the lDDT head's 50 bins, the
//! predicted aligned error (PAE) from the aligned-error head's 64 bins up to 31 Å, and the
//! predicted TM-score (pTM) and AlphaFold-Multimer's interface score (ipTM) and ranking
//! confidence, plus the `<name>_confidence.json` that `fastfold predict` writes.
use std::path::Path;

use tch::{Kind, Tensor};

use crate::model::layers::chunked;
use crate::model::pair_rows::PairRows;
use crate::model::Result;

/// pLDDT in `[0, 100]` per residue: the expected value of the bin centres (`(i + 1/2) / bins`)
/// under the softmax of `logits` `[..., bins]`, times 100.
pub fn plddt(logits: &Tensor) -> Tensor {
    let bins = logits.size().last().copied().unwrap_or(1);
    let centres = (Tensor::arange(bins, (Kind::Float, logits.device())) + 0.5) / bins as f64;
    (logits.to_kind(Kind::Float).softmax(-1, Kind::Float) * centres).sum_dim_intlist(-1, false, Kind::Float) * 100.0
}

/// Bin centres of the aligned-error head: `bins - 1` breaks evenly from 0 to `max_bin` Å,
/// each bin's centre half a step above its lower break, and the last (open) bin one step above
/// the one before.
pub fn aligned_error_centres(bins: i64, max_bin: f64, device: tch::Device) -> Tensor {
    let step = max_bin / (bins - 2) as f64;
    Tensor::arange(bins, (Kind::Float, device)) * step + step / 2.0
}

/// Bytes of float32 probabilities a confidence measure makes at a time: the logits' rows are
/// taken so many at a time that their softmax and its weighted copy stay under this, where
/// whole they were two float32 copies of the logits (at 12,000 residues 37 GB each, beside the
/// logits and the pair on the device after a pass). Each row's result is computed as before,
/// so the values are the same bit for bit.
const ROWS_BYTES: i64 = 64 << 20;

/// The rows of `logits` [N, ..., bins] whose float32 copy fits `bytes` (at least one).
fn rows_at_a_time(logits: &Tensor, bytes: i64) -> i64 {
    let per_row = logits.numel() as i64 / logits.size().first().copied().unwrap_or(1).max(1) * 4;
    (bytes / per_row.max(1)).max(1)
}

/// `f(start, rows)` ([rows, ...] results) over the rows of `logits`, as many at a time as
/// `bytes` holds in float32, joined ([`chunked`]).
fn by_rows(logits: &Tensor, bytes: i64, f: impl FnMut(i64, i64) -> Result<Tensor>) -> Result<Tensor> {
    let n = logits.size().first().copied().unwrap_or(0);
    chunked(n, Some(rows_at_a_time(logits, bytes)), f)
}

/// The predicted aligned error `[N, N]` in Å (expected value of the bin centres) from the
/// aligned-error logits `[N, N, bins]` (AlphaFold: 64 bins, breaks up to 31 Å), and the
/// largest value it can take (the last centre). Rows 64 MiB of float32 at a time. Under DAP
/// inference the logits are the real rows `rows` holds (`[real, N, bins]`): each rank computes
/// its rows and the result is gathered (a collective every rank calls).
pub fn predicted_aligned_error(logits: &Tensor, rows: &PairRows, max_bin: f64) -> Result<(Tensor, f64)> {
    let (error, last) = aligned_error(logits, max_bin, ROWS_BYTES)?;
    Ok((rows.gather(&error)?, last))
}

/// [`predicted_aligned_error`], rows `bytes` of float32 at a time.
fn aligned_error(logits: &Tensor, max_bin: f64, bytes: i64) -> Result<(Tensor, f64)> {
    let bins = logits.size().last().copied().unwrap_or(2);
    let centres = aligned_error_centres(bins, max_bin, logits.device());
    let last = centres.double_value(&[bins - 1]);
    let error = by_rows(logits, bytes, |start, rows| {
        let probs = logits.f_narrow(0, start, rows)?.f_to_kind(Kind::Float)?.f_softmax(-1, Kind::Float)?;
        Ok(probs.f_mul(&centres)?.f_sum_dim_intlist(-1, false, Kind::Float)?)
    })?;
    Ok((error, last))
}

/// The predicted TM-score from the aligned-error logits `[N, N, bins]` (under DAP inference
/// the rows `rows` holds, as [`predicted_aligned_error`] takes them; a collective then): for
/// each aligned residue `i`, the mean over residues `j` of the expected TM term
/// `1 / (1 + (e / d0)^2)` with `d0 = 1.24 (max(N, 19) - 15)^(1/3) - 1.8`; the score is the best
/// `i`.
pub fn predicted_tm_score(logits: &Tensor, rows: &PairRows, max_bin: f64) -> Result<f64> {
    tm_score(logits, rows, max_bin, (None, None), ROWS_BYTES)
}

/// AlphaFold's `predicted_tm_score(logits, breaks, residue_weights, asym_id)`
/// (`alphafold/common/confidence.py`): [`predicted_tm_score`] with residues weighted by
/// `residue_weights` `[N]` (0 for padding; N in `d0` is their sum) and, with `asym_id` `[N]`, the
/// interface score (ipTM): for each `i`, the mean over residues `j` of other chains only.
/// AlphaFold-Multimer's pTM is this without `asym_id`, its ipTM with it.
///
/// DeepMind's code returns `per_alignment` at the argmax of `per_alignment * weights`, and
/// ColabFold's the maximum of that product: the same for weights of 0 and 1, the only ones
/// either pipeline passes.
///
/// The logits are `rows`' rows of them, as [`predicted_tm_score`] takes them.
pub fn predicted_tm_score_of_chains(
    logits: &Tensor,
    rows: &PairRows,
    max_bin: f64,
    residue_weights: &Tensor,
    asym_id: Option<&Tensor>,
) -> anyhow::Result<f64> {
    let (size, n) = (logits.size(), rows.residues());
    anyhow::ensure!(
        size.len() == 3 && size[..2] == [rows.real(), n],
        "aligned-error logits: expected shape [{}, {n}, bins], found {size:?}",
        rows.real()
    );
    for (what, t) in [("residue weights", Some(residue_weights)), ("asym_id", asym_id)] {
        if let Some(t) = t {
            anyhow::ensure!(t.size() == [n], "{what}: expected shape [{n}] (as the logits), found {:?}", t.size());
        }
    }
    Ok(tm_score(logits, rows, max_bin, (Some(residue_weights), asym_id), ROWS_BYTES)?)
}

/// AlphaFold-Multimer's ranking confidence, `0.8 ipTM + 0.2 pTM` (DeepMind's
/// `get_confidence_metrics` in multimer mode; ColabFold's `rank_by='multimer'` is 100 times it).
pub fn multimer_ranking_confidence(iptm: f64, ptm: f64) -> f64 {
    0.8 * iptm + 0.2 * ptm
}

/// The TM-score of [`predicted_tm_score_of_chains`] (shapes already checked), rows `bytes` of
/// float32 at a time, each aligned residue's score gathered from the ranks' rows under DAP.
fn tm_score(
    logits: &Tensor,
    rows: &PairRows,
    max_bin: f64,
    (residue_weights, asym_id): (Option<&Tensor>, Option<&Tensor>),
    bytes: i64,
) -> Result<f64> {
    let size = logits.size();
    let (n, bins, first) = (rows.residues(), size[size.len() - 1], rows.start());
    let opts = (Kind::Float, logits.device());
    let weights = match residue_weights {
        Some(w) => w.to_kind(Kind::Float),
        None => Tensor::ones([n], opts),
    };
    let clipped = weights.sum(Kind::Float).double_value(&[]).max(19.0);
    let d0 = 1.24 * (clipped - 15.0).cbrt() - 1.8;
    let centres = aligned_error_centres(bins, max_bin, logits.device());
    let tm_per_bin = ((centres / d0).square() + 1.0).reciprocal();
    // Each aligned residue's score from its row of the logits, rows a few at a time.
    let per_alignment = by_rows(logits, bytes, |start, count| {
        let probs = logits.f_narrow(0, start, count)?.f_to_kind(Kind::Float)?.f_softmax(-1, Kind::Float)?;
        let term = probs.f_mul(&tm_per_bin)?.f_sum_dim_intlist(-1, false, Kind::Float)?;
        // The residues `first + start ..` of the whole: the logits' rows are `rows`' rows.
        let aligned = |t: &Tensor| t.f_narrow(0, first + start, count);
        let mut pair_weights = aligned(&weights)?.f_unsqueeze(1)?.f_mul(&weights.f_unsqueeze(0)?)?;
        if let Some(asym) = asym_id {
            let other = aligned(asym)?.f_unsqueeze(1)?.f_ne_tensor(&asym.f_unsqueeze(0)?)?;
            pair_weights = pair_weights.f_mul(&other.f_to_kind(Kind::Float)?)?;
        }
        let normed = pair_weights.f_div(&pair_weights.f_sum_dim_intlist(-1, true, Kind::Float)?.f_add_scalar(1e-8)?)?;
        Ok(term.f_mul(&normed)?.f_sum_dim_intlist(-1, false, Kind::Float)?)
    })?;
    let per_alignment = rows.gather(&per_alignment)?;
    Ok(per_alignment.f_mul(&weights)?.f_max()?.f_double_value(&[])?)
}

/// What `<name>_confidence.json` holds.
#[derive(Debug, serde::Serialize)]
pub struct Confidence {
    /// Per-residue pLDDT.
    pub plddt: Vec<f64>,
    /// Mean pLDDT.
    pub mean_plddt: f64,
    /// Predicted TM-score (parameter sets with the aligned-error head only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ptm: Option<f64>,
    /// Predicted aligned error, Å, `[N][N]` (with the aligned-error head only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pae: Option<Vec<Vec<f64>>>,
    /// The largest value a PAE entry can take.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pae: Option<f64>,
}

impl Confidence {
    /// From the lDDT logits `[N, bins]` and, when the parameters have the aligned-error head,
    /// its logits `[N, N, bins]`, or under DAP inference the rows `rows` holds (a collective
    /// then: every rank calls it) (AlphaFold's `max_error_bin` 31 Å).
    pub fn from_logits(
        lddt_logits: &Tensor,
        aligned_error_logits: Option<&Tensor>,
        rows: &PairRows,
    ) -> anyhow::Result<Confidence> {
        let plddt = Vec::<f64>::try_from(plddt(lddt_logits).to_kind(Kind::Double).to_device(tch::Device::Cpu))?;
        let mean_plddt = plddt.iter().sum::<f64>() / plddt.len().max(1) as f64;
        let (mut ptm, mut pae, mut max_pae) = (None, None, None);
        if let Some(logits) = aligned_error_logits {
            let (error, max) = predicted_aligned_error(logits, rows, 31.0)?;
            let error = error.to_kind(Kind::Double).to_device(tch::Device::Cpu);
            pae = Some(Vec::<Vec<f64>>::try_from(error)?);
            max_pae = Some(max);
            ptm = Some(predicted_tm_score(logits, rows, 31.0)?);
        }
        Ok(Confidence { plddt, mean_plddt, ptm, pae, max_pae })
    }

    /// Writes the JSON file (atomically).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        data::write_atomic(path, |w| -> anyhow::Result<()> { Ok(serde_json::to_writer(w, self)?) })
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    fn one_hot(bins: i64, at: i64, lead: &[i64]) -> Tensor {
        let mut shape = lead.to_vec();
        shape.push(bins);
        // Large logits: the softmax puts all but ~e^-100 of the mass on `at`.
        Tensor::zeros(&shape, (Kind::Float, Device::Cpu)).index_fill(-1, &Tensor::from_slice(&[at]), 100.0)
    }

    #[test]
    fn plddt_is_the_expected_bin_centre() {
        let uniform = Tensor::zeros([3, 50], (Kind::Float, Device::Cpu));
        let p = Vec::<f64>::try_from(plddt(&uniform).to_kind(Kind::Double)).unwrap();
        assert!(p.iter().all(|&v| (v - 50.0).abs() < 1e-4), "{p:?}");
        let p = plddt(&one_hot(50, 49, &[2])).double_value(&[0]);
        assert!((p - 99.0).abs() < 1e-4, "{p}");
        let p = plddt(&one_hot(50, 0, &[2])).double_value(&[1]);
        assert!((p - 1.0).abs() < 1e-4, "{p}");
    }

    #[test]
    fn aligned_error_and_tm_score_follow_alphafold() {
        // 64 bins, breaks 0, 0.5, ..., 31: centres 0.25, 0.75, ..., 31.25, 31.75.
        let c = Vec::<f64>::try_from(aligned_error_centres(64, 31.0, Device::Cpu).to_kind(Kind::Double)).unwrap();
        assert!((c[0] - 0.25).abs() < 1e-6 && (c[62] - 31.25).abs() < 1e-5 && (c[63] - 31.75).abs() < 1e-5);
        let n = 30;
        let whole = PairRows::whole(n);
        let (pae, max) = predicted_aligned_error(&one_hot(64, 2, &[n, n]), &whole, 31.0).unwrap();
        assert!((pae.double_value(&[3, 4]) - 1.25).abs() < 1e-4 && (max - 31.75).abs() < 1e-5);
        // Every pair certain of an error of 1.25 A: pTM = 1 / (1 + (1.25 / d0)^2).
        let d0 = 1.24 * (30f64 - 15.0).cbrt() - 1.8;
        let want = 1.0 / (1.0 + (1.25 / d0).powi(2));
        let got = predicted_tm_score(&one_hot(64, 2, &[n, n]), &whole, 31.0).unwrap();
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        // Short chains use N = 19 in d0.
        let d0 = 1.24 * 4f64.cbrt() - 1.8;
        let got = predicted_tm_score(&one_hot(64, 0, &[5, 5]), &PairRows::whole(5), 31.0).unwrap();
        assert!((got - 1.0 / (1.0 + (0.25 / d0).powi(2))).abs() < 1e-5);
    }

    /// The measures rows a few at a time equal them whole, bit for bit (their memory:
    /// `tests/memory.rs`).
    #[test]
    fn measures_by_rows_equal_them_whole() {
        let (n, bins) = (300, 64);
        tch::manual_seed(5);
        let logits = Tensor::randn([n, n, bins], (Kind::Float, Device::Cpu)) * 3.0;
        let weights = Tensor::ones([n], (Kind::Float, Device::Cpu)).index_fill(0, &Tensor::from_slice(&[7i64]), 0.0);
        let asym = Tensor::arange(n, (Kind::Int64, Device::Cpu)).divide_scalar_mode(120, "floor");
        // 13 rows at a time in 1 MiB: 24 of them.
        let bytes = 1 << 20;
        assert_eq!(rows_at_a_time(&logits, bytes), 13);
        let centres = aligned_error_centres(bins, 31.0, Device::Cpu);
        let whole = (logits.softmax(-1, Kind::Float) * &centres).sum_dim_intlist(-1, false, Kind::Float);
        assert!(aligned_error(&logits, 31.0, bytes).unwrap().0.equal(&whole));
        // pTM and ipTM as the whole computation made them.
        let d0 = 1.24 * (weights.sum(Kind::Float).double_value(&[]) - 15.0).cbrt() - 1.8;
        let term = (logits.softmax(-1, Kind::Float) * ((&centres / d0).square() + 1.0).reciprocal()).sum_dim_intlist(
            -1,
            false,
            Kind::Float,
        );
        for chains in [None, Some(&asym)] {
            let mut pw = weights.unsqueeze(1) * weights.unsqueeze(0);
            if let Some(a) = chains {
                pw *= a.unsqueeze(1).ne_tensor(&a.unsqueeze(0)).to_kind(Kind::Float);
            }
            let normed = &pw / (pw.sum_dim_intlist(-1, true, Kind::Float) + 1e-8);
            let want = ((&term * normed).sum_dim_intlist(-1, false, Kind::Float) * &weights).max().double_value(&[]);
            let got = tm_score(&logits, &PairRows::whole(n), 31.0, (Some(&weights), chains), bytes).unwrap();
            assert_eq!(got, want, "chains {:?}", chains.is_some());
        }
    }

    #[test]
    fn confidence_json_has_what_the_heads_give() {
        let dir = suite_tests::scratch("fastfold", "confidence");
        let lddt = Tensor::zeros([4, 50], (Kind::Float, Device::Cpu));
        let c = Confidence::from_logits(&lddt, None, &PairRows::whole(4)).unwrap();
        c.write(&dir.join("a.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("a.json")).unwrap()).unwrap();
        assert_eq!(v["plddt"].as_array().unwrap().len(), 4);
        assert!((v["mean_plddt"].as_f64().unwrap() - 50.0).abs() < 1e-4);
        assert!(v.get("ptm").is_none() && v.get("pae").is_none());
        let c = Confidence::from_logits(&lddt, Some(&one_hot(64, 2, &[4, 4])), &PairRows::whole(4)).unwrap();
        c.write(&dir.join("b.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("b.json")).unwrap()).unwrap();
        assert_eq!(v["pae"].as_array().unwrap().len(), 4);
        assert!(v["ptm"].as_f64().unwrap() > 0.0 && (v["max_pae"].as_f64().unwrap() - 31.75).abs() < 1e-5);
    }
}
