//! `fastfold predict` with AlphaFold-Multimer's parameters, as `run_alphafold.py
//! --model_preset=multimer` lays its outputs out: the FASTA file's records one complex, its
//! folder named after the file; the features (`features.npz`) from AlphaFold-Multimer's
//! pipeline ([`crate::multimer`]) on each entity's searched alignments, or, without a search,
//! on each chain's sequence alone (paired across chains by the query rows); every model
//! `--num-multimer-predictions-per-model` times with `run_alphafold.py`'s seeds
//! ([`Settings::runs`]); each prediction `<model>_pred_<i>` written as
//! `<name>_unrelaxed.pdb` (one PDB chain per record, lettered in the features' chain order
//! as AlphaFold letters them) and `<name>_confidence.json` (pLDDT, PAE,
//! pTM, ipTM, the ranking confidence); `ranked_<i>.pdb` and `ranking_debug.json` by
//! `0.8 ipTM + 0.2 pTM` (`iptm+ptm`), `timings.json`, and the plots.
//!
//! ColabFold's plots unless `--no-plots`; with `--save-outputs`, `<name>_outputs.npz` (with
//! `iptm`). fp32; with several ranks the stacks run under DAP and rank 0 writes the files.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use engine::dist::World;
use engine::job::Precision;
use tch::Kind;

use super::{save_outputs, write_ranking, ModelOutputs, PredictArgs, Predicted};
use crate::confidence::{multimer_ranking_confidence, predicted_tm_score_of_chains, Confidence};
use crate::input::file_stem;
use crate::model::heads::MAX_ERROR_BIN;
use crate::model::multimer::{
    network_key, MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs, MULTIMER_STRUCTURE_ITERATIONS,
};
use crate::model::recycling::Recycling;
use crate::multimer::complex::CHAIN_IDS;
use crate::multimer::preset::{MultimerPreset, Settings};
use crate::multimer::{search, Complex, EntityInput};
use crate::pdb::Structure;
use crate::plots::{self, ModelConfidence};
use crate::query_folder::QueryFolder;
use crate::ranking::{Ranking, Timings};
use crate::search::Mode;

