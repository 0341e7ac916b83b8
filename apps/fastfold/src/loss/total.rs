//! AlphaFold's whole monomer training loss (supplementary 1.9, equation 7; DeepMind's
//! `AlphaFoldIteration`, which sums each head's `loss` times its weight) and the two training
//! stages' weights:
//!
//! `loss = structure module (FAPE, chi, angle norm, + violation_weight * violations)
//!        + 0.3 distogram + 2 masked MSA + 0.01 pLDDT
//!        + experimentally_resolved_weight * experimentally resolved + aligned_error_weight * PAE`
//!
//! | | initial training | fine-tuning |
//! |---|---|---|
//! | structural violations | 0 | 1 |
//! | experimentally resolved | 0 | 0.01 |
//! | predicted aligned error (pTM models) | 0 | 0.1 |
//! | crop, MSA clusters, extra MSA rows | 256, 128, 1024 | 384, 512, 5120 |
//! | learning rate | 1e-3 | 5e-4 |
//!
//! (supplementary Table 4, 1.9.7; OpenFold's `initial_training` and `finetuning` presets).
//! Backbone FAPE is clamped in 90% of the examples in both stages (1.11.5).
use tch::Tensor;

use super::heads::{head_losses, HeadLossConfig, MaskedMsaTarget};
use super::structure::{structure_loss, StructureLossConfig};
use super::violations::{find_structural_violations, ViolationConfig, ViolationMetrics};
use crate::ground_truth::GroundTruth;
use crate::model::alphafold::Pass;
use crate::model::Result;

/// AlphaFold's two training stages (supplementary Table 4), named as OpenFold's presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrainingStage {
    /// Training from random parameters: no violation and no experimentally-resolved term.
    #[value(name = "initial_training")]
    InitialTraining,
    /// Fine-tuning a trained model: every term (the released parameters' config).
    #[value(name = "finetuning")]
    Finetuning,
}

impl TrainingStage {
    /// The stage's loss weights.
    pub fn loss(self) -> LossConfig {
        match self {
            TrainingStage::InitialTraining => LossConfig::initial_training(),
            TrainingStage::Finetuning => LossConfig::finetuning(),
        }
    }

    /// Residues a training example is cropped to (256, 384).
    pub fn crop_size(self) -> usize {
        self.pick(256, 384)
    }

    /// MSA cluster centres (128, 512).
    pub fn max_msa_clusters(self) -> usize {
        self.pick(128, 512)
    }

    /// Extra MSA rows (1024, 5120).
    pub fn max_extra_msa(self) -> usize {
        self.pick(1024, 5120)
    }

    /// The learning rate after warm-up (1e-3, 5e-4).
    pub fn learning_rate(self) -> f64 {
        match self {
            TrainingStage::InitialTraining => 1e-3,
            TrainingStage::Finetuning => 5e-4,
        }
    }

    fn pick(self, initial: usize, finetuning: usize) -> usize {
        match self {
            TrainingStage::InitialTraining => initial,
            TrainingStage::Finetuning => finetuning,
        }
    }
}

/// Every weight and setting of the training loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    /// The structure module's terms (FAPE, chi, angle norm).
    pub structure: StructureLossConfig,
    /// The other heads' weights and the confidence heads' resolution range.
    pub heads: HeadLossConfig,
    /// The violation checks' tolerances.
    pub violation: ViolationConfig,
    /// `structural_violation_loss_weight` (0 in initial training, 1 in fine-tuning).
    pub violation_weight: f64,
    /// `structure_module.weight` (1).
    pub structure_weight: f64,
    /// The fraction of examples whose backbone FAPE is clamped (0.9).
    pub clamped_fape_fraction: f64,
}

impl LossConfig {
    /// Initial training: violations, experimentally resolved and aligned error weigh 0.
    pub fn initial_training() -> LossConfig {
        let heads = HeadLossConfig { experimentally_resolved: 0.0, aligned_error: 0.0, ..HeadLossConfig::default() };
        LossConfig { heads, violation_weight: 0.0, ..LossConfig::finetuning() }
    }

