//! The tensor optimizers' per-parameter state: slots created at the first gradient, and their
//! checkpoint entries `{param}.{slot}` (PyTorch's slot names).
use tch::Tensor;

use super::Param;
use crate::Result;

/// Named state tensors, as read from a checkpoint.
pub type StateDict = std::collections::HashMap<String, Tensor>;

/// A parameter's state slot, created at zero like `like` on first use.
pub(crate) fn state_for<'a>(slot: &'a mut Option<Tensor>, like: &Tensor) -> Result<&'a mut Tensor> {
    if slot.is_none() {
        *slot = Some(like.f_zeros_like()?);
    }
    Ok(slot.as_mut().expect("just filled"))
}

/// `{param}.{slot}` entries for the slots that exist.
pub(crate) fn slots_to_state(params: &[Param], slot: &str, states: &[Option<Tensor>]) -> Vec<(String, Tensor)> {
    params
        .iter()
        .zip(states)
        .filter_map(|(p, s)| s.as_ref().map(|t| (format!("{}.{slot}", p.name), t.shallow_clone())))
        .collect()
}

/// Fills `states` from `{param}.{slot}` entries; a parameter without one starts empty, as in a
/// fresh optimizer (it had no gradient yet when the checkpoint was taken).
pub(crate) fn slots_from_state(
    params: &[Param],
    slot: &str,
    states: &mut [Option<Tensor>],
    dict: &mut StateDict,
) -> Result<()> {
    for (p, s) in params.iter().zip(states.iter_mut()) {
        let key = format!("{}.{slot}", p.name);
        *s = match dict.remove(&key) {
            Some(t) => {
                crate::error::ensure!(
                    t.size() == p.tensor.size(),
                    "optimizer state {key} has shape {:?}, the parameter {:?}",
                    t.size(),
                    p.tensor.size()
                );
                crate::error::ensure!(
                    t.is_floating_point(),
                    "optimizer state {key} holds {:?} values, expected floating point",
                    t.kind()
                );
                Some(t.f_to_kind(p.tensor.kind())?.f_to_device(p.tensor.device())?)
            }
            None => None,
        };
    }
    Ok(())
}

/// Takes a scalar counter such as `step` out of a state dict.
pub(crate) fn counter_from_state(dict: &mut StateDict, key: &str) -> Result<i64> {
    let t = dict.remove(key).ok_or_else(|| crate::Error::invalid(format!("optimizer state has no {key}")))?;
    Ok(t.f_int64_value(&[])?)
}

/// Bytes of a list of lazily created state tensors.
pub(crate) fn bytes_of(states: &[Option<Tensor>]) -> usize {
    states.iter().flatten().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
}
