//! Multi-tensor AdamW, LAMB and LARS: one launch updates every parameter (LAMB and LARS: two,
//! the second after the per-tensor norms are known), through a table of the tensors' addresses.
//! The arithmetic is the engine's (`engine::optim`), with its configurations; the compositions
//! ([`Backend::Torch`]) are the engine's own rules (`engine::optim::fused::Rule::step`).
use engine::optim::fused::{MultiTensorSteps, Rule, StepTensors};
use engine::optim::{AdamWConfig, LambConfig, LarsConfig};
use tch::{Device, Kind, Tensor};

use crate::checks::target;
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::launch::Target;
use crate::{Backend, Error, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "optim",
    include_str!("cuda/optim.cu"),
    &["adamw_f32", "lamb_moments_f32", "lamb_apply_f32", "lars_norms_f32", "lars_apply_f32"],
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

impl<'a> OptimTensors<'a> {
    /// The tensors as the engine's rules take them.
    fn step_tensors(&self) -> StepTensors<'a> {
        StepTensors {
            param: self.param,
            grad: self.grad,
            state: [Some(self.exp_avg), Some(self.exp_avg_sq)],
            adapt: self.adapt,
        }
    }

    fn row(&self) -> Row<'_> {
        Row {
            slots: [
                ("param", Some(self.param)),
                ("grad", Some(self.grad)),
                ("exp_avg", Some(self.exp_avg)),
                ("exp_avg_sq", Some(self.exp_avg_sq)),
            ],
            adapt: self.adapt,
        }
    }
}

/// One parameter's tensors for a LARS step: f32, one shape, updated in place.
#[derive(Debug)]
pub struct LarsTensors<'a> {
    /// The weight.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: &'a Tensor,
    /// The momentum buffer (its contents are ignored on step 1, which sets it); needed when
    /// the momentum is not 0.
    pub momentum_buffer: Option<&'a Tensor>,
    /// Whether weight decay and the trust ratio apply (see `engine::optim::Param`).
    pub adapt: bool,
}

impl<'a> LarsTensors<'a> {
    /// The tensors as the engine's rules take them.
    fn step_tensors(&self) -> StepTensors<'a> {
        StepTensors { param: self.param, grad: self.grad, state: [self.momentum_buffer, None], adapt: self.adapt }
    }

    fn row(&self) -> Row<'_> {
        Row {
            slots: [
                ("param", Some(self.param)),
                ("grad", Some(self.grad)),
                ("momentum_buffer", self.momentum_buffer),
                ("unused", None),
            ],
            adapt: self.adapt,
        }
    }
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
}

/// Step `step` (counted from 1) of AdamW over `tensors`:
/// `w = w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`, the decay for adapted tensors only.
pub fn adamw_step(tensors: &[OptimTensors], cfg: &AdamWConfig, step: i32, backend: Backend) -> Result<()> {
    check("adamw_step", tensors, step)?;
    tch::no_grad(|| match backend {
        Backend::Torch => {
            let tensors: Vec<StepTensors> = tensors.iter().map(OptimTensors::step_tensors).collect();
            Ok(Rule::AdamW(*cfg).step(&tensors, step)?)
        }
        Backend::Fused => {
            let rows: Vec<Row> = tensors.iter().map(OptimTensors::row).collect();
            let Some(table) = Table::new("adamw_step", &rows)? else { return Ok(()) };
            let adam = AdamScalars::new(cfg.betas, cfg.eps, step);
            let decay = if cfg.weight_decay != 0.0 { 1.0 - cfg.lr * cfg.weight_decay } else { 1.0 };
            let mut a = adam.args(table.args()).f32(cfg.lr as f32).f32(decay as f32);
            KERNEL.launch("adamw_f32", table.at, table.grid(), THREADS, &mut a)
        }
    })
}

