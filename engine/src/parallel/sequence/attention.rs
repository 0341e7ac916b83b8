//! Masks and the serial reference: softmax attention over the whole sequence in one process,
//! written with plain operations (autograd gives its backward), which the parallel forms must
//! equal.
use tch::{Device, Kind, Tensor};

use crate::error::ensure;
use crate::Result;

/// Which keys each query may attend to. Both parts are optional and combine.
#[derive(Debug, Default)]
pub struct AttentionMask {
    /// Query `i` attends only to keys `j <= i` (positions in the whole sequence).
    pub causal: bool,
    /// Per-key mask over the whole sequence, `[batch, seq]`, the same on every rank: booleans
    /// (true: the key takes part; false: padding) or floats added to the scores (0 or `-inf`,
    /// or any bias). A query with no key left gets a zero output (not NaN).
    pub key_padding: Option<Tensor>,
}

impl AttentionMask {
    /// No masking.
    pub fn none() -> AttentionMask {
        AttentionMask::default()
    }

    /// Causal masking only.
    pub fn causal() -> AttentionMask {
        AttentionMask { causal: true, key_padding: None }
    }

    /// The key mask as additive scores `[batch, 1, 1, seq]` in `kind`, checked against the
    /// batch and the whole sequence length.
    pub(crate) fn key_bias(&self, batch: i64, seq: i64, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        let Some(m) = &self.key_padding else { return Ok(None) };
        ensure!(
            m.size() == [batch, seq],
            "attention key mask has shape {:?}, expected [batch {batch}, whole sequence {seq}]",
            m.size()
        );
        let m = m.f_to_device(device)?;
        let bias = match m.kind() {
            Kind::Bool => {
                Tensor::f_zeros([batch, seq], (kind, device))?.f_masked_fill(&m.f_logical_not()?, f64::NEG_INFINITY)?
            }
            _ if m.is_floating_point() => m.f_to_kind(kind)?.f_to_device(device)?.f_detach()?,
            k => return Err(crate::Error::invalid(format!("attention key mask must be bool or float, got {k:?}"))),
        };
        Ok(Some(bias.f_view([batch, 1, 1, seq])?))
    }
}

/// What causality does to queries at positions `q0 ..q0 + sq` against keys `k0 ..k0 + sk`.
pub(crate) enum Causal {
    /// Every key is visible to every query.
    All,
    /// No key is visible to any query.
    None,
    /// `[sq, sk]`, true where the key is in the query's future (to be filled with `-inf`).
    Some(Tensor),
}

pub(crate) fn causal_block(q0: i64, sq: i64, k0: i64, sk: i64, device: Device) -> Result<Causal> {
    if k0 + sk - 1 <= q0 {
        return Ok(Causal::All);
    }
    if k0 > q0 + sq - 1 {
        return Ok(Causal::None);
    }
    let qpos = Tensor::f_arange_start(q0, q0 + sq, (Kind::Int64, device))?.f_unsqueeze(1)?;
    let kpos = Tensor::f_arange_start(k0, k0 + sk, (Kind::Int64, device))?.f_unsqueeze(0)?;
    Ok(Causal::Some(kpos.f_gt_tensor(&qpos)?))
}

/// `(batch, heads, seq, head_dim)` of matching `q, k, v`.
pub(crate) fn check_qkv(q: &Tensor, k: &Tensor, v: &Tensor, what: &str) -> Result<(i64, i64, i64, i64)> {
    let shape = q.size();
    ensure!(shape.len() == 4, "{what}: q must be [batch, heads, seq, head_dim], got shape {shape:?}");
    ensure!(
        k.size() == shape && v.size() == shape,
        "{what}: q {shape:?}, k {:?} and v {:?} must have one shape",
        k.size(),
        v.size()
    );
    ensure!(shape.iter().all(|&s| s > 0), "{what}: empty dimension in shape {shape:?}");
    Ok((shape[0], shape[1], shape[2], shape[3]))
}

/// Softmax attention `softmax(q k^T / sqrt(head_dim) + mask) v` over whole sequences,
/// `[batch, heads, seq, head_dim]`, in one process (the serial reference). Queries with no
/// visible key get zeros.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
    let (b, _, s, d) = check_qkv(q, k, v, "attention")?;
    let mut scores = q.f_matmul(&k.f_transpose(-2, -1)?)?.f_mul_scalar(1.0 / (d as f64).sqrt())?;
    if let Some(bias) = mask.key_bias(b, s, q.kind(), q.device())? {
        scores = scores.f_add(&bias)?;
    }
    if mask.causal {
        if let Causal::Some(future) = causal_block(0, s, 0, s, q.device())? {
            // Added as a float bias rather than masked_fill'ed: an addition saves nothing for
            // backward, where masked_fill would keep the [seq, seq] mask, the one tensor that
            // does not shrink with the heads a rank holds.
            let bias =
                Tensor::f_zeros(future.size(), (q.kind(), q.device()))?.f_masked_fill(&future, f64::NEG_INFINITY)?;
            scores = scores.f_add(&bias)?;
        }
    }
    // A row of -inf would make softmax NaN; such rows get zero weights instead.
    let empty = scores.f_amax([-1], true)?.f_eq(f64::NEG_INFINITY)?;
    let weights = scores.f_masked_fill(&empty, 0.0)?.f_softmax(-1, q.kind())?.f_masked_fill(&empty, 0.0)?;
    Ok(weights.f_matmul(v)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serial reference equals libtorch's scaled_dot_product_attention (math backend on
    /// CPU), causal and with a boolean key mask.
    #[test]
    fn reference_equals_scaled_dot_product_attention() {
        let opts = (Kind::Float, Device::Cpu);
        let (q, k, v) =
            (Tensor::randn([2, 3, 6, 4], opts), Tensor::randn([2, 3, 6, 4], opts), Tensor::randn([2, 3, 6, 4], opts));
        let causal = attention(&q, &k, &v, &AttentionMask::causal()).unwrap();
        let want = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
        assert!(causal.allclose(&want, 1e-5, 1e-6, false));
        let keep = Tensor::from_slice(&[true, false, true, true, false, true]).view([1, 6]).repeat([2, 1]);
        let masked =
            attention(&q, &k, &v, &AttentionMask { causal: false, key_padding: Some(keep.shallow_clone()) }).unwrap();
        let want =
            Tensor::scaled_dot_product_attention(&q, &k, &v, Some(keep.view([2, 1, 1, 6])), 0.0, false, None, false);
        assert!(masked.allclose(&want, 1e-5, 1e-6, false));
    }
}
