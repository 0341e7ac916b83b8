//! What `--gpu-mem` must hold besides Gemini's chunks: the frozen parts that stay resident on
//! the device in the compute kind (the text encoder and the VAE; under LoRA the adapters too).
//! Gemini's budget is what the cap leaves after them, so the plan can never exceed the cap.
use anyhow::bail;
use engine::gemini::human;
use tch::nn::VarStore;

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

#[cfg(test)]
mod tests {
    use super::*;

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
