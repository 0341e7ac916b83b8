//! What `predict` and `train` share on the command line: where the features come from (FASTA
//! and an optional A3M alignment through AlphaFold's feature pipeline, or an already-processed
//! `.npz`), and the device, ranks, chunking and timeout a run uses.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::builder::TypedValueParser;
use engine::dist::World;
use engine::fp32_matmul::Fp32Matmul;
use engine::job::{LaunchArgs, SeedArgs};
use engine::parallel::dap::Dap;
use tch::Device;

use crate::features::{process, FeatureConfig, Features, RawFeatures};
use crate::model::AttentionKernel;
use crate::model::{Exec, Params};
use crate::preset::Preset;
use crate::search::{Mode, Search};

/// The inputs: FASTA (+ A3M) or processed features.
#[derive(clap::Args, Debug, Clone)]
pub struct InputArgs {
    /// FASTA file; every record is a query (not with --features).
    pub fasta: Option<PathBuf>,
    /// Precomputed alignment of the query: A3M, or Stockholm as jackhmmer writes it; FASTA
    /// with one record only. Without it the
    /// sequence runs alone (single-sequence mode).
    #[arg(long)]
    pub msa: Option<PathBuf>,
    /// Features in place of FASTA and MSA: processed ones (`.npz` under AlphaFold's feature
    /// names, with the leading recycling dimension; every model runs on them as they are), or
    /// the raw `features.npz` that predict writes beside its outputs (AlphaFold's
    /// `features.pkl` arrays; processed here per model, as FASTA input is).
    #[arg(long, conflicts_with_all = ["fasta", "msa"])]
    pub features: Option<PathBuf>,
    /// AlphaFold's model preset (model_1 ... model_5, optionally _ptm) whose MSA sizes apply;
    /// default: the one the --params file's name gives (`params_model_N[_ptm]`), else 512
    /// clusters and 1024 extra rows. The parameters must be that preset's network.
    #[arg(long)]
    pub preset: Option<Preset>,
    /// MSA rows kept as cluster centres (AlphaFold's `max_msa_clusters`; default: the
    /// preset's).
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub max_msa_clusters: Option<usize>,
    /// Further rows kept as the extra MSA (AlphaFold's `max_extra_msa`; default: the
    /// preset's).
    #[arg(long)]
    pub max_extra_msa: Option<usize>,
    /// Seed of the feature pipeline's MSA sampling and masking.
    #[command(flatten)]
    pub seed: SeedArgs,
}

/// The most recycling passes `--num-recycle` and train's `--recycles` take (each pass
/// processed here samples its own MSA features, so the count sizes memory).
pub const MAX_RECYCLES: u64 = 1000;

/// The longest query folder name: file systems allow 255 bytes, less the staging folder's
/// `.<name>.partial-<pid>` around it.
const MAX_NAME: usize = 200;

/// The `--msa` alignment: A3M, or Stockholm (as jackhmmer writes it, recognised by its
/// `# STOCKHOLM` header) read as AlphaFold's `parse_stockholm` reads it.
fn read_msa(path: &Path) -> anyhow::Result<data::a3m::Msa> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --msa {}", path.display()))?;
    parse_alignment(&text, path)
}

/// An alignment's text (`path` names it in errors): Stockholm when it starts with the
/// `# STOCKHOLM` header, else A3M.
pub(crate) fn parse_alignment(text: &str, path: &Path) -> anyhow::Result<data::a3m::Msa> {
    if text.trim_start_matches('\u{feff}').trim_start().starts_with("# STOCKHOLM") {
        return Ok(crate::search::stockholm::parse(text, path)?);
    }
    Ok(data::a3m::parse(text, path)?)
}

/// A name usable as a file-name stem: path separators and odd characters become `_`.
pub(crate) fn file_stem(name: &str) -> String {
    let s: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    match s.trim_start_matches('.') {
        "" => "query".into(),
        t => t.to_string(),
    }
}

