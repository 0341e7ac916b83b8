//! Mixed precision: fp32 master weights behind bf16/fp16 model weights, and dynamic loss
//! scaling for fp16 that skips steps whose gradients overflowed.
use tch::{Device, Kind, Tensor};

use super::clip::{scaled_grad_norm, Held};
use super::{Optimizer, Param};
use crate::autograd::set_grad;
use crate::dist::ProcessGroup;
use crate::Result;

/// fp32 copies of the model parameters, optionally on another device. The optimizer runs on
/// [`Self::master`]; each step copies the model's gradients in and the updated weights back
/// out. Two uses: mixed precision (bf16/fp16 model, fp32 master) and optimizer offload (master
/// and therefore the optimizer's state in CPU memory while the model trains on the GPU).
pub struct MasterWeights {
    model: Vec<Param>,
    master: Vec<Param>,
    device: Device,
}

impl MasterWeights {
    /// fp32 leaf copies of `model`'s parameters (same names and decay rule) on the model's
    /// device.
    pub fn new(model: Vec<Param>) -> Result<MasterWeights> {
        let device = model.first().map_or(Device::Cpu, |p| p.tensor.device());
        Self::on(model, device)
    }

    /// fp32 leaf copies of `model`'s parameters on `device` (CPU: optimizer offload).
    pub fn on(model: Vec<Param>, device: Device) -> Result<MasterWeights> {
        let master = model
            .iter()
            .map(|p| {
                let t = p.tensor.f_detach()?.f_to_kind(Kind::Float)?.f_to_device(device)?.f_detach_copy()?;
                let t = t.f_set_requires_grad(true)?;
                Ok(p.with_tensor(t))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MasterWeights { model, master, device })
    }

    /// The fp32 parameters, for the optimizer.
    pub fn master(&self) -> Vec<Param> {
        self.master.iter().map(Param::shallow_copy).collect()
    }

    /// Where the masters live.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes held by the fp32 masters.
    pub fn bytes(&self) -> usize {
        self.master.iter().map(|p| p.tensor.numel() * 4).sum()
    }

    /// The model's parameters.
    pub fn model(&self) -> &[Param] {
        &self.model
    }

    /// Moves the model's gradients to the masters in fp32: each master gradient is set to its
    /// model gradient (none where the model has none), which is then dropped, so the step holds
    /// one gradient a weight (4 bytes) where keeping the model's would hold 6 in bf16. The step
    /// reads only the masters'.
    pub fn gradients_to_master(&self) -> Result<()> {
        for (m, p) in self.master.iter().zip(&self.model) {
            let g = p.tensor.grad();
            if g.defined() {
                set_grad(&m.tensor, Some(&g.f_to_kind(Kind::Float)?.f_to_device(self.device)?))?;
                set_grad(&p.tensor, None)?;
            } else {
                set_grad(&m.tensor, None)?;
            }
        }
        Ok(())
    }

    /// Copies the master weights into the model (rounding to its precision) and clears the
    /// model's gradients and the masters'. The masters' are the step's alone: kept, they would
    /// hold 4 bytes a weight through the next forward and backward (330 MiB for ViT-B/16, what
    /// an H200 run measured over PyTorch's `zero_grad(set_to_none=True)`), and
    /// [`Self::gradients_to_master`] makes them anew.
    pub fn weights_to_model(&self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (m, p) in self.master.iter().zip(&self.model) {
                let mut t = p.tensor.shallow_clone();
                t.f_copy_(&m.tensor)?;
                set_grad(&p.tensor, None)?;
                set_grad(&m.tensor, None)?;
            }
            Ok(())
        })
    }
}

/// Dynamic loss scaling (as `torch.amp.GradScaler`): the loss is multiplied by a large scale
/// so fp16 gradients do not underflow; a step whose gradients contain inf or NaN is skipped
/// and the scale halved; after `growth_interval` clean steps the scale doubles.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f64,
    /// Factor applied after `growth_interval` clean steps.
    pub growth_factor: f64,
    /// Factor applied after an overflow.
    pub backoff_factor: f64,
    /// Clean steps between growths.
    pub growth_interval: usize,
    clean_steps: usize,
}

impl Default for LossScaler {
    /// PyTorch's defaults: 2^16, x2 every 2000 clean steps, x0.5 on overflow.
    fn default() -> Self {
        LossScaler { scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, clean_steps: 0 }
    }
}

