//! `fastfold predict` with AlphaFold-Multimer's parameters, as `run_alphafold.py
//! --model_preset=multimer` lays its outputs out: the FASTA file's records one complex, its
//! folder named after the file; the features (`features.npz`) from AlphaFold-Multimer's
//! pipeline ([`crate::multimer`]) on each entity's searched alignments, or, without a search,
//! on each chain's sequence alone (paired across chains by the query rows), or read from a
//! `features.npz` such a run wrote (`--features`, the folder named after that file); every
//! model (of a directory, those `--models` picks)
//! `--num-multimer-predictions-per-model` times with `run_alphafold.py`'s seeds
//! ([`Settings::runs`]); each prediction `<model>_pred_<i>` written as
//! `<name>_unrelaxed.pdb` (one PDB chain per record, lettered in the features' chain order
//! as AlphaFold letters them) and `<name>_confidence.json` (pLDDT, PAE,
//! pTM, ipTM, the ranking confidence); `ranked_<i>.pdb` and `ranking_debug.json` by
//! `0.8 ipTM + 0.2 pTM` (`iptm+ptm`), `timings.json`, and the plots.
//!
//! ColabFold's plots unless `--no-plots`; with `--save-outputs`, `<name>_outputs.npz` (with
//! `iptm`). fp32, or bf16 (`--precision bf16`: as the monomer model, the structure module's
//! geometry in fp32); `--max-msa-clusters` and `--max-extra-msa` in place of the preset's
//! `num_msa` and `num_extra_msa`; with several ranks the stacks run under DAP and rank 0
//! writes the files.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use engine::dist::World;
use tch::{Device, Kind, Tensor};

use super::{save_outputs, write_ranking, ModelOutputs, PredictArgs, Predicted};
use crate::confidence::{multimer_ranking_confidence, predicted_tm_score_of_chains, Confidence};
use crate::input::file_stem;
use crate::memory::{self, MultimerSizes};
use crate::model::heads::MAX_ERROR_BIN;
use crate::model::multimer::{
    network_key, MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs, MULTIMER_STRUCTURE_ITERATIONS,
};
use crate::model::recycling::Recycling;
use crate::model::Exec;
use crate::models::{no_choice_of_a_file, ModelChoice};
use crate::multimer::complex::CHAIN_IDS;
use crate::multimer::preset::{MultimerPreset, Settings};
use crate::multimer::{search, Complex, EntityInput};
use crate::pdb::Structure;
use crate::plots::{self, ModelConfidence};
use crate::query_folder::QueryFolder;
use crate::ranking::{Ranking, Timings};
use crate::search::Mode;