impl InputArgs {
    /// The preset in force for the parameters loaded from `path` (`--preset`, else the one the
    /// file's name gives, else none), checked against them.
    pub fn preset(&self, params: &Params, path: &Path) -> anyhow::Result<Option<Preset>> {
        let (preset, from) = match self.preset {
            Some(p) => (p, "--preset"),
            None => match Preset::from_params_path(path) {
                Some(p) => (p, "its file name"),
                None => return Ok(None),
            },
        };
        let config = params.model_config()?;
        preset.check(&config).map_err(|e| anyhow::anyhow!("{} is not {preset} ({from}): {e}", path.display()))?;
        Ok(Some(preset))
    }

    /// The inputs, each named (the FASTA record's name or the features file's stem, made safe
    /// for file names), with `recycles + 1` recycling slices when processed here, MSA sizes
    /// from `preset` unless given.
    pub fn load(
        &self,
        recycles: usize,
        preset: Option<Preset>,
        device: Device,
    ) -> anyhow::Result<Vec<(String, Features)>> {
        self.read(device, None)?
            .into_iter()
            .map(|q| Ok((q.name.clone(), self.process(&q.query, recycles, preset, device, &q.name)?)))
            .collect()
    }

    /// An error when the inputs leave nothing to search for (--features or --msa given).
    pub fn check_searchable(&self) -> anyhow::Result<()> {
        match self.features.as_ref().or(self.msa.as_ref()) {
            Some(path) => bail!(
                "{} is given, so there is nothing to search for: drop it, or --data-dir and the database flags",
                path.display()
            ),
            None => Ok(()),
        }
    }

    /// The inputs as read, before any preset's processing, each named (the FASTA record's
    /// name or the features file's stem, made safe for file names; two records that would
    /// share a name are an error, since each gets its own output folder). With `search`
    /// (the search, the output folder, the mode), each record's MSA comes from a homology
    /// search whose alignments go to `<out>/<name>/msas/`. Each query has the seconds its
    /// reading and search took (see [`ReadQuery::seconds`]).
    pub fn read(&self, device: Device, search: Option<(&Search, &Path, Mode)>) -> anyhow::Result<Vec<ReadQuery>> {
        // Each query's time runs from the end of the one before, so the first's also has the
        // reading of the files the queries share (FASTA, --msa).
        let mut start = Instant::now();
        if search.is_some() {
            self.check_searchable()?;
        }
        if let Some(path) = &self.features {
            let arrays = data::npz::read(path)?;
            let names: Vec<&str> = arrays.iter().map(|(k, _)| k.as_str()).collect();
            let query = match RawFeatures::are_raw(&names) {
                true => Query::Raw(RawFeatures::from_npz_arrays(arrays, path)?),
                false => Query::Processed(Features::from_npz_arrays(arrays, path, device)?),
            };
            let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            return Ok(vec![ReadQuery { name: file_stem(&name), query, seconds: start.elapsed().as_secs_f64() }]);
        }
        let Some(fasta) = &self.fasta else { bail!("give a FASTA file or --features") };
        let records = data::fasta::read(fasta)?;
        if records.is_empty() {
            bail!("{}: no FASTA records", fasta.display());
        }
        let msa = match &self.msa {
            Some(path) if records.len() > 1 => {
                bail!(
                    "--msa {} is one alignment, but {} has {} records",
                    path.display(),
                    fasta.display(),
                    records.len()
                )
            }
            Some(path) => Some((read_msa(path)?, path.clone())),
            None => None,
        };
        let mut read: Vec<ReadQuery> = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            let name = file_stem(&r.name);
            if name.len() > MAX_NAME {
                bail!(
                    "{}: record {} ({:.40}...) has a name of {} characters; its output folder's name allows \
                     {MAX_NAME}: shorten the header's first word",
                    fasta.display(),
                    i + 1,
                    r.name,
                    name.len()
                );
            }
            if let Some(j) = read.iter().position(|q| q.name == name) {
                bail!(
                    "{}: records {} and {} are both named {name:?} as output folders; rename one",
                    fasta.display(),
                    j + 1,
                    i + 1
                );
            }
            let raw = match search {
                Some((search, out, mode)) => {
                    let msas = out.join(&name).join("msas");
                    let found = search
                        .run(&name, &r.sequence, &msas, mode)
                        .with_context(|| format!("searching for homologues of {}", r.name))?;
                    RawFeatures::new(&r.sequence, Some((&found.msa, &msas)))
                        .map(|raw| RawFeatures { templates: found.templates, ..raw })
                }
                None => RawFeatures::new(&r.sequence, msa.as_ref().map(|(m, p)| (m, p.as_path()))),
            }
            .with_context(|| format!("record {}", r.name))?;
            read.push(ReadQuery { name, query: Query::Raw(raw), seconds: start.elapsed().as_secs_f64() });
            start = Instant::now();
        }
        Ok(read)
    }

    /// `query`'s processed features for a model of `preset` (its MSA sizes unless given),
    /// with `recycles + 1` recycling slices when processed here; `name` names it in errors.
    pub fn process(
        &self,
        query: &Query,
        recycles: usize,
        preset: Option<Preset>,
        device: Device,
        name: &str,
    ) -> anyhow::Result<Features> {
        let raw = match query {
            Query::Processed(features) => return Ok(features.to_device(device)),
            Query::Raw(raw) => raw,
        };
        let defaults = FeatureConfig::default();
        let config = FeatureConfig {
            max_msa_clusters: self
                .max_msa_clusters
                .or(preset.map(Preset::max_msa_clusters))
                .unwrap_or(defaults.max_msa_clusters),
            max_extra_msa: self.max_extra_msa.or(preset.map(Preset::max_extra_msa)).unwrap_or(defaults.max_extra_msa),
            num_recycle: recycles,
            ..defaults
        };
        process(raw, &config, self.seed.seed, device).with_context(|| format!("processing the features of {name}"))
    }
}

