//! Multi-tensor AdamW and LAMB: one launch updates every parameter (LAMB: two, the second after
//! the per-tensor norms of the weights and updates are known), through a table of the tensors'
//! addresses. The arithmetic is the engine's (`engine::optim`), with its configurations.
use engine::optim::{AdamWConfig, LambConfig};
use tch::{Device, Kind, Tensor};

use crate::checks::cuda_device;
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::{Backend, Error, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "optim",
    include_str!("cuda/optim.cu"),
    &["adamw_f32", "lamb_moments_f32", "lamb_apply_f32"],
    // No multiply-add contraction: each operation rounds as in the engine's host executor.
    &["--fmad=false"],
);

/// Elements per block.
const CHUNK: i64 = 16384;
const THREADS: u32 = 512;

/// One parameter's tensors for a step: f32, one shape, updated in place (`param`, `exp_avg`,
/// `exp_avg_sq`).
#[derive(Debug)]
pub struct OptimTensors<'a> {
    /// The weight.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: &'a Tensor,
    /// The first moment (zeros before the first step).
    pub exp_avg: &'a Tensor,
    /// The second moment (zeros before the first step).
    pub exp_avg_sq: &'a Tensor,
    /// Whether weight decay and the trust ratio apply (see `engine::optim::Param`).
    pub adapt: bool,
}

/// Adam's per-step scalars, computed in f64 as the engine does.
struct AdamScalars([f64; 7]);

impl AdamScalars {
    fn new(betas: (f64, f64), eps: f64, step: i32) -> AdamScalars {
        let (b1, b2) = betas;
        AdamScalars([b1, 1.0 - b1, b2, 1.0 - b2, 1.0 - b1.powi(step), (1.0 - b2.powi(step)).sqrt(), eps])
    }

    fn args(&self, mut a: Args) -> Args {
        for v in self.0 {
            a = a.f32(v as f32);
        }
        a
    }

    /// Updates the moments and returns the direction `(m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`.
    fn moments_and_direction(&self, t: &OptimTensors) -> tch::Result<Tensor> {
        let [b1, omb1, b2, omb2, bc1, sqrt_bc2, eps] = self.0;
        let g = t.grad;
        let _ = t.exp_avg.shallow_clone().f_mul_scalar_(b1)?.f_add_(&g.f_mul_scalar(omb1)?)?;
        let _ = t.exp_avg_sq.shallow_clone().f_mul_scalar_(b2)?.f_add_(&g.f_mul(&g.f_mul_scalar(omb2)?)?)?;
        t.exp_avg.f_div_scalar(bc1)?.f_div(&t.exp_avg_sq.f_sqrt()?.f_div_scalar(sqrt_bc2)?.f_add_scalar(eps)?)
    }
}

/// Step `step` (counted from 1) of AdamW over `tensors`:
/// `w = w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`, the decay for adapted tensors only.
pub fn adamw_step(tensors: &[OptimTensors], cfg: &AdamWConfig, step: i32, backend: Backend) -> Result<()> {
    check("adamw_step", tensors, step)?;
    let adam = AdamScalars::new(cfg.betas, cfg.eps, step);
    let decay = 1.0 - cfg.lr * cfg.weight_decay;
    tch::no_grad(|| match backend {
        Backend::Torch => {
            for t in tensors {
                let d = adam.moments_and_direction(t)?;
                if t.adapt && cfg.weight_decay != 0.0 {
                    let _ = t.param.shallow_clone().f_mul_scalar_(decay)?;
                }
                let _ = t.param.shallow_clone().f_sub_(&d.f_mul_scalar(cfg.lr)?)?;
            }
            Ok(())
        }
        Backend::Fused => {
            let Some(table) = Table::new("adamw_step", tensors)? else { return Ok(()) };
            let decay = if cfg.weight_decay != 0.0 { decay } else { 1.0 };
            let mut a = adam.args(table.args()).f32(cfg.lr as f32).f32(decay as f32);
            KERNEL.launch("adamw_f32", table.device, table.grid(), THREADS, &mut a)
        }
    })
}