/// Every model's predictions on the complex of `args`' FASTA file (or its `--features`); the
/// summaries in the order they ran.
pub(super) fn run(args: &PredictArgs, world: &World) -> anyhow::Result<Vec<Predicted>> {
    check(args)?;
    let (device, exec, backend) = args.chunk.setup(&args.launch, world)?;
    let budget = args.chunk.budget(device)?;
    if budget.is_some() && device == Device::Cpu {
        // The CPU's measured peak: every allocation libtorch makes from here on, counted.
        engine::host_memory::track()?;
    }
    let kind = args.precision.precision.kind();
    let models = resolve(&args.params, args.models.as_deref())?;
    let settings = Settings::new(
        args.multimer.num_multimer_predictions_per_model,
        args.recycles,
        args.recycle_early_stop_tolerance,
    );
    let presets: Vec<MultimerPreset> = models.iter().map(|(p, _)| *p).collect();
    let runs = settings.runs(&presets, args.input.seed.seed)?;

    let start = Instant::now();
    let name = query_name(args)?;
    // Rank 0 writes the files; every rank runs the network (its stacks under DAP).
    let folder = match world.rank() {
        0 => Some(QueryFolder::open(&args.out, &name)?),
        _ => None,
    };
    let staging = folder.as_ref().map(|f| f.staging.clone());
    let (features, source) = read_features(args, world, &name, staging.as_deref())?;
    let inputs = MultimerInputs::from_named(|n| features.get(n).map(Tensor::shallow_clone), &source)?;
    let chains = pdb_chains(&inputs.asym_id, &source)?;
    let mut timings = Timings::default();
    timings.add("features", start.elapsed().as_secs_f64());

    let mut done = Vec::new();
    let mut scores = Vec::new();
    let mut confidences = Vec::new();
    for (preset, path) in &models {
        let iterations = args.structure_iterations.unwrap_or(MULTIMER_STRUCTURE_ITERATIONS);
        let net = MultimerAlphaFold::load_on(path, iterations, device, Some(kind), (backend, args.chunk.attention))
            .with_context(|| format!("parameters {}", path.display()))?
            .with_sampling(sampling(args, *preset));
        let planned = budget
            .map(|b| plan(&net, &inputs, &features, b, (&exec, device, kind)))
            .transpose()
            .with_context(|| format!("{name} with {preset}"))?;
        if let (Some((_, plan, sizes)), Some(budget), 0) = (&planned, budget, world.rank()) {
            super::say_plan(&format!("{name} {preset}"), budget, &sizes.pass, plan);
        }
        let exec = planned.as_ref().map_or(&exec, |(exec, _, _)| exec);
        let planned_bytes = planned.as_ref().map(|(_, plan, _)| plan.peak());
        for run in runs.iter().filter(|r| r.preset == *preset) {
            let recycling =
                Recycling { max: settings.num_recycle, early_stop_tolerance: settings.recycle_early_stop_tolerance };
            super::start_peak(planned_bytes.is_some(), device)?;
            let start = Instant::now();
            let (pass, recycles) = tch::no_grad(|| net.predict(&inputs, recycling, network_key(run.seed), exec))
                .with_context(|| format!("predicting {name} with {}", run.name))?;
            // The prediction's peak, before the confidence measures and the files.
            let peak_bytes = super::measured_peak(planned_bytes.is_some(), device)?;
            let seconds = start.elapsed().as_secs_f64();
            timings.add(format!("predict_and_compile_{}", run.name), seconds);
            let pae = pass.heads.aligned_error.as_ref().context("AlphaFold-Multimer's parameters have a PAE head")?;
            let weights = inputs.seq_mask.to_kind(Kind::Float).to_device(pae.device());
            let asym_id = inputs.asym_id.to_kind(Kind::Int64).to_device(pae.device());
            // Collectives under DAP: every rank computes its rows' measures and gathers, rank 0
            // (with `staging`) writes.
            let rows = &pass.heads.rows;
            let ptm = predicted_tm_score_of_chains(pae, rows, MAX_ERROR_BIN, &weights, None)?;
            let iptm = predicted_tm_score_of_chains(pae, rows, MAX_ERROR_BIN, &weights, Some(&asym_id))?;
            let ranking_confidence = multimer_ranking_confidence(iptm, ptm);
            let mut confidence = Confidence::from_logits(&pass.heads.lddt, Some(pae), rows)?;
            confidence.ptm = Some(ptm);
            let whole = if args.save_outputs { pass.whole_on_host()? } else { None };
            if let Some(dir) = &staging {
                let outputs = ModelOutputs {
                    pass: &pass,
                    recycles,
                    confidence: &confidence,
                    iptm: Some(iptm),
                    ranking_confidence,
                    whole,
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
                peak_bytes,
                planned_bytes,
            });
            confidences.push((run.name.clone(), confidence));
        }
    }
    let Some(folder) = folder else { return Ok(done) };
    let ranking = Ranking::multimer(&scores);
    write_ranking(&folder.staging, &ranking, &timings)?;
    if !args.no_plots {
        write_plots(&folder.staging, &name, &features, &chains, &ranking, &confidences)?;
    }
    folder.commit()?;
    Ok(done)
}

/// The complex's name, its output folder's: the FASTA file's stem, or the `--features`
/// file's (as a monomer run names a features file's query).
fn query_name(args: &PredictArgs) -> anyhow::Result<String> {
    let path = match (&args.input.features, &args.input.fasta) {
        (Some(path), _) | (None, Some(path)) => path,
        (None, None) => bail!("give a FASTA file (its records are the complex's chains) or --features"),
    };
    Ok(file_stem(&path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()))
}

