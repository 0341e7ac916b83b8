//! LayerNorm for the sequence-parallel region of a Megatron-SP model. The normalisation itself
//! acts on each token alone, so a rank normalises its block of the sequence with the whole
//! (replicated) weight and bias; but then each rank's backward sees only its block's share of
//! the parameters' gradient, and the full gradient is the sum over the group (Megatron
//! all-reduces these "sequence-parallel parameters" after backward; here `copy_to`'s backward
//! does it as part of the graph). Without sequence parallelism it is a plain LayerNorm on the
//! replicated activations.
use tch::{nn, Tensor};

use super::init::{self, Init};
use super::TensorParallel;
use crate::Result;

/// A LayerNorm over the last dimension whose parameters are replicated over the group.
#[derive(Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
    sequence_parallel: bool,
    tp: TensorParallel,
}

impl LayerNorm {
    /// LayerNorm over `width` features with PyTorch's initialisation (weight 1, bias 0).
    /// `sequence_parallel`: the inputs are sequence blocks, so parameter gradients are summed.
    pub fn new(p: &nn::Path, width: i64, eps: f64, sequence_parallel: bool, tp: &TensorParallel) -> Result<Self> {
        let weight = init::full(Init::Ones, 0, &p.path("weight"), &[width])?;
        let bias = init::full(Init::Zeros, 0, &p.path("bias"), &[width])?;
        Self::from_full(p, &weight, &bias, eps, sequence_parallel, tp)
    }

    /// LayerNorm with the given `weight` and `bias` `[width]`.
    pub fn from_full(
        p: &nn::Path,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
        sequence_parallel: bool,
        tp: &TensorParallel,
    ) -> Result<Self> {
        crate::error::ensure!(
            weight.dim() == 1 && bias.size() == weight.size(),
            "layer norm {}: weight {:?} and bias {:?} must be one and the same width",
            p.path("weight"),
            weight.size(),
            bias.size()
        );
        Ok(LayerNorm {
            weight: p.f_var_copy("weight", weight)?,
            bias: p.f_var_copy("bias", bias)?,
            eps,
            sequence_parallel,
            tp: tp.clone(),
        })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (w, b) = match self.sequence_parallel {
            true => (self.tp.copy_to(&self.weight)?, self.tp.copy_to(&self.bias)?),
            false => (self.weight.shallow_clone(), self.bias.shallow_clone()),
        };
        Ok(x.f_layer_norm(self.weight.size(), Some(&w), Some(&b), self.eps, false)?)
    }

    /// The weight `[width]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[width]`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
}