/// One query as [`InputArgs::read`] gives it.
pub struct ReadQuery {
    /// The FASTA record's name or the features file's stem, made safe for file names (its
    /// output folder's name).
    pub name: String,
    /// Its features.
    pub query: Query,
    /// Seconds of its reading and homology search (AlphaFold's `features` step, which
    /// `run_alphafold.py` times per FASTA file); the first query's include the reading of the
    /// input files the queries share.
    pub seconds: f64,
}

/// One query as read: raw features for AlphaFold's pipeline to process per preset (as
/// `run_alphafold.py` processes per model), or features processed already.
pub enum Query {
    /// From FASTA (and A3M).
    Raw(RawFeatures),
    /// From a processed `--features` file: every model runs on them as they are.
    Processed(Features),
}

/// `--chunk-size`, `--gpu-mem`, `--kernels` and `--fp32-matmul`: how the model's modules run.
#[derive(clap::Args, Debug, Clone)]
pub struct ChunkArgs {
    /// Run attention, transitions, outer product mean and triangle ops in chunks of this many
    /// rows (less memory, same result).
    #[arg(long, value_parser = engine::parse::count(1..).try_map(i64::try_from), conflicts_with = "gpu_mem")]
    pub chunk_size: Option<i64>,
    /// Memory budget (`80G`, `3GiB`). On a GPU it caps the whole process, as `nvidia-smi`
    /// counts it: what the CUDA context and libraries hold is measured at the start. `predict`
    /// chooses each chunked operation's chunk size from the inference memory profile to fit
    /// what is left (with `--nproc` each rank's), none chunked where it allows; without the
    /// flag, on a GPU for the device's free memory at the start, on the CPU no plan. `train`
    /// plans no chunks from it and refuses it on the CPU.
    #[arg(long, visible_alias = "memory-budget", value_parser = |s: &str| engine::gemini::parse_bytes(s).map_err(|e| e.to_string()))]
    pub gpu_mem: Option<u64>,
    /// The attention softmax (scale, mask, pair bias), LayerNorms and triangle-update gates:
    /// the fused CUDA kernels or libtorch's compositions (default: fused on CUDA, torch
    /// elsewhere).
    #[arg(long, value_enum)]
    pub kernels: Option<kernels::Backend>,
    /// The attentions of an inference pass on the fused kernels: `logits` makes each
    /// attention's logits whole (cuBLAS) and softmaxes them in place; `flash` runs the
    /// tensor-core kernel, which never makes them (its fp32 products TF32; a GPU of compute
    /// capability 8.0 or later). Training always makes them whole.
    #[arg(long, value_enum, default_value_t = AttentionKernel::Logits)]
    pub attention: AttentionKernel,
    /// fp32 matrix products on a GPU: `tf32` (TF32 tensor cores, as AlphaFold's JAX code runs
    /// them there by default) or `ieee` (strict fp32). The structure module and every rigid
    /// transform stay IEEE either way, as AlphaFold keeps its geometry off the tensor cores.
    /// No effect on the CPU or on bf16 products.
    #[arg(long, value_enum, default_value_t = Fp32Matmul::Tf32)]
    pub fp32_matmul: Fp32Matmul,
}

