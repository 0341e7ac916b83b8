//! How `fastfold train` lays out its ranks: `--nproc N --dap D` makes N / D groups of D
//! consecutive ranks. The ranks of a group split one example's Evoformer and extra-MSA stacks
//! under DAP (FastFold's dynamic axial parallelism); the groups are data-parallel replicas
//! that train different examples (OpenFold's and FastFold's data parallelism), each
//! accumulating `--accumulation K` examples per optimizer step, so a step trains N / D x K
//! examples (AlphaFold's global batch: 128, e.g. 32 groups x 4, or 128 groups x 1).
//!
//! Gradients: inside a group the stacks' partial gradients are summed over its DAP ranks
//! ([`engine::parallel::dap::Dap::reduce_gradients`]); across groups every gradient is
//! averaged over the ranks at the same DAP position ([`Ranks::data`]) by the engine's
//! bucketed data-parallel all-reduce ([`DataParallel`]), which overlaps the last accumulated
//! example's backward. Both reductions are sums, so their order does not change the result:
//! the average over the step's examples, as one process accumulating them all. Under
//! `--zero 1` each data-parallel rank keeps and steps the optimizer state of its share of the
//! parameters ([`ZeroOptimizer`]) and broadcasts them after the step.
use anyhow::{bail, Context};
use engine::dist::{DeviceMesh, ProcessGroup, ReduceOp, World};
use engine::optim::{Optimizer, Param};
use engine::parallel::dap::Dap;
use engine::parallel::{partition, DataParallel, DataParallelConfig, ZeroOptimizer};
use tch::Tensor;

use crate::loss::StepLoss;
use crate::train_data::loader::Shard;

/// `fastfold train`'s layout of ranks and examples per step.
#[derive(clap::Args, Debug, Clone)]
pub struct ParallelArgs {
    /// Ranks of one DAP group, which split each example's stacks (default: every rank of the
    /// job, one group). It must divide the job's ranks (--nproc): the --nproc / --dap groups
    /// train different examples, their gradients averaged.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub dap: Option<usize>,
    /// Examples each group trains per optimizer step, their gradients averaged (gradient
    /// accumulation).
    #[arg(long, default_value_t = 1, value_parser = engine::parse::count(1..), conflicts_with = "global_batch")]
    pub accumulation: usize,
    /// Examples per optimizer step over all groups (AlphaFold: 128), in place of
    /// --accumulation: a multiple of the groups (--nproc / --dap), each accumulating its share.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub global_batch: Option<usize>,
    /// ZeRO stage over the data-parallel ranks: 0 (every rank keeps the whole optimizer
    /// state) or 1 (each keeps and steps its share of the parameters'; no effect with one
    /// group).
    #[arg(long, default_value_t = 0, value_parser = engine::parse::count(0..=1))]
    pub zero: usize,
}

/// This rank's place in the layout (see the module docs).
#[derive(Clone, Debug)]
pub struct Ranks {
    /// DAP over this rank's group.
    pub dap: Dap,
    /// The ranks at this rank's DAP position in every group, which average their gradients
    /// (none with one group).
    pub data: Option<ProcessGroup>,
    /// The examples this rank's group trains.
    pub shard: Shard,
    /// ZeRO stage over `data`.
    pub zero: usize,
}

impl ParallelArgs {
    /// On `n` ranks: the DAP group size, the groups and the examples each accumulates per
    /// step, or an error naming the flags.
    pub fn sizes(&self, n: usize) -> anyhow::Result<(usize, usize, usize)> {
        let d = self.dap.unwrap_or(n);
        if d == 0 || !n.is_multiple_of(d) {
            bail!("--dap {d} does not divide the job's {n} ranks (--nproc {n})");
        }
        let replicas = n / d;
        let accumulation = match self.global_batch {
            Some(b) if !b.is_multiple_of(replicas) => {
                bail!("--global-batch {b} is not a multiple of the {replicas} groups (--nproc {n} / --dap {d})")
            }
            Some(b) => b / replicas,
            None => self.accumulation,
        };
        Ok((d, replicas, accumulation))
    }

    /// The groups of `world` (a collective when there are several groups of several ranks:
    /// every rank builds them together). The flags are checked first, alike on every rank.
    pub fn ranks(&self, world: &World) -> anyhow::Result<Ranks> {
        let n = world.size();
        let (d, replicas, accumulation) = self.sizes(n)?;
        let (dap, data, replica) = match (d, replicas) {
            (1, 1) => (Dap::none(), None, 0),
            // Today's layout and the default: one DAP group of every rank.
            (_, 1) => (Dap::new(world.group.clone()), None, 0),
            // Pure data parallelism: every rank a replica.
            (1, _) => (Dap::none(), Some(world.group.clone()), world.rank()),
            _ => {
                // DAP groups are runs of consecutive ranks (the last axis varies fastest), on
                // one node where links are fastest, as tensor parallelism's are.
                let mesh = DeviceMesh::new(&world.group, &[("dp", replicas), ("dap", d)])?;
                let group = |axis: &str| mesh.group(axis).cloned().with_context(|| format!("no {axis} axis"));
                let replica = mesh.coord("dp").context("no dp axis")?;
                (Dap::new(group("dap")?), Some(group("dp")?), replica)
            }
        };
        let shard = Shard { replica: replica as u64, replicas: replicas as u64, accumulation: accumulation as u64 };
        Ok(Ranks { dap, data, shard, zero: self.zero })
    }
}

