//! The rules over flat fp32 tensors where they live (Gemini's chunk homes on the compute
//! device): the host kernels' two-half step with the same f32 arithmetic in the same order, as
//! tensor operations on each segment's views, so device and host chunks train alike.
use tch::{Kind, Tensor};

use super::{CpuRule, Segment};
use crate::optim::clip::square_sum;
use crate::optim::fused::{self, Rule, StepTensors};
use crate::Result;

/// An optimizer stepping flat tensors (one chunk's home or shard) in place, its state in flat
/// tensors beside them.
#[derive(Debug)]
pub struct DeviceOptimizer {
    rule: CpuRule,
    step: i32,
    segments: Vec<Segment>,
    /// Adam's first moment or LARS's momentum buffer (undefined where the rule keeps none).
    m: Tensor,
    /// Adam's second moment (undefined for LARS).
    v: Tensor,
}

impl DeviceOptimizer {
    /// An optimizer for flat tensors like `like` (dtype, device, length) holding `segments`.
    pub fn new(rule: CpuRule, segments: Vec<Segment>, like: &Tensor) -> Result<DeviceOptimizer> {
        let slots = rule.state_slots().len();
        let buffer =
            |slot: usize| -> Result<Tensor> { Ok(if slot < slots { like.f_zeros_like()? } else { Tensor::new() }) };
        Ok(DeviceOptimizer { rule, step: 0, segments, m: buffer(0)?, v: buffer(1)? })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> i32 {
        self.step
    }

    /// The state tensors (see [`super::HostOptimizer::state`]); undefined where the rule keeps
    /// none.
    pub fn state(&self) -> (&Tensor, &Tensor) {
        (&self.m, &self.v)
    }

    /// Restores the step count and the state tensors' contents.
    pub fn load_state(&mut self, step: i32, m: &Tensor, v: &Tensor) -> Result<()> {
        self.step = step;
        tch::no_grad(|| -> Result<()> {
            if self.m.defined() {
                self.m.f_copy_(m)?;
            }
            if self.v.defined() {
                self.v.f_copy_(v)?;
            }
            Ok(())
        })
    }

    /// Bytes of optimizer state.
    pub fn state_bytes(&self) -> usize {
        [&self.m, &self.v].iter().filter(|t| t.defined()).map(|t| t.numel() * 4).sum()
    }

    /// Sets the learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        self.rule.set_lr(lr);
    }

    fn views(&self, s: &Segment, w: &Tensor, g: &Tensor) -> Result<[Tensor; 4]> {
        let cut = |t: &Tensor| -> Result<Tensor> {
            Ok(if t.defined() { t.f_narrow(0, s.offset as i64, s.len as i64)? } else { Tensor::new() })
        };
        Ok([cut(w)?, cut(g)?, cut(&self.m)?, cut(&self.v)?])
    }

    /// First half of a step (see [`super::HostOptimizer::prepare`]): the sums of squares per
    /// segment, as a `[segments, 2]` f64 tensor on the host.
    pub fn prepare(&mut self, w: &Tensor, g: &Tensor) -> Result<Tensor> {
        self.step += 1;
        tch::no_grad(|| -> Result<Tensor> {
            let mut sums = vec![];
            for seg in &self.segments {
                let [w, g, mut m, mut v] = self.views(seg, w, g)?;
                let zero = || w.f_new_zeros([2], (Kind::Double, w.device()));
                let pair = match self.rule {
                    CpuRule::AdamW(_) => zero()?,
                    CpuRule::Lamb(c) => {
                        let rule = c.at::<f64>(self.step, seg.adapt);
                        rule.adam.moments(&mut m, &mut v, &g)?;
                        if seg.adapt {
                            let r = rule.update(&w, &m, &v)?;
                            Tensor::f_stack(&[square_sum(&w)?, square_sum(&r)?], 0)?
                        } else {
                            zero()?
                        }
                    }
                    CpuRule::Lars(_) if seg.adapt => Tensor::f_stack(&[square_sum(&w)?, square_sum(&g)?], 0)?,
                    CpuRule::Lars(_) => zero()?,
                };
                sums.push(pair);
            }
            // A rank's shard of a chunk may hold only padding: no segments, no sums.
            if sums.is_empty() {
                return Ok(Tensor::f_zeros([0, 2], (Kind::Double, tch::Device::Cpu))?);
            }
            Ok(Tensor::f_stack(&sums, 0)?.f_to_device(tch::Device::Cpu)?)
        })
    }