impl ChunkArgs {
    /// Checks the options and returns this rank's device, the execution context (DAP over the
    /// job, the chunk size) and the kernels the modules run.
    pub fn setup(&self, launch: &LaunchArgs, world: &World) -> anyhow::Result<(Device, Exec, kernels::Backend)> {
        let dap = match world.size() {
            1 => Dap::none(),
            _ => Dap::new(world.group.clone()),
        };
        self.setup_with(launch, world, dap)
    }

    /// [`ChunkArgs::setup`] with DAP over `dap` in place of the whole job (`fastfold train`'s
    /// groups: see [`crate::train_parallel`]). Sets the process's fp32 products as
    /// `--fp32-matmul` says ([`engine::fp32_matmul::set`]).
    pub fn setup_with(
        &self,
        launch: &LaunchArgs,
        world: &World,
        dap: Dap,
    ) -> anyhow::Result<(Device, Exec, kernels::Backend)> {
        let device = launch.device(world)?;
        let backend = kernels::Backend::resolve(self.kernels, device)?;
        self.attention.check(backend, self.fp32_matmul == Fp32Matmul::Ieee)?;
        engine::fp32_matmul::set(self.fp32_matmul)?;
        if let Some(split) = self.process_cap(device)? {
            if world.rank() == 0 {
                eprintln!("{split}");
            }
        }
        Ok((device, Exec::new(dap, self.chunk_size), backend))
    }

    /// `--gpu-mem` on a GPU: the process capped there, and how the cap splits between the CUDA
    /// context and libraries and the caching allocator ([`engine::gemini::cap_process_memory`];
    /// a second call reuses the first's measurement).
    fn process_cap(&self, device: Device) -> anyhow::Result<Option<engine::gemini::DeviceSplit>> {
        let Some(cap) = self.gpu_mem else { return Ok(None) };
        engine::gemini::cap_process_memory(device, cap, false)
            .with_context(|| format!("--gpu-mem {}", engine::gemini::human(cap as usize)))
    }

    /// The memory budget predictions are planned for: `--gpu-mem` (on a GPU, what the process's
    /// cap leaves the caching allocator), else on a GPU its free memory now (none with
    /// `--chunk-size`, which chooses for itself).
    pub fn budget(&self, device: Device) -> anyhow::Result<Option<u64>> {
        if let Some(split) = self.process_cap(device)? {
            return Ok(Some(split.allocator));
        }
        Ok(match (self.gpu_mem, self.chunk_size, device) {
            (Some(b), _, _) => Some(b),
            (None, None, Device::Cuda(d)) => Some(engine::cuda::mem_get_info(d)?.0),
            _ => None,
        })
    }
}
