//! One step that turns a serial model's parameters into a data-parallel training setup:
//! gradient synchronisation (DDP buckets, or ZeRO-2's reduce-scatter into owners), fp32 master
//! weights under bf16/fp16 or CPU offload, the optimizer (sharded under ZeRO 1 and 2) and the
//! fp16 loss scaler. The model itself stays serial; trainers call [`parallelize`] once and then
//! drive micro-batches and steps through [`Parallelized`]. The tensor and pipeline axes join
//! here as further fields of [`ParallelPlan`].
use tch::{Device, Kind, Tensor};

use crate::autograd::backward;
use crate::dist::ProcessGroup;
use crate::optim::{clip_grad_norm, LossScaler, MasterWeights, Optimizer, Param};
use crate::parallel::{partition, DataParallel, DataParallelConfig, ZeroOptimizer};
use crate::Result;

/// How a replicated model trains over a data-parallel group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParallelPlan {
    /// ZeRO stage: 0 (plain data parallel), 1 (sharded optimizer state), 2 (and gradients).
    pub zero: u8,
    /// The model's weights and activations; below fp32, fp32 masters are stepped instead, and
    /// fp16 scales the loss dynamically.
    pub compute: Kind,
    /// Keep the fp32 master weights and optimizer state in CPU memory.
    pub offload_optimizer: bool,
    /// Where the model's weights live.
    pub device: Device,
}

/// The parameters wired for data-parallel training (see the module docs).
pub struct Parallelized {
    ddp: DataParallel,
    master: Option<MasterWeights>,
    optimizer: Box<dyn Optimizer>,
    scaler: Option<LossScaler>,
    group: ProcessGroup,
    zero: u8,
    weights: Vec<(String, Tensor)>,
}

/// Applies `plan` to `params` (the model's trainable parameters, the same order on every rank)
/// over `group`; `build` makes the optimizer over the parameters it should step (the fp32
/// masters, or this rank's shard of them under ZeRO). Rank 0's weights are broadcast to all.
pub fn parallelize(
    params: Vec<Param>,
    group: &ProcessGroup,
    plan: &ParallelPlan,
    build: impl FnOnce(Vec<Param>) -> Box<dyn Optimizer>,
) -> Result<Parallelized> {
    crate::error::ensure!(plan.zero <= 2, "ZeRO stage {} does not exist (0, 1 or 2)", plan.zero);
    // A second handle list on the same tensors, for the masters to copy from and into.
    let model = params.iter().map(Param::shallow_copy);
    let master = match (plan.compute, plan.offload_optimizer) {
        (Kind::Float, false) => None,
        (_, offload) => Some(MasterWeights::on(model.collect(), if offload { Device::Cpu } else { plan.device })?),
    };
    let owners = partition(&params, group.size());
    let cfg = DataParallelConfig::default();
    let ddp = match plan.zero {
        2 => DataParallel::new_sharded(&params, group, cfg, owners.clone())?,
        _ => DataParallel::new(&params, group, cfg)?,
    };
    let stepped = master.as_ref().map_or(params, |m| m.master());
    // Masters were copied before DataParallel's broadcast: take rank 0's weights too.
    if master.is_some() {
        tch::no_grad(|| stepped.iter().try_for_each(|p| group.broadcast(&p.tensor, 0)))?;
    }
    let weights = stepped.iter().map(|p| (p.name.clone(), p.tensor.shallow_clone())).collect();
    let optimizer: Box<dyn Optimizer> = match plan.zero {
        0 => build(stepped),
        _ => Box::new(ZeroOptimizer::new(stepped, owners, group, build)?),
    };
    let scaler = (plan.compute == Kind::Half).then(LossScaler::default);
    Ok(Parallelized { ddp, master, optimizer, scaler, group: group.clone(), zero: plan.zero, weights })
}

impl Parallelized {
    /// The fp32 weights by name (the masters under mixed precision): what checkpoints hold.
    pub fn weights(&self) -> &[(String, Tensor)] {
        &self.weights
    }

    /// The optimizer (over this rank's shard under ZeRO).
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// The optimizer, to load its state.
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        self.optimizer.as_mut()
    }

    /// The fp16 loss scaler.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The fp16 loss scaler, to restore its state.
    pub fn scaler_mut(&mut self) -> Option<&mut LossScaler> {
        self.scaler.as_mut()
    }

    /// Backward of one micro-batch's `loss` (already divided by the accumulation count);
    /// gradients are synchronised during the `last` micro-batch's backward only.
    pub fn backward(&self, loss: &Tensor, last: bool) -> Result<()> {
        self.ddp.set_sync(last)?;
        let scaled = match &self.scaler {
            Some(s) => s.scale_loss(loss)?,
            None => loss.shallow_clone(),
        };
        backward(&[&scaled], &[None], false)
    }

    /// After the last micro-batch: finishes the gradient reduction, unscales (fp16), clips the
    /// global norm to `clip`, steps at `lr` and copies masters back into the model. Returns
    /// whether the step was applied (fp16 skips steps whose gradients overflowed).
    pub fn step(&mut self, lr: f64, clip: Option<f64>) -> Result<bool> {
        self.optimizer.set_lr(lr);
        self.ddp.finish_gradients()?;
        if let Some(m) = &self.master {
            m.gradients_to_master()?;
        }
        let finite = match &self.scaler {
            Some(s) => s.unscale(self.optimizer.params(), Some(&self.group))?,
            None => true,
        };
        if finite {
            if let Some(max) = clip {
                clip_grad_norm(self.optimizer.params(), max, (self.zero == 2).then_some(&self.group))?;
            }
            self.optimizer.step()?;
        }
        self.optimizer.zero_grad();
        if let Some(s) = self.scaler.as_mut() {
            s.update(finite);
        }
        self.weights_to_model()?;
        Ok(finite)
    }

    /// Copies the fp32 masters into the model (after loading a checkpoint into them).
    pub fn weights_to_model(&self) -> Result<()> {
        match &self.master {
            Some(m) => m.weights_to_model(),
            None => Ok(()),
        }
    }
}
