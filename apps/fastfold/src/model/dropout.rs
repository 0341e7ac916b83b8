//! Training dropout as AlphaFold applies it (`modules.dropout_wrapper` and `apply_dropout`):
//! each Evoformer-style sub-module's update is multiplied, before it joins the residual
//! stream, by a keep mask `jax.random.bernoulli(key, 1 - rate, shape)` divided by `1 - rate`,
//! where the shape is the update's with one dimension set to 1 (`shared_dropout`: the mask is
//! shared along rows for `per_row` modules, along columns for `per_column` ones).
//!
//! The mask is drawn from a [`Key`] with JAX's counter-based generator, so a key draws the mask
//! DeepMind's code draws from it. It is always drawn for the whole, unpadded update and then
//! padded and cut to this rank's block: every DAP rank, whatever the group size, and every
//! recomputation of a checkpointed block, gets the same mask for the same key.
//!
//! At AlphaFold's rates only `per_row` masks of the MSA are drawn ([`Rates::EVOFORMER`]: the
//! column attention, the one `per_column` MSA module, drops at 0), and their shape does not
//! depend on the MSA's depth, so leaving fully-masked rows out of the stacks
//! ([`crate::model::masked_rows`]) changes no mask.
use engine::parallel::dap::Dap;
use rayon::prelude::*;
use tch::{Device, Kind, Tensor};

use crate::jax_random::Key;
use crate::model::Result;

/// Which dimension of a `[a, b, c]` update the mask is shared along (set to 1 in its shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    /// `per_row`: one mask for every row, dimension 0 of size 1.
    Rows,
    /// `per_column`: one mask for every column, dimension 1 of size 1.
    Columns,
}

impl Shared {
    fn dim(self) -> usize {
        match self {
            Shared::Rows => 0,
            Shared::Columns => 1,
        }
    }
}

/// The dropout rates of the sub-modules of an Evoformer or template pair stack block, as in
/// AlphaFold's `config.py` (0: no mask drawn, the key goes unused as in DeepMind's code).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    pub msa_row_attention: f64,
    pub msa_column_attention: f64,
    pub msa_transition: f64,
    pub outer_product_mean: f64,
    pub triangle_multiplication_outgoing: f64,
    pub triangle_multiplication_incoming: f64,
    pub triangle_attention_starting_node: f64,
    pub triangle_attention_ending_node: f64,
    pub pair_transition: f64,
}

impl Rates {
    /// The Evoformer and extra-MSA blocks' rates, the same in the monomer and Multimer configs:
    /// 0.15 for the row attention, 0.25 for the triangle updates, none elsewhere.
    pub const EVOFORMER: Rates = Rates {
        msa_row_attention: 0.15,
        msa_column_attention: 0.0,
        msa_transition: 0.0,
        outer_product_mean: 0.0,
        triangle_multiplication_outgoing: 0.25,
        triangle_multiplication_incoming: 0.25,
        triangle_attention_starting_node: 0.25,
        triangle_attention_ending_node: 0.25,
        pair_transition: 0.0,
    };

    /// No dropout anywhere.
    pub const NONE: Rates = Rates {
        msa_row_attention: 0.0,
        msa_column_attention: 0.0,
        msa_transition: 0.0,
        outer_product_mean: 0.0,
        triangle_multiplication_outgoing: 0.0,
        triangle_multiplication_incoming: 0.0,
        triangle_attention_starting_node: 0.0,
        triangle_attention_ending_node: 0.0,
        pair_transition: 0.0,
    };
}

/// Every dropout rate of AlphaFold's training forward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutRates {
    /// The Evoformer and extra-MSA blocks.
    pub evoformer: Rates,
    /// The template pair stack's blocks (only their pair modules).
    pub template_pair_stack: Rates,
    /// The structure module's, after its attention and after its transition (`dropout`).
    pub structure_module: f64,
}

impl DropoutRates {
    /// AlphaFold's `config.py`, monomer and Multimer alike: the template pair stack drops its
    /// triangle updates at 0.25 as the Evoformer does, the structure module at 0.1.
    pub const ALPHAFOLD: DropoutRates =
        DropoutRates { evoformer: Rates::EVOFORMER, template_pair_stack: Rates::EVOFORMER, structure_module: 0.1 };
}