    /// Fine-tuning, AlphaFold's released config (`model/config.py`; the pTM models' aligned
    /// error 0.1): violations 1, experimentally resolved 0.01.
    pub fn finetuning() -> LossConfig {
        LossConfig {
            structure: StructureLossConfig::default(),
            heads: HeadLossConfig::default(),
            violation: ViolationConfig::default(),
            violation_weight: 1.0,
            structure_weight: 1.0,
            clamped_fape_fraction: 0.9,
        }
    }
}

/// What the loss reads beside the model's pass: the truth and the example's own features.
pub struct LossInputs<'a> {
    /// The true structure's ground truth.
    pub truth: &'a GroundTruth,
    /// The masked-MSA objective's targets (the trained pass's).
    pub msa: MaskedMsaTarget<'a>,
    /// 1 for the real residues `[N]`.
    pub seq_mask: &'a Tensor,
    /// Residue numbers `[N]` (the peptide-bond checks join consecutive numbers).
    pub residue_index: &'a Tensor,
    /// The structure's resolution (Å; 0 for NMR and distillation): the confidence terms train
    /// only between 0.1 and 3 Å.
    pub resolution: f64,
    /// Whether backbone FAPE is clamped in this example.
    pub clamped: bool,
}

/// The total and every term (scalars, fp32).
#[derive(Debug)]
pub struct TotalLoss {
    /// The weighted sum.
    pub total: Tensor,
    /// The structure module's loss, violations included at their weight.
    pub structure: Tensor,
    /// Its terms.
    pub structure_terms: super::StructureLoss,
    /// The violation loss (before its weight).
    pub violation: Tensor,
    /// The fractions of residues with violations.
    pub violation_metrics: ViolationMetrics,
    /// The other heads' losses (their weighted sum in `heads.loss`).
    pub heads: super::HeadLosses,
}

/// The training loss of `pass` on `inputs` with `cfg`'s weights.
pub fn total_loss(pass: &Pass, inputs: &LossInputs, cfg: &LossConfig) -> Result<TotalLoss> {
    let s = &pass.structure;
    let terms = structure_loss(s, inputs.truth, inputs.seq_mask, inputs.clamped, &cfg.structure)?;
    // Without weight the violations are only measured: no graph through them, and nothing of
    // theirs (not even a NaN) reaches the loss, as AlphaFold leaves them out.
    let weighted = cfg.violation_weight != 0.0;
    let find = |atom14: &Tensor| {
        find_structural_violations(atom14, &inputs.truth.aatype, inputs.residue_index, None, &cfg.violation)
    };
    let violations = if weighted { find(&s.atom14)? } else { tch::no_grad(|| find(&s.atom14.f_detach()?))? };
    let violation = violations.loss()?;
    let violation_metrics = violations.metrics(&s.atom14, inputs.residue_index, inputs.seq_mask)?;
    let structure = match weighted {
        true => terms.loss.f_add(&violation.f_mul_scalar(cfg.violation_weight)?)?,
        false => terms.loss.shallow_clone(),
    };
    let heads = head_losses(&pass.heads, s, &inputs.msa, inputs.truth, inputs.resolution, &cfg.heads)?;
    let total = structure.f_mul_scalar(cfg.structure_weight)?.f_add(&heads.loss)?;
    Ok(TotalLoss { total, structure, structure_terms: terms, violation, violation_metrics, heads })
}

/// Whether training step `step` of a run seeded `seed` clamps backbone FAPE: a uniform draw
/// from the two (SplitMix64 of their combination) below `fraction`, the same on every rank
/// and in every rerun.
pub fn clamped_fape_at(seed: u64, step: u64, fraction: f64) -> bool {
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(step).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 11) as f64 / (1u64 << 53) as f64) < fraction
}

