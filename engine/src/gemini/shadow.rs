//! Shadows: tensors shaped like this rank's part of every chunk's home (fp32), which a user of
//! Gemini keeps beside the weights, an exponential moving average of them for one. A shadow is
//! sharded as the homes are (1/N of the model per rank under ZeRO-3, however many chunks there
//! are), updates element by element against the homes, and converts to and from full tensors by
//! parameter name, which is how it is saved and how it loads on another number of ranks. The
//! parameters' own state dict is the homes read as a shadow.
use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use super::manager::ChunkManager;
use super::training::Gemini;
use crate::{Error, Result};

impl Gemini {
    /// Copies of this rank's part of every chunk's home, in host memory: a shadow that starts at
    /// the current weights.
    pub fn home_shards(&self) -> Result<Vec<Tensor>> {
        let m = self.manager()?;
        (0..m.chunk_count()).map(|c| Ok(m.home(c).f_to_device(Device::Cpu)?.f_detach_copy()?)).collect()
    }

    /// Calls `f(chunk, home)` with this rank's part of every chunk's home where it lives (read
    /// it, e.g. to move a shadow towards the weights after a step; writing it would bypass the
    /// resident copies).
    pub fn with_homes(&self, mut f: impl FnMut(usize, &Tensor) -> Result<()>) -> Result<()> {
        let m = self.manager()?;
        (0..m.chunk_count()).try_for_each(|c| f(c, m.home(c)))
    }

    /// Exchanges the homes' values with `shards`' and frees the resident copies, which hold the
    /// old values: the model then runs with the shadow's weights, and a second swap puts the
    /// weights back bit for bit (the shadow too).
    pub fn swap_homes(&self, shards: &[Tensor]) -> Result<()> {
        let mut m = self.manager()?;
        check_shapes(&m, shards)?;
        tch::no_grad(|| -> Result<()> {
            for (c, shard) in shards.iter().enumerate() {
                let home = m.home(c).shallow_clone();
                let old = home.f_to_device(Device::Cpu)?.f_detach_copy()?;
                home.f_detach()?.f_copy_(shard)?;
                shard.f_detach()?.f_copy_(&old)?;
            }
            Ok(())
        })?;
        m.homes_changed()
    }

    /// Full tensors by parameter name, on the host, from per-chunk shards (collective under
    /// ZeRO-3: every rank of the group calls it).
    pub fn gather_shards(&self, shards: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
        let m = self.manager()?;
        check_shapes(&m, shards)?;
        gather(&m, shards)
    }

    /// This rank's shards of full tensors given by parameter name (the inverse of
    /// [`Gemini::gather_shards`], on any number of ranks), in host memory; elements that belong to
    /// no parameter are zero. A missing name or a shape that differs is an error naming it.
    pub fn cut_shards(&self, named: &HashMap<String, Tensor>) -> Result<Vec<Tensor>> {
        let m = self.manager()?;
        let shards: Vec<Tensor> = (0..m.chunk_count())
            .map(|c| Ok(Tensor::f_zeros(m.home(c).size(), (Kind::Float, Device::Cpu))?))
            .collect::<Result<_>>()?;
        for_each_piece(&m, named, |c, at, len, src| {
            shards[c].f_narrow(0, at as i64, len as i64)?.f_copy_(src)?;
            Ok(())
        })?;
        Ok(shards)
    }
}

fn check_shapes(m: &ChunkManager, shards: &[Tensor]) -> Result<()> {
    crate::error::ensure!(
        shards.len() == m.chunk_count(),
        "gemini: {} shards given for {} chunks",
        shards.len(),
        m.chunk_count()
    );
    for (c, s) in shards.iter().enumerate() {
        let want = m.home(c).size();
        crate::error::ensure!(
            s.size() == want,
            "gemini: chunk {c}'s shard has shape {:?}, expected {want:?}",
            s.size()
        );
    }
    Ok(())
}

/// Full named tensors from per-chunk shards (see [`Gemini::gather_shards`]).
pub(super) fn gather(m: &ChunkManager, shards: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![];
    for (c, shard) in shards.iter().enumerate() {
        let full = match m.replication() {
            Some(rep) if rep.shard => rep.group.all_gather(&shard.f_to_device(m.device())?)?,
            _ => shard.shallow_clone(),
        }
        .f_to_device(Device::Cpu)?;
        for s in m.slots(c) {
            let t = full.f_narrow(0, s.offset as i64, s.numel as i64)?.f_view(s.shape.as_slice())?.f_detach_copy()?;
            out.push((s.name.clone(), t));
        }
    }
    Ok(out)
}

/// Calls `put(chunk, first element in the shard, length, values)` for every part of a parameter
/// in this rank's shards, the values cut from `named`; a missing name or a shape that differs
/// is an error naming it.
pub(super) fn for_each_piece(
    m: &ChunkManager,
    named: &HashMap<String, Tensor>,
    mut put: impl FnMut(usize, usize, usize, &Tensor) -> Result<()>,
) -> Result<()> {
    tch::no_grad(|| {
        for c in 0..m.chunk_count() {
            for p in m.pieces(c) {
                let t = named.get(&p.name).ok_or_else(|| Error::invalid(format!("state dict: missing {}", p.name)))?;
                if t.size() != p.shape {
                    return Err(Error::invalid(format!(
                        "state dict: {} has shape {:?}, the model {:?}",
                        p.name,
                        t.size(),
                        p.shape
                    )));
                }
                let src = t.f_flatten(0, -1)?.f_narrow(0, p.in_param as i64, p.len as i64)?;
                put(c, p.in_shard, p.len, &src)?;
            }
        }
        Ok(())
    })
}
