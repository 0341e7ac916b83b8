//! The inference memory profile's predicted peak of `fastfold predict` by length, fp32 and
//! bf16, at model_1_ptm's sizes, and the chunk plans for a budget: no run, the profile alone
//! (`fastfold::memory`; checked against the CPU allocator by `tests/memory.rs`).
//!
//! `cargo bench -p fastfold --bench memory_plan -- --msa-rows 508 --extra-rows 5120`
use clap::Parser;
use fastfold::memory::{self, plan::gib, Sizes};
use fastfold::model::exec::ChunkPlan;
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
    /// Extra-MSA rows.
    #[arg(long, default_value_t = 5120)]
    extra_rows: i64,
    /// Recycling feature slices kept (num_recycle + 1).
    #[arg(long, default_value_t = 4)]
    slices: i64,
    /// Budgets, comma-separated (`80G`: 80 GiB).
    #[arg(long, value_delimiter = ',', default_value = "80G,139G")]
    budgets: Vec<String>,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Bytes of processed features for `n` residues (AlphaFold's pipeline: float32 and int64).
fn feature_bytes(n: i64, s: i64, e: i64, slices: i64) -> u64 {
    (slices * (n * 720 + s * n * 212 + e * n * 20)) as u64
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (cfg, model) = (EvoformerConfig::default(), ModelConfig::default());
    let numel: usize = Params::random_model(&cfg, &model, 0)?.iter().map(|(_, t)| t.numel()).sum();
    println!(
        "model_1_ptm sizes ({numel} parameters), {} MSA rows, {} extra rows, no templates, {} feature slices",
        args.msa_rows, args.extra_rows, args.slices
    );
    let budgets: Vec<(String, u64)> =
        args.budgets.iter().map(|b| Ok((b.clone(), engine::gemini::parse_bytes(b)?))).collect::<anyhow::Result<_>>()?;
    print!("| residues | precision | parameters + features GiB | unchunked peak GiB | least peak GiB (at) |");
    for (b, _) in &budgets {
        print!(" planned for {b} GiB |");
    }
    println!();
    println!("|---:|---|---:|---:|---:|{}", "---:|".repeat(budgets.len()));
    let mut plans = vec![];
    for &n in &args.residues {
        for (kind, name) in [(Kind::Float, "fp32"), (Kind::BFloat16, "bf16")] {
            let e = kind.elt_size_in_bytes() as i64;
            let sizes = Sizes { residues: n, msa_rows: args.msa_rows, extra_rows: args.extra_rows, elem: e };
            let fixed = (numel as i64 * e) as u64 + feature_bytes(n, args.msa_rows, args.extra_rows, args.slices);
            let whole = memory::pass_peak(&cfg, &model, sizes, &ChunkPlan::uniform(None));
            let least = memory::pass_peak(&cfg, &model, sizes, &ChunkPlan::uniform(Some(1)));
            print!(
                "| {n} | {name} | {:.1} | {:.1} | {:.1} ({}) |",
                gib(fixed),
                gib(fixed + whole.bytes),
                gib(fixed + least.bytes),
                least.at
            );
            for (b, budget) in &budgets {
                match memory::plan(&cfg, &model, sizes, fixed, *budget) {
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
