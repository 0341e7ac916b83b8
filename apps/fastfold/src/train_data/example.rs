//! A training chain read from the layout ([`load`]) and made into one step's example
//! ([`prepare`]): AlphaFold's training-time pipeline on it, block deletion of the MSA, the
//! eval pipeline's MSA sampling, clustering and masked-MSA targets
//! ([`crate::features::process`], with the step's recycling count), then the contiguous crop
//! of the features and the ground truth alike; with template sampling, the example's templates
//! ([`super::templates`]) join the features before the pipeline and are cropped with them.
use anyhow::{bail, Context};
use tch::Device;

use super::layout::ChainEntry;
use super::target::read_chain;
use super::templates::{read_hits, ChainTemplates, TemplateSampling};
use super::transforms::{
    block_deletion_keep, crop_start, crop_structure, keep_msa_rows, keyed, sample_recycles, BlockDeletion, Draw,
};
use crate::features::{process, FeatureConfig, Features, RawFeatures};
use crate::input::parse_alignment;
use crate::pdb::Structure;

/// A chain as read: its raw features (SEQRES and every MSA of its folder) and its structure.
#[derive(Clone, Debug)]
pub struct Example {
    /// `<pdb>_<chain>`.
    pub name: String,
    /// The raw features, the MSAs' rows concatenated in file-name order, duplicates dropped.
    pub raw: RawFeatures,
    /// The true structure over SEQRES.
    pub structure: Structure,
    /// Resolution in Å (0: none).
    pub resolution: f64,
    /// The query sequence the MSAs and template hits align to (SEQRES, see [`load`]).
    pub sequence: String,
    /// The chain's template hits, when its folder has hit files (and the loader reads them).
    pub templates: Option<ChainTemplates>,
}

/// Reads a chain of the layout: its mmCIF chain and its MSAs. Every MSA's query row must be
/// the chain's SEQRES, but where SEQRES has an unknown residue (`X`, a modified one), whose
/// letter the alignment's query then gives (OpenFold's alignments were searched with
/// Biopython's one-letter codes, which name the parent of many modified residues).
pub fn load(entry: &ChainEntry) -> anyhow::Result<Example> {
    let chain = read_chain(&entry.mmcif, &entry.chain)?;
    let (msa, sequence) = read_msas(&entry.msas, &entry.name, &chain.sequence, &entry.mmcif)?;
    let source = entry.msas[0].clone();
    let raw = RawFeatures::new(&sequence, Some((&msa, &source)))
        .with_context(|| format!("chain {}: its MSAs against SEQRES of {}", entry.name, entry.mmcif.display()))?;
    let templates = match entry.templates.is_empty() {
        true => None,
        false => {
            let pdb = entry.name.rsplit_once('_').map_or(entry.name.as_str(), |(pdb, _)| pdb);
            let hits = read_hits(&entry.templates, &sequence, pdb, chain.release_date.clone());
            Some(hits.with_context(|| format!("chain {}", entry.name))?)
        }
    };
    Ok(Example { name: chain.name, raw, structure: chain.structure, resolution: chain.resolution, sequence, templates })
}

/// What makes a chain one step's example.
#[derive(Clone, Debug, PartialEq)]
pub struct Pipeline {
    /// MSA sizes and masking of the feature pipeline (its `num_recycle` is the step's draw).
    pub features: FeatureConfig,
    /// MSA block deletion.
    pub block_deletion: BlockDeletion,
    /// Residues of the crop (AlphaFold: 256 initial training, 384 fine-tuning).
    pub crop_size: usize,
    /// Recycling passes are drawn from 0..=max_recycles (AlphaFold: 3).
    pub max_recycles: usize,
    /// The run's seed.
    pub seed: u64,
    /// How examples draw their templates (`None`: no templates, `--max-templates 0`).
    pub templates: Option<TemplateSampling>,
}