/// Every model's predictions on the complex of `args`' FASTA file; the summaries in the order
/// they ran.
pub(super) fn run(args: &PredictArgs, world: &World) -> anyhow::Result<Vec<Predicted>> {
    check(args)?;
    let Some(fasta) = &args.input.fasta else { bail!("give a FASTA file: its records are the complex's chains") };
    let (device, exec, _) = args.chunk.setup(&args.launch, world)?;
    let models = resolve(&args.params)?;
    let settings = Settings::new(
        args.multimer.num_multimer_predictions_per_model,
        args.recycles,
        args.recycle_early_stop_tolerance,
    );
    let presets: Vec<MultimerPreset> = models.iter().map(|(p, _)| *p).collect();
    let runs = settings.runs(&presets, args.input.seed.seed)?;

    let start = Instant::now();
    let records = data::fasta::read(fasta)?;
    if records.is_empty() {
        bail!("{}: no FASTA records", fasta.display());
    }
    let complex = Complex::new(&records, fasta)?;
    let name = file_stem(&fasta.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
    // Rank 0 writes the files; every rank runs the network (its stacks under DAP).
    let folder = match world.rank() {
        0 => Some(QueryFolder::open(&args.out, &name)?),
        _ => None,
    };
    let staging = folder.as_ref().map(|f| f.staging.clone());
    let entities = entity_inputs(args, world, &complex, fasta, &args.out.join(&name).join("msas"))?;
    let features = crate::multimer::features(&complex, &entities)?;
    if let Some(dir) = &staging {
        features.save_npz(&dir.join("features.npz"))?;
    }
    let inputs = MultimerInputs::from_named(|n| features.get(n).map(|a| a.tensor()), &name)?;
    // Each residue's PDB chain: A, B, ... in the features' chain order (`asym_id`), as
    // AlphaFold's `protein.to_pdb` letters them (which differ from `chain_id_map.json`'s FASTA
    // letters when copies of a sequence are not adjacent records).
    let chains: Vec<char> = complex
        .assembly_order()
        .iter()
        .zip(CHAIN_IDS.chars())
        .flat_map(|(c, id)| std::iter::repeat_n(id, c.sequence.chars().count()))
        .collect();
    let mut timings = Timings::default();
    timings.add("features", start.elapsed().as_secs_f64());

    let mut done = Vec::new();
    let mut scores = Vec::new();
    let mut confidences = Vec::new();
    for (preset, path) in &models {
        let iterations = args.structure_iterations.unwrap_or(MULTIMER_STRUCTURE_ITERATIONS);
        let sampling = MsaSampling {
            num_msa: preset.num_msa() as i64,
            num_extra_msa: preset.num_extra_msa() as i64,
            masked: MaskedMsaConfig::default(),
        };
        let net = MultimerAlphaFold::load_on(path, iterations, device)
            .with_context(|| format!("parameters {}", path.display()))?
            .with_sampling(sampling);
        for run in runs.iter().filter(|r| r.preset == *preset) {
            let recycling =
                Recycling { max: settings.num_recycle, early_stop_tolerance: settings.recycle_early_stop_tolerance };
            let start = Instant::now();
            let (pass, recycles) = tch::no_grad(|| net.predict(&inputs, recycling, network_key(run.seed), &exec))
                .with_context(|| format!("predicting {name} with {}", run.name))?;
            let seconds = start.elapsed().as_secs_f64();
            timings.add(format!("predict_and_compile_{}", run.name), seconds);
            let pae = pass.heads.aligned_error.as_ref().context("AlphaFold-Multimer's parameters have a PAE head")?;
            let weights = inputs.seq_mask.to_kind(Kind::Float).to_device(pae.device());
            let asym_id = inputs.asym_id.to_kind(Kind::Int64).to_device(pae.device());
            let ptm = predicted_tm_score_of_chains(pae, MAX_ERROR_BIN, &weights, None)?;
            let iptm = predicted_tm_score_of_chains(pae, MAX_ERROR_BIN, &weights, Some(&asym_id))?;
            let ranking_confidence = multimer_ranking_confidence(iptm, ptm);
            let mut confidence = Confidence::from_logits(&pass.heads.lddt, Some(pae))?;
            confidence.ptm = Some(ptm);
            if let Some(dir) = &staging {
                let outputs = ModelOutputs {
                    pass: &pass,
                    recycles,
                    confidence: &confidence,
                    iptm: Some(iptm),
                    ranking_confidence,
                };
                write_prediction(dir, &run.name, &outputs, &inputs, &chains, args.save_outputs)?;
            }
            scores.push((run.name.clone(), ranking_confidence));
            done.push(Predicted {
                name: name.clone(),
                model: run.name.clone(),
                residues: chains.len() as i64,
                mean_plddt: confidence.mean_plddt,
                ptm: Some(ptm),
                iptm: Some(iptm),
                recycles,
                seconds,
                peak_bytes: engine::process::peak_memory(device),
                planned_bytes: None,
            });
            confidences.push((run.name.clone(), confidence));
        }
    }
    let Some(folder) = folder else { return Ok(done) };
    let ranking = Ranking::multimer(&scores);
    write_ranking(&folder.staging, &ranking, &timings)?;
    if !args.no_plots {
        write_plots(&folder.staging, &name, &features, &complex, &ranking, &confidences)?;
    }
    folder.commit()?;
    Ok(done)
}

/// One prediction's files in the query's folder `dir`: `<name>_unrelaxed.pdb` (residue `i` in
/// PDB chain `chains[i]`), `<name>_confidence.json` (the monomer's measures, pTM as Multimer
/// weighs it, `iptm` and `ranking_confidence`) and, with `save`, `<name>_outputs.npz`.
fn write_prediction(
    dir: &Path,
    name: &str,
    outputs: &ModelOutputs,
    inputs: &MultimerInputs,
    chains: &[char],
    save: bool,
) -> anyhow::Result<()> {
    let s = &outputs.pass.structure;
    let plddt = outputs.pass.heads.plddt();
    Structure::from_tensors(&inputs.aatype, &inputs.residue_index, &s.atom37, &s.atom37_mask, &plddt)?
        .write_with_chains(&dir.join(format!("{name}_unrelaxed.pdb")), chains)?;
    let mut json = serde_json::to_value(outputs.confidence)?;
    json["iptm"] = outputs.iptm.into();
    json["ranking_confidence"] = outputs.ranking_confidence.into();
    let path = dir.join(format!("{name}_confidence.json"));
    data::write_atomic(&path, |w| -> anyhow::Result<()> { Ok(serde_json::to_writer(w, &json)?) })?;
    if save {
        save_outputs(&dir.join(format!("{name}_outputs.npz")), outputs)?;
    }
    Ok(())
}

/// ColabFold's plots of the complex ([`crate::plots`]): the predictions in their ranking's
/// order, the chains (in the features' order) separated, the MSA's real rows' coverage.
fn write_plots(
    dir: &Path,
    name: &str,
    features: &crate::multimer::MultimerFeatures,
    complex: &Complex,
    ranking: &Ranking,
    confidences: &[(String, Confidence)],
) -> anyhow::Result<()> {
    let ranked: Vec<ModelConfidence> = ranking
        .order
        .iter()
        .filter_map(|m| confidences.iter().find(|(n, _)| n == m))
        .map(|(_, c)| ModelConfidence { plddt: &c.plddt, pae: c.pae.as_deref() })
        .collect();
    let msa = features.get("msa").context("the features have no msa")?.tensor().to_kind(Kind::Int64);
    let real = features.get("num_alignments").map_or(msa.size()[0], |a| a.tensor().int64_value(&[]));
    let rows: Vec<Vec<i64>> =
        (0..real.min(msa.size()[0])).map(|i| Vec::<i64>::try_from(msa.get(i))).collect::<Result<_, _>>()?;
    let chains: Vec<usize> = complex.assembly_order().iter().map(|c| c.sequence.chars().count()).collect();
    plots::write(dir, name, &ranked, Some(&rows), &chains).with_context(|| format!("plotting {name}"))?;
    Ok(())
}

/// The options a multimer run does not take (yet), named.
fn check(args: &PredictArgs) -> anyhow::Result<()> {
    if args.precision.precision != Precision::Fp32 {
        bail!("AlphaFold-Multimer runs in fp32 only so far: leave out --precision");
    }
    let monomer_only = [
        ("--features", args.input.features.is_some()),
        ("--msa", args.input.msa.is_some()),
        ("--preset", args.input.preset.is_some()),
        ("--max-msa-clusters", args.input.max_msa_clusters.is_some()),
        ("--max-extra-msa", args.input.max_extra_msa.is_some()),
        ("--models", args.models.is_some()),
        ("--gpu-mem", args.chunk.gpu_mem.is_some()),
    ];
    if let Some((flag, _)) = monomer_only.iter().find(|(_, given)| *given) {
        bail!(
            "{flag} applies to monomer runs (so far); AlphaFold-Multimer (--params {}) takes the complex from \
             the FASTA file and the MSA sizes from the model's name",
            args.params.display()
        );
    }
    Ok(())
}

/// The Multimer parameter files of `params` (one file, or every file of a directory) with
/// their presets, by release name (`params_model_N_multimer_v3.npz`), which sets the MSA
/// sizes.
fn resolve(params: &Path) -> anyhow::Result<Vec<(MultimerPreset, PathBuf)>> {
    let files: Vec<PathBuf> = match params.is_dir() {
        true => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(params)
                .with_context(|| format!("reading --params {}", params.display()))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| MultimerPreset::from_params_path(p).is_some())
                .collect();
            files.sort();
            files
        }
        false => vec![params.to_path_buf()],
    };
    if files.is_empty() {
        bail!("--params {}: no AlphaFold-Multimer parameter file (params_model_N_multimer_v3.npz)", params.display());
    }
    files
        .into_iter()
        .map(|f| match MultimerPreset::from_params_path(&f) {
            Some(p) => Ok((p, f)),
            None => bail!(
                "--params {}: name the file as its release is named (params_model_N_multimer_v3.npz, or _v2, \
                 or its .safetensors conversion), which gives its MSA sizes",
                f.display()
            ),
        })
        .collect()
}