/// Step `step` (counted from 1) of LAMB over `tensors`: `r = m_hat / (sqrt(v_hat) + eps) + wd w`,
/// `w = w - lr ||w|| / ||r|| r` (the trust ratio 1 where a norm is 0; for tensors that do not
/// adapt, neither decay nor ratio). Whole tensors only: the norms of tensor-parallel shards
/// (`engine::optim::Param::split_over`) are not summed over their group here.
pub fn lamb_step(tensors: &[OptimTensors], cfg: &LambConfig, step: i32, backend: Backend) -> Result<()> {
    check("lamb_step", tensors, step)?;
    tch::no_grad(|| match backend {
        Backend::Torch => {
            let tensors: Vec<StepTensors> = tensors.iter().map(OptimTensors::step_tensors).collect();
            Ok(Rule::Lamb(*cfg).step(&tensors, step)?)
        }
        Backend::Fused => {
            let rows: Vec<Row> = tensors.iter().map(OptimTensors::row).collect();
            let Some(table) = Table::new("lamb_step", &rows)? else { return Ok(()) };
            let adam = AdamScalars::new(cfg.betas, cfg.eps, step);
            let norms = Tensor::f_zeros([tensors.len() as i64, 2], (Kind::Float, table.at.device()))?;
            let wd = cfg.weight_decay as f32;
            let mut a = adam.args(table.args()).f32(wd).tensor(&norms);
            KERNEL.launch("lamb_moments_f32", table.at, table.grid(), THREADS, &mut a)?;
            let mut a = adam.args(table.args()).f32(wd).f32(cfg.lr as f32).tensor(&norms);
            KERNEL.launch("lamb_apply_f32", table.at, table.grid(), THREADS, &mut a)
        }
    })
}

/// Step `step` (counted from 1) of LARS over `tensors`: `d = (g + wd w) ratio` with
/// `ratio = trust ||w|| / (||g|| + wd ||w|| + eps)` (1 where a norm is 0) for adapted tensors,
/// else `d = g`; with momentum the buffer becomes `d` on step 1 and `buffer momentum + d` after,
/// and `d` the buffer; `w = w - lr d`. Whole tensors only, as [`lamb_step`].
pub fn lars_step(tensors: &[LarsTensors], cfg: &LarsConfig, step: i32, backend: Backend) -> Result<()> {
    const OP: &str = "lars_step";
    let rows: Vec<Row> = tensors.iter().map(LarsTensors::row).collect();
    check_rows(OP, &rows, step)?;
    if cfg.momentum != 0.0 {
        if let Some(i) = tensors.iter().position(|t| t.momentum_buffer.is_none()) {
            return Err(Error::invalid(format!("{OP}: momentum {} needs tensor {i}'s momentum_buffer", cfg.momentum)));
        }
    }
    let first = step == 1;
    tch::no_grad(|| match backend {
        Backend::Torch => {
            let tensors: Vec<StepTensors> = tensors.iter().map(LarsTensors::step_tensors).collect();
            Ok(Rule::Lars(*cfg).step(&tensors, step)?)
        }
        Backend::Fused => {
            // Without momentum the kernel must not touch a buffer it was given.
            let rows: Vec<Row> = rows
                .into_iter()
                .map(|mut r| {
                    if cfg.momentum == 0.0 {
                        r.slots[2].1 = None;
                    }
                    r
                })
                .collect();
            let Some(table) = Table::new(OP, &rows)? else { return Ok(()) };
            let norms = Tensor::f_zeros([tensors.len() as i64, 2], (Kind::Float, table.at.device()))?;
            let mut a = table.args().tensor(&norms);
            KERNEL.launch("lars_norms_f32", table.at, table.grid(), THREADS, &mut a)?;
            let mut a = table
                .args()
                .f32(cfg.lr as f32)
                .f32(cfg.momentum as f32)
                .f32(cfg.weight_decay as f32)
                .f32(cfg.trust_coefficient as f32)
                .f32(cfg.eps as f32)
                .i32(first as i32)
                .tensor(&norms);
            KERNEL.launch("lars_apply_f32", table.at, table.grid(), THREADS, &mut a)
        }
    })
}

/// [`adamw_step`], [`lamb_step`] and [`lars_step`] as the engine's multi-tensor steps
/// (`engine::optim::fused::install`): an app run with `--kernels fused` installs them with
/// [`Backend::Fused`], and the tensor optimizers of data parallelism and ZeRO then step every
/// CUDA parameter in one launch (two for LAMB and LARS). With [`Backend::Torch`] they take f32
/// tensors anywhere (the tests' way to check the engine's side on the CPU).
#[derive(Debug)]
pub struct MultiTensor(pub Backend);

impl MultiTensorSteps for MultiTensor {
    fn accepts(&self, t: &Tensor) -> bool {
        (self.0 == Backend::Torch || Target::of(t.device()).is_some()) && t.kind() == Kind::Float && t.is_contiguous()
    }

