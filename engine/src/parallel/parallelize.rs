//! One step that turns a serial model's parameters into a data-parallel training setup:
//! gradient synchronisation (DDP buckets, or ZeRO-2's reduce-scatter into owners), fp32 master
//! weights under bf16/fp16 or CPU offload, the optimizer (sharded under ZeRO 1 and 2) and the
//! fp16 loss scaler. The model itself stays serial; trainers call [`parallelize`] once and then
//! drive micro-batches and steps through [`Parallelized`]. Under tensor parallelism the app
//! splits its layers first (`vit`'s `tensor_parallel`) and passes the data-parallel group of
//! its mesh here, with the split parameters marked (`Param::split_over`) so that clipping and
//! LAMB/LARS take whole-parameter norms. Under pipeline parallelism each stage parallelizes its
//! own parameters over its data-parallel group, runs its micro-batches' backward passes without
//! synchronising ([`Parallelized::set_sync`]) and sums the clipping norm over the stages
//! ([`Parallelized::across_stages`]); LAMB's and LARS's trust ratios are per parameter, and a
//! parameter lives on one stage, so they need nothing more.
//!
//! Under ZeRO 1 and 2 the fp32 masters are sharded with the optimizer state, so
//! [`Parallelized::full_weights`] gathers them for checkpoints and evaluation.
use tch::{Device, Kind, Tensor};

use crate::autograd::backward;
use crate::dist::ProcessGroup;
use crate::optim::{clip_to, scaled_grad_norm, Held, LossScaler, MasterWeights, Optimizer, Param};
use crate::parallel::{partition, DataParallel, DataParallelConfig, GradientBytes, ZeroOptimizer};
use crate::Result;

/// How a replicated model trains over a data-parallel group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParallelPlan {
    /// ZeRO stage: 0 (plain data parallel), 1 (sharded optimizer state and fp32 masters), 2
    /// (and gradients).
    pub zero: u8,
    /// The kind the model computes in: fp16 scales the loss dynamically. Its weights are of
    /// this kind too, stepped through fp32 masters below fp32, unless they are kept in fp32
    /// (adapters trained over a half-precision model), which are stepped as they are.
    pub compute: Kind,
    /// Keep the fp32 master weights and optimizer state in CPU memory.
    pub offload_optimizer: bool,
    /// Where the model's weights live.
    pub device: Device,
    /// Gradient bucket size in bytes (see [`DataParallelConfig::bucket_bytes`]).
    pub bucket_bytes: usize,
}

impl Default for ParallelPlan {
    /// Plain data parallelism in fp32 on the CPU, PyTorch's bucket size.
    fn default() -> Self {
        ParallelPlan {
            zero: 0,
            compute: Kind::Float,
            offload_optimizer: false,
            device: Device::Cpu,
            bucket_bytes: DataParallelConfig::default().bucket_bytes,
        }
    }
}

/// What [`Parallelized::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stepped {
    /// Whether the update was applied (fp16 skips a step whose gradients overflowed).
    pub applied: bool,
    /// The global gradient norm before clipping, unscaled: taken where the step needs it, to
    /// clip or to find an fp16 overflow (`None` otherwise).
    pub grad_norm: Option<f64>,
}

/// Who steps what: every rank all parameters (ZeRO 0), or each rank its own (ZeRO 1 and 2).
enum Stepper {
    Replicated { optimizer: Box<dyn Optimizer>, master: Option<MasterWeights> },
    Sharded(ZeroOptimizer<Box<dyn Optimizer>>),
}

/// The parameters wired for data-parallel training (see the module docs).
pub struct Parallelized {
    ddp: DataParallel,
    stepper: Stepper,
    scaler: Option<LossScaler>,
    group: ProcessGroup,
    /// The pipeline group whose stages hold the rest of the model.
    stages: Option<ProcessGroup>,
}

/// Applies `plan` to `params` (the model's trainable parameters, the same order on every rank)
/// over `group`; `build` makes the optimizer over the parameters it should step (the fp32
/// masters, or this rank's share of them under ZeRO). Rank 0's weights are broadcast to all.
pub fn parallelize(
    params: Vec<Param>,
    group: &ProcessGroup,
    plan: &ParallelPlan,
    build: impl FnOnce(Vec<Param>) -> Box<dyn Optimizer>,
) -> Result<Parallelized> {
    crate::error::ensure!(plan.zero <= 2, "ZeRO stage {} does not exist (0, 1 or 2)", plan.zero);
    let owners = partition(&params, group.size());
    // Broadcasts rank 0's weights; the masters below are copied from them.
    // Each rank's loss is divided by the group's size before backward (see
    // `Parallelized::loss_to_backpropagate`): the reduction sums.
    let cfg = DataParallelConfig { bucket_bytes: plan.bucket_bytes, average: false, ..DataParallelConfig::default() };
    let ddp = match plan.zero {
        2 => DataParallel::new_sharded(&params, group, cfg, owners.clone())?,
        _ => DataParallel::new(&params, group, cfg)?,
    };
    // Masters stand behind weights below fp32, or hold the optimizer off the device; weights
    // kept in fp32 under a half-precision compute (adapters) step as they are.
    let below_fp32 = params.iter().any(|p| p.tensor.kind() != Kind::Float);
    let master_device = match (below_fp32, plan.offload_optimizer) {
        (false, false) => None,
        (_, true) => Some(Device::Cpu),
        (true, false) => Some(plan.device),
    };
    let stepper = match (plan.zero, master_device) {
        (0, None) => Stepper::Replicated { optimizer: build(params), master: None },
        (0, Some(device)) => {
            let master = MasterWeights::on(params, device)?;
            Stepper::Replicated { optimizer: build(master.master()), master: Some(master) }
        }
        (_, None) => Stepper::Sharded(ZeroOptimizer::new(params, owners, group, build)?),
        (_, Some(device)) => Stepper::Sharded(ZeroOptimizer::with_masters(params, owners, group, device, build)?),
    };
    let scaler = (plan.compute == Kind::Half).then(LossScaler::default);
    Ok(Parallelized { ddp, stepper, scaler, group: group.clone(), stages: None })
}

