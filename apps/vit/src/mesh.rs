//! The process groups a [`Layout`] lays a job's ranks over: `pp x dp x sp x tp` (tensor-parallel
//! groups are runs of consecutive ranks, sequence-parallel groups next, then the data replicas,
//! then the pipeline stages; see [`ParallelDims`]). Under a pipeline every group but `pipeline`
//! lies within one stage.
use anyhow::Context;
use engine::dist::{ParallelDims, ProcessGroup, World};

use crate::layout::Layout;

/// This rank's groups (see the module docs).
#[derive(Clone, Debug)]
pub struct Mesh {
    /// The data-parallel replicas: they split the batch.
    pub data: ProcessGroup,
    /// What gradients are averaged over (and ZeRO shards the optimizer over): the data
    /// replicas and the sequence ranks together (the sequence ranks' gradients are partial).
    pub grads: ProcessGroup,
    /// The tensor-parallel group (none for one rank).
    pub tp: Option<ProcessGroup>,
    /// The sequence-parallel group (none for one rank).
    pub sp: Option<ProcessGroup>,
    /// The pipeline group: the ranks at this rank's place in every stage (none for one stage).
    pub pipeline: Option<ProcessGroup>,
}

impl Mesh {
    /// The groups of `layout` over `world` (a collective: every rank builds them together).
    pub fn new(world: &World, layout: &Layout) -> anyhow::Result<Mesh> {
        let Layout { dp, tp, sp, pp, .. } = *layout;
        anyhow::ensure!(
            dp * tp * sp * pp == world.size(),
            "the layout's {pp} x {dp} x {sp} x {tp} ranks are not the job's {}",
            world.size()
        );
        if tp * sp * pp == 1 {
            let g = world.group.clone();
            return Ok(Mesh { data: g.clone(), grads: g, tp: None, sp: None, pipeline: None });
        }
        let mesh = ParallelDims { pp, dp, sp, tp }.build(&world.group)?;
        let group = |axis: &str| mesh.group(axis).cloned().with_context(|| format!("no {axis} axis"));
        let data = group("dp")?;
        let grads = match sp {
            1 => data.clone(),
            // The ranks of this rank's stage at its tensor-parallel index:
            // `((stage * dp + d) * sp + s) * tp + t`.
            _ => {
                let mut mine = None;
                for (stage, t) in (0..pp).flat_map(|stage| (0..tp).map(move |t| (stage, t))) {
                    let members: Vec<usize> = (0..dp * sp).map(|i| (stage * dp * sp + i) * tp + t).collect();
                    mine = world.group.subgroup(&members, &format!("dp_sp{}", stage * tp + t))?.or(mine);
                }
                mine.context("this rank is in no data x sequence group")?
            }
        };
        let (tp, sp, pipeline) = (group("tp")?, group("sp")?, group("pp")?);
        let several = |g: ProcessGroup| (g.size() > 1).then_some(g);
        Ok(Mesh { data, grads, tp: several(tp), sp: several(sp), pipeline: several(pipeline) })
    }
}
