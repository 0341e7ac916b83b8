//! A full single-sequence prediction with AlphaFold's sizes (`model_1_ptm`: 48 Evoformer
//! blocks, 4 extra-MSA blocks, templates, structure module, heads; random weights) for each
//! requested length (the features on the host, one recycling slice on the device at a time, as
//! `fastfold predict` runs): wall time and peak memory (on a GPU the caching allocator's peak and the
//! card's, as `nvidia-smi` counts it: `engine::process::CardPeak`, the cache emptied before each
//! length so that each card figure is its length's). On a GPU, with three or more lengths, it then
//! predicts the longest sequence that fits the device's memory from a quadratic fit of the
//! measured peaks (the pair representation grows with the square of the length), said as a
//! prediction: running it would take longer than a benchmark should.
//!
//! With `--msa-rows`, a synthetic alignment of that depth in place of the single sequence
//! (5,628 rows fill model_1_ptm's 508 clusters and 5,120 extra rows); with `--gpu-mem`, the
//! chunks (and offloading) of `fastfold predict`'s memory plan for that budget, its planned
//! peak printed beside the measured ones.
//!
//! With `--trace DIR`, one more pass of the first length runs under libtorch's profiler: a
//! table of its kernels by name and the GPU's busy time against the pass's wall time
//! (`engine::kernel_trace`), and its Chrome trace in `DIR`.
//!
//! `cargo bench -p fastfold --bench predict -- --residues 256,512 --device cuda --chunk-size 64`
//! `cargo bench -p fastfold --bench predict -- --residues 1200 --msa-rows 5628 --device cuda --gpu-mem 2.2G`
use std::path::Path;
use std::time::Instant;

use clap::Parser;
use engine::device::DeviceKind;
use engine::fp32_matmul::Fp32Matmul;
use engine::parallel::dap::Dap;
use fastfold::features::{process, FeatureConfig, RawFeatures};
use fastfold::memory;
use fastfold::model::alphafold::AlphaFold;
use fastfold::model::AttentionKernel;
use fastfold::model::{EvoformerConfig, Exec, ModelConfig, Params};
use tch::Kind;

#[path = "common/synthetic_msa.rs"]
mod synthetic_msa;
use synthetic_msa::synthetic_msa;