/// One step's example: features and ground truth cropped alike.
#[derive(Debug)]
pub struct Prepared {
    /// `<pdb>_<chain>`.
    pub name: String,
    /// The processed, cropped features (on the CPU), with `recycles + 1` recycling slices.
    pub features: Features,
    /// The crop of the true structure.
    pub structure: Structure,
    /// Resolution in Å.
    pub resolution: f64,
    /// Recycling passes before the trained one.
    pub recycles: usize,
    /// The crop's first SEQRES residue.
    pub crop_start: usize,
}

/// `example` as step `step`'s example on data-parallel rank `rank`: its templates (when the
/// pipeline samples them and the chain has hits), block deletion, the feature pipeline with the
/// step's recycling count, and a crop of `crop_size` residues, each drawn from (seed, step,
/// rank).
pub fn prepare(example: &Example, pipeline: &Pipeline, step: u64, rank: u64) -> anyhow::Result<Prepared> {
    let recycles = sample_recycles(pipeline.seed, step, pipeline.max_recycles);
    prepare_with_recycles(example, pipeline, step, rank, recycles)
}

/// As [`prepare`] with `recycles` recycling passes rather than a draw from
/// `pipeline.max_recycles` (validation's fixed count).
pub fn prepare_with_recycles(
    example: &Example,
    pipeline: &Pipeline,
    step: u64,
    rank: u64,
    recycles: usize,
) -> anyhow::Result<Prepared> {
    let seed = pipeline.seed;
    let keep = block_deletion_keep(
        example.raw.msa.len(),
        &pipeline.block_deletion,
        &mut keyed(seed, Draw::BlockDeletion, step, rank),
    );
    let mut raw = keep_msa_rows(&example.raw, &keep);
    if let (Some(sampling), Some(hits)) = (&pipeline.templates, &example.templates) {
        let templates = sampling.draw(&example.sequence, hits, (seed, step, rank));
        raw.templates = Some(templates.with_context(|| format!("chain {}", example.name))?);
    }
    let config = FeatureConfig { num_recycle: recycles, ..pipeline.features.clone() };
    let feature_seed = keyed(seed, Draw::Features, step, rank).next_u64();
    let features = process(&raw, &config, feature_seed, Device::Cpu).with_context(|| example.name.clone())?;
    let n = raw.seq_length;
    let start = crop_start(n, pipeline.crop_size, &mut keyed(seed, Draw::Crop, step, rank));
    let len = n.min(pipeline.crop_size);
    Ok(Prepared {
        name: example.name.clone(),
        features: features.crop(start as i64, len as i64)?,
        structure: crop_structure(&example.structure, start, len),
        resolution: example.resolution,
        recycles,
        crop_start: start,
    })
}

/// The MSA files `msas` of chain `name` (SEQRES `seqres`, from `mmcif`, named in errors)
/// read and concatenated in order, and the query they align: SEQRES with each unknown residue
/// (`X`) given the first alignment's query letter (see [`load`]). Errors name the file and the
/// chain: a query row of another length than SEQRES, a chain without MSA files.
pub fn read_msas(
    msas: &[std::path::PathBuf],
    name: &str,
    seqres: &str,
    mmcif: &std::path::Path,
) -> anyhow::Result<(data::a3m::Msa, String)> {
    let mut all: Option<data::a3m::Msa> = None;
    for path in msas {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let m = parse_alignment(&text, path).with_context(|| format!("chain {name}"))?;
        let Some(query) = m.sequences.first() else { bail!("{}: no sequences", path.display()) };
        let n = seqres.chars().count();
        if query.chars().count() != n {
            bail!(
                "{}: the query row has {} columns, chain {name} has {n} SEQRES residues ({})",
                path.display(),
                query.chars().count(),
                mmcif.display()
            );
        }
        match all.as_mut() {
            None => all = Some(m),
            Some(all) => {
                all.sequences.extend(m.sequences);
                all.deletion_matrix.extend(m.deletion_matrix);
                all.descriptions.extend(m.descriptions);
            }
        }
    }
    let msa = all.with_context(|| format!("chain {name}: no MSA files"))?;
    let sequence: String = seqres
        .chars()
        .zip(msa.sequences[0].chars())
        .map(|(seqres, query)| if seqres == 'X' { query } else { seqres })
        .collect();
    Ok((msa, sequence))
}