impl Parallelized {
    /// These parameters are one pipeline stage's, the other stages' ranks of `pp` holding the
    /// rest of the model: the gradient norm (clipping, fp16's overflow check) then sums the
    /// stages' squares, so every stage clips by and skips on the whole model's norm.
    pub fn across_stages(mut self, pp: &ProcessGroup) -> Parallelized {
        self.stages = (pp.size() > 1).then(|| pp.clone());
        self
    }

    /// With `false`, backward passes accumulate gradients locally without communicating, for a
    /// runtime that runs the backward passes itself (a pipeline's micro-batches); set `true`
    /// before [`Self::step`], which then reduces every gradient at once.
    pub fn set_sync(&self, sync: bool) -> Result<()> {
        self.ddp.set_sync(sync)
    }

    /// Every weight in fp32 by name, the same full tensors on every rank: what checkpoints
    /// and evaluation use. Under ZeRO with master weights these are gathered from their owners
    /// into fresh buffers (a collective: every rank calls it); otherwise they are the stepped
    /// tensors themselves.
    pub fn full_weights(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.stepper {
            Stepper::Replicated { optimizer, .. } => {
                Ok(optimizer.params().iter().map(|p| (p.name.clone(), p.tensor.shallow_clone())).collect())
            }
            Stepper::Sharded(z) => z.full_weights(),
        }
    }

    /// Sets every weight from full fp32 tensors (as [`Self::full_weights`] returns them, for
    /// instance filled from a checkpoint), masters and model alike.
    pub fn load_full_weights(&self, full: &[(String, Tensor)]) -> Result<()> {
        match &self.stepper {
            Stepper::Replicated { optimizer, master } => {
                tch::no_grad(|| -> Result<()> {
                    for (p, (_, t)) in optimizer.params().iter().zip(full) {
                        p.tensor.shallow_clone().f_copy_(t)?;
                    }
                    Ok(())
                })?;
                master.as_ref().map_or(Ok(()), MasterWeights::weights_to_model)
            }
            Stepper::Sharded(z) => z.load_full_weights(full),
        }
    }

    /// The model's parameters (in the model's precision), as given to [`parallelize`].
    pub fn model_params(&self) -> &[Param] {
        match &self.stepper {
            Stepper::Replicated { master: Some(m), .. } => m.model(),
            Stepper::Replicated { optimizer, master: None } => optimizer.params(),
            Stepper::Sharded(z) => z.params(),
        }
    }

    /// The optimizer (over this rank's shard under ZeRO).
    pub fn optimizer(&self) -> &dyn Optimizer {
        match &self.stepper {
            Stepper::Replicated { optimizer, .. } => optimizer.as_ref(),
            Stepper::Sharded(z) => z,
        }
    }

