//! `fastfold train`'s periodic validation on held-out chains (`--val-mmcif-dir`,
//! `--val-alignment-dir`, in OpenFold's layout like the training chains), as OpenFold
//! validates with `--val_data_dir` and `--val_alignment_dir`: lDDT-Cα of the last pass and
//! every loss term, their means over the chains, with the moving average of the weights when
//! one is kept (what AlphaFold and OpenFold evaluate), without gradients.
//!
//! Each chain is prepared once, before the first step, by the eval pipeline: no MSA block
//! deletion, no templates, `--val-recycles` recycling passes (AlphaFold's eval: 3), the whole
//! chain (or, with `--val-crop-size`, a crop of it drawn once from the seed and the chain's
//! place in the list), the MSA sampling and masking drawn from the seed and that place. The
//! same weights then give the same result every time.
//!
//! With AlphaFold-Multimer's parameters the held-out set is of complexes
//! ([`Validation::open_complexes`]): each entry of the held-out layout is one complex of its
//! protein chains, selected and read as the training set of complexes is
//! ([`crate::train_data::complexes`]), without templates. Each complex is evaluated by the
//! forward and loss that train it ([`crate::train::Trainer::evaluate`]) with `--val-recycles`
//! passes, as example number (its place in the list + 1): the network samples its MSA from the
//! key of the seed and that number, and with `--val-crop-size` the crop is the one training
//! draws for that number ([`crate::complex_crop`]), so again the same weights give the same
//! result every time. lDDT-Cα is over all the complex's chains, against the truth as the chain
//! permutation alignment laid it out; the loss terms are Multimer's. The record is the same
//! for both: `val_chains` then counts complexes.
//!
//! Under DAP the ranks of a group compute each chain together; every group (every
//! data-parallel replica) validates every chain, in the same order, so that no collective
//! beyond the model's own is needed and every rank holds the same result: the validation set
//! is small next to training, and this keeps its record identical whatever the layout of ranks.
//! Complexes are validated the same way.
use std::path::{Path, PathBuf};

use anyhow::Context;
use tch::Device;

use crate::loss::StepLoss;
use crate::train_data::args::TrainDataArgs;
use crate::train_data::complexes::{select_complexes_as, LoadedComplex};
use crate::train_data::example::{load, prepare_with_recycles, Pipeline, Prepared};
use crate::train_data::layout;
use crate::train_data::transforms::BlockDeletion;
use crate::train_target::{layout_example, EvalExample, Example};

/// Validation options of `fastfold train`.
#[derive(clap::Args, Debug, Clone)]
pub struct ValArgs {
    /// Held-out chains' mmCIF entries (OpenFold's `--val_data_dir`), validated after the last
    /// step and every --val-every steps; the training filters apply but --train-list. With
    /// AlphaFold-Multimer's parameters each entry is one complex of its protein chains.
    #[arg(long, requires = "val_alignment_dir")]
    pub val_mmcif_dir: Option<PathBuf>,
    /// The held-out chains' alignments, one folder per chain (OpenFold's `--val_alignment_dir`).
    #[arg(long, requires = "val_mmcif_dir")]
    pub val_alignment_dir: Option<PathBuf>,
    /// Validate every this many steps (and after the last).
    #[arg(long, requires = "val_mmcif_dir", value_parser = engine::parse::count(1..))]
    pub val_every: Option<usize>,
    /// Validate on the first this many chains (complexes, with AlphaFold-Multimer) in name
    /// order only.
    #[arg(long, requires = "val_mmcif_dir", value_parser = engine::parse::count(1..))]
    pub val_max_chains: Option<usize>,
    /// Recycling passes before the evaluated one (AlphaFold's eval: 3).
    #[arg(long, default_value_t = 3, value_parser = engine::parse::count(0..=crate::input::MAX_RECYCLES))]
    pub val_recycles: usize,
    /// Evaluate a fixed crop of this many residues of longer chains (default: whole chains); a
    /// complex takes training's crop of it (contiguous or spatial), drawn once.
    #[arg(long, requires = "val_mmcif_dir", value_parser = engine::parse::count(1..))]
    pub val_crop_size: Option<usize>,
}

/// One validation's record: the means over the validation chains (or complexes).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ValResult {
    /// Chains validated (complexes, with AlphaFold-Multimer).
    pub val_chains: usize,
    /// lDDT-Cα of the last pass (15 Å cutoff), in [0, 1].
    pub val_lddt_ca: f64,
    /// The loss (the training stage's weights, backbone FAPE clamped; a complex's: Multimer's).
    pub val_loss: f64,
    /// Backbone FAPE.
    pub val_fape: f64,
    /// Side-chain FAPE.
    pub val_sidechain_fape: f64,
    /// Chi angles.
    pub val_chi: f64,
    /// Structural violations.
    pub val_violation: f64,
    /// Distogram.
    pub val_distogram: f64,
    /// Masked MSA.
    pub val_masked_msa: f64,
    /// pLDDT.
    pub val_plddt: f64,
    /// Experimentally resolved.
    pub val_experimentally_resolved: f64,
}

