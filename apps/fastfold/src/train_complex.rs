//! Training AlphaFold-Multimer on one complex: the example (a FASTA file's records as one
//! complex, [`crate::multimer`]'s features of it on its chains' saved alignments or each
//! chain's sequence alone, with templates drawn per example from the alignments' folders' hits
//! when asked ([`ComplexSource`]), and its true structure read chain by chain from a structure
//! file; each example cropped by [`crate::complex_crop`] when a crop size is given) and the loss of
//! a training forward ([`crate::loss::multimer_total`], after the chain permutation
//! alignment). The trainer ([`crate::train::Trainer::accumulate_complex`]) runs the forward
//! and the step.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tch::{Device, Kind, Tensor};

use crate::complex_crop::{crop_inputs, ComplexCrop, CropKind};
use crate::ground_truth::GroundTruth;
use crate::loss::multimer_total::{multimer_total_loss, ComplexLossInputs, MultimerLossConfig, WholeChains};
use crate::loss::{MaskedMsaTarget, StepLoss};
use crate::model::alphafold::Pass;
use crate::model::multimer::{MultimerInputs, SampledMsa};
use crate::multimer::{search, Complex, EntityInput};
use crate::pdb::Structure;
use crate::search::{Mode, Search};
use crate::train_data::layout::hit_files;
use crate::train_data::templates::{read_hits, ChainTemplates, TemplateSampling};
use crate::train_target::{ComplexExample, Target};

/// The complex of `fasta`'s records and its true structure in `target`, the features on
/// `device`: its features from each entity's saved alignments in `msas`
/// ([`saved_alignments`]), else from each chain's sequence alone; record `k` is chain `A`, `B`,
/// ... (as AlphaFold-Multimer letters the records), read from the structure file's chain of
/// that letter, and the truth is laid out in the features' chain order (entity by entity).
/// Errors name the file and the chain: a record whose chain the structure lacks, or whose
/// residues differ from the chain's. No templates ([`ComplexSource::with_templates`] draws
/// them).
pub fn read_complex_structure(
    fasta: &Path,
    msas: Option<&Path>,
    target: &Path,
    device: Device,
) -> anyhow::Result<(MultimerInputs, Structure)> {
    let source = ComplexSource::read(fasta, msas, target)?;
    Ok((source.inputs((0, 0), device)?, source.truth))
}

/// One complex to train on as read before its features: the complex of a FASTA file's records,
/// each entity's inputs (its alignments), its true structure and, with template sampling,
/// each entity's template hits. Every example's features are made from it, its templates drawn
/// for that example ([`ComplexSource::inputs`]).
pub struct ComplexSource {
    complex: Complex,
    entities: Vec<EntityInput>,
    /// The true structure, in the features' chain order.
    pub truth: Structure,
    /// The FASTA file, as errors name it.
    fasta: PathBuf,
    /// The structure file, as errors name it.
    target: PathBuf,
    /// How examples draw templates and each entity's hits (`None`: its folder has no hit file).
    templates: Option<(TemplateSampling, Vec<Option<ChainTemplates>>)>,
}

impl ComplexSource {
    /// The complex and truth of [`read_complex_structure`], without templates.
    pub fn read(fasta: &Path, msas: Option<&Path>, target: &Path) -> anyhow::Result<ComplexSource> {
        let records = data::fasta::read(fasta)?;
        if records.len() < 2 {
            bail!(
                "{}: a complex needs several FASTA records (one per chain); it has {}",
                fasta.display(),
                records.len()
            );
        }
        let complex = Complex::new(&records, fasta)?;
        let entities = match msas {
            Some(dir) => saved_alignments(&complex, dir)?,
            None => EntityInput::single_sequences(&complex, fasta)?,
        };
        let mut chains = Vec::new();
        for chain in complex.assembly_order() {
            let s = Structure::read(target, Some(chain.id)).with_context(|| {
                format!("--target {}: chain {} (FASTA record {:?})", target.display(), chain.id, chain.record)
            })?;
            let len = chain.sequence.chars().count();
            if s.aatype.len() != len {
                bail!(
                    "--target {}: chain {} has {} residues, FASTA record {:?} has {len}",
                    target.display(),
                    chain.id,
                    s.aatype.len(),
                    chain.record
                );
            }
            chains.push(s);
        }
        let truth = join_chains(chains).context("a complex without chains")?;
        let (fasta, target) = (fasta.to_path_buf(), target.to_path_buf());
        Ok(ComplexSource { complex, entities, truth, fasta, target, templates: None })
    }

