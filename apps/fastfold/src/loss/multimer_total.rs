//! AlphaFold-Multimer's whole training loss on one complex: the true chains first put in the
//! prediction's order ([`super::chain_permutation`], supplement 7.3), then each head's loss
//! times the weight DeepMind's Multimer config gives it (`model/config.py`, `CONFIG_MULTIMER`'s
//! `heads`), summed as `AlphaFoldIteration` sums the heads that have a weight:
//!
//! `loss = structure module (Multimer's, violations included) + 0.3 distogram + 2 masked MSA
//!        + 0.01 pLDDT + 0.01 experimentally resolved + 0.1 predicted aligned error`
//!
//! The structure module's term is [`super::multimer::multimer_structure_loss`]; the other heads'
//! are the monomer's ([`super::heads`]): `modules_multimer.AlphaFoldIteration` builds those heads
//! from the monomer's `modules` (`DistogramHead`, `MaskedMsaHead`, `PredictedLDDTHead`,
//! `ExperimentallyResolvedHead`, `PredictedAlignedErrorHead`), so their losses are the same
//! functions. Multimer's masked-MSA head has 22 classes, not 23; the loss reads the width from
//! the logits. There is no clamped/unclamped draw: Multimer clamps the intra-chain FAPE always
//! and the interface FAPE never. The confidence terms train only on structures solved at 0.1 to
//! 3 Å, as in the monomer.
use tch::{Kind, Tensor};

use super::chain_permutation::{align_crop, chain_runs, chains, crop_residue_order, places_in_chains};
use super::heads::{head_losses, HeadLossConfig, HeadLosses, MaskedMsaTarget};
use super::multimer::{multimer_structure_loss, MultimerStructureLoss, MultimerStructureLossConfig};
use crate::ground_truth::GroundTruth;
use crate::model::heads::HeadOutputs;
use crate::model::structure::StructureOutput;
use crate::model::Result;
use crate::residue_constants::atom_order;

/// Every weight of Multimer's training loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultimerLossConfig {
    /// The structure module's terms (`heads.structure_module`).
    pub structure: MultimerStructureLossConfig,
    /// `heads.structure_module.weight` (1).
    pub structure_weight: f64,
    /// The other heads' weights and resolution range.
    pub heads: HeadLossConfig,
}

impl Default for MultimerLossConfig {
    /// AlphaFold-Multimer v2.3's config: its heads' weights are the monomer's pTM fine-tuning
    /// weights (distogram 0.3, masked MSA 2, pLDDT 0.01, experimentally resolved 0.01, aligned
    /// error 0.1, resolution 0.1-3 Å), which [`HeadLossConfig::default`] holds.
    fn default() -> Self {
        MultimerLossConfig {
            structure: MultimerStructureLossConfig::default(),
            structure_weight: 1.0,
            heads: HeadLossConfig::default(),
        }
    }
}

/// What Multimer's loss reads of a complex beside the prediction.
pub struct ComplexLossInputs<'a> {
    /// The true structure, its chains laid out as the features' (chain `k` of the truth has the
    /// residues of the features' chain `k`); copies of an entity are interchangeable, and the
    /// loss puts them in the prediction's order.
    pub truth: &'a GroundTruth,
    /// The masked-MSA objective's targets (the trained pass's sampled MSA).
    pub msa: MaskedMsaTarget<'a>,
    /// Chain of each residue `[N]` (`asym_id`).
    pub asym_id: &'a Tensor,
    /// Entity of each residue `[N]` (`entity_id`).
    pub entity_id: &'a Tensor,
    /// Residue numbers `[N]`, from 0 in each chain.
    pub residue_index: &'a Tensor,
    /// 1 for the real residues `[N]`.
    pub seq_mask: &'a Tensor,
    /// The structure's resolution (Å; 0 for none: no confidence terms).
    pub resolution: f64,
    /// When the prediction is of a crop of the complex: the whole complex's chains, by which
    /// `truth` (then the whole truth) is laid out; each predicted residue is compared with the
    /// residue of its number (`residue_index`) in the true chain assigned to its chain.
    pub whole: Option<WholeChains<'a>>,
}

