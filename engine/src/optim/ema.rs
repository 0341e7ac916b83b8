//! An exponential moving average of parameters, as AlphaFold keeps one (decay 0.999) for
//! evaluation and for the weights it releases: OpenFold's `ExponentialMovingAverage`.
//!
//! The average starts at the parameters' values and moves after every optimizer step by
//! `shadow -= (1 - decay) * (shadow - param)`, i.e. `decay * shadow + (1 - decay) * param`, in
//! fp32 whatever the parameters' precision. There is no warm-up of the decay: OpenFold has
//! none, and AlphaFold's runs (fine-tuning from released weights, or 10^5 steps and more from
//! scratch, where the initial weights' share `0.999^step` is gone after a few thousand steps)
//! do not need one; diffusers' `EMAModel` warm-up is the diffusion app's own (its arithmetic
//! is [`update`]'s).
//!
//! The average is read by name ([`Ema::weights`]) or swapped into the parameters for a while
//! ([`Ema::with_average`]: saving, evaluation), and saved for a resume as `{param}.ema` entries
//! beside the optimizer's `{param}.{slot}` ones ([`Ema::state`], [`Ema::load_state`]).
use tch::{Kind, Tensor};

use super::state::StateDict;
use super::Param;
use crate::Result;

/// The slot name of the average in a state dictionary.
const SLOT: &str = "ema";

/// The average of a list of parameters (see the module documentation).
pub struct Ema {
    params: Vec<Param>,
    shadow: Vec<Tensor>,
    decay: f64,
}

impl Ema {
    /// An average of `params` (handles on the live tensors, e.g. an optimizer's
    /// [`super::Optimizer::params`]) starting at their current values; `decay` in [0, 1].
    pub fn new(params: &[Param], decay: f64) -> Result<Ema> {
        crate::error::ensure!((0.0..=1.0).contains(&decay), "EMA decay {decay}: a decay from 0 to 1 is needed");
        let shadow = tch::no_grad(|| {
            params.iter().map(|p| Ok(p.tensor.f_detach_copy()?.f_to_kind(Kind::Float)?)).collect::<Result<Vec<_>>>()
        })?;
        Ok(Ema { params: params.iter().map(Param::shallow_copy).collect(), shadow, decay })
    }

    /// The decay.
    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Moves the average towards the parameters' current values (after an optimizer step).
    pub fn update(&mut self) -> Result<()> {
        for (p, s) in self.params.iter().zip(&self.shadow) {
            update(s, &p.tensor.f_detach()?.f_to_kind(Kind::Float)?, self.decay)?;
        }
        Ok(())
    }

    /// The average by parameter name (fp32, shared with the average: copy before changing).
    pub fn weights(&self) -> Vec<(String, Tensor)> {
        self.params.iter().zip(&self.shadow).map(|(p, s)| (p.name.clone(), s.shallow_clone())).collect()
    }

    /// Runs `f` with the average in the parameters (in their precision), then puts their own
    /// values back exactly; they are back when `f` fails too.
    pub fn with_average<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let saved =
            tch::no_grad(|| self.params.iter().map(|p| Ok(p.tensor.f_detach_copy()?)).collect::<Result<Vec<_>>>())?;
        self.copy_in(&self.shadow)?;
        let out = f();
        self.copy_in(&saved)?;
        Ok(out)
    }

    /// Copies `values` (one per parameter) into the parameters.
    fn copy_in(&self, values: &[Tensor]) -> Result<()> {
        tch::no_grad(|| {
            for (p, v) in self.params.iter().zip(values) {
                p.tensor.f_detach()?.f_copy_(v)?;
            }
            Ok(())
        })
    }

    /// The state for a checkpoint: `{param}.ema` per parameter.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        self.params.iter().zip(&self.shadow).map(|(p, s)| (format!("{}.{SLOT}", p.name), s.shallow_clone())).collect()
    }

    /// Restores what [`Ema::state`] returned, taking its entries out of `state`; a missing,
    /// mis-shaped or non-floating entry is an error naming it.
    pub fn load_state(&mut self, state: &mut StateDict) -> Result<()> {
        for (p, s) in self.params.iter().zip(&mut self.shadow) {
            let key = format!("{}.{SLOT}", p.name);
            let t = state.remove(&key).ok_or_else(|| crate::Error::invalid(format!("EMA state has no {key}")))?;
            crate::error::ensure!(
                t.size() == p.tensor.size(),
                "EMA state {key} has shape {:?}, the parameter {:?}",
                t.size(),
                p.tensor.size()
            );
            crate::error::ensure!(t.is_floating_point(), "EMA state {key} holds {:?} values", t.kind());
            *s = t.f_to_kind(Kind::Float)?.f_to_device(p.tensor.device())?;
        }
        Ok(())
    }
}

