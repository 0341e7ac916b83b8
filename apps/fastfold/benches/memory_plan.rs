//! The inference memory profile's predicted peak of `fastfold predict` by length, fp32 and
//! bf16, at model_1_ptm's sizes (or, with `--multimer`, model_1_multimer_v3's on a complex),
//! and the chunk plans for a budget: no run, the profile alone (`fastfold::memory`; checked
//! against the CPU allocator by `tests/memory.rs`).
//!
//! `cargo bench -p fastfold --bench memory_plan -- --msa-rows 508 --extra-rows 5120`
//! `cargo bench -p fastfold --bench memory_plan -- --multimer --residues 600,1200,2400`
//! `cargo bench -p fastfold --bench memory_plan -- --ranks 4` (one DAP rank's)
use clap::Parser;
use fastfold::memory::{self, plan::gib, AttentionLogits, MultimerSizes, Peak, Plan, Sizes};
use fastfold::model::config::TemplateConfig;
use fastfold::model::exec::ChunkPlan;
use fastfold::model::AttentionKernel;
use fastfold::model::{EvoformerConfig, ModelConfig, Params};
use tch::Kind;

#[derive(Parser, Debug)]
#[command(about = "Predicted peak memory of one prediction by length, and chunk plans for budgets")]
struct Args {
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,2000,4000,8000,12000,16000")]
    residues: Vec<i64>,
    /// MSA rows (clusters) the Evoformer runs.
    #[arg(long, default_value_t = 508)]
    msa_rows: i64,
    /// Extra-MSA rows (default: 5,120; with --multimer, v3's 2,048).
    #[arg(long)]
    extra_rows: Option<i64>,
    /// AlphaFold-Multimer v3 (model_1_multimer_v3's widths, 2 chains, the MSA sampled from
    /// 2,556 rows on the host, as on a GPU) in place of the monomer.
    #[arg(long)]
    multimer: bool,
    /// Templates, every one real (default: none for the monomer, 4 with --multimer).
    #[arg(long)]
    templates: Option<i64>,
    /// Recycling slices of the features on the device (a GPU's `fastfold predict` keeps the
    /// features on the host and moves each pass's slice over).
    #[arg(long, default_value_t = 1)]
    slices: i64,
    /// Budgets, comma-separated (`80G`: 80 GiB).
    #[arg(long, value_delimiter = ',', default_value = "80G,139G")]
    budgets: Vec<String>,
    /// The attentions on a GPU's fused kernels (`fastfold predict --attention`): whole logits
    /// softmaxed in place, or the tensor-core kernel, which makes none.
    #[arg(long, value_enum, default_value_t = AttentionKernel::Logits)]
    attention: AttentionKernel,
    /// DAP ranks (`fastfold predict --nproc`): each figure is then one rank's, the one holding
    /// the most rows (the monomer only; plans for several ranks never offload).
    #[arg(long, default_value_t = 1)]
    ranks: i64,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Bytes of one pass's batch on the device before the pass (`AlphaFold::batch`: the per-row
/// features stay on the host until used, `Batch::resident_tensors`) for `n` residues, `s` MSA
/// rows and `t` templates: float features in `elem`-byte elements (the target features, the
/// residue and MSA masks), residue types and indices in int64, a template's atoms, their
/// mask, residue types, pseudo-beta and its mask as processed (float32 and int64).
fn batch_bytes(n: i64, s: i64, t: i64, elem: i64) -> u64 {
    (n * (16 + 23 * elem) + s * n * elem + t * n * (37 * 4 * 4 + 8 + 4 * 4)) as u64
}

/// Parameters of model_1_multimer_v3 (the full-size fixture's manifest: names and shapes).
fn multimer_parameters() -> anyhow::Result<i64> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/multimer_network/full_manifest.json");
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let shapes = manifest["arrays"].as_array().ok_or_else(|| anyhow::anyhow!("{path}: no arrays"))?;
    Ok(shapes.iter().map(|a| a[1].as_array().map_or(0, |d| d.iter().map(|x| x.as_i64().unwrap_or(0)).product())).sum())
}

/// The network the table is for: its peak under a chunk plan and its plan for a budget.
struct Network {
    cfg: EvoformerConfig,
    model: ModelConfig,
    /// With AlphaFold-Multimer: its template stack and the complex's sampling sizes.
    multimer: Option<(TemplateConfig, i64, i64)>,
}

impl Network {
    fn multimer_sizes(&self, sizes: Sizes) -> Option<(TemplateConfig, MultimerSizes)> {
        self.multimer.map(|(t, msa, templates)| {
            {
                // The Evoformer runs the centres and the templates' rows (all real here).
                let pass = Sizes { msa_rows: sizes.msa_rows + templates, templates, ..sizes };
                let centres = sizes.msa_rows;
                let sampling_on_device = false;
                (t, MultimerSizes { pass, centres, msa, masked_rows: false, own_rows: centres, sampling_on_device })
            }
        })
    }

