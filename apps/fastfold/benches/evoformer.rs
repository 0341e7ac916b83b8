//! One Evoformer block (AlphaFold's sizes unless `--small`): inference forward and training
//! forward+backward time and peak memory, beside the same block in PyTorch eager
//! (`benches/evoformer_baseline.py`, same weights and inputs, its outputs first checked against
//! ours), and the ratio.
//!
//! `cargo bench -p fastfold --bench evoformer -- --residues 256 --sequences 128 --device cuda`
//! is the shape OpenFold and FastFold report; `scripts/bench-fastfold.sh` runs it.
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::ensure;
use clap::Parser;
use engine::device::DeviceKind;
use engine::fp32_matmul::Fp32Matmul;
use engine::parallel::dap::Dap;
use fastfold::model::layers::Stream;
use fastfold::model::{AttentionKernel, EvoformerConfig, EvoformerStack, Exec, Params};
use tch::{Device, Kind, Tensor};

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/evoformer_baseline.py");

#[derive(Parser, Debug)]
#[command(about = "One Evoformer block: ours against PyTorch eager")]
struct Args {
    /// Residues N.
    #[arg(long, default_value_t = 64)]
    residues: i64,
    /// MSA sequences S.
    #[arg(long, default_value_t = 32)]
    sequences: i64,
    /// Device.
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// bf16 instead of fp32.
    #[arg(long)]
    bf16: bool,
    /// fp32 products on a GPU, both sides: TF32 tensor cores (as `fastfold predict` runs by
    /// default) or IEEE.
    #[arg(long, value_enum, default_value_t = Fp32Matmul::Tf32)]
    fp32_matmul: Fp32Matmul,
    /// Untimed runs first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Chunk size of the memory-heavy steps.
    #[arg(long)]
    chunk_size: Option<i64>,
    /// The tiny test configuration instead of AlphaFold's sizes.
    #[arg(long)]
    small: bool,
    /// Our side's attention softmax, LayerNorms and gates: fused CUDA kernels or libtorch's
    /// compositions (default: fused on CUDA, as `fastfold predict` runs; the baseline is eager).
    #[arg(long, value_enum)]
    kernels: Option<kernels::Backend>,
    /// The forward's attentions on the fused kernels, as `fastfold predict --attention` runs
    /// them: whole logits softmaxed in place, or the tensor-core kernel.
    #[arg(long, value_enum, default_value_t = AttentionKernel::Logits)]
    attention: AttentionKernel,
    /// CPU threads (both sides; 0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    threads: i32,
    /// Skip the PyTorch baseline.
    #[arg(long)]
    no_baseline: bool,
    /// After timing, profile one forward and one forward+backward of ours (and one
    /// forward+backward of the baseline): their kernels (on a GPU; the host's operators on the
    /// CPU) summed by name in a table each, and their Chrome traces written to this folder
    /// (`evoformer-forward.json`, `evoformer-forward-backward.json`, `eager-forward-backward.json`).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn sync(device: Device) -> anyhow::Result<()> {
    if let Device::Cuda(d) = device {
        engine::cuda::synchronize(d)?;
    }
    Ok(())
}

