//! AlphaFold's monomer training loss (supplementary 1.9), term by term as DeepMind's code
//! computes it, on the model's outputs and the [`crate::ground_truth::GroundTruth`] of the true
//! structure. One file per group of terms:
//!
//! - [`structure`]: the structure module's loss: backbone FAPE over every iteration (clamped or
//!   not), side-chain FAPE on the renamed ground truth, the chi and angle-norm losses.
//! - [`violations`]: the structural violations (peptide bonds, clashes, within-residue bounds)
//!   and their loss, added to the structure module's in fine-tuning.
//! - [`heads`]: the other heads' losses: distogram, masked MSA, pLDDT, experimentally resolved
//!   and predicted aligned error, and their weighted sum.
//! - [`total`]: the whole loss with the initial-training or fine-tuning weights.
//! - [`multimer`]: AlphaFold-Multimer's structure-module loss (backbone FAPE split within and
//!   between chains, violations across chains).
//! - [`multimer_total`]: AlphaFold-Multimer's whole loss on a complex, after the
//!   [`chain_permutation`] alignment puts the true chains in the prediction's order.
//!
//! Each term is checked against DeepMind's code on the same parameters and batch, values and
//! the gradient of every parameter (`tests/alphafold_loss.rs`, `tests/violations.rs`;
//! Multimer's: its value and the gradient of every predicted input, `tests/multimer_loss.rs`,
//! the structure module's alone and the whole loss).
pub mod chain_permutation;
pub mod heads;
pub mod multimer;
pub mod multimer_total;
pub mod structure;
pub mod total;
pub mod violations;

pub use heads::{head_losses, lddt_ca, HeadLossConfig, HeadLosses, MaskedMsaTarget};
pub use structure::{structure_loss, StructureLoss, StructureLossConfig};
pub use total::{clamped_fape_at, total_loss, LossConfig, LossInputs, StepLoss, TotalLoss, TrainingStage};
pub use violations::{find_structural_violations, ViolationConfig, ViolationMetrics, Violations};