impl LossScaler {
    /// The loss to call backward on.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.f_mul_scalar(self.scale)?)
    }

    /// Unscales the gradients of `opt`'s parameters and steps unless any is inf or NaN on any
    /// rank of `group` (every rank then makes the same decision). Returns whether it stepped;
    /// either way the scale is updated and, after a skip, the gradients are cleared.
    pub fn step(&mut self, opt: &mut dyn Optimizer, group: Option<&ProcessGroup>) -> Result<bool> {
        let finite = self.unscale(opt.params(), group)?;
        if finite {
            opt.step()?;
        } else {
            opt.zero_grad();
        }
        self.update(finite);
        Ok(finite)
    }

    /// The first half of [`LossScaler::step`], for callers that act between unscaling and
    /// stepping (gradient clipping): divides the gradients by the scale and returns whether
    /// they are all finite on every rank of `group`.
    pub fn unscale(&self, params: &[Param], group: Option<&ProcessGroup>) -> Result<bool> {
        // Summed over the group: finite on every rank exactly when the sum is finite.
        let held = group.map_or(Held::Local, Held::Sharded);
        Ok(scaled_grad_norm(params, 1.0 / self.scale, held)?.is_finite())
    }

    /// The second half of [`LossScaler::step`]: backs off after an overflow, grows after
    /// `growth_interval` clean steps.
    pub fn update(&mut self, finite: bool) {
        if !finite {
            self.scale *= self.backoff_factor;
            self.clean_steps = 0;
            return;
        }
        self.clean_steps += 1;
        if self.clean_steps == self.growth_interval {
            self.scale *= self.growth_factor;
            self.clean_steps = 0;
        }
    }

    /// Clean steps since the last change of scale (for checkpoints).
    pub fn clean_steps(&self) -> usize {
        self.clean_steps
    }

    /// Restores a checkpointed scaler position.
    pub fn resume(&mut self, scale: f64, clean_steps: usize) {
        self.scale = scale;
        self.clean_steps = clean_steps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, AdamWConfig};

    fn grads(p: &Tensor, g: &[f32]) {
        (p * Tensor::from_slice(g)).sum(Kind::Float).backward();
    }

    #[test]
    fn the_scaler_skips_an_injected_overflow_and_adapts_the_scale() {
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let mut opt = AdamW::new(vec![Param::new("w", &w)], AdamWConfig::default());
        let mut scaler = LossScaler { growth_interval: 2, scale: 1024.0, ..LossScaler::default() };
        grads(&w, &[1024.0, f32::INFINITY]);
        assert!(!scaler.step(&mut opt, None).unwrap(), "overflow: no step");
        assert_eq!(Vec::<f32>::try_from(&w).unwrap(), vec![1.0, 2.0], "weights untouched");
        assert_eq!(scaler.scale, 512.0);
        assert!(!w.grad().defined() || w.grad().abs().sum(Kind::Float).double_value(&[]) == 0.0);
        for _ in 0..2 {
            grads(&w, &[512.0, -512.0]);
            assert!(scaler.step(&mut opt, None).unwrap());
        }
        assert_eq!(scaler.scale, 1024.0, "two clean steps double the scale");
        assert!(Vec::<f32>::try_from(&w).unwrap() != vec![1.0, 2.0], "clean steps update");
        // Unscaled gradient was (1, -1): AdamW's first step moves each weight by lr.
    }

    #[test]
    fn master_weights_round_trip_through_bf16() {
        let m = Tensor::from_slice(&[1.0f32, 3.0]).to_kind(Kind::BFloat16).set_requires_grad(true);
        let mw = MasterWeights::new(vec![Param::new("m", &m)]).unwrap();
        assert_eq!(mw.master()[0].tensor.kind(), Kind::Float);
        (&m * Tensor::from_slice(&[2.0f32, 4.0]).to_kind(Kind::BFloat16)).sum(Kind::BFloat16).backward();
        mw.gradients_to_master().unwrap();
        assert!(!m.grad().defined(), "the model's gradient moved to the master");
        let master = mw.master();
        assert_eq!(Vec::<f32>::try_from(master[0].tensor.grad()).unwrap(), vec![2.0, 4.0]);
        let mut opt = AdamW::new(master, AdamWConfig { lr: 0.5, weight_decay: 0.0, ..AdamWConfig::default() });
        opt.step().unwrap();
        mw.weights_to_model().unwrap();
        let model = Vec::<f32>::try_from(m.to_kind(Kind::Float)).unwrap();
        assert_eq!(model, vec![0.5, 2.5], "first AdamW step moves by lr; bf16 holds these exactly");
        assert!(!m.grad().defined(), "model gradients cleared");
        assert!(!mw.master()[0].tensor.grad().defined(), "master gradients cleared");
    }
}
