//! Where chunk homes (fp32 masters, gradients, optimizer state) live: a static policy fixes
//! the tiers when the chunks are built; the auto policy places the homes after the warm-up
//! step, from what that step needed on the device besides model data.
use tch::Device;

use super::budget::human;
use super::manager::{ChunkManager, Tier};
use crate::{Error, Result};

/// Where chunk homes (fp32 masters, gradients, optimizer state) live.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Placement {
    /// This fraction of the chunks (the last in execution order) keeps its home in host
    /// memory, the rest on the device; `1.0` offloads everything.
    Static {
        /// Fraction of chunks offloaded, in `[0, 1]`.
        offload: f64,
    },
    /// Homes start in host memory; after the first (warm-up) backward, which records the
    /// chunk access order and, on a GPU, the memory that is not model data (activations,
    /// workspace) from the caching allocator's peak, as many homes move to the device as the
    /// budget leaves room for beside the working set.
    Auto,
}

impl Placement {
    /// The tier every home starts on (host memory: a static policy then moves its share to
    /// the device); an error for an offload fraction outside `[0, 1]`.
    pub(crate) fn first_tier(&self) -> Result<Tier> {
        if let Placement::Static { offload } = *self {
            crate::error::ensure!(
                (0.0..=1.0).contains(&offload),
                "gemini: offload fraction {offload} is not within [0, 1]"
            );
        }
        Ok(Tier::Host)
    }

    /// A static policy moves the homes it keeps on the device there, the first chunks in
    /// execution order; the auto policy waits for the warm-up step.
    pub(crate) fn place_static(&self, m: &mut ChunkManager) -> Result<()> {
        if let Placement::Static { offload } = *self {
            let n = m.chunk_count();
            let on_device = n - (offload * n as f64).ceil() as usize;
            for c in 0..on_device {
                m.move_home(c, Tier::Device)?;
            }
        }
        Ok(())
    }

    /// The auto policy's warm-up step on a GPU keeps chunks only while modules use them (see
    /// [`ChunkManager::set_lean`]): its activations share the cap but are measured only after
    /// it.
    pub(crate) fn begin_warmup(&self, m: &mut ChunkManager) {
        m.set_lean(*self == Placement::Auto && matches!(m.device(), Device::Cuda(_)));
    }
}

/// On a GPU, the share of the budget the auto policy's plan fills; the rest absorbs the caching
/// allocator's fragmentation (Colossal-AI's `steady_cuda_cap_ratio` is the same 0.9).
const STEADY_SHARE: f64 = 0.9;

/// Device bytes in use before the warm-up step, with the allocator's peak reset so that the
/// step's own peak can be read after it (GPU only; `0` elsewhere).
pub(crate) fn device_baseline(device: Device) -> Result<i64> {
    Ok(match device {
        Device::Cuda(d) => {
            crate::cuda::reset_peak_stats(d)?;
            crate::cuda::memory_stats(d)?.allocated
        }
        _ => 0,
    })
}

/// The auto policy's plan: the budget (on a GPU [`STEADY_SHARE`] of it) less the non-model
/// peak is what model data may use; of that, the working set (the widest module's chunks, the
/// `prefetch` ones, a gradient chunk in flight, the copy a prefetch stages: one at a time,
/// since each is freed once its cast is queued, and its stream reuses the memory; and over a
/// data-parallel group the whole gradients that wait for the end of backward to be reduced)
/// stays free for payloads, and homes move to the device in chunk order while they fit.
/// `baseline` is [`device_baseline`] from before the warm-up step.
pub(crate) fn place_after_warmup(m: &mut ChunkManager, baseline: i64, prefetch: usize) -> Result<()> {
    m.set_lean(false);
    let (non_model, budget, staging) = match m.device() {
        Device::Cuda(d) => {
            let peak = crate::cuda::memory_stats(d)?.peak_allocated - baseline;
            let non_model = (peak.max(0) as usize).saturating_sub(m.device_bytes().1);
            let staging = if prefetch > 0 { m.staging_bytes() } else { 0 };
            (non_model, (m.budget() as f64 * STEADY_SHARE) as usize, staging)
        }
        _ => (0, m.budget(), 0),
    };
    let working = (m.widest_access() + prefetch + 1) * m.chunk_bytes() + staging + m.reduced_gradient_bytes();
    if non_model + working > budget {
        return Err(Error::invalid(format!(
            "gemini: the warm-up step needed {} besides model data and the widest module needs {} of chunks, together more than the {} budget",
            human(non_model),
            human(working),
            human(budget)
        )));
    }
    m.release_all()?;
    m.set_budget(budget - non_model);
    let mut room = budget - non_model - working - m.device_bytes().0;
    for c in 0..m.chunk_count() {
        let need = m.home_buffer_bytes(c);
        if m.tier(c) == Tier::Host && need <= room {
            m.move_home(c, Tier::Device)?;
            room -= need;
        }
    }
    Ok(())
}
