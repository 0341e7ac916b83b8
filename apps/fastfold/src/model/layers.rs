//! Linear and LayerNorm with AlphaFold's array names, and the chunking helper every
//! memory-heavy module uses.
use kernels::Backend;
use tch::Tensor;

use crate::model::dropout::DropMask;
use crate::model::scope::{Init, Scope};
use crate::model::{ensure, Result};

/// `x @ weights + bias` with `weights` stored [in, out] (haiku's layout).
pub struct Linear {
    weights: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// The device its weights are on.
    pub fn device(&self) -> tch::Device {
        self.weights.device()
    }

    /// Arrays `weights` [c_in, c_out] and, with `bias`, `bias` `[c_out]`.
    pub fn new(p: &Scope, c_in: i64, c_out: i64, bias: bool) -> Result<Self> {
        let weights = p.param("weights", &[c_in, c_out], Init::Weight { fan_in: c_in })?;
        let bias = match bias {
            true => Some(p.param("bias", &[c_out], Init::Small)?),
            false => None,
        };
        Ok(Linear { weights, bias })
    }

    /// Arrays `weights` [c_in, heads, per_head] and, with `bias`, `bias` [heads, per_head]
    /// (haiku's Linear with a two-dimensional output, as AlphaFold-Multimer's invariant point
    /// attention stores its projections), read as one layer of `heads * per_head` outputs.
    pub fn per_head(p: &Scope, c_in: i64, heads: i64, per_head: i64, bias: bool) -> Result<Self> {
        let out = heads * per_head;
        let weights =
            p.param("weights", &[c_in, heads, per_head], Init::Weight { fan_in: c_in })?.f_reshape([c_in, out])?;
        let bias = match bias {
            true => Some(p.param("bias", &[heads, per_head], Init::Small)?.f_reshape([out])?),
            false => None,
        };
        Ok(Linear { weights, bias })
    }