/// Each entity's inputs: from the homology search when one is asked for (UniProt pairing the
/// rows of a complex of distinct chains; rank 0 searches while the other ranks wait, then read
/// what it saved), else each chain's sequence alone, the query rows paired.
fn entity_inputs(
    args: &PredictArgs,
    world: &World,
    complex: &Complex,
    fasta: &Path,
    msas: &Path,
) -> anyhow::Result<Vec<EntityInput>> {
    if args.search.requested() {
        let mode = if world.rank() == 0 { Mode::Search } else { Mode::ReadSaved };
        let several = world.size() > 1;
        if several && mode == Mode::ReadSaved {
            world.group.barrier().context("waiting for rank 0's homology search")?;
        }
        let uniprot = args.multimer.uniprot(args.search.databases.data_dir.as_deref());
        let inputs = match args.search.search(mode)? {
            Some(searcher) => search::entity_inputs(complex, &searcher, uniprot.as_deref(), msas, mode),
            None => Err(anyhow::anyhow!("the homology search is not set up")),
        };
        if several && mode == Mode::Search {
            // Released whether the search worked or not: the others then fail reading it back.
            world.group.barrier().context("telling the other ranks the homology search is done")?;
        }
        return inputs;
    }
    EntityInput::single_sequences(complex, fasta)
}