    /// The optimizer, to load its state.
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        match &mut self.stepper {
            Stepper::Replicated { optimizer, .. } => optimizer.as_mut(),
            Stepper::Sharded(z) => z,
        }
    }

    /// The fp16 loss scaler.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The fp16 loss scaler, to restore its state.
    pub fn scaler_mut(&mut self) -> Option<&mut LossScaler> {
        self.scaler.as_mut()
    }

    /// Bytes of fp32 master weights on this rank (a share of them under ZeRO).
    pub fn master_bytes(&self) -> usize {
        let master = match &self.stepper {
            Stepper::Replicated { master, .. } => master.as_ref(),
            Stepper::Sharded(z) => z.master(),
        };
        master.map_or(0, MasterWeights::bytes)
    }

    /// The gradient bytes this rank held at the peak of the last synchronised backward.
    pub fn gradient_bytes(&self) -> Result<GradientBytes> {
        self.ddp.gradient_bytes()
    }

    /// Backward of one micro-batch's `loss` (already divided by the accumulation count);
    /// gradients are synchronised during the `last` micro-batch's backward only.
    pub fn backward(&self, loss: &Tensor, last: bool) -> Result<()> {
        self.ddp.set_sync(last)?;
        backward(&[&self.loss_to_backpropagate(loss)?], &[None], false)
    }

    /// What a rank backpropagates for its `loss` (the mean over its examples): divided by the
    /// group's size, so its gradients are its share of the mean over every rank's examples and
    /// the reduction sums them, and times the fp16 loss scale. Dividing first, as gradient
    /// accumulation divides each micro-batch's loss, keeps a rank's fp16 gradients from
    /// overflowing where one process's over the whole batch would not.
    pub fn loss_to_backpropagate(&self, loss: &Tensor) -> Result<Tensor> {
        let share = loss.f_div_scalar(self.group.size() as f64)?;
        Ok(match &self.scaler {
            Some(s) => s.scale_loss(&share)?,
            None => share,
        })
    }

    /// After the last micro-batch: finishes the gradient reduction, unscales (fp16), clips the
    /// global norm to `clip`, steps at `lr` and copies masters back into the model. Returns
    /// whether the step was applied (fp16 skips steps whose gradients overflowed) and the
    /// gradient norm where it was taken (a caller that wants it every step clips at infinity,
    /// which clips nothing).
    pub fn step(&mut self, lr: f64, clip: Option<f64>) -> Result<Stepped> {
        self.ddp.finish_gradients()?;
        // The tensors the optimizer steps hold the gradients that matter: all of them, or
        // this rank's share (summed over the group for the norm).
        let (stepped, held) = match &self.stepper {
            Stepper::Replicated { optimizer, master } => {
                if let Some(m) = master {
                    m.gradients_to_master()?;
                }
                (optimizer.params(), Held::Replicated(&self.group))
            }
            Stepper::Sharded(z) => {
                z.gradients_to_master()?;
                (z.stepped(), Held::Sharded(&self.group))
            }
        };
        // Unscaling, the overflow check and the clipping norm: one reduction, one sync.
        let grad_norm = match (&self.scaler, clip) {
            (None, None) => None,
            (scaler, clip) => {
                let mut norm = scaled_grad_norm(stepped, scaler.as_ref().map_or(1.0, |s| 1.0 / s.scale), held)?;
                if let Some(pp) = &self.stages {
                    // The stage's norm is the same on its data-parallel ranks; add the stages'.
                    let squares = Tensor::from_slice(&[norm * norm]);
                    pp.all_reduce(&squares, crate::dist::ReduceOp::Sum)?;
                    norm = squares.f_double_value(&[0])?.sqrt();
                }
                if let Some(max) = clip {
                    clip_to(stepped, norm, max)?;
                }
                Some(norm)
            }
        };
        // Without a scaler a non-finite norm steps anyway, as in PyTorch.
        let finite = self.scaler.is_none() || grad_norm.is_some_and(f64::is_finite);
        let optimizer = self.optimizer_mut();
        optimizer.set_lr(lr);
        if finite {
            optimizer.step()?;
        }
        match &self.stepper {
            // Drops the masters' gradients (and the model's, moved to them above): zeroing them
            // first would be a pass over 4 bytes a weight for nothing.
            Stepper::Replicated { master: Some(m), .. } => m.weights_to_model()?,
            _ => self.optimizer_mut().zero_grad(),
        }
        if let Some(s) = self.scaler.as_mut() {
            s.update(finite);
        }
        Ok(Stepped { applied: finite, grad_norm })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::{InitOptions, World};
    use crate::optim::{AdamW, AdamWConfig};

    #[test]
    fn fp32_weights_under_fp16_compute_step_as_they_are_with_a_loss_scaler() {
        let world = World::single(&InitOptions::default()).unwrap();
        let w = Tensor::from_slice(&[1.0f32, -1.0, 2.0, 0.5]).set_requires_grad(true);
        let plan = ParallelPlan { compute: Kind::Half, ..ParallelPlan::default() };
        let cfg = AdamWConfig { lr: 0.25, weight_decay: 0.0, ..AdamWConfig::default() };
        let mut par =
            parallelize(vec![Param::new("w", &w)], &world.group, &plan, |ps| Box::new(AdamW::new(ps, cfg))).unwrap();
        assert_eq!(par.master_bytes(), 0, "no fp32 copy of fp32 weights");
        assert!(par.scaler().is_some(), "fp16 compute scales the loss");
        par.backward(&(&w * 3.0).sum(Kind::Float), true).unwrap();
        // An infinite clip clips nothing but takes the norm, unscaled.
        let stepped = par.step(0.25, Some(f64::INFINITY)).unwrap();
        assert_eq!(stepped, Stepped { applied: true, grad_norm: Some(6.0) });
        // AdamW's first step moves each weight by lr against its gradient's sign.
        assert_eq!(Vec::<f32>::try_from(w.detach()).unwrap(), vec![0.75, -1.25, 1.75, 0.25]);
        let stepped = par.step(0.25, None).unwrap();
        assert!(stepped.applied && stepped.grad_norm == Some(0.0), "the scaler's overflow check takes the norm");
    }
}