    /// Applies the layer to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = self.matmul(x)?;
        Ok(match &self.bias {
            // Without autograd the bias is added in place.
            Some(b) if !y.requires_grad() => y.f_add_(b)?,
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

    /// The layer of outputs `[start, start + len)` alone, as views of this layer's arrays (so
    /// gradients land in them): one half of a fused projection that stores two layers side
    /// by side (AlphaFold-Multimer v3's triangle multiplications).
    pub fn outputs(&self, start: i64, len: i64) -> Result<Linear> {
        let out = self.weights.size()[1];
        ensure!(
            start >= 0 && len > 0 && start + len <= out,
            "outputs {start}..{} of a layer with {out} outputs",
            start + len
        );
        Ok(Linear {
            weights: self.weights.f_narrow(1, start, len)?,
            bias: self.bias.as_ref().map(|b| b.f_narrow(0, start, len)).transpose()?,
        })
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
    /// Arrays `scale` `[c]` and `offset` `[c]`.
    pub fn new(p: &Scope, channels: i64) -> Result<Self> {
        Ok(LayerNorm {
            scale: p.param("scale", &[channels], Init::One)?,
            offset: p.param("offset", &[channels], Init::Small)?,
            channels,
            kernels: p.kernels(),
        })
    }

    /// Whether its arrays record gradients.
    pub fn records(&self) -> bool {
        self.scale.requires_grad() || self.offset.requires_grad()
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Backend::Torch => Ok(x.f_layer_norm([self.channels], Some(&self.scale), Some(&self.offset), 1e-5, true)?),
            Backend::Fused => Ok(kernels::layer_norm(x, &self.scale, &self.offset, 1e-5, Backend::Fused)?),
        }
    }
}

/// The step of a chunked loop over `len` rows: `chunk`, or everything at once.
pub(crate) fn step(len: i64, chunk: Option<i64>) -> Result<i64> {
    match chunk {
        Some(c) => {
            ensure!(c > 0, "chunk size must be positive, got {c}");
            Ok(c.min(len.max(1)))
        }
        None => Ok(len.max(1)),
    }
}

/// Rows `[start, start + n)` of `x` along `dim` (a chunk of a [`chunked`] loop), or `x` itself
/// when they are all of it: libtorch's backward of a narrow zero-fills a buffer of the whole
/// input and copies the gradient into it even then, once per unchunked call in training.
pub fn narrow(x: &Tensor, dim: i64, start: i64, n: i64) -> Result<Tensor> {
    match start == 0 && x.size().get(dim as usize) == Some(&n) {
        true => Ok(x.shallow_clone()),
        false => Ok(x.f_narrow(dim, start, n)?),
    }
}

/// Runs `f(start, len)` over slices of `[0, len)` at most `chunk` long and joins the results
/// along dim 0 (`None`: one call over everything). Modules slice their batch-like axis with it,
/// bounding the largest intermediate. Without autograd the results are copied into one output
/// as they come (the output and one chunk alive, not every chunk and then their concatenation).
pub fn chunked(len: i64, chunk: Option<i64>, f: impl FnMut(i64, i64) -> Result<Tensor>) -> Result<Tensor> {
    chunked_along(0, len, chunk, f)
}

/// [`chunked`] along dim `dim` of the results.
pub fn chunked_along(
    dim: i64,
    len: i64,
    chunk: Option<i64>,
    mut f: impl FnMut(i64, i64) -> Result<Tensor>,
) -> Result<Tensor> {
    let step = step(len, chunk)?;
    if step >= len {
        return f(0, len);
    }
    let (mut parts, mut out): (Vec<Tensor>, Option<Tensor>) = (Vec::new(), None);
    let mut start = 0;
    while start < len {
        let n = step.min(len - start);
        let part = f(start, n)?;
        match &out {
            Some(o) => o.f_narrow(dim, start, n)?.f_copy_(&part)?,
            None if part.requires_grad() => {
                parts.push(part);
                start += n;
                continue;
            }
            None => {
                let mut shape = part.size();
                shape[dim as usize] = len;
                let o = Tensor::f_empty(shape, (part.kind(), part.device()))?;
                o.f_narrow(dim, start, n)?.f_copy_(&part)?;
                out = Some(o);
            }
        }
        start += n;
    }
    match out {
        Some(o) => Ok(o),
        None => Ok(Tensor::f_cat(&parts, dim)?),
    }
}

/// A residual stream (the MSA or the pair representation) that one module after another adds
/// its update to. Once the tensor belongs to the forward (it made it, or its caller gave it
/// up) and nothing records gradients, each update is added in place chunk by chunk as it is
/// computed, so no update is ever whole and no second stream is made; otherwise the update is
/// computed (in chunks, joined) and added into a new tensor, as autograd needs.
///
/// In place, a module's chunk `[start, start + n)` along `dim` is written before the next
/// chunk is computed: a module reads only its own chunk of the stream, and anything it needs
/// of the whole stream (a bias, a projection) it computes before the first chunk.
///
/// In training, the next update may be dropped first ([`Stream::drop_next`]: AlphaFold's
/// dropout of a sub-module's update before the residual sum).
pub struct Stream {
    t: Tensor,
    owned: bool,
    dropout: Option<DropMask>,
}

impl Stream {
    /// A stream over `t`; `owned`: no one else reads `t`, so it may be updated in place.
    pub fn new(t: Tensor, owned: bool) -> Stream {
        Stream { t, owned, dropout: None }
    }

    /// Multiplies the next update [`Stream::add_chunked`] adds by `dropout`'s mask (`None`:
    /// adds it as it is). The mask is in the layout the stream has when that update is added.
    pub fn drop_next(&mut self, dropout: Option<DropMask>) {
        self.dropout = dropout;
    }

    /// The stream's tensor now.
    pub fn get(&self) -> &Tensor {
        &self.t
    }

    /// Whether no one else reads the tensor.
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// Whether the next [`Stream::add_chunked`] adds in place (an owned stream that records no
    /// gradients and drops nothing), given an update that records none either.
    pub fn adds_in_place(&self) -> bool {
        self.owned && !self.t.requires_grad() && self.dropout.is_none()
    }

    /// The tensor.
    pub fn into_inner(self) -> Tensor {
        self.t
    }

    /// Replaces the tensor by `f` of it (a layout switch), keeping whether it is owned: `f`
    /// returns the tensor itself or a new one nobody else holds.
    pub fn map(self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Stream> {
        let (owned, dropout) = (self.owned, self.dropout);
        Ok(Stream { t: f(&self.t)?, owned, dropout })
    }

    /// Adds `update` to rows `[start, start + n)` along `dim` in place, for a module that
    /// writes its update in an order of its own; only where [`Stream::adds_in_place`] and the
    /// update records no gradients.
    pub fn add_in_place(&mut self, dim: i64, start: i64, n: i64, update: &Tensor) -> Result<()> {
        ensure!(
            self.adds_in_place() && !update.requires_grad(),
            "an update added in place to a stream that autograd or dropout needs whole"
        );
        let _ = self.t.f_narrow(dim, start, n)?.f_add_(update)?;
        Ok(())
    }

    /// Adds the update `f(stream, start, n)` of rows `[start, start + n)` along `dim`, `chunk`
    /// rows at a time (`None`: whole).
    pub fn add_chunked(
        &mut self,
        dim: i64,
        chunk: Option<i64>,
        mut f: impl FnMut(&Tensor, i64, i64) -> Result<Tensor>,
    ) -> Result<()> {
        let len = self.t.size()[dim as usize];
        let step = step(len, chunk)?;
        let (mut parts, mut in_place) = (Vec::new(), None);
        let dropout = self.dropout.take();
        let mut start = 0;
        while start < len {
            let n = step.min(len - start);
            let mut u = f(&self.t, start, n)?;
            if let Some(d) = &dropout {
                u = d.apply(&u, dim, start, n)?;
            }
            if *in_place.get_or_insert(self.owned && !self.t.requires_grad() && !u.requires_grad()) {
                let _ = self.t.f_narrow(dim, start, n)?.f_add_(&u)?;
            } else {
                parts.push(u);
            }
            start += n;
        }
        if !parts.is_empty() {
            let update = match parts.len() {
                1 => parts.remove(0),
                _ => Tensor::f_cat(&parts, dim)?,
            };
            drop(parts);
            self.t = self.t.f_add(&update)?;
            self.owned = true;
        }
        Ok(())
    }
}

/// The additive attention bias of a key mask: 0 where `mask` is 1, -1e9 where it is 0
/// (AlphaFold's `1e9 * (mask - 1)`), shaped `[batch, 1, 1, keys]`.
pub fn mask_bias(mask: &Tensor) -> Result<Tensor> {
    Ok(mask.f_sub_scalar(1.0)?.f_mul_scalar(1e9)?.f_unsqueeze(1)?.f_unsqueeze(1)?)
}