/// The whole complex's chains, for a prediction of a crop of it.
#[derive(Clone, Copy)]
pub struct WholeChains<'a> {
    /// Chain of each residue of the whole complex `[M]`.
    pub asym_id: &'a Tensor,
    /// Entity of each residue of the whole complex `[M]`.
    pub entity_id: &'a Tensor,
}

/// The total and its terms (scalars, fp32).
#[derive(Debug)]
pub struct MultimerTotalLoss {
    /// The weighted sum.
    pub total: Tensor,
    /// The structure module's loss and its terms.
    pub structure: MultimerStructureLoss,
    /// The other heads' losses.
    pub heads: HeadLosses,
    /// For each predicted chain, the true chain it was compared with (indices into the chains
    /// in residue order).
    pub assignment: Vec<usize>,
    /// The truth as compared, when it is not `inputs.truth` as given: its chains in the
    /// prediction's order and, for a crop, the crop's residues (what a metric such as lDDT
    /// compares the prediction with).
    pub aligned_truth: Option<GroundTruth>,
}

/// Multimer's training loss of the structure module's output `structure` and the heads'
/// logits `heads` against `inputs`, with `cfg`'s weights.
pub fn multimer_total_loss(
    heads: &HeadOutputs,
    structure: &StructureOutput,
    inputs: &ComplexLossInputs,
    cfg: &MultimerLossConfig,
) -> Result<MultimerTotalLoss> {
    let (aligned, assignment) = aligned_truth(structure, inputs)?;
    let truth = aligned.as_ref().unwrap_or(inputs.truth);
    let s = multimer_structure_loss(
        structure,
        truth,
        inputs.seq_mask,
        inputs.residue_index,
        inputs.asym_id,
        &cfg.structure,
    )?;
    let h = head_losses(heads, structure, &inputs.msa, truth, inputs.resolution, &cfg.heads)?;
    let total = s.loss.f_mul_scalar(cfg.structure_weight)?.f_add(&h.loss)?;
    Ok(MultimerTotalLoss { total, structure: s, heads: h, assignment, aligned_truth: aligned })
}

/// The truth with its chains in the prediction's order (none when that is the order it has)
/// and the assignment chosen, from the predicted Cα atoms (no gradient through the choice).
fn aligned_truth(structure: &StructureOutput, inputs: &ComplexLossInputs) -> Result<(Option<GroundTruth>, Vec<usize>)> {
    let truth = inputs.truth;
    let (pred_chains, truth_chains, places) = match inputs.whole {
        None => {
            let list = chains(inputs.asym_id, inputs.entity_id)?;
            let places = places_in_chains(&list);
            (list.clone(), list, places)
        }
        Some(w) => {
            let numbers: Vec<i64> =
                Vec::try_from(inputs.residue_index.f_to_kind(Kind::Int64)?.f_to_device(tch::Device::Cpu)?)?;
            let places = numbers.iter().map(|&r| usize::try_from(r).unwrap_or(usize::MAX)).collect();
            (chain_runs(inputs.asym_id, inputs.entity_id)?, chains(w.asym_id, w.entity_id)?, places)
        }
    };
    let ca = atom_order("CA").unwrap_or(1) as i64;
    let assignment = tch::no_grad(|| {
        let pred = structure.atom37.f_detach()?.f_to_kind(Kind::Float)?.f_select(1, ca)?;
        let mask = truth.all_atom_mask.f_select(1, ca)?;
        align_crop(&pred_chains, &truth_chains, &places, &pred, &truth.all_atom_positions.f_select(1, ca)?, &mask)
    })?;
    if inputs.whole.is_none() && assignment.iter().enumerate().all(|(p, &t)| p == t) {
        return Ok((None, assignment));
    }
    let order = crop_residue_order(&pred_chains, &truth_chains, &places, &assignment);
    let rows = Tensor::from_slice(&order).f_to_device(truth.aatype.device())?;
    let pick = |t: &Tensor| t.f_index_select(0, &rows);
    let reordered =
        GroundTruth::new(&pick(&truth.aatype)?, &pick(&truth.all_atom_positions)?, &pick(&truth.all_atom_mask)?)?;
    Ok((Some(reordered), assignment))
}