/// One update of `shadow` towards `value` in place: `shadow -= (1 - decay) * (shadow - value)`,
/// the arithmetic of OpenFold's `ExponentialMovingAverage` and diffusers' `EMAModel.step`.
pub fn update(shadow: &Tensor, value: &Tensor, decay: f64) -> Result<()> {
    tch::no_grad(|| {
        let step = shadow.f_sub(value)?.f_mul_scalar(1.0 - decay)?;
        let _ = shadow.f_detach()?.f_sub_(&step)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn param(name: &str, values: &[f32]) -> Param {
        Param::new(name, &Tensor::from_slice(values).set_requires_grad(true))
    }

    fn set(p: &Param, values: &[f32]) {
        tch::no_grad(|| p.tensor.detach().copy_(&Tensor::from_slice(values)));
    }

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double)).unwrap()
    }

    /// Over a few steps the average is `decay * shadow + (1 - decay) * param` from the initial
    /// values, computed here in f64: within 1e-5 (a few fp32 roundings of values below 5).
    #[test]
    fn follows_the_formula_and_swaps_in_and_back() {
        let (a, b) = (param("a", &[1.0, -2.0]), param("b", &[0.5]));
        let mut ema = Ema::new(&[a.shallow_copy(), b.shallow_copy()], 0.9).unwrap();
        let mut want = [1.0f64, -2.0, 0.5];
        for step in 1..=4 {
            let now = [step as f32, -2.0 + 0.5 * step as f32, 0.5 - step as f32];
            set(&a, &now[..2]);
            set(&b, &now[2..]);
            ema.update().unwrap();
            for (w, x) in want.iter_mut().zip(now) {
                *w = 0.9 * *w + 0.1 * x as f64;
            }
        }
        let got: Vec<f64> = ema.weights().iter().flat_map(|(_, t)| values(t)).collect();
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-5, "average {got:?}, formula {want:?}");
        }
        assert_eq!(ema.weights().iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        // Swapped in for a while, then the parameters' own values exactly.
        let inside = ema.with_average(|| values(&a.tensor)).unwrap();
        assert!((inside[0] - want[0]).abs() <= 1e-5 && (inside[1] - want[1]).abs() <= 1e-5, "{inside:?}");
        assert_eq!(values(&a.tensor), [4.0, 0.0]);
        assert_eq!(values(&b.tensor), [-3.5]);
        assert!(a.tensor.requires_grad(), "still a leaf that trains");
    }

    /// Decay 0 follows the parameters; the average is fp32 for a bf16 parameter.
    #[test]
    fn decay_zero_follows_and_the_average_is_fp32() {
        let p = Param::new("w", &Tensor::from_slice(&[1.0f32, 2.0]).to_kind(Kind::BFloat16));
        let mut ema = Ema::new(&[p.shallow_copy()], 0.0).unwrap();
        tch::no_grad(|| p.tensor.detach().copy_(&Tensor::from_slice(&[3.0f32, 5.0])));
        ema.update().unwrap();
        let (_, avg) = &ema.weights()[0];
        assert_eq!((avg.kind(), values(avg)), (Kind::Float, vec![3.0, 5.0]));
        assert!(Ema::new(&[p.shallow_copy()], 1.5).is_err() && Ema::new(&[p], f64::NAN).is_err());
    }

    /// An average restored from its state continues as the one that was saved, bit for bit;
    /// a missing or mis-shaped entry is an error naming it.
    #[test]
    fn resumes_from_its_state() {
        let steps = |ema: &mut Ema, p: &Param, from: usize, to: usize| {
            for step in from..to {
                set(p, &[(step as f32).sin(), (step as f32).cos()]);
                ema.update().unwrap();
            }
        };
        let p = param("w", &[0.25, 0.75]);
        let mut straight = Ema::new(&[p.shallow_copy()], 0.999).unwrap();
        steps(&mut straight, &p, 0, 6);
        set(&p, &[0.25, 0.75]);
        let mut first = Ema::new(&[p.shallow_copy()], 0.999).unwrap();
        steps(&mut first, &p, 0, 3);
        let mut state: StateDict = first.state().into_iter().map(|(k, t)| (k, t.copy())).collect();
        assert_eq!(state.keys().collect::<Vec<_>>(), ["w.ema"]);
        let mut resumed = Ema::new(&[p.shallow_copy()], 0.999).unwrap();
        resumed.load_state(&mut state).unwrap();
        assert!(state.is_empty(), "its entries are taken");
        steps(&mut resumed, &p, 3, 6);
        assert!(resumed.weights()[0].1.equal(&straight.weights()[0].1), "bit for bit");

        let mut wrong: StateDict = [("w.ema".to_string(), Tensor::zeros([3], (Kind::Float, Device::Cpu)))].into();
        let err = resumed.load_state(&mut wrong).err().unwrap().to_string();
        assert!(err.contains("w.ema") && err.contains("[3]"), "{err}");
        let err = resumed.load_state(&mut StateDict::new()).err().unwrap().to_string();
        assert!(err.contains("no w.ema"), "{err}");
    }
}