    fn peak(&self, sizes: Sizes, chunks: &ChunkPlan) -> Peak {
        match self.multimer_sizes(sizes) {
            Some((t, m)) => memory::multimer_pass_peak(&self.cfg, &self.model, Some(&t), m, chunks),
            None => memory::pass_peak(&self.cfg, &self.model, sizes, chunks),
        }
    }

    fn plan(&self, sizes: Sizes, fixed: u64, budget: u64) -> Result<Plan, String> {
        match self.multimer_sizes(sizes) {
            Some((t, m)) => memory::plan_multimer(&self.cfg, &self.model, Some(&t), m, fixed, budget),
            None => memory::plan(&self.cfg, &self.model, sizes, fixed, budget),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.ranks >= 1, "--ranks must be 1 or more, got {}", args.ranks);
    anyhow::ensure!(!(args.multimer && args.ranks > 1), "--ranks: the Multimer profile is one process's");
    let (cfg, model) = (EvoformerConfig::default(), ModelConfig::default());
    let (net, numel, extra_rows) = match args.multimer {
        false => {
            let numel: usize = Params::random_model(&cfg, &model, 0)?.iter().map(|(_, t)| t.numel()).sum();
            let extra = args.extra_rows.unwrap_or(5120);
            println!(
                "model_1_ptm sizes ({numel} parameters), {} MSA rows, {extra} extra rows, {} templates, {} recycling \
                 slice(s) of the features on the device",
                args.msa_rows,
                args.templates.unwrap_or(0),
                args.slices
            );
            (Network { cfg, model, multimer: None }, numel as i64, extra)
        }
        true => {
            let cfg = EvoformerConfig { outer_product_mean_first: true, fused_triangle_projections: true, ..cfg };
            let model = ModelConfig { aligned_error_bins: Some(64), templates: None, ..model };
            let numel = multimer_parameters()?;
            let extra = args.extra_rows.unwrap_or(2048);
            // v2.3's pipeline: the MSA the sampling draws from, at least 512 rows.
            let msa = (args.msa_rows + extra).max(512);
            println!(
                "model_1_multimer_v3 sizes ({numel} parameters), {} cluster centres and {extra} extra rows sampled \
                 from {msa}, {} templates, the features on the host",
                args.msa_rows,
                args.templates.unwrap_or(4)
            );
            let multimer = Some((TemplateConfig::default(), msa, args.templates.unwrap_or(4)));
            (Network { cfg, model, multimer }, numel, extra)
        }
    };
    let budgets: Vec<(String, u64)> =
        args.budgets.iter().map(|b| Ok((b.clone(), engine::gemini::parse_bytes(b)?))).collect::<anyhow::Result<_>>()?;
    print!(
        "| residues | precision | parameters + features GiB | unchunked peak GiB | least peak GiB (at) | least \
         offloaded GiB (at) |"
    );
    for (b, _) in &budgets {
        print!(" planned for {b} GiB |");
    }
    println!();
    println!("|---:|---|---:|---:|---:|---:|{}", "---:|".repeat(budgets.len()));
    let mut plans = vec![];
    for &n in &args.residues {
        for (kind, name) in [(Kind::Float, "fp32"), (Kind::BFloat16, "bf16")] {
            let e = kind.elt_size_in_bytes() as i64;
            let templates = if args.multimer { 0 } else { args.templates.unwrap_or(0) };
            // On a GPU: the fused kernels.
            let sizes = Sizes {
                residues: n,
                msa_rows: args.msa_rows,
                extra_rows,
                elem: e,
                templates,
                logits: AttentionLogits::of((kernels::Backend::Fused, args.attention)),
                host_apart: true,
                ranks: args.ranks,
            };
            // A complex's features stay on the host, the monomer's too but for the pass's slice.
            let features = match args.multimer {
                true => 0,
                false => args.slices as u64 * batch_bytes(n, args.msa_rows, templates, e),
            };
            let fixed = (numel * e) as u64 + features;
            let whole = net.peak(sizes, &ChunkPlan::uniform(None));
            let least = net.peak(sizes, &ChunkPlan::least());
            let offloaded = match args.ranks {
                1 => {
                    let p = net.peak(sizes, &ChunkPlan::least_offloaded());
                    format!("{:.1} ({})", gib(fixed + p.bytes), p.at)
                }
                _ => "(not under DAP)".to_string(),
            };
            print!(
                "| {n} | {name} | {:.1} | {:.1} | {:.1} ({}) | {offloaded} |",
                gib(fixed),
                gib(fixed + whole.bytes),
                gib(fixed + least.bytes),
                least.at,
            );
            for (b, budget) in &budgets {
                match net.plan(sizes, fixed, *budget) {
                    Ok(p) => {
                        print!(" {:.1} |", gib(p.peak()));
                        plans.push(format!("{n} {name} in {b}: {}", p.describe()));
                    }
                    Err(_) => print!(" does not fit |"),
                }
            }
            println!();
        }
    }
    println!();
    for p in plans {
        println!("- {p}");
    }
    Ok(())
}