fn median_ms(
    warmup: usize,
    iters: usize,
    device: Device,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        sync(device)?;
        let start = Instant::now();
        f()?;
        sync(device)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `f` run once under the profiler: its table of kernels (`title`), its Chrome trace at `path`.
fn trace(
    device: Device,
    path: &std::path::Path,
    title: &str,
    f: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<String> {
    sync(device)?;
    engine::kernel_trace::table_of(device != Device::Cpu, path, &format!("ours, {title}, traced"), 25, || {
        f()?;
        sync(device)
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.threads > 0 {
        tch::set_num_threads(args.threads);
    }
    let device = args.device.device(0, 1)?;
    engine::fp32_matmul::set(args.fp32_matmul)?;
    let kind = if args.bf16 { Kind::BFloat16 } else { Kind::Float };
    let base = if args.small { EvoformerConfig::tiny() } else { EvoformerConfig::default() };
    let cfg = EvoformerConfig { num_blocks: 1, num_extra_blocks: 0, ..base };
    let params = Params::random(&cfg, 0)?;
    let (s, n) = (args.sequences, args.residues);
    let mut rng = data::augment::Rng::keyed(1, 0, 0);
    let msa = rng.normal_tensor(&[s, n, cfg.c_m]);
    let pair = rng.normal_tensor(&[n, n, cfg.c_z]);
    let (wm, wz) = (rng.normal_tensor(&[s, n, cfg.c_m]), rng.normal_tensor(&[n, n, cfg.c_z]));
    let (msa_mask, pair_mask) =
        (Tensor::ones([s, n], (Kind::Float, Device::Cpu)), Tensor::ones([n, n], (Kind::Float, Device::Cpu)));
    let on = |t: &Tensor| t.to_device(device).to_kind(kind);

    let backend = kernels::Backend::resolve(args.kernels, device)?;
    args.attention.check(backend, !args.bf16 && args.fp32_matmul == Fp32Matmul::Ieee)?;
    let p = params.to_kind(kind)?.to_device(device, true)?.with_kernels(backend);
    let stack = EvoformerStack::main(&p)?;
    // The forward row is inference, as `fastfold predict` runs a block: parameters that record
    // no gradient, so that the block takes its inference path (biases, gates and softmax in
    // place; the tensor-core attention with --attention flash). The baseline's is torch.no_grad.
    let inference = params.to_kind(kind)?.to_device(device, false)?.with_kernels(backend);
    let inference = EvoformerStack::main(&inference.with_attention(args.attention))?;
    let exec = Exec::new(Dap::none(), args.chunk_size);
    let (m_in, z_in, mm, pm) = (on(&msa), on(&pair), on(&msa_mask), on(&pair_mask));
    // The inputs kept: every run starts from them.
    let inputs = || (Stream::new(m_in.shallow_clone(), false), Stream::new(z_in.shallow_clone(), false));
    let infer = || tch::no_grad(|| inference.forward(inputs().0, inputs().1, &mm, &pm, &exec, None));
    let (ours_msa, ours_pair, _) = infer()?;
    let forward = median_ms(args.warmup, args.iters, device, || {
        let _outputs = infer()?;
        Ok(())
    })?;
    if let Device::Cuda(d) = device {
        engine::cuda::reset_peak_stats(d)?;
    }
    let (wm_d, wz_d) = (on(&wm), on(&wz));
    let forward_backward = median_ms(args.warmup, args.iters, device, || {
        let (m, z, _) = stack.forward(inputs().0, inputs().1, &mm, &pm, &exec, None)?;
        ((m * &wm_d).sum(Kind::Float) + (z * &wz_d).sum(Kind::Float)).backward();
        for (_, t) in p.iter() {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        Ok(())
    })?;
    let peak = engine::process::peak_memory(device);
    let traced = match &args.trace {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            let forward = trace(device, &dir.join("evoformer-forward.json"), "forward", || {
                let _outputs = infer()?;
                Ok(())
            })?;
            let both = trace(device, &dir.join("evoformer-forward-backward.json"), "forward+backward", || {
                let (m, z, _) = stack.forward(inputs().0, inputs().1, &mm, &pm, &exec, None)?;
                ((m * &wm_d).sum(Kind::Float) + (z * &wz_d).sum(Kind::Float)).backward();
                Ok(())
            })?;
            Some(format!("\n{forward}\n{both}"))
        }
        None => None,
    };
    let mib = |b: Option<u64>| b.map_or("-".to_string(), |b| format!("{:.0}", b as f64 / (1 << 20) as f64));
    let tf32 = !args.bf16 && args.fp32_matmul == Fp32Matmul::Tf32 && device != Device::Cpu;
    println!(
        "Evoformer block, {s} sequences x {n} residues, c_m {} c_z {}, {} on {device:?}, kernels {backend:?}, attention {:?}{}",
        cfg.c_m,
        cfg.c_z,
        match (args.bf16, tf32) {
            (true, _) => "bf16",
            (false, true) => "fp32 (TF32 products)",
            (false, false) => "fp32",
        },
        args.attention,
        args.chunk_size.map(|c| format!(", chunk {c}")).unwrap_or_default()
    );
    println!("| | forward ms | forward+backward ms | peak MiB |");
    println!("|---|---|---|---|");
    println!("| ours | {forward:.1} | {forward_backward:.1} | {} |", mib(peak));
    if let Some(tables) = traced {
        println!("{tables}");
    }
    if args.no_baseline {
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("fastfold-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (params_path, inputs_path): (PathBuf, PathBuf) = (dir.join("params.npz"), dir.join("inputs.npz"));
    params.save(&params_path)?;
    let named: Vec<(String, Tensor)> = [
        ("msa", &msa),
        ("pair", &pair),
        ("msa_mask", &msa_mask),
        ("pair_mask", &pair_mask),
        ("weight_msa", &wm),
        ("weight_pair", &wz),
        ("ours_msa", &ours_msa.to_kind(Kind::Float)),
        ("ours_pair", &ours_pair.to_kind(Kind::Float)),
    ]
    .iter()
    .map(|(k, t)| (k.to_string(), t.shallow_clone()))
    .collect();
    data::checkpoint::save_npz(&named, &inputs_path)?;
    let stdout = engine::baseline::run(
        Command::new(engine::baseline::python()?)
            .arg(BASELINE)
            .arg(&params_path)
            .arg(&inputs_path)
            .args(["--device", if device == Device::Cpu { "cpu" } else { "cuda" }])
            .args(["--precision", if args.bf16 { "bf16" } else { "fp32" }])
            .args(["--iters", &args.iters.to_string(), "--warmup", &args.warmup.to_string()])
            .args(["--threads", &args.threads.to_string()])
            .args(["--fp32-matmul", args.fp32_matmul.name()])
            .args(args.trace.iter().flat_map(|dir| [std::ffi::OsStr::new("--trace"), dir.as_os_str()])),
        BASELINE,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let json = engine::baseline::last_json(&stdout?, BASELINE)?;
    let num = |k: &str| engine::baseline::number(&json, k);
    let (bf, bfb, diff) = (num("forward_ms")?, num("forward_backward_ms")?, num("max_abs_diff")?);
    // Both sides round alike only in IEEE fp32; TF32 rounds each product's inputs to 10 bits.
    let tolerance = match (args.bf16, tf32) {
        (true, _) => 0.5,
        (false, true) => 0.05,
        (false, false) => 1e-3,
    };
    ensure!(diff <= tolerance, "the baseline's outputs differ from ours by {diff} (tolerance {tolerance})");
    println!("| PyTorch eager | {bf:.1} | {bfb:.1} | {} |", mib(json["peak_bytes"].as_u64()));
    println!("| ratio (eager / ours) | {:.2} | {:.2} | |", bf / forward, bfb / forward_backward);
    println!("outputs agree: max abs difference {diff:.2e}");
    Ok(())
}