/// The complex's features by AlphaFold's names, and where they came from (for errors): the
/// `--features` file as it is (the `features.npz` a multimer run writes), or the pipeline's on
/// the FASTA file's records; either written to `staging` as `features.npz` (rank 0).
fn read_features(
    args: &PredictArgs,
    world: &World,
    name: &str,
    staging: Option<&Path>,
) -> anyhow::Result<(HashMap<String, Tensor>, String)> {
    let (arrays, source) = match (&args.input.features, &args.input.fasta) {
        (Some(path), _) => {
            if args.search.requested() {
                args.input.check_searchable()?;
            }
            let source = format!("--features {}", path.display());
            (data::npz::read(path).with_context(|| source.clone())?, source)
        }
        (None, Some(fasta)) => {
            let records = data::fasta::read(fasta)?;
            if records.is_empty() {
                bail!("{}: no FASTA records", fasta.display());
            }
            let complex = Complex::new(&records, fasta)?;
            let entities = entity_inputs(args, world, &complex, fasta, &args.out.join(name).join("msas"))?;
            (crate::multimer::features(&complex, &entities)?.tensors(), name.to_string())
        }
        (None, None) => bail!("give a FASTA file (its records are the complex's chains) or --features"),
    };
    if let Some(dir) = staging {
        data::checkpoint::save_npz(&arrays, &dir.join("features.npz"))?;
    }
    Ok((arrays.into_iter().collect(), source))
}

/// Each residue's PDB chain from its `asym_id` (1 is `A`, 2 `B`, ...), as AlphaFold's
/// `protein.to_pdb` letters them: the features' chain order (which differs from
/// `chain_id_map.json`'s FASTA letters when copies of a sequence are not adjacent records).
fn pdb_chains(asym_id: &Tensor, source: &str) -> anyhow::Result<Vec<char>> {
    let ids = Vec::<i64>::try_from(asym_id.to_kind(Kind::Int64).flatten(0, -1))?;
    let letters: Vec<char> = CHAIN_IDS.chars().collect();
    ids.iter()
        .map(|&id| match usize::try_from(id - 1).ok().and_then(|i| letters.get(i)) {
            Some(&c) => Ok(c),
            None => bail!("{source}: asym_id {id} is not a chain 1 to {} (AlphaFold's chain ids)", letters.len()),
        })
        .collect()
}