#[derive(Parser, Debug)]
#[command(about = "Full single-sequence predictions at AlphaFold's sizes: time and peak memory")]
struct Args {
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    residues: Vec<usize>,
    /// Recycling passes after the first.
    #[arg(long, default_value_t = 0)]
    recycles: usize,
    /// Rows of a synthetic alignment (1: the single sequence).
    #[arg(long, default_value_t = 1)]
    msa_rows: usize,
    /// A memory budget (`3G`): each length's chunks from `fastfold predict`'s plan for it; on a
    /// GPU the whole process's cap, as `fastfold predict --gpu-mem` takes it (the CUDA context
    /// and libraries measured at the start, the plan given the rest).
    #[arg(long, conflicts_with = "chunk_size")]
    gpu_mem: Option<String>,
    /// Chunk size of the memory-heavy steps.
    #[arg(long)]
    chunk_size: Option<i64>,
    /// bf16 instead of fp32.
    #[arg(long)]
    bf16: bool,
    /// fp32 products on a GPU: TF32 tensor cores (`fastfold predict`'s default) or IEEE.
    #[arg(long, value_enum, default_value_t = Fp32Matmul::Tf32)]
    fp32_matmul: Fp32Matmul,
    /// The attention softmax, LayerNorms and gates: fused CUDA kernels or libtorch's
    /// compositions (default: fused on CUDA, as `fastfold predict` runs).
    #[arg(long, value_enum)]
    kernels: Option<kernels::Backend>,
    /// The attentions on the fused kernels: whole logits softmaxed in place, or the
    /// tensor-core kernel (`fastfold predict --attention`).
    #[arg(long, value_enum, default_value_t = AttentionKernel::Logits)]
    attention: AttentionKernel,
    /// Device.
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// After timing the first length, profile one more pass of it (no recycling): its kernels
    /// (on a GPU; the host's operators on the CPU) summed by name in a table, and its Chrome
    /// trace written to this folder (`predict-<residues>.json`).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let device = args.device.device(0, 1)?;
    engine::fp32_matmul::set(args.fp32_matmul)?;
    // Before anything is allocated, as `fastfold predict` caps the process.
    let budget = match args.gpu_mem.as_deref().map(engine::gemini::parse_bytes).transpose()? {
        Some(cap) => match engine::gemini::cap_process_memory(device, cap, false)? {
            Some(split) => {
                println!("{split}");
                Some(split.allocator)
            }
            None => Some(cap),
        },
        None => None,
    };
    let kind = if args.bf16 { Kind::BFloat16 } else { Kind::Float };
    let params = Params::random_model(&EvoformerConfig::default(), &ModelConfig::default(), 0)?;
    let backend = kernels::Backend::resolve(args.kernels, device)?;
    let params = params.to_kind(kind)?.to_device(device, false)?.with_kernels(backend).with_attention(args.attention);
    let model = AlphaFold::new(&params)?;
    let param_bytes = memory::bytes_of(params.iter().map(|(_, t)| t));
    let exec = Exec::new(Dap::none(), args.chunk_size);
    println!(
        "predict, {}, model_1_ptm sizes (random weights), {} recycles, {} on {device:?}, kernels {backend:?}, attention {:?}{}{}",
        match args.msa_rows {
            1 => "single sequence".to_string(),
            rows => format!("a synthetic MSA of {rows} rows"),
        },
        args.recycles,
        match (args.bf16, device) {
            (true, _) => "bf16".to_string(),
            (false, tch::Device::Cpu) => "fp32".to_string(),
            (false, _) => format!("fp32 ({} products)", args.fp32_matmul.name()),
        },
        args.attention,
        args.chunk_size.map(|c| format!(", chunk {c}")).unwrap_or_default(),
        args.gpu_mem.as_deref().map(|b| format!(", planned for {b}")).unwrap_or_default()
    );
    println!("| residues | seconds | peak MiB | card peak MiB | planned MiB |");
    println!("|---|---|---|---|---|");
    let letters = b"ARNDCQEGHILKMFPSTWYV";
    let features = |n: usize| {
        let sequence: String = (0..n).map(|i| letters[(i * 7 + i / 3) % 20] as char).collect();
        let msa = (args.msa_rows > 1).then(|| synthetic_msa(&sequence, args.msa_rows, 0));
        let raw = RawFeatures::new(&sequence, msa.as_ref().map(|m| (m, Path::new("synthetic.a3m"))))?;
        let config = FeatureConfig { num_recycle: args.recycles, ..FeatureConfig::default() };
        // On the host, as `fastfold predict` keeps them: each pass's slice goes to the device.
        process(&raw, &config, 0, tch::Device::Cpu)
    };
    if let tch::Device::Cuda(d) = device {
        // An untimed short run first: the first length would otherwise carry CUDA's lazy
        // module loading, the libraries' handles and the kernels' compilation.
        let warm = features(16)?;
        tch::no_grad(|| model.predict(&warm, args.recycles, kind, &exec, None))?;
        engine::cuda::synchronize(d)?;
    }
    let mut peaks = vec![];
    let mut plans = vec![];
    let mut traced = None;
    for &n in &args.residues {
        let features = features(n)?;
        let (exec, planned) = match budget {
            Some(budget) => {
                let on = (kind, device, 1);
                let (plan, _) =
                    memory::plan_prediction(&model, &ModelConfig::default(), param_bytes, &features, on, budget)?;
                plans.push(format!("- {n}: {} (the pass's peak in {})", plan.describe(), plan.pass.at));
                (Exec::planned(Dap::none(), plan.chunks.clone()), Some(plan.peak()))
            }
            None => (exec.clone(), None),
        };
        let card = match device {
            tch::Device::Cuda(d) => {
                engine::cuda::reset_peak_stats(d)?;
                engine::cuda::empty_cache()?;
                Some(engine::process::CardPeak::start(d)?)
            }
            _ => None,
        };
        let start = Instant::now();
        let pass = tch::no_grad(|| model.predict(&features, args.recycles, kind, &exec, None))?;
        if let tch::Device::Cuda(d) = device {
            engine::cuda::synchronize(d)?;
        }
        let seconds = start.elapsed().as_secs_f64();
        anyhow::ensure!(
            bool::try_from(pass.structure.atom37.isfinite().all())?,
            "non-finite positions at {n} residues"
        );
        let peak = engine::process::peak_memory(device);
        peaks.extend(peak.map(|b| (n as f64, b as f64)));
        let mib = |b: Option<u64>| b.map_or("-".into(), |b| format!("{:.0}", b as f64 / (1 << 20) as f64));
        let card = card.map(engine::process::CardPeak::finish).transpose()?;
        println!("| {n} | {seconds:.1} | {} | {} | {} |", mib(peak), mib(card), mib(planned));
        if let (Some(dir), None) = (&args.trace, &traced) {
            std::fs::create_dir_all(dir)?;
            let (chrome, title) =
                (dir.join(format!("predict-{n}.json")), format!("ours, one pass at {n} residues, traced"));
            traced = Some(engine::kernel_trace::table_of(device.is_cuda(), &chrome, &title, 30, || {
                tch::no_grad(|| model.predict(&features, 0, kind, &exec, None))?;
                if let tch::Device::Cuda(d) = device {
                    engine::cuda::synchronize(d)?;
                }
                anyhow::Ok(())
            })?);
        }
    }
    for p in plans {
        println!("{p}");
    }
    if let Some(table) = traced {
        println!("\n{table}");
    }
    if let (tch::Device::Cuda(d), true) = (device, peaks.len() >= 3) {
        // What the peaks may reach: the free memory once the cache is handed back, plus what
        // is allocated now (the weights, which the peaks include).
        engine::cuda::empty_cache()?;
        let (free, _) = engine::cuda::mem_get_info(d)?;
        let budget = free as f64 + engine::cuda::memory_stats(d)?.allocated as f64;
        match longest_within(&peaks, budget)? {
            Some(n) => println!(
                "longest sequence that fits {:.1} GiB, predicted from a quadratic fit of the peaks above (not run): {n} residues",
                budget / (1u64 << 30) as f64
            ),
            None => println!("the peaks above do not grow as a quadratic: no prediction of the longest sequence"),
        }
    }
    Ok(())
}