/// Step `step` (counted from 1) of LAMB over `tensors`: `r = m_hat / (sqrt(v_hat) + eps) + wd w`,
/// `w = w - lr ||w|| / ||r|| r` (the trust ratio 1 where a norm is 0; for tensors that do not
/// adapt, neither decay nor ratio). Whole tensors only: the norms of tensor-parallel shards
/// (`engine::optim::Param::split_over`) are not summed over their group here.
pub fn lamb_step(tensors: &[OptimTensors], cfg: &LambConfig, step: i32, backend: Backend) -> Result<()> {
    check("lamb_step", tensors, step)?;
    let adam = AdamScalars::new(cfg.betas, cfg.eps, step);
    tch::no_grad(|| match backend {
        Backend::Torch => {
            for t in tensors {
                let mut r = adam.moments_and_direction(t)?;
                if t.adapt && cfg.weight_decay != 0.0 {
                    r = r.f_add(&t.param.f_mul_scalar(cfg.weight_decay)?)?;
                }
                let mut scale = cfg.lr;
                if t.adapt {
                    let (w, rn) = (t.param.f_norm()?.f_double_value(&[])?, r.f_norm()?.f_double_value(&[])?);
                    if w > 0.0 && rn > 0.0 {
                        scale *= w / rn;
                    }
                }
                let _ = t.param.shallow_clone().f_sub_(&r.f_mul_scalar(scale)?)?;
            }
            Ok(())
        }
        Backend::Fused => {
            let Some(table) = Table::new("lamb_step", tensors)? else { return Ok(()) };
            let norms = Tensor::f_zeros([tensors.len() as i64, 2], (Kind::Float, Device::Cuda(table.device)))?;
            let wd = cfg.weight_decay as f32;
            let mut a = adam.args(table.args()).f32(wd).tensor(&norms);
            KERNEL.launch("lamb_moments_f32", table.device, table.grid(), THREADS, &mut a)?;
            let mut a = adam.args(table.args()).f32(wd).f32(cfg.lr as f32).tensor(&norms);
            KERNEL.launch("lamb_apply_f32", table.device, table.grid(), THREADS, &mut a)
        }
    })
}

fn check(op: &str, tensors: &[OptimTensors], step: i32) -> Result<()> {
    ensure!(step >= 1, "{op}: steps count from 1 (got {step})");
    for (i, t) in tensors.iter().enumerate() {
        let shape = t.param.size();
        for (name, x) in [("grad", t.grad), ("exp_avg", t.exp_avg), ("exp_avg_sq", t.exp_avg_sq)] {
            ensure!(x.size() == shape, "{op}: tensor {i}'s {name} is {:?}, its param {shape:?}", x.size());
        }
        for (name, x) in [("param", t.param), ("grad", t.grad), ("exp_avg", t.exp_avg), ("exp_avg_sq", t.exp_avg_sq)] {
            ensure!(x.kind() == Kind::Float, "{op}: tensor {i}'s {name} is {:?}; optimizer steps take f32", x.kind());
        }
    }
    Ok(())
}

/// The kernels' view of the tensors: 6 entries per tensor (the four addresses, the element
/// count, the adapt flag) and (tensor, first element) per block, copied to the device from
/// pinned memory without waiting (the tensors are kept alive until the copy has run by the
/// caching allocators).
struct Table {
    device: usize,
    entries: Tensor,
    chunks: Tensor,
    blocks: u32,
}

impl Table {
    /// `None` when there is nothing to update.
    fn new(op: &str, tensors: &[OptimTensors]) -> Result<Option<Table>> {
        let mut all = Vec::new();
        for t in tensors {
            all.extend([("param", t.param), ("grad", t.grad), ("exp_avg", t.exp_avg), ("exp_avg_sq", t.exp_avg_sq)]);
        }
        if all.is_empty() {
            return Ok(None);
        }
        let device = cuda_device(op, Some(Kind::Float), &all)?;
        let mut entries = Vec::with_capacity(tensors.len() * 6);
        let mut chunks = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let n = t.param.numel() as i64;
            for x in [t.param, t.grad, t.exp_avg, t.exp_avg_sq] {
                entries.push(x.data_ptr() as i64);
            }
            entries.extend([n, t.adapt as i64]);
            chunks.extend((0..n).step_by(CHUNK as usize).flat_map(|start| [i as i64, start]));
        }
        if chunks.is_empty() {
            return Ok(None);
        }
        let blocks = u32::try_from(chunks.len() / 2).map_err(|_| Error::invalid(format!("{op}: too many elements")))?;
        let upload = |v: &[i64]| -> Result<Tensor> {
            let host = Tensor::from_slice(v).f_pin_memory(Device::Cuda(device))?;
            Ok(host.f_to_device_(Device::Cuda(device), Kind::Int64, true, false)?)
        };
        Ok(Some(Table { device, entries: upload(&entries)?, chunks: upload(&chunks)?, blocks }))
    }

    fn args(&self) -> Args {
        Args::default().tensor(&self.entries).tensor(&self.chunks).i32(CHUNK as i32)
    }

    fn grid(&self) -> (u32, u32, u32) {
        (self.blocks, 1, 1)
    }
}
