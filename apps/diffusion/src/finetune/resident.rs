//! What `--gpu-mem` must hold besides Gemini's chunks: the frozen parts that stay resident on
//! the device in the compute kind (the text encoder and the VAE; under LoRA the adapters too).
//! Gemini's budget is what the cap leaves after them, so the plan can never exceed the cap.
use anyhow::bail;
use engine::gemini::human;
use tch::nn::VarStore;
use tch::Kind;

/// A resident part's name and its bytes on the device.
pub type Part = (&'static str, usize);

/// The bytes of `vs`'s weights in their current kind.
pub fn bytes_of(vs: &VarStore) -> usize {
    vs.variables().values().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
}

/// Gemini's budget under a `cap` of `--gpu-mem` bytes with `parts` resident; an error naming
/// the parts and their bytes when they alone fill the cap.
pub fn budget_after(cap: u64, parts: &[Part]) -> anyhow::Result<u64> {
    let resident: usize = parts.iter().map(|&(_, b)| b).sum();
    if resident as u64 >= cap {
        let list: Vec<String> = parts.iter().map(|&(name, b)| format!("{name} {}", human(b))).collect();
        bail!(
            "--gpu-mem {} is too small: the frozen parts resident on the device take {} ({}), \
             leaving nothing for the UNet",
            human(cap as usize),
            human(resident),
            list.join(", ")
        );
    }
    Ok(cap - resident as u64)
}

/// What a step that ran out of the device memory `--gpu-mem` left it can change: the frozen
/// `parts`' share, then the flags that shrink the other two (Gemini's chunks on the device and
/// the activations), those not already given. On a GPU the cap is the allocator's, so a step
/// that needs more fails inside libtorch; this says why in the app's terms.
pub fn out_of_memory_hint(parts: &[Part], kind: Kind, checkpointing: bool) -> String {
    let resident: usize = parts.iter().map(|&(_, b)| b).sum();
    let list: Vec<String> = parts.iter().map(|&(name, b)| format!("{name} {}", human(b))).collect();
    let mut fixes = vec![];
    if kind == Kind::Float {
        fixes.push(
            "--precision bf16 (or fp16) halves the frozen parts, the UNet's chunks on the device and the activations",
        );
    }
    if !checkpointing {
        fixes.push("--gradient-checkpointing keeps only each UNet block's inputs for the backward");
    }
    fixes.push("a smaller --micro-batch or --resolution shrinks the activations");
    format!(
        "the frozen parts take {} of it ({}) in {kind:?}, the UNet's chunks and the activations shared the rest; {}",
        human(resident),
        list.join(", "),
        fixes.join("; ")
    )
}

/// Whether `err` (any cause in its chain) is libtorch's out-of-memory error.
pub fn is_out_of_memory(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| cause.to_string().contains("out of memory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_step_names_the_flags_not_given() {
        let parts = [("text encoder", 470 << 20), ("VAE", 320 << 20)];
        let fp32 = out_of_memory_hint(&parts, Kind::Float, false);
        for needle in
            ["790.0 MiB", "text encoder 470.0 MiB", "VAE 320.0 MiB", "--precision bf16", "--gradient-checkpointing"]
        {
            assert!(fp32.contains(needle), "{needle:?} in {fp32}");
        }
        let lean = out_of_memory_hint(&parts, Kind::BFloat16, true);
        assert!(!lean.contains("--precision") && !lean.contains("--gradient-checkpointing"), "{lean}");
        assert!(lean.contains("--micro-batch"), "{lean}");
        let oom = anyhow::anyhow!("CUDA out of memory. Tried to allocate 122.00 MiB").context("backward");
        assert!(is_out_of_memory(&oom));
        assert!(!is_out_of_memory(&anyhow::anyhow!("no images")));
    }

    #[test]
    fn the_budget_is_what_the_resident_parts_leave() {
        let parts = [("text encoder", 300 << 20), ("VAE", 100 << 20)];
        assert_eq!(budget_after(1 << 30, &parts).unwrap(), (1 << 30) - (400 << 20));
        let err = budget_after(256 << 20, &parts).unwrap_err().to_string();
        for needle in ["--gpu-mem 256.0 MiB", "400.0 MiB", "text encoder 300.0 MiB", "VAE 100.0 MiB"] {
            assert!(err.contains(needle), "{needle:?} in {err}");
        }
    }

    #[test]
    fn bytes_follow_the_kind() {
        let vs = VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[3, 5]);
        assert_eq!(bytes_of(&vs), 60);
        let mut vs = vs;
        vs.set_kind(tch::Kind::BFloat16);
        assert_eq!(bytes_of(&vs), 30);
    }
}
