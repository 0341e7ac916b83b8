//! Linear and LayerNorm with AlphaFold's array names, and the chunking helper every
//! memory-heavy module uses.
use kernels::Backend;
use tch::Tensor;

use crate::model::scope::{Init, Scope};
use crate::model::{ensure, Result};

/// `x @ weights + bias` with `weights` stored [in, out] (haiku's layout).
pub struct Linear {
    weights: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Arrays `weights` [c_in, c_out] and, with `bias`, `bias` [c_out].
    pub fn new(p: &Scope, c_in: i64, c_out: i64, bias: bool) -> Result<Self> {
        let weights = p.param("weights", &[c_in, c_out], Init::Weight { fan_in: c_in })?;
        let bias = match bias {
            true => Some(p.param("bias", &[c_out], Init::Small)?),
            false => None,
        };
        Ok(Linear { weights, bias })
    }

    /// Applies the layer to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.matmul(x)?;
        Ok(match &self.bias {
            Some(b) => y.f_add(b)?,
            None => y,
        })
    }

    /// `x @ weights` alone, for a fused kernel that adds the bias itself.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_matmul(&self.weights)?)
    }

    /// The bias, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

/// LayerNorm over the last dimension, arrays `scale` and `offset` (haiku's eps, 1e-5).
pub struct LayerNorm {
    scale: Tensor,
    offset: Tensor,
    channels: i64,
    kernels: Backend,
}

impl LayerNorm {
    /// Arrays `scale` [c] and `offset` [c].
    pub fn new(p: &Scope, channels: i64) -> Result<Self> {
        Ok(LayerNorm {
            scale: p.param("scale", &[channels], Init::One)?,
            offset: p.param("offset", &[channels], Init::Small)?,
            channels,
            kernels: p.kernels(),
        })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Backend::Torch => Ok(x.f_layer_norm([self.channels], Some(&self.scale), Some(&self.offset), 1e-5, true)?),
            Backend::Fused => Ok(kernels::layer_norm(x, &self.scale, &self.offset, 1e-5, Backend::Fused)?),
        }
    }
}

/// Runs `f(start, len)` over slices of `[0, len)` at most `chunk` long and concatenates the
/// results along dim 0 (`None`: one call over everything). Modules slice their batch-like
/// axis with it, bounding the largest intermediate.
pub fn chunked(len: i64, chunk: Option<i64>, mut f: impl FnMut(i64, i64) -> Result<Tensor>) -> Result<Tensor> {
    let step = match chunk {
        Some(c) => {
            ensure!(c > 0, "chunk size must be positive, got {c}");
            c
        }
        None => len,
    };
    if step >= len {
        return f(0, len);
    }
    let mut parts = Vec::new();
    let mut start = 0;
    while start < len {
        let n = step.min(len - start);
        parts.push(f(start, n)?);
        start += n;
    }
    Ok(Tensor::f_cat(&parts, 0)?)
}

/// The additive attention bias of a key mask: 0 where `mask` is 1, -1e9 where it is 0
/// (AlphaFold's `1e9 * (mask - 1)`), shaped `[batch, 1, 1, keys]`.
pub fn mask_bias(mask: &Tensor) -> Result<Tensor> {
    Ok(mask.f_sub_scalar(1.0)?.f_mul_scalar(1e9)?.f_unsqueeze(1)?.f_unsqueeze(1)?)
}
