//! A full single-sequence prediction with AlphaFold's sizes (`model_1_ptm`: 48 Evoformer
//! blocks, 4 extra-MSA blocks, templates, structure module, heads; random weights) for each
//! requested length: wall time and peak memory.
//!
//! `cargo bench -p fastfold --bench predict -- --residues 256,512 --device cuda --chunk-size 64`
use std::time::Instant;

use clap::Parser;
use engine::device::DeviceKind;
use engine::parallel::dap::Dap;
use fastfold::features::{process, FeatureConfig, RawFeatures};
use fastfold::model::alphafold::AlphaFold;
use fastfold::model::{EvoformerConfig, ModelConfig, Params};
use tch::Kind;

#[derive(Parser, Debug)]
#[command(about = "Full single-sequence predictions at AlphaFold's sizes: time and peak memory")]
struct Args {
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    residues: Vec<usize>,
    /// Recycling passes after the first.
    #[arg(long, default_value_t = 0)]
    recycles: usize,
    /// Chunk size of the memory-heavy steps.
    #[arg(long)]
    chunk_size: Option<i64>,
    /// bf16 instead of fp32.
    #[arg(long)]
    bf16: bool,
    /// The attention softmax, LayerNorms and gates: fused CUDA kernels or libtorch's
    /// compositions (default: fused on CUDA, as `fastfold predict` runs).
    #[arg(long, value_enum)]
    kernels: Option<kernels::Backend>,
    /// Device.
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let device = args.device.device(0, 1)?;
    let kind = if args.bf16 { Kind::BFloat16 } else { Kind::Float };
    let params = Params::random_model(&EvoformerConfig::default(), &ModelConfig::default(), 0)?;
    let backend = kernels::Backend::resolve(args.kernels, device)?;
    let params = params.to_kind(kind)?.to_device(device, false)?.with_kernels(backend);
    let model = AlphaFold::new(&params)?;
    println!(
        "single-sequence predict, model_1_ptm sizes (random weights), {} recycles, {} on {device:?}, kernels {backend:?}{}",
        args.recycles,
        if args.bf16 { "bf16" } else { "fp32" },
        args.chunk_size.map(|c| format!(", chunk {c}")).unwrap_or_default()
    );
    println!("| residues | seconds | peak MiB |");
    println!("|---|---|---|");
    let letters = b"ARNDCQEGHILKMFPSTWYV";
    let features = |n: usize| {
        let sequence: String = (0..n).map(|i| letters[(i * 7 + i / 3) % 20] as char).collect();
        let raw = RawFeatures::new(&sequence, None)?;
        let config = FeatureConfig { num_recycle: args.recycles, ..FeatureConfig::default() };
        process(&raw, &config, 0, device)
    };
    if let tch::Device::Cuda(d) = device {
        // An untimed short run first: the first length would otherwise carry CUDA's lazy
        // module loading, the libraries' handles and the kernels' compilation.
        let warm = features(16)?;
        tch::no_grad(|| model.predict(&warm, args.recycles, kind, &Dap::none(), args.chunk_size))?;
        engine::cuda::synchronize(d)?;
    }
    for &n in &args.residues {
        let features = features(n)?;
        if let tch::Device::Cuda(d) = device {
            engine::cuda::reset_peak_stats(d)?;
        }
        let start = Instant::now();
        let pass = tch::no_grad(|| model.predict(&features, args.recycles, kind, &Dap::none(), args.chunk_size))?;
        if let tch::Device::Cuda(d) = device {
            engine::cuda::synchronize(d)?;
        }
        let seconds = start.elapsed().as_secs_f64();
        anyhow::ensure!(
            bool::try_from(pass.structure.atom37.isfinite().all())?,
            "non-finite positions at {n} residues"
        );
        let peak =
            engine::process::peak_memory(device).map_or("-".into(), |b| format!("{:.0}", b as f64 / (1 << 20) as f64));
        println!("| {n} | {seconds:.1} | {peak} |");
    }
    Ok(())
}