impl ValResult {
    /// The means of per-chain `(lddt_ca, terms)`.
    pub fn mean(per_chain: &[(f64, StepLoss)]) -> ValResult {
        let n = per_chain.len().max(1) as f64;
        let mean = |f: &dyn Fn(&(f64, StepLoss)) -> f64| per_chain.iter().map(f).sum::<f64>() / n;
        ValResult {
            val_chains: per_chain.len(),
            val_lddt_ca: mean(&|c| c.0),
            val_loss: mean(&|c| c.1.loss),
            val_fape: mean(&|c| c.1.fape),
            val_sidechain_fape: mean(&|c| c.1.sidechain_fape),
            val_chi: mean(&|c| c.1.chi),
            val_violation: mean(&|c| c.1.violation),
            val_distogram: mean(&|c| c.1.distogram),
            val_masked_msa: mean(&|c| c.1.masked_msa),
            val_plddt: mean(&|c| c.1.plddt),
            val_experimentally_resolved: mean(&|c| c.1.experimentally_resolved),
        }
    }

    /// TensorBoard's scalars, under `val/`.
    pub fn scalars(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("val/lddt_ca", self.val_lddt_ca),
            ("val/loss", self.val_loss),
            ("val/fape", self.val_fape),
            ("val/sidechain_fape", self.val_sidechain_fape),
            ("val/chi", self.val_chi),
            ("val/violation", self.val_violation),
            ("val/distogram", self.val_distogram),
            ("val/masked_msa", self.val_masked_msa),
            ("val/plddt", self.val_plddt),
            ("val/experimentally_resolved", self.val_experimentally_resolved),
        ]
    }
}

/// The validation chains or complexes, prepared (in host memory: each goes to the device for
/// its turn).
pub struct Validation {
    /// The examples, in name order.
    set: HeldOut,
    /// Where the model runs.
    device: Device,
    /// Validate every this many steps (and after the last).
    every: Option<usize>,
}

/// What a validation set holds, by the network trained.
enum HeldOut {
    /// A monomer's chains, each prepared once.
    Chains(Vec<Prepared>),
    /// AlphaFold-Multimer's complexes as read (each numbered by its place, with its recycles),
    /// the crop size (`None`: whole complexes) and the run's seed, which draw each crop.
    Complexes { complexes: Vec<LoadedComplex>, crop: Option<usize>, seed: u64 },
}

/// The held-out layout's folders (`None` without --val-mmcif-dir).
fn held_out_dirs(val: &ValArgs) -> Option<(&Path, &Path)> {
    Some((val.val_mmcif_dir.as_deref()?, val.val_alignment_dir.as_deref()?))
}

/// `data`'s filters for the held-out layout: neither the training list nor the training set's
/// chain cache names held-out chains.
fn held_out_filters(data: &TrainDataArgs) -> anyhow::Result<layout::Filters> {
    Ok(layout::Filters { train_list: None, chain_data: None, ..data.filters()? })
}

impl Validation {
    /// The chains `val` names (none without --val-mmcif-dir), prepared by the eval pipeline
    /// with `data`'s filters (but its train list and chain cache) and the run's MSA sizes in `train`'s
    /// pipeline, to run on `device`.
    pub fn open(
        val: &ValArgs,
        data: &TrainDataArgs,
        train: &Pipeline,
        device: Device,
    ) -> anyhow::Result<Option<Validation>> {
        let Some((mmcif_dir, alignment_dir)) = held_out_dirs(val) else { return Ok(None) };
        let filters = held_out_filters(data)?;
        let selection = layout::select_as(mmcif_dir, alignment_dir, &filters, &layout::LayoutFlags::VALIDATION)?;
        let mut chains = selection.chains;
        chains.sort_by(|a, b| a.name.cmp(&b.name));
        chains.truncate(val.val_max_chains.unwrap_or(usize::MAX));
        let pipeline = Pipeline {
            block_deletion: BlockDeletion { num_blocks: 0, ..BlockDeletion::default() },
            crop_size: val.val_crop_size.unwrap_or(usize::MAX),
            templates: None,
            ..train.clone()
        };
        let mut prepared = Vec::with_capacity(chains.len());
        for (i, entry) in chains.iter().enumerate() {
            let mut entry = entry.clone();
            entry.templates.clear();
            let example = load(&entry).with_context(|| format!("validation chain {}", entry.name))?;
            // Drawn by the chain's place in the list: the same example at every validation.
            let p = prepare_with_recycles(&example, &pipeline, i as u64 + 1, 0, val.val_recycles)?;
            // Its target is checked now, not at the first validation.
            layout_example(&p, Device::Cpu)?;
            prepared.push(p);
        }
        Ok(Some(Validation { set: HeldOut::Chains(prepared), device, every: val.val_every }))
    }