impl Ranks {
    /// One process: no DAP, no replicas, one example a step.
    pub fn one() -> Ranks {
        Ranks { dap: Dap::none(), data: None, shard: Shard::ONE, zero: 0 }
    }

    /// The engine's bucketed gradient averaging of `params` over the data-parallel group
    /// (none with one group). Hooks on the parameters launch each bucket's all-reduce as its
    /// gradients arrive in the backward that [`DataParallel::set_sync`] allows.
    pub fn gradient_sync(&self, params: &[Param]) -> anyhow::Result<Option<DataParallel>> {
        let Some(group) = &self.data else { return Ok(None) };
        Ok(Some(DataParallel::new(params, group, DataParallelConfig::default())?))
    }

    /// `make`'s optimizer over `params`, under --zero 1 sharded over the data-parallel group:
    /// `make` then builds it over this rank's share.
    pub fn optimizer(
        &self,
        params: Vec<Param>,
        make: impl FnOnce(Vec<Param>) -> Box<dyn Optimizer>,
    ) -> anyhow::Result<Box<dyn Optimizer>> {
        match (&self.data, self.zero) {
            (Some(group), 1) => {
                let owners = partition(&params, group.size());
                Ok(Box::new(ZeroOptimizer::new(params, owners, group, make)?))
            }
            _ => Ok(make(params)),
        }
    }
}

/// The mean of each term over the step's examples on every replica (`terms`: this rank's;
/// one all-reduce over `data`, the same on every rank). `clamped` says whether backbone FAPE
/// was clamped in every one of them.
pub fn mean_over_replicas(terms: &[StepLoss], data: Option<&ProcessGroup>) -> anyhow::Result<StepLoss> {
    let first = terms.first().context("a step without examples")?;
    let values = |t: &StepLoss| {
        [
            t.loss,
            t.fape,
            f64::from(u8::from(t.clamped)),
            t.sidechain_fape,
            t.chi,
            t.angle_norm,
            t.violation,
            t.distogram,
            t.masked_msa,
            t.plddt,
            t.experimentally_resolved,
            t.aligned_error.unwrap_or(0.0),
            1.0,
        ]
    };
    let mut sums = [0.0; 13];
    for t in terms {
        sums.iter_mut().zip(values(t)).for_each(|(s, v)| *s += v);
    }
    if let Some(group) = data {
        let total = Tensor::from_slice(&sums);
        group.all_reduce(&total, ReduceOp::Sum)?;
        sums.copy_from_slice(&Vec::<f64>::try_from(&total)?);
    }
    let m: Vec<f64> = sums.iter().map(|s| s / sums[12]).collect();
    Ok(StepLoss {
        loss: m[0],
        fape: m[1],
        clamped: m[2] == 1.0,
        sidechain_fape: m[3],
        chi: m[4],
        angle_norm: m[5],
        violation: m[6],
        distogram: m[7],
        masked_msa: m[8],
        plddt: m[9],
        experimentally_resolved: m[10],
        aligned_error: first.aligned_error.map(|_| m[11]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::dist::InitOptions;

    #[test]
    fn one_rank_is_one_group_and_flags_are_checked() {
        let world = World::single(&InitOptions::default()).unwrap();
        let args = ParallelArgs { dap: None, accumulation: 3, global_batch: None, zero: 0 };
        let ranks = args.ranks(&world).unwrap();
        assert_eq!(ranks.shard, Shard { accumulation: 3, ..Shard::ONE });
        assert!(ranks.data.is_none());
        let ranks = ParallelArgs { global_batch: Some(128), ..args.clone() }.ranks(&world).unwrap();
        assert_eq!(ranks.shard.accumulation, 128, "one group accumulates the whole global batch");
        let err = ParallelArgs { dap: Some(2), ..args }.ranks(&world).unwrap_err().to_string();
        assert!(err.contains("--dap 2") && err.contains("--nproc 1"), "{err}");
    }

    #[test]
    fn the_global_batch_is_groups_times_accumulation() {
        let args = ParallelArgs { dap: Some(2), accumulation: 1, global_batch: Some(128), zero: 0 };
        assert_eq!(args.sizes(64).unwrap(), (2, 32, 4), "AlphaFold's 128: 32 groups x 4");
        assert_eq!(ParallelArgs { dap: None, ..args.clone() }.sizes(8).unwrap(), (8, 1, 128));
        let err = ParallelArgs { dap: Some(1), global_batch: Some(6), ..args.clone() }.sizes(4).unwrap_err();
        assert!(err.to_string().contains("--global-batch 6 is not a multiple of the 4 groups"), "{err}");
        let err = ParallelArgs { dap: Some(3), ..args }.sizes(4).unwrap_err().to_string();
        assert!(err.contains("--dap 3 does not divide the job's 4 ranks (--nproc 4)"), "{err}");
    }

    #[test]
    fn the_mean_is_over_the_examples() {
        let t = |loss: f64, clamped: bool| StepLoss {
            loss,
            fape: 2.0 * loss,
            clamped,
            sidechain_fape: 0.0,
            chi: 0.0,
            angle_norm: 0.0,
            violation: 0.0,
            distogram: 0.0,
            masked_msa: 0.0,
            plddt: 0.0,
            experimentally_resolved: 0.0,
            aligned_error: None,
        };
        let m = mean_over_replicas(&[t(1.0, true), t(2.0, false)], None).unwrap();
        assert_eq!((m.loss, m.fape, m.clamped, m.aligned_error), (1.5, 3.0, false, None));
        assert!(mean_over_replicas(&[t(1.0, true), t(3.0, true)], None).unwrap().clamped);
    }
}
