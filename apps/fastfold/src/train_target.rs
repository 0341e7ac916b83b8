//! The true structure of a training example in the layouts the losses read, from a
//! structure file (`--target`) or a prepared data-set example ([`layout_example`]), and the
//! examples that pair it with their features ([`Example`], [`ComplexExample`],
//! [`EvalExample`]); both the training loop ([`crate::train`]) and validation
//! ([`crate::validation`]) score against it.
use anyhow::{bail, Context};
use tch::{Device, Kind, Tensor};

use crate::features::Features;
use crate::ground_truth::GroundTruth;
use crate::model::multimer::MultimerInputs;
use crate::pdb::Structure;
use crate::residue_constants::{RESNAMES, UNK_RESTYPE_INDEX};
use crate::train_data::example::Prepared;

/// The true structure in the layouts the losses read.
pub struct Target {
    /// The ground truth, as AlphaFold computes it from the structure.
    pub truth: GroundTruth,
    /// The structure's resolution (Å; 0, the default, for none: no confidence terms).
    pub resolution: f64,
    /// For a complex's whole truth compared with a prediction of a crop of it: the whole
    /// complex's chain (`asym_id`) and entity (`entity_id`) of each residue, `[M]` each (the loss
    /// finds each predicted residue in its assigned true chain by its number). `None`: the
    /// truth has the prediction's residues.
    pub whole_chains: Option<(Tensor, Tensor)>,
}

impl Target {
    /// From a structure whose residue types must be the features' (`aatype` `[N]`), with the
    /// atoms backbone FAPE and the distogram need (else an error: one example without them
    /// would train on without those terms, silently).
    pub fn new(s: &Structure, aatype: &Tensor, source: &str) -> anyhow::Result<Target> {
        let target = Target::of_crop(s, aatype, source)?;
        // Without them a loss term is 0 and training would go on, silently, without it.
        if target.truth.backbone()?.1.sum(Kind::Float).double_value(&[]) == 0.0 {
            bail!("{source}: no residue has the N, CA and C atoms that backbone FAPE needs");
        }
        if target.truth.pseudo_beta_mask.sum(Kind::Float).double_value(&[]) == 0.0 {
            bail!("{source}: no residue has the CB atom (CA for glycine) that the distogram loss needs");
        }
        Ok(target)
    }

    /// As [`Target::new`], but the structure may lack those atoms: a data set's crop can fall
    /// on residues that were never observed, and trains that step with those terms at 0, as
    /// AlphaFold's masked losses give them.
    pub fn of_crop(s: &Structure, aatype: &Tensor, source: &str) -> anyhow::Result<Target> {
        let n = aatype.size()[0];
        let ours: Vec<i64> = Vec::try_from(aatype.to_device(Device::Cpu))?;
        if s.aatype.len() as i64 != n {
            bail!("{source}: {} residues, the input has {n}", s.aatype.len());
        }
        // An unknown residue on either side matches: the input's X is any residue, and the
        // structure's is a modified one (SEP, a D-amino acid) whose parent the input names, as
        // AlphaFold's mmCIF reader maps it.
        let unknown = |a: usize| a == UNK_RESTYPE_INDEX;
        if let Some(i) = (0..n as usize)
            .find(|&i| s.aatype[i] != ours[i] as usize && !unknown(ours[i] as usize) && !unknown(s.aatype[i]))
        {
            let name = |a: usize| RESNAMES.get(a).copied().unwrap_or("?");
            bail!(
                "{source}: residue {} is {} in the structure, {} in the input",
                i + 1,
                name(s.aatype[i]),
                name(ours[i] as usize)
            );
        }
        let device = aatype.device();
        let flat: Vec<f32> = s.positions.iter().flatten().flatten().copied().collect();
        let positions = Tensor::from_slice(&flat).view([n, 37, 3]).to_device(device);
        let flat: Vec<f32> = s.mask.iter().flatten().copied().collect();
        let mask = Tensor::from_slice(&flat).view([n, 37]).to_device(device);
        let truth = GroundTruth::new(aatype, &positions, &mask).with_context(|| source.to_string())?;
        Ok(Target { truth, resolution: 0.0, whole_chains: None })
    }
}

/// A prepared example on `device` with its target: (features, target, recycles, the chain
/// and its crop as the log names them).
pub fn layout_example(p: &Prepared, device: Device) -> anyhow::Result<(Features, Target, usize, String)> {
    let features = p.features.to_device(device);
    let len = p.structure.aatype.len();
    let name = format!("{} {}-{}", p.name, p.crop_start + 1, p.crop_start + len);
    let mut target = Target::of_crop(&p.structure, &features.aatype.get(0), &name)?;
    target.resolution = p.resolution;
    Ok((features, target, p.recycles, name))
}

/// One example of a step, as [`crate::train::Trainer::step`] trains it: a monomer query's processed
/// `Features`, or a complex's `MultimerInputs` ([`ComplexExample`]).
pub struct Example<'a, F = Features> {
    /// Its features.
    pub features: &'a F,
    /// Its true structure.
    pub target: &'a Target,
    /// Recycling passes before the trained one.
    pub recycles: usize,
    /// Its number in the run's stream of examples (1-based, [`crate::train_data::loader::Shard::example`]): backbone
    /// FAPE's clamping is drawn from it, so that it is the same whichever rank trains it (for
    /// a complex, the network's sampling key).
    pub number: u64,
}

impl<F> Clone for Example<'_, F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for Example<'_, F> {}

/// One complex of a step, as [`crate::train::Trainer::accumulate_complex`] trains it: its features (the MSA
/// sampled inside the network) and its true structure, chains laid out as the features'
/// ([`crate::train_complex::TrainingComplex`]), or an example's crop of them.
pub type ComplexExample<'a> = Example<'a, MultimerInputs>;

/// One example as [`crate::train::Trainer::evaluate`] scores it, of the network the trainer holds: a
/// monomer's chain or AlphaFold-Multimer's complex.
#[derive(Clone, Copy)]
pub enum EvalExample<'a> {
    /// A chain's processed features (their MSA sampled when prepared).
    Chain(Example<'a>),
    /// A complex (its MSA sampled inside the network, keyed by its number).
    Complex(ComplexExample<'a>),
}