    /// The complexes `val` names (none without --val-mmcif-dir), for AlphaFold-Multimer: the
    /// held-out layout's entries selected and read as the training set of complexes is
    /// ([`select_complexes_as`], [`LoadedComplex::read`]) with `data`'s filters (but its train
    /// list and chain cache), without templates, the first --val-max-chains in name order;
    /// complex `i` (from 0) is example number `i + 1` with --val-recycles passes, cropped (with
    /// --val-crop-size) as training under `seed` crops that number, to run on `device`.
    pub fn open_complexes(
        val: &ValArgs,
        data: &TrainDataArgs,
        seed: u64,
        device: Device,
    ) -> anyhow::Result<Option<Validation>> {
        let Some((mmcif_dir, alignment_dir)) = held_out_dirs(val) else { return Ok(None) };
        let filters = held_out_filters(data)?;
        let selection = select_complexes_as(mmcif_dir, alignment_dir, &filters, &layout::LayoutFlags::VALIDATION)?;
        let mut entries = selection.chains;
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        entries.truncate(val.val_max_chains.unwrap_or(usize::MAX));
        let crop = val.val_crop_size;
        let mut complexes = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().enumerate() {
            let number = i as u64 + 1;
            let what = || format!("validation complex {}", entry.name);
            let loaded = LoadedComplex::read(entry, None, number, val.val_recycles).with_context(what)?;
            // Its target and crop are checked now, not at the first validation.
            loaded.training(crop, Device::Cpu)?.cropped(seed, number).with_context(what)?;
            complexes.push(loaded);
        }
        Ok(Some(Validation { set: HeldOut::Complexes { complexes, crop, seed }, device, every: val.val_every }))
    }

    /// Chains (or complexes) validated.
    pub fn len(&self) -> usize {
        match &self.set {
            HeldOut::Chains(chains) => chains.len(),
            HeldOut::Complexes { complexes, .. } => complexes.len(),
        }
    }

    /// Whether there are none (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the set holds, as the log says it: `chains` or `complexes`.
    pub fn what(&self) -> &'static str {
        match self.set {
            HeldOut::Chains(_) => "chains",
            HeldOut::Complexes { .. } => "complexes",
        }
    }

    /// Whether step `step` of `steps` validates: every --val-every steps and after the last.
    pub fn due(&self, step: usize, steps: usize) -> bool {
        step == steps || self.every.is_some_and(|every| step.is_multiple_of(every))
    }

    /// Scores every chain or complex, in order, by `evaluate` (lDDT-Cα and the loss terms of
    /// the example; every rank of the job together) and averages them. The trainer passes its
    /// evaluation ([`crate::train::Trainer::evaluate`]) with the weights it validates (see
    /// [`crate::train::Trainer::with_evaluated_weights`]).
    pub fn run(&self, evaluate: impl Fn(&EvalExample) -> anyhow::Result<(f64, StepLoss)>) -> anyhow::Result<ValResult> {
        let scores = match &self.set {
            HeldOut::Chains(chains) => chains
                .iter()
                .zip(1..)
                .map(|(p, number)| {
                    let (features, target, recycles, _) = layout_example(p, self.device)?;
                    let (features, target) = (&features, &target);
                    evaluate(&EvalExample::Chain(Example { features, target, recycles, number }))
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
            HeldOut::Complexes { complexes, crop, seed } => complexes
                .iter()
                .map(|c| {
                    let complex = c.training(*crop, self.device)?;
                    let (score, _) = complex.with_example(*seed, c.recycles, c.number, |e| {
                        evaluate(&EvalExample::Complex(*e)).with_context(|| format!("validation complex {}", c.name))
                    })?;
                    Ok(score)
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
        };
        Ok(ValResult::mean(&scores))
    }
}

#[cfg(test)]
mod tests {
    use super::{HeldOut, StepLoss, ValResult, Validation};

    #[test]
    fn validations_fall_every_n_steps_and_after_the_last() {
        let v = |every| Validation { set: HeldOut::Chains(Vec::new()), device: tch::Device::Cpu, every };
        let due = |v: &Validation| (1..=7).filter(|&s| v.due(s, 7)).collect::<Vec<_>>();
        assert_eq!(due(&v(Some(3))), [3, 6, 7]);
        assert_eq!(due(&v(None)), [7], "without --val-every: after the last step only");
        assert_eq!(due(&v(Some(1))), [1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn the_record_is_the_mean_over_the_chains() {
        let terms = |loss: f64| StepLoss {
            loss,
            fape: 2.0 * loss,
            clamped: true,
            sidechain_fape: 0.0,
            chi: 0.0,
            angle_norm: 0.0,
            violation: 0.0,
            distogram: 0.0,
            masked_msa: 0.0,
            plddt: 0.0,
            experimentally_resolved: 0.0,
            aligned_error: None,
        };
        let r = ValResult::mean(&[(0.5, terms(1.0)), (0.75, terms(3.0))]);
        assert_eq!((r.val_chains, r.val_lddt_ca, r.val_loss, r.val_fape), (2, 0.625, 2.0, 4.0));
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"val_lddt_ca\":0.625") && json.contains("\"val_chains\":2"), "{json}");
    }
}