/// The longest length (a multiple of 16) whose peak, from the least-squares quadratic through
/// `(length, bytes)`, stays within `budget` bytes; None when the points do not fix a quadratic
/// or it does not grow.
fn longest_within(points: &[(f64, f64)], budget: f64) -> anyhow::Result<Option<usize>> {
    // p = c0 + c1 x + c2 x^2 with x in thousands of residues (conditioning).
    let rows: Vec<f64> = points.iter().flat_map(|&(n, _)| [1.0, n / 1e3, (n / 1e3).powi(2)]).collect();
    let a = tch::Tensor::from_slice(&rows).view([-1, 3]);
    let b = tch::Tensor::from_slice(&points.iter().map(|&(_, p)| p).collect::<Vec<_>>()).view([-1, 1]);
    let (c, _, rank, _) = a.f_linalg_lstsq(&b, None, "gelsd")?;
    if rank.int64_value(&[]) < 3 {
        return Ok(None);
    }
    let c = Vec::<f64>::try_from(c.view([-1]))?;
    let (c0, c1, c2) = (c[0], c[1], c[2]);
    if c2 <= 0.0 {
        return Ok(None);
    }
    // The larger root of c2 x^2 + c1 x + (c0 - budget) = 0.
    let disc = c1 * c1 - 4.0 * c2 * (c0 - budget);
    let x = (-c1 + disc.max(0.0).sqrt()) / (2.0 * c2);
    let n = (x * 1000.0 / 16.0).floor() as usize * 16;
    Ok((n > 0).then_some(n))
}