    fn step(&self, rule: Rule, tensors: &[StepTensors], step: i32) -> engine::Result<()> {
        fn state<'a>(t: &StepTensors<'a>, slot: usize) -> Result<&'a Tensor> {
            t.state[slot].ok_or_else(|| Error::invalid(format!("Adam's state slot {slot} is missing")))
        }
        let adam = || -> Result<Vec<OptimTensors>> {
            tensors
                .iter()
                .map(|t| {
                    Ok(OptimTensors {
                        param: t.param,
                        grad: t.grad,
                        exp_avg: state(t, 0)?,
                        exp_avg_sq: state(t, 1)?,
                        adapt: t.adapt,
                    })
                })
                .collect()
        };
        let done = match rule {
            Rule::AdamW(c) => adamw_step(&adam()?, &c, step, self.0),
            Rule::Lamb(c) => lamb_step(&adam()?, &c, step, self.0),
            Rule::Lars(c) => {
                let lars: Vec<LarsTensors> = tensors
                    .iter()
                    .map(|t| LarsTensors { param: t.param, grad: t.grad, momentum_buffer: t.state[0], adapt: t.adapt })
                    .collect();
                lars_step(&lars, &c, step, self.0)
            }
        };
        Ok(done?)
    }
}

/// What an app's `--kernels` choice means for the engine's optimizers: the fused multi-tensor
/// steps installed (`engine::optim::fused`) for [`Backend::Fused`], none for the compositions.
pub fn install_optimizer_steps(backend: Backend) {
    let fused = backend == Backend::Fused;
    engine::optim::fused::install(fused.then(|| std::sync::Arc::new(MultiTensor(backend)) as _));
}

fn check(op: &str, tensors: &[OptimTensors], step: i32) -> Result<()> {
    check_rows(op, &tensors.iter().map(OptimTensors::row).collect::<Vec<_>>(), step)
}

fn check_rows(op: &str, rows: &[Row], step: i32) -> Result<()> {
    ensure!(step >= 1, "{op}: steps count from 1 (got {step})");
    for (i, row) in rows.iter().enumerate() {
        let shape = row.param().size();
        for (name, x) in row.present().skip(1) {
            ensure!(x.size() == shape, "{op}: tensor {i}'s {name} is {:?}, its param {shape:?}", x.size());
        }
        for (name, x) in row.present() {
            ensure!(x.kind() == Kind::Float, "{op}: tensor {i}'s {name} is {:?}; optimizer steps take f32", x.kind());
        }
    }
    Ok(())
}

/// One parameter's row of the kernels' table: the weight, the gradient and up to two state
/// buffers (absent ones are null pointers), and whether it adapts.
struct Row<'a> {
    slots: [(&'static str, Option<&'a Tensor>); 4],
    adapt: bool,
}

impl<'a> Row<'a> {
    fn param(&self) -> &'a Tensor {
        self.slots[0].1.expect("every row has its weight")
    }

    fn present(&self) -> impl Iterator<Item = (&'static str, &'a Tensor)> + '_ {
        self.slots.iter().filter_map(|&(name, t)| t.map(|t| (name, t)))
    }
}

/// The kernels' view of the tensors: 6 entries per tensor (the four addresses, the element
/// count, the adapt flag) and (tensor, first element) per block, copied to the device from
/// pinned memory without waiting (the tensors are kept alive until the copy has run by the
/// caching allocators).
struct Table {
    /// Where the tensors are and the launches run.
    at: Target,
    entries: Tensor,
    chunks: Tensor,
    blocks: u32,
}

impl Table {
    /// `None` when there is nothing to update.
    fn new(op: &str, rows: &[Row]) -> Result<Option<Table>> {
        let all: Vec<(&str, &Tensor)> = rows.iter().flat_map(Row::present).collect();
        if all.is_empty() {
            return Ok(None);
        }
        let at = target(op, Some(Kind::Float), &all)?;
        let mut entries = Vec::with_capacity(rows.len() * 6);
        let mut chunks = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            let n = row.param().numel() as i64;
            entries.extend(row.slots.iter().map(|(_, t)| t.map_or(0, |t| t.data_ptr() as i64)));
            entries.extend([n, row.adapt as i64]);
            chunks.extend((0..n).step_by(CHUNK as usize).flat_map(|start| [i as i64, start]));
        }
        if chunks.is_empty() {
            return Ok(None);
        }
        let blocks = u32::try_from(chunks.len() / 2).map_err(|_| Error::invalid(format!("{op}: too many elements")))?;
        let upload = |v: &[i64]| -> Result<Tensor> {
            let host = Tensor::from_slice(v);
            match at {
                Target::Cuda(d) => {
                    Ok(engine::cuda::pinned(&host)?.f_to_device_(Device::Cuda(d), Kind::Int64, true, false)?)
                }
                Target::Emulator => Ok(host),
            }
        };
        Ok(Some(Table { at, entries: upload(&entries)?, chunks: upload(&chunks)?, blocks }))
    }

    fn args(&self) -> Args {
        Args::default().tensor(&self.entries).tensor(&self.chunks).i32(CHUNK as i32)
    }

    fn grid(&self) -> (u32, u32, u32) {
        (self.blocks, 1, 1)
    }
}