/// The values of a step's loss terms (AlphaFold's names in the comments), as `fastfold train`'s
/// log records them (the mean over the step's examples).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepLoss {
    /// The weighted total.
    pub loss: f64,
    /// Backbone FAPE averaged over the structure module's iterations, clamped or not.
    pub fape: f64,
    /// Whether backbone FAPE was clamped in this step.
    pub clamped: bool,
    /// Side-chain FAPE (`sidechain_fape`).
    pub sidechain_fape: f64,
    /// The chi loss (`chi_loss`).
    pub chi: f64,
    /// The angle-norm loss (`angle_norm_loss`).
    pub angle_norm: f64,
    /// The structural-violation loss before its weight.
    pub violation: f64,
    /// Distogram cross-entropy.
    pub distogram: f64,
    /// Masked-MSA cross-entropy.
    pub masked_msa: f64,
    /// pLDDT cross-entropy (0 outside the resolution range).
    pub plddt: f64,
    /// Experimentally-resolved cross-entropy (0 outside the resolution range).
    pub experimentally_resolved: f64,
    /// Aligned-error cross-entropy, with the aligned-error head.
    pub aligned_error: Option<f64>,
}

impl StepLoss {
    /// The values of the total, the structure module's terms `[fape, sidechain_fape, chi,
    /// angle_norm, violation]` (scalars), whether backbone FAPE was `clamped`, and `heads`'
    /// terms.
    pub fn of(total: &Tensor, structure: [&Tensor; 5], clamped: bool, heads: &super::HeadLosses) -> StepLoss {
        let v = |t: &Tensor| t.double_value(&[]);
        let [fape, sidechain_fape, chi, angle_norm, violation] = structure.map(v);
        StepLoss {
            loss: v(total),
            fape,
            clamped,
            sidechain_fape,
            chi,
            angle_norm,
            violation,
            distogram: v(&heads.distogram),
            masked_msa: v(&heads.masked_msa),
            plddt: v(&heads.plddt),
            experimentally_resolved: v(&heads.experimentally_resolved),
            aligned_error: heads.aligned_error.as_ref().map(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stages_differ_where_table_4_says() {
        let (a, b) = (LossConfig::initial_training(), LossConfig::finetuning());
        assert_eq!((a.violation_weight, a.heads.experimentally_resolved, a.heads.aligned_error), (0.0, 0.0, 0.0));
        assert_eq!((b.violation_weight, b.heads.experimentally_resolved, b.heads.aligned_error), (1.0, 0.01, 0.1));
        assert_eq!(LossConfig { violation_weight: 1.0, heads: b.heads, ..a }, b, "nothing else differs");
        assert_eq!((a.heads.distogram, a.heads.masked_msa, a.heads.plddt), (0.3, 2.0, 0.01));
        assert_eq!(a.clamped_fape_fraction, 0.9);
        let s = TrainingStage::Finetuning;
        assert_eq!((s.crop_size(), s.max_msa_clusters(), s.max_extra_msa()), (384, 512, 5120));
        assert_eq!(TrainingStage::InitialTraining.loss(), a);
    }

    #[test]
    fn fape_is_clamped_in_nine_steps_of_ten_deterministically() {
        let clamped = (1..=10_000).filter(|&s| clamped_fape_at(7, s, 0.9)).count();
        assert!((8_850..=9_150).contains(&clamped), "{clamped} of 10000 steps clamped");
        let run = |seed| (1..=50).map(|s| clamped_fape_at(seed, s, 0.9)).collect::<Vec<_>>();
        assert_eq!(run(7), run(7), "the same seed gives the same steps");
        assert_ne!(run(7), run(8), "another seed gives other steps");
        assert!((1..=100).all(|s| clamped_fape_at(3, s, 1.0)) && (1..=100).all(|s| !clamped_fape_at(3, s, 0.0)));
    }
}