/// How a model samples the MSA on each pass: its preset's sizes (`num_msa`, `num_extra_msa`),
/// or `--max-msa-clusters` and `--max-extra-msa` in their place, as AlphaFold's config
/// overrides them.
fn sampling(args: &PredictArgs, preset: MultimerPreset) -> MsaSampling {
    MsaSampling {
        num_msa: args.input.max_msa_clusters.unwrap_or(preset.num_msa()) as i64,
        num_extra_msa: args.input.max_extra_msa.unwrap_or(preset.num_extra_msa()) as i64,
        masked: MaskedMsaConfig::default(),
    }
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
/// order, the chains (residue `i` in `chains[i]`, the features' order) separated, the MSA's
/// real rows' coverage.
fn write_plots(
    dir: &Path,
    name: &str,
    features: &HashMap<String, Tensor>,
    chains: &[char],
    ranking: &Ranking,
    confidences: &[(String, Confidence)],
) -> anyhow::Result<()> {
    let ranked: Vec<ModelConfidence> = ranking
        .order
        .iter()
        .filter_map(|m| confidences.iter().find(|(n, _)| n == m))
        .map(|(_, c)| ModelConfidence { plddt: &c.plddt, pae: c.pae.as_deref() })
        .collect();
    let msa = features.get("msa").context("the features have no msa")?.to_kind(Kind::Int64);
    let real = features.get("num_alignments").map_or(msa.size()[0], |a| a.int64_value(&[]));
    let rows: Vec<Vec<i64>> =
        (0..real.min(msa.size()[0])).map(|i| Vec::<i64>::try_from(msa.get(i))).collect::<Result<_, _>>()?;
    let lengths: Vec<usize> = chains.chunk_by(|a, b| a == b).map(<[char]>::len).collect();
    plots::write(dir, name, &ranked, Some(&rows), &lengths).with_context(|| format!("plotting {name}"))?;
    Ok(())
}

/// The options a multimer run does not take, each refused with what to do instead.
fn check(args: &PredictArgs) -> anyhow::Result<()> {
    let params = args.params.display();
    if let Some(msa) = &args.input.msa {
        bail!(
            "--msa {} is one chain's alignment; a complex's alignments come from the search (--data-dir and the \
             database flags), saved under <out>/<name>/msas/<chain id>/ and read back with --use-precomputed-msas \
             (or give the features of a multimer run with --features)",
            msa.display()
        );
    }
    if let Some(preset) = &args.input.preset {
        bail!(
            "--preset {preset} is a monomer model's; AlphaFold-Multimer (--params {params}) takes its MSA sizes \
             from the model's name (params_model_N_multimer_v3), --max-msa-clusters and --max-extra-msa override them"
        );
    }
    Ok(())
}

/// The execution context of `net` on `inputs` under a memory budget: each chunked operation's
/// size from the Multimer pass's memory profile ([`memory::plan_multimer`]), on top of the
/// parameters and (on the CPU, where the features are) the features; the plan and the sizes
/// it was made for.
fn plan(
    net: &MultimerAlphaFold,
    inputs: &MultimerInputs,
    features: &HashMap<String, Tensor>,
    budget: u64,
    (exec, device, kind): (&Exec, Device, Kind),
) -> anyhow::Result<(Exec, memory::Plan, MultimerSizes)> {
    let on_cpu = device == Device::Cpu;
    let sizes = memory::multimer_sizes_of(inputs, net, (kind, device), on_cpu, exec.dap().size())?;
    let features = if on_cpu { memory::bytes_of(features.values()) } else { 0 };
    let plan = memory::plan_multimer(
        net.config(),
        net.model_config(),
        net.template_config(),
        sizes,
        net.param_bytes() + features,
        budget,
    )
    .map_err(|e| anyhow::anyhow!("{e} (--gpu-mem)"))?;
    Ok((Exec::planned(exec.dap().clone(), plan.chunks.clone()), plan, sizes))
}

/// The Multimer parameter files of `params` (one file, or the files of a directory `models`
/// picks, by default every one) with their presets, by release name
/// (`params_model_N_multimer_v3.npz`), which sets the MSA sizes: a number picks every release
/// of that model the directory has, a name (`model_1_multimer_v3`) the one file.
fn resolve(params: &Path, models: Option<&[ModelChoice]>) -> anyhow::Result<Vec<(MultimerPreset, PathBuf)>> {
    no_choice_of_a_file(params, models)?;
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
    let mut all = files
        .into_iter()
        .map(|f| match MultimerPreset::from_params_path(&f) {
            Some(p) => Ok((p, f)),
            None => bail!(
                "--params {}: name the file as its release is named (params_model_N_multimer_v3.npz, or _v2, \
                 or its .safetensors conversion), which gives its MSA sizes",
                f.display()
            ),
        })
        .collect::<anyhow::Result<Vec<(MultimerPreset, PathBuf)>>>()?;
    // One file a model: the `.npz` where its `.safetensors` conversion is there too.
    all.dedup_by_key(|(p, _)| *p);
    let Some(choices) = models else { return Ok(all) };
    let mut picked: Vec<(MultimerPreset, PathBuf)> = Vec::new();
    for &choice in choices {
        let chosen: Vec<&(MultimerPreset, PathBuf)> = match choice {
            ModelChoice::Number(n) => all.iter().filter(|(p, _)| p.model == n).collect(),
            ModelChoice::Multimer(m) => all.iter().filter(|(p, _)| *p == m).take(1).collect(),
            ModelChoice::Named(m) => bail!(
                "--models {m} is a monomer model; --params {} holds AlphaFold-Multimer's (pick them by number or \
                 as model_1_multimer_v3)",
                params.display()
            ),
        };
        if chosen.is_empty() {
            let have: Vec<String> = all.iter().map(|(p, _)| p.to_string()).collect();
            bail!("--models {choice}: {} has no parameter file for it (it has {have:?})", params.display());
        }
        for c in chosen {
            if picked.iter().any(|(p, _)| *p == c.0) {
                bail!("--models names {} twice", c.0);
            }
            picked.push(c.clone());
        }
    }
    Ok(picked)
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