    /// Second half of a step: the update, with the whole parameters' sums (`[segments, 2]`).
    /// Leaves `g` as it is: Gemini, the one caller, overwrites a spent gradient with the next
    /// (`gemini/manager/gradients.rs`), as it does on the host, where it passes
    /// [`super::StepExtras::keep_gradients`]. AdamW,
    /// which needs no norms, runs through the installed multi-tensor steps when they take the
    /// segments (see [`crate::optim::fused`]); LAMB's and LARS's norms may span shards, so they
    /// keep the tensor operations.
    pub fn finish(&mut self, w: &Tensor, g: &Tensor, sums: &[[f64; 2]]) -> Result<()> {
        if self.finish_multi_tensor(w, g)? {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for (seg, sums) in self.segments.iter().zip(sums) {
                let [mut w, g, mut m, mut v] = self.views(seg, w, g)?;
                let norms = seg.adapt.then(|| (sums[0].sqrt(), sums[1].sqrt()));
                match self.rule {
                    CpuRule::AdamW(c) => c.at::<f64>(self.step, seg.adapt).step(&mut w, &mut m, &mut v, &g)?,
                    CpuRule::Lamb(c) => {
                        let rule = c.at::<f64>(self.step, seg.adapt);
                        let r = rule.update(&w, &m, &v)?;
                        rule.apply(&mut w, &r, rule.scale(norms))?;
                    }
                    CpuRule::Lars(c) => {
                        let buf = m.defined().then_some((&mut m, self.step == 1));
                        c.at::<f64>(norms).step(&mut w, buf, &g)?;
                    }
                }
            }
            Ok(())
        })
    }
}

impl DeviceOptimizer {
    /// AdamW over every segment in one call of the installed multi-tensor steps; whether it ran.
    fn finish_multi_tensor(&self, w: &Tensor, g: &Tensor) -> Result<bool> {
        let (CpuRule::AdamW(c), Some(steps)) = (self.rule, fused::installed()) else { return Ok(false) };
        let views = self.segments.iter().map(|s| self.views(s, w, g)).collect::<Result<Vec<_>>>()?;
        if views.is_empty() || !views.iter().flatten().all(|t| steps.accepts(t)) {
            return Ok(false);
        }
        let tensors: Vec<StepTensors> = views
            .iter()
            .zip(&self.segments)
            .map(|([w, g, m, v], s)| StepTensors { param: w, grad: g, state: [Some(m), Some(v)], adapt: s.adapt })
            .collect();
        tch::no_grad(|| steps.step(Rule::AdamW(c), &tensors, self.step))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use tch::Tensor;

    use super::*;
    use crate::optim::flat::HostOptimizer;
    use crate::optim::{AdamWConfig, LambConfig, LarsConfig};

    /// The tensor kernels take the host kernels' arithmetic in the same order; what differs is
    /// the summation order of the norms (f64 either way) and fused multiply-adds. Observed:
    /// at most a few ulps.
    const TOL: f64 = 1e-6;

    #[test]
    fn tensor_rules_match_host_rules() {
        let segments = vec![
            Segment { name: "w".into(), offset: 0, len: 3000, adapt: true },
            Segment { name: "b".into(), offset: 3003, len: 40, adapt: false },
            Segment { name: "zero".into(), offset: 3043, len: 64, adapt: true },
        ];
        let len = 3200;
        let rules = [
            CpuRule::AdamW(AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() }),
            CpuRule::Lamb(LambConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() }),
            CpuRule::Lars(LarsConfig { lr: 0.5, weight_decay: 1e-3, ..Default::default() }),
            CpuRule::Lars(LarsConfig { lr: 0.5, momentum: 0.0, ..Default::default() }),
        ];
        let gen = |seed: i64| {
            let g = Tensor::from_slice(&crate::optim::flat::host::tests::randn(len as usize, seed));
            g.f_mul_scalar(1.0 + seed as f64 * 0.1).unwrap()
        };
        for rule in rules {
            let w0 = gen(0);
            let _ = w0.narrow(0, 3043, 64).zero_();
            let grads: Vec<Tensor> = (1..=4).map(gen).collect();
            let mut host = HostOptimizer::new(rule, segments.clone(), len as usize);
            let mut w_host = Vec::<f32>::try_from(&w0).unwrap();
            let mut device = DeviceOptimizer::new(rule, segments.clone(), &w0).unwrap();
            let w_dev = w0.copy();
            for g in &grads {
                let mut g_host = Vec::<f32>::try_from(g).unwrap();
                host.step(&mut w_host, &mut g_host);
                let sums = device.prepare(&w_dev, g).unwrap();
                let sums: Vec<[f64; 2]> =
                    Vec::<Vec<f64>>::try_from(sums).unwrap().into_iter().map(|r| [r[0], r[1]]).collect();
                let before = g.copy();
                device.finish(&w_dev, g, &sums).unwrap();
                assert!(g.equal(&before), "{rule:?}: the gradient is left as it is");
            }
            let expected = Tensor::from_slice(&w_host);
            let diff = (&w_dev - &expected).abs().max().double_value(&[]);
            let scale = expected.abs().max().double_value(&[]);
            assert!(diff <= TOL * scale, "{rule:?}: differs by {diff:e} (max |w| {scale:e})");
            assert_eq!(w_dev.narrow(0, 3000, 3), w0.narrow(0, 3000, 3), "padding untouched");
            assert_eq!(device.steps(), 4);
            assert_eq!(device.state_bytes(), host.state_bytes());
        }
    }
}