/// A drawn mask, ready to multiply an update chunk by chunk: the 0/1 keep mask of this rank's
/// block (size 1 along the shared dimension) and the keep rate it is divided by.
pub struct DropMask {
    keep: Tensor,
    keep_rate: f64,
}

impl DropMask {
    /// The mask `key` draws for a whole update of `shape` (unpadded) at `rate` shared along
    /// `shared`, padded to `padded` (the stack's DAP padding) and cut to this rank's block
    /// along `split` (the dimension the update's layout splits, if any); `None` at rate 0.
    #[allow(clippy::too_many_arguments)]
    pub fn draw(
        key: Key,
        rate: f64,
        shape: [i64; 3],
        shared: Shared,
        padded: [i64; 3],
        split: Option<i64>,
        dap: &Dap,
        kind: Kind,
        device: Device,
    ) -> Result<Option<DropMask>> {
        if rate == 0.0 {
            return Ok(None);
        }
        let keep_rate = 1.0 - rate;
        let mut draw_shape = shape;
        draw_shape[shared.dim()] = 1;
        let keep = keep_mask(key, keep_rate, &draw_shape);
        let mut keep = Tensor::from_slice(&keep).f_reshape(draw_shape)?;
        for d in 0..3 {
            if d != shared.dim() && padded[d] != shape[d] {
                keep = dap.pad_to(&keep, d as i64, padded[d])?;
            }
        }
        if let Some(dim) = split {
            if dim as usize != shared.dim() {
                keep = dap.local(&keep, dim)?;
            }
        }
        Ok(Some(DropMask { keep: keep.f_to_kind(kind)?.f_to_device(device)?, keep_rate }))
    }

    /// `update` (rows `[start, start + n)` along `dim` of the whole block) dropped:
    /// `keep * update / keep_rate`, as AlphaFold computes it.
    pub fn apply(&self, update: &Tensor, dim: i64, start: i64, n: i64) -> Result<Tensor> {
        let keep = match self.keep.size()[dim as usize] {
            1 => self.keep.shallow_clone(),
            _ => self.keep.f_narrow(dim, start, n)?,
        };
        Ok(update.f_mul(&keep)?.f_div_scalar(self.keep_rate)?)
    }
}

/// AlphaFold's dropout of a whole activation `x` (no shared dimension: the structure
/// module's `safe_dropout` / `apply_dropout`): `keep * x / keep_rate` with the keep mask
/// `key` draws for `x`'s shape; `x` itself at rate 0.
pub fn drop_whole(x: &Tensor, key: Key, rate: f64) -> Result<Tensor> {
    if rate == 0.0 {
        return Ok(x.shallow_clone());
    }
    let keep_rate = 1.0 - rate;
    let keep = Tensor::from_slice(&keep_mask(key, keep_rate, &x.size())).f_reshape(x.size())?;
    let keep = keep.f_to_kind(x.kind())?.f_to_device(x.device())?;
    Ok(x.f_mul(&keep)?.f_div_scalar(keep_rate)?)
}

/// `jax.random.bernoulli(key, keep_rate, shape)` as 0/1 floats, row-major: a uniform draw
/// below the rate in float32 (JAX compares in the rate's dtype, float32 without x64).
/// Drawn in parallel pieces (each element depends on its index alone): a full-size training
/// step draws tens of millions.
pub fn keep_mask(key: Key, keep_rate: f64, shape: &[i64]) -> Vec<f32> {
    const PIECE: usize = 1 << 14;
    let n = shape.iter().product::<i64>() as usize;
    let p = keep_rate as f32;
    let mut keep = vec![0.0f32; n];
    keep.par_chunks_mut(PIECE).enumerate().for_each(|(c, piece)| {
        for (j, k) in piece.iter_mut().enumerate() {
            if key.uniform_at((c * PIECE + j) as u64) < p {
                *k = 1.0;
            }
        }
    });
    keep
}