    /// The complex drawing its examples' templates by `sampling` from each entity's hits: those
    /// of its first chain's folder in `msas` (`A/`, `B/`, ...), hmmsearch's `pdb_hits.sto` as
    /// predict saves it (AlphaFold-Multimer's search), else its `.hhr` files (hhsearch's
    /// `pdb_hits.hhr`), read as a data set's chain folder is read
    /// ([`crate::train_data::layout::hit_files`]); an entity without any has none. The complex has no
    /// PDB entry or release date here: no hit is dropped as its own entry's (those that
    /// duplicate its sequence are), and `--max-template-date` alone limits the hits' dates.
    pub fn with_templates(self, sampling: TemplateSampling, msas: &Path) -> anyhow::Result<ComplexSource> {
        let hits = self
            .complex
            .entity_representatives()
            .iter()
            .map(|chain| {
                let folder = msas.join(chain.id.to_string());
                let files = hit_files(&folder).with_context(|| format!("--msas {}", msas.display()))?;
                match files.is_empty() {
                    true => Ok(None),
                    false => {
                        let hits = read_hits(&files, &chain.sequence, "", None);
                        Ok(Some(hits.with_context(|| format!("chain {}", chain.id))?))
                    }
                }
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(ComplexSource { templates: Some((sampling, hits)), ..self })
    }

    /// Each entity's first chain and its hit files (none: no templates), for the log.
    pub fn template_files(&self) -> Vec<(char, Vec<PathBuf>)> {
        let Some((_, hits)) = &self.templates else { return Vec::new() };
        let chains = self.complex.entity_representatives();
        chains.iter().zip(hits).map(|(c, h)| (c.id, h.as_ref().map(|h| h.paths.clone()).unwrap_or_default())).collect()
    }

    /// The features of example `number` of a run seeded `seed` on `device`: each entity with
    /// hits draws its templates as a data set's complex does ([`TemplateSampling::draw`],
    /// keyed by the seed, the number and the entity); without template sampling every example's
    /// are the same.
    pub fn inputs(&self, (seed, number): (u64, u64), device: Device) -> anyhow::Result<MultimerInputs> {
        let mut entities = std::borrow::Cow::Borrowed(&self.entities);
        if let Some((sampling, hits)) = &self.templates {
            let reps = self.complex.entity_representatives();
            for (e, (chain, hits)) in reps.iter().zip(hits).enumerate() {
                if let Some(hits) = hits {
                    let drawn = sampling.draw(&chain.sequence, hits, (seed, number, e as u64));
                    entities.to_mut()[e].raw.templates = Some(drawn.with_context(|| format!("chain {}", chain.id))?);
                }
            }
        }
        let features = crate::multimer::features(&self.complex, &entities)?;
        let name = self.fasta.display().to_string();
        Ok(MultimerInputs::from_named(|n| features.get(n).map(|a| a.tensor().to_device(device)), &name)?)
    }

    /// Example `number`'s complex ([`ComplexSource::inputs`] under `seed`) at resolution
    /// `resolution`, cropped to `crop` residues when given.
    pub fn training(
        &self,
        resolution: f64,
        crop: Option<usize>,
        (seed, number): (u64, u64),
        device: Device,
    ) -> anyhow::Result<TrainingComplex> {
        let inputs = self.inputs((seed, number), device)?;
        let source = format!("--target {}", self.target.display());
        TrainingComplex::new(inputs, self.truth.clone(), resolution, crop, source)
    }
}

/// The structures of a complex's chains, in order, as one (`None`: no chains).
pub fn join_chains(chains: Vec<Structure>) -> Option<Structure> {
    chains.into_iter().reduce(|mut all, s| {
        all.aatype.extend(s.aatype);
        all.residue_index.extend(s.residue_index);
        all.positions.extend(s.positions);
        all.mask.extend(s.mask);
        all.b_factors.extend(s.b_factors);
        all
    })
}

/// A complex to train on: its features and truth, whole, and how each example crops them.
pub struct TrainingComplex {
    /// The whole complex's features.
    pub inputs: MultimerInputs,
    /// Its true structure, whole.
    pub truth: Structure,
    /// The whole truth as a target.
    pub target: Target,
    /// The crop (`None`: every example is the whole complex).
    pub crop: Option<ComplexCrop>,
    /// Where the truth was read, as errors name it.
    source: String,
}

impl TrainingComplex {
    /// The complex of [`read_complex_structure`], resolution `resolution`, cropped to `crop`
    /// residues when given ([`ComplexCrop::new`]).
    pub fn read(
        fasta: &Path,
        msas: Option<&Path>,
        target: &Path,
        resolution: f64,
        crop: Option<usize>,
        device: Device,
    ) -> anyhow::Result<TrainingComplex> {
        let (inputs, truth) = read_complex_structure(fasta, msas, target, device)?;
        TrainingComplex::new(inputs, truth, resolution, crop, format!("--target {}", target.display()))
    }

    /// The complex of `inputs` and its truth `truth` (chains laid out as the features'), read
    /// from `source` (named in errors), resolution `resolution`, cropped to `crop` residues
    /// when given.
    pub fn new(
        inputs: MultimerInputs,
        truth: Structure,
        resolution: f64,
        crop: Option<usize>,
        source: String,
    ) -> anyhow::Result<TrainingComplex> {
        let aatype = inputs.aatype.to_kind(Kind::Int64);
        let mut whole = Target::new(&truth, &aatype, &source)?;
        whole.resolution = resolution;
        let crop = crop.map(ComplexCrop::new);
        Ok(TrainingComplex { inputs, truth, target: whole, crop, source })
    }

    /// Example `number`'s features and truth under a run seeded `seed`: `None` when it is the
    /// whole complex (no crop, or one no shorter than the complex), else the features of the
    /// residues [`ComplexCrop::residues`] draws, the whole truth with the whole complex's chains
    /// (the loss compares each predicted chain with the same residues of the true chain it
    /// assigns, [`crate::loss::chain_permutation::align_crop`]) and which crop it was.
    pub fn cropped(&self, seed: u64, number: u64) -> anyhow::Result<Option<(MultimerInputs, Target, CropKind)>> {
        let Some(crop) = &self.crop else { return Ok(None) };
        let (kind, keep) = crop.residues(&ids(&self.inputs.asym_id)?, &self.truth, seed, number);
        if kind == CropKind::Whole {
            return Ok(None);
        }
        let inputs = crop_inputs(&self.inputs, &keep);
        let aatype = self.inputs.aatype.to_kind(Kind::Int64);
        let mut target = Target::of_crop(&self.truth, &aatype, &self.source)?;
        target.resolution = self.target.resolution;
        target.whole_chains = Some((self.inputs.asym_id.shallow_clone(), self.inputs.entity_id.shallow_clone()));
        Ok(Some((inputs, target, kind)))
    }
    /// `f` on example `number` of the complex under a run seeded `seed`, `recycles` passes
    /// before the last: its crop for that number ([`TrainingComplex::cropped`]) or the whole
    /// complex; returns what `f` does and the crop taken. Training and validation both make a
    /// complex's examples here, so that a validation crop is the crop training would draw.
    pub fn with_example<T>(
        &self,
        seed: u64,
        recycles: usize,
        number: u64,
        f: impl FnOnce(&ComplexExample) -> anyhow::Result<T>,
    ) -> anyhow::Result<(T, CropKind)> {
        let cropped = self.cropped(seed, number)?;
        let (features, target, kind) = match &cropped {
            Some((features, target, kind)) => (features, target, *kind),
            None => (&self.inputs, &self.target, CropKind::Whole),
        };
        Ok((f(&ComplexExample { features, target, recycles, number })?, kind))
    }
}

/// A per-residue id array's values.
fn ids(t: &Tensor) -> anyhow::Result<Vec<i64>> {
    Ok(Vec::try_from(t.to_kind(Kind::Int64).to_device(Device::Cpu))?)
}

/// Each entity's inputs from the alignments a search saved in `msas` (`--msas`: predict's
/// `msas/` folder, `<chain id>/` for each entity's first chain), read back as predict reads them
/// with `--use-precomputed-msas` ([`search::entity_inputs`] reading only): the merged MSA and,
/// for distinct chains, the UniProt alignment that pairs rows. A missing folder or file is an
/// error naming `--msas`, the chain and the path.
pub fn saved_alignments(complex: &Complex, msas: &Path) -> anyhow::Result<Vec<EntityInput>> {
    if !msas.is_dir() {
        bail!("--msas {}: no such folder (a complex's saved alignments, A/, B/, ...)", msas.display());
    }
    let first = complex.entity_representatives().first().map(|c| c.id).context("a complex without chains")?;
    let searcher = Search::saved(&msas.join(first.to_string()));
    search::entity_inputs(complex, &searcher, None, msas, Mode::ReadSaved)
        .with_context(|| format!("--msas {}", msas.display()))
}

/// Multimer's loss of one forward on a complex.
pub struct ComplexLosses {
    /// The weighted sum, for backward.
    pub total: Tensor,
    /// Every term's value.
    pub terms: StepLoss,
    /// The truth as the loss compared it, when not the target's as given
    /// ([`crate::loss::multimer_total::MultimerTotalLoss::aligned_truth`]).
    aligned_truth: Option<GroundTruth>,
}

impl ComplexLosses {
    /// lDDT-Cα of `pass`'s prediction against the truth as the loss compared it: each predicted
    /// chain against the true copy the chain permutation alignment gave it (the target's chain
    /// order is arbitrary among copies), and a crop against the same residues of the truth.
    pub fn lddt_ca(&self, pass: &Pass, target: &Target) -> anyhow::Result<f64> {
        let truth = self.aligned_truth.as_ref().unwrap_or(&target.truth);
        Ok(crate::loss::lddt_ca(&pass.structure.atom37, truth)?.double_value(&[]))
    }
}

/// Multimer's loss of a forward's last `pass` and its `sampled` MSA on the complex of
/// `features` against `target` with `cfg`'s weights: the total, for backward, every term's
/// value and the truth it compared with. The log's `fape` is Multimer's `bb_loss` (intra-chain
/// plus interface backbone FAPE, averaged over the iterations); nothing is drawn for clamping
/// (`clamped` false).
pub fn complex_losses(
    pass: &Pass,
    sampled: &SampledMsa,
    features: &MultimerInputs,
    target: &Target,
    cfg: &MultimerLossConfig,
) -> anyhow::Result<ComplexLosses> {
    let device = pass.structure.atom37.device();
    let f = features;
    let on = |t: &Tensor| t.to_device(device);
    let (true_msa, bert_mask) = (on(&sampled.true_msa), on(&sampled.bert_mask));
    let (asym_id, entity_id) = (on(&f.asym_id), on(&f.entity_id));
    let (residue_index, seq_mask) = (on(&f.residue_index), on(&f.seq_mask).to_kind(Kind::Float));
    let whole_chains = target.whole_chains.as_ref().map(|(a, e)| (on(a), on(e)));
    let inputs = ComplexLossInputs {
        truth: &target.truth,
        msa: MaskedMsaTarget { true_msa: &true_msa, bert_mask: &bert_mask },
        asym_id: &asym_id,
        entity_id: &entity_id,
        residue_index: &residue_index,
        seq_mask: &seq_mask,
        resolution: target.resolution,
        whole: whole_chains.as_ref().map(|(asym_id, entity_id)| WholeChains { asym_id, entity_id }),
    };
    let l = multimer_total_loss(&pass.heads, &pass.structure, &inputs, cfg)?;
    let s = &l.structure;
    let structure = [&s.backbone, &s.sidechain_fape, &s.chi_loss, &s.angle_norm_loss, &s.violation];
    let terms = StepLoss::of(&l.total, structure, false, &l.heads);
    Ok(ComplexLosses { total: l.total, terms, aligned_truth: l.aligned_truth })
}
