//! Padding-free stacks against the padded run: AlphaFold's features pad the MSA to 512
//! clusters and the extra MSA to 5,120 rows whatever the alignment's depth; this times a whole
//! prediction at AlphaFold's sizes (`model_1_ptm`, random weights) on such padded features,
//! once running every padding row and once leaving the fully-masked rows out
//! ([`fastfold::model::masked_rows`]), side by side (the fastest of `--repeats` interleaved
//! runs each), and checks the outputs agree.
//!
//! `cargo bench -p fastfold --bench masked_rows -- --residues 64 --depths 1,64,1024`
use std::time::Instant;

use clap::Parser;
use engine::device::DeviceKind;
use engine::parallel::dap::Dap;
use fastfold::features::{process, FeatureConfig, RawFeatures};
use fastfold::model::alphafold::{AlphaFold, Pass};
use fastfold::model::{EvoformerConfig, Exec, ModelConfig, Params};
use tch::{Device, Kind};

#[derive(Parser, Debug)]
#[command(about = "Predictions on padded features with and without the fully-masked rows")]
struct Args {
    /// Sequence length.
    #[arg(long, default_value_t = 64)]
    residues: usize,
    /// Alignment depths (sequences, the query included), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64,1024")]
    depths: Vec<usize>,
    /// MSA clusters the features are padded to (AlphaFold: 512).
    #[arg(long, default_value_t = 512)]
    max_msa_clusters: usize,
    /// Extra-MSA rows the features are padded to (AlphaFold: 5120 for models 1, 3, 4).
    #[arg(long, default_value_t = 5120)]
    max_extra_msa: usize,
    /// Evoformer blocks (AlphaFold: 48); fewer for a quick look.
    #[arg(long, default_value_t = 48)]
    blocks: i64,
    /// Recycling passes after the first.
    #[arg(long, default_value_t = 0)]
    recycles: usize,
    /// Timed runs of each kind, interleaved; the fastest counts (a shared machine's load
    /// comes and goes).
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Chunk size of the memory-heavy steps.
    #[arg(long)]
    chunk_size: Option<i64>,
    /// Device.
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A query of `n` residues and an A3M of `depth` sequences: the query and copies with about a
/// quarter of the residues changed at random (xorshift, fixed seeds), so no two rows are alike.
fn alignment(n: usize, depth: usize) -> (String, String) {
    let letters = b"ARNDCQEGHILKMFPSTWYV";
    let query: String = (0..n).map(|i| letters[(i * 7 + i / 3) % 20] as char).collect();
    let mut a3m = format!(">query\n{query}\n");
    for s in 1..depth as u64 {
        let mut state = s.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let row: String = query
            .bytes()
            .map(|c| match next() % 4 {
                0 => letters[(next() % 20) as usize] as char,
                _ => c as char,
            })
            .collect();
        a3m.push_str(&format!(">s{s}\n{row}\n"));
    }
    (query, a3m)
}

fn time(model: &AlphaFold, features: &fastfold::features::Features, args: &Args) -> anyhow::Result<(f64, Pass)> {
    let start = Instant::now();
    let pass = tch::no_grad(|| {
        model.predict(features, args.recycles, Kind::Float, &Exec::new(Dap::none(), args.chunk_size), None)
    })?;
    if let Device::Cuda(d) = features.aatype.device() {
        engine::cuda::synchronize(d)?;
    }
    Ok((start.elapsed().as_secs_f64(), pass))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let device = args.device.device(0, 1)?;
    let cfg = EvoformerConfig { num_blocks: args.blocks, ..EvoformerConfig::default() };
    let params = Params::random_model(&cfg, &ModelConfig::default(), 0)?.to_device(device, false)?;
    let padded = AlphaFold::new(&params)?.drop_masked_rows(false);
    let dropped = AlphaFold::new(&params)?;
    println!(
        "predict on features padded to {} MSA / {} extra rows: model_1_ptm sizes with {} Evoformer blocks \
         (random weights), {} residues, {} recycles, fp32 on {device:?}",
        args.max_msa_clusters, args.max_extra_msa, args.blocks, args.residues, args.recycles
    );
    println!("| depth | MSA rows | extra rows | padded s | masked rows left out s | speed-up | max diff positions Å |");
    println!("|---|---|---|---|---|---|---|");
    for &depth in &args.depths {
        let (query, a3m) = alignment(args.residues, depth.max(1));
        let msa = data::a3m::parse(&a3m, std::path::Path::new("<synthetic>"))?;
        let raw = RawFeatures::new(&query, Some((&msa, std::path::Path::new("<synthetic>"))))?;
        let config = FeatureConfig {
            max_msa_clusters: args.max_msa_clusters,
            max_extra_msa: args.max_extra_msa,
            num_recycle: args.recycles,
            pad_msa: true,
            ..FeatureConfig::default()
        };
        let features = process(&raw, &config, 0, device)?;
        let real = |mask: &tch::Tensor| -> anyhow::Result<i64> {
            Ok(mask.get(0).sum_dim_intlist(1, false, Kind::Float).gt(0.0).sum(Kind::Int64).int64_value(&[]))
        };
        let (msa_rows, extra_rows) = (real(&features.msa_mask)?, real(&features.extra_msa_mask)?);
        if depth == args.depths[0] {
            time(&dropped, &features, &args)?; // warm-up: first-call allocations and kernel set-up
        }
        let (mut t_padded, mut t_dropped) = (f64::INFINITY, f64::INFINITY);
        let (mut want, mut got) = (None, None);
        for _ in 0..args.repeats.max(1) {
            let (t, pass) = time(&padded, &features, &args)?;
            (t_padded, want) = (t_padded.min(t), Some(pass));
            let (t, pass) = time(&dropped, &features, &args)?;
            (t_dropped, got) = (t_dropped.min(t), Some(pass));
        }
        let (Some(want), Some(got)) = (want, got) else { anyhow::bail!("no run") };
        let mask = got.structure.atom37_mask.unsqueeze(-1);
        let diff = ((&got.structure.atom37 - &want.structure.atom37) * &mask).abs().max().double_value(&[]);
        println!(
            "| {depth} | {msa_rows} of {} | {extra_rows} of {} | {t_padded:.2} | {t_dropped:.2} | {:.1}x | {diff:.1e} |",
            features.msa_mask.size()[1],
            features.extra_msa_mask.size()[1],
            t_padded / t_dropped
        );
    }
    Ok(())
}
