//! Pipeline parallelism for the ViT (`vit pretrain --pp N`), on the engine's
//! [`engine::parallel::pipeline`]: the model's parts (the stem, each block, the head; see
//! [`Part`]) are the layers the engine's partitioner cuts into `pp x virtual-stages` stages,
//! balancing parameter bytes, part counts or measured times (`--pp-balance`), and each pipeline rank keeps its stages. The micro-batches of a
//! step (the per-replica batch over `--micro-batch`) run under the chosen schedule; the loss
//! lives on the last stage.
//!
//! The mesh is `pp x dp x sp x tp` (tensor-parallel groups are runs of consecutive ranks, then
//! the sequence-parallel groups, the data-parallel replicas, the stages; see
//! [`engine::dist::ParallelDims`] and [`crate::mesh::Mesh`]). Each stage's parameters are wired by
//! [`engine::parallel::parallelize()`] over its data x sequence group (ZeRO included); the
//! pipeline's backward passes accumulate without synchronising and the optimizer step reduces
//! them at once. The gradient norm for clipping sums every stage's squares
//! ([`Parallelized::across_stages`]), so it is the whole model's; LAMB's and LARS's trust
//! ratios are per parameter, each held whole by one stage (or summed over the tensor-parallel
//! group for split ones), so they equal one process's too. Under `--tp` each stage's blocks are
//! split as [`crate::tensor_parallel`] splits them; under `--tp-mode 2d|2.5d|3d` every part is
//! split ([`crate::multi_dim`]), and each rank's block of the batch and the width crosses
//! between stages.
//!
//! Under `--sp` ([`crate::sequence_parallel`]) every rank of a stage's sequence group runs the
//! stage's parts on its block of the tokens: the stem (on the first stage, whole on every
//! sequence rank) keeps the rank's block, the blocks attend across the group, and the head
//! (on the last stage) gathers the tokens back; what crosses between stages is each rank's
//! token block `[micro-batch, tokens / sp, width]`, sent to the same sequence rank of the next
//! stage, and the gradient of that block comes back. Every sequence rank of the last stage
//! computes the same loss.
//!
//! Every rank builds the serial model from the seed (as one process would), keeps its stages'
//! parts and frees the other parts' weights. Checkpoints and the final model hold the whole
//! model's full tensors under timm's names: [`Stages::gather`] sums the stages' disjoint
//! parameters over the pipeline group. Evaluation runs the pipeline's forward pass.
use std::sync::Arc;

use anyhow::bail;
use data::augment::Transform;
use data::loader::{make_batch, BatchSpec};
use data::Dataset;
use engine::dist::{ProcessGroup, ReduceOp};
use engine::optim::Param;
use engine::parallel::pipeline::{self, assign, split, Balance, Pipeline, Schedule};
use engine::parallel::Parallelized;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::{pad_to_blocks, to_tensors};
use crate::layout::Layout;
use crate::model::{correct_top_k, soft_cross_entropy, Part, Vit};
use crate::tensor_parallel::Sharding;

/// What a rank runs: the whole model (one process, data and tensor parallelism) or its
/// stages of a pipeline.
pub enum Model {
    /// Every part, run in turn.
    Whole(Vit),
    /// This rank's pipeline stages.
    Stages(Box<Stages>),
}

impl Model {
    /// `model` (built in `vs`, split by `sharding`) placed on this rank: whole without a
    /// pipeline group `pp`, else cut into stages as `layout` says, of which this rank keeps
    /// its own (the other parts' weights freed). Returns the parameters this rank trains, named
    /// and marked as [`Sharding::params`] gives them. `world`: every rank of the job
    /// (`--pp-balance time` takes rank 0's measurement); `announce`: print the split.
    #[allow(clippy::too_many_arguments)]
    pub fn place(
        model: Vit,
        vs: &VarStore,
        sharding: &Sharding,
        pp: Option<&ProcessGroup>,
        layout: &Layout,
        world: &ProcessGroup,
        device: Device,
        announce: bool,
    ) -> anyhow::Result<(Model, Vec<Param>)> {
        let params = sharding.params(vs);
        let Some(pp) = pp else { return Ok((Model::Whole(model), params)) };
        let stages = Stages::new(model, vs, params, sharding, pp, layout, world, device, announce)?;
        let mine = stages.pipe.params().iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        let params = sharding.params(vs).into_iter().filter(|p| mine.contains(&p.name)).collect();
        Ok((Model::Stages(Box::new(stages)), params))
    }

    /// `parallel` (this rank's parameters' data-parallel wiring) made aware of the other
    /// stages: the gradient norm is the whole model's.
    pub fn wire(&self, parallel: Parallelized) -> Parallelized {
        match self {
            Model::Whole(_) => parallel,
            Model::Stages(s) => parallel.across_stages(&s.pp),
        }
    }
}

/// Cuts `layers` into `stages` by their forward and backward times on `sample` as world rank 0
/// measured them. Every rank measures (a tensor-parallel part's collectives need its whole
/// group, and every rank then makes the same calls), and rank 0's times are broadcast, so
/// every rank (every replica and stage) cuts the same split from the same numbers.
fn measured_split(
    layers: &[Box<dyn pipeline::Layer>],
    stages: usize,
    sample: &Tensor,
    world: &ProcessGroup,
) -> engine::Result<pipeline::Split> {
    const WARMUP: usize = 2;
    let measured = pipeline::split_measured(layers, stages, sample, WARMUP)?;
    let costs = Tensor::f_from_slice(&measured.costs)?.f_to_device(sample.device())?;
    world.broadcast(&costs, 0)?;
    let costs = Vec::<f64>::try_from(costs.f_to_device(Device::Cpu)?)?;
    pipeline::split_costs(costs, stages, measured.unit)
}

/// One part of the ViT as a pipeline layer, with its parameters.
pub(crate) struct PartLayer {
    part: Part,
    params: Vec<Param>,
}

impl PartLayer {
    /// `part` with those of `params` it owns.
    pub(crate) fn new(part: Part, params: &[Param]) -> PartLayer {
        let params = params.iter().filter(|q| part.owns(&q.name)).map(Param::shallow_copy).collect();
        PartLayer { part, params }
    }
}

impl pipeline::Layer for PartLayer {
    fn forward(&self, input: &Tensor) -> engine::Result<Tensor> {
        self.part.forward(input).map_err(|e| engine::Error::invalid(format!("{}: {e:#}", self.part.name())))
    }

    fn params(&self) -> Vec<Param> {
        self.params.iter().map(Param::shallow_copy).collect()
    }
}

/// This rank's stages of the pipeline and what gathering the whole model needs.
pub struct Stages {
    pipe: Pipeline,
    pp: ProcessGroup,
    /// Every parameter of the whole model with its full (unsplit) shape, sorted by name: the
    /// layout of [`Stages::gather`].
    full_shapes: Vec<(String, Vec<i64>)>,
}

impl Stages {
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: Vit,
        vs: &VarStore,
        params: Vec<Param>,
        sharding: &Sharding,
        pp: &ProcessGroup,
        layout: &Layout,
        world: &ProcessGroup,
        device: Device,
        announce: bool,
    ) -> anyhow::Result<Stages> {
        let (kind, v) = (layout.schedule, layout.virtual_stages);
        let (micro_batches, micro_size) = (layout.batch.accumulation, layout.batch.micro);
        let p = pp.size();
        let cfg = *model.config();
        // Full shapes before the other stages' weights go (a collective over --tp).
        let full_shapes = tch::no_grad(|| -> anyhow::Result<Vec<(String, Vec<i64>)>> {
            params.iter().map(|q| Ok((q.name.clone(), sharding.gather(&q.name, &q.tensor)?.size()))).collect()
        })?;
        let parts = model.into_parts();
        let names: Vec<String> = parts.iter().map(Part::name).collect();
        let layers: Vec<Box<dyn pipeline::Layer>> =
            parts.into_iter().map(|part| Box::new(PartLayer::new(part, &params)) as Box<dyn pipeline::Layer>).collect();
        let owned: usize = layers.iter().map(|l| l.params().len()).sum();
        if owned != params.len() {
            bail!("the ViT's parts own {owned} of its {} parameters", params.len());
        }
        // The layout has checked that the parts fill the stages.
        let cut = match layout.balance {
            Balance::Time => {
                let kind = params.first().map_or(Kind::Float, |q| q.tensor.kind());
                let size = [micro_size as i64, cfg.in_channels, cfg.image_size, cfg.image_size];
                measured_split(&layers, p * v, &Tensor::f_full(size, 0.5, (kind, device))?, world)?
            }
            balance => split(&layers, p * v, balance)?,
        };
        if announce {
            println!(
                "pipeline: {} schedule, {p} ranks x {v} virtual stage(s), {micro_batches} micro-batches",
                kind.name()
            );
            // Virtual stage s runs on pipeline rank s % pp.
            for (s, (line, range)) in cut.to_string().lines().zip(&cut.ranges).enumerate() {
                println!("  {line} on pipeline rank {}: {}", s % p, names[range.clone()].join(", "));
            }
        }
        let chunks = assign(layers, &cut, pp.rank(), p)?;
        let mine: Vec<String> = chunks.iter().flat_map(|c| c.params()).map(|q| q.name).collect();
        // The other stages' weights are not needed here: free them (the names stay in `vs`).
        tch::no_grad(|| -> anyhow::Result<()> {
            for (name, mut t) in vs.variables() {
                if !mine.contains(&name) {
                    t.set_data(&Tensor::f_empty([0], (t.kind(), t.device()))?);
                }
            }
            Ok(())
        })?;
        let schedule = Schedule::new(kind, p, micro_batches, v)?;
        let pipe = Pipeline::new(pp, chunks, schedule, device)?;
        Ok(Stages { pipe, pp: pp.clone(), full_shapes })
    }

    /// One step's micro-batches (`(images, soft targets)`, every one the same size) forward and
    /// backward through the pipeline; gradients are left local for `parallel.step` to reduce.
    /// Returns the mean loss on the rank holding the last stage, `None` elsewhere.
    pub fn forward_backward(
        &mut self,
        parallel: &Parallelized,
        micro: &[(Tensor, Tensor)],
    ) -> anyhow::Result<Option<f64>> {
        parallel.set_sync(false)?;
        let inputs: Vec<Tensor> = micro.iter().map(|(x, _)| x.shallow_clone()).collect();
        let mut sum = 0.0;
        let mut loss = |i: usize, logits: &Tensor| -> engine::Result<Tensor> {
            let l = soft_cross_entropy(logits, &micro[i].1);
            sum += l.f_double_value(&[])?;
            parallel.loss_to_backpropagate(&l)
        };
        let held = self.pipe.step(&inputs, &mut loss)?;
        // The optimizer step reduces every gradient at once.
        parallel.set_sync(true)?;
        Ok(held.map(|_| sum / micro.len() as f64))
    }

    /// Top-1 and top-5 accuracy on `set` through the pipeline's forward pass: each
    /// data-parallel replica evaluates every N-th example and the last stage counts (on one
    /// rank of its tensor- and sequence-parallel groups: `counts_here` there), summed over
    /// `world`. The first stage pads each chunk to a multiple of `blocks`
    /// ([`crate::batch::pad_to_blocks`]) and the last drops the padding's logits.
    #[allow(clippy::too_many_arguments)]
    pub fn evaluate(
        &self,
        set: &Arc<dyn Dataset>,
        transform: &Transform,
        dp: &ProcessGroup,
        world: &ProcessGroup,
        counts_here: bool,
        blocks: usize,
        device: Device,
        kind: Kind,
    ) -> anyhow::Result<(f64, f64)> {
        let (first, last) = (self.pp.rank() == 0, self.pipe.holds_loss());
        let mine: Vec<usize> = (dp.rank()..set.len()).step_by(dp.size()).collect();
        let mut counts = [0i64; 2];
        for chunk in mine.chunks(256) {
            // Images enter on the first stage; labels are read on the last.
            let batch = match first || last {
                true => Some(make_batch(set.as_ref(), transform, 0, &BatchSpec { indices: chunk.to_vec(), epoch: 0 })?),
                false => None,
            };
            let tensors = batch.as_ref().map(|b| to_tensors(b, device, kind)).transpose()?;
            let input = tensors.as_ref().filter(|_| first).map(|(x, _)| pad_to_blocks(x, blocks)).transpose()?;
            let logits = self.pipe.forward_only(input.as_ref())?;
            if let (Some(logits), Some((_, labels)), true) = (logits, &tensors, counts_here) {
                let logits = logits.f_narrow(0, 0, labels.size()[0])?;
                counts[0] += correct_top_k(&logits, labels, 1);
                counts[1] += correct_top_k(&logits, labels, 5);
            }
        }
        let counts = Tensor::from_slice(&counts);
        world.all_reduce(&counts, ReduceOp::Sum)?;
        let n = set.len() as f64;
        Ok((counts.int64_value(&[0]) as f64 / n, counts.int64_value(&[1]) as f64 / n))
    }

    /// Whether this rank holds the last stage (where the loss is).
    pub fn holds_loss(&self) -> bool {
        self.pipe.holds_loss()
    }

    /// The whole model's full fp32 weights, sorted by name, on every rank, from `local` (this
    /// stage's full tensors by name): every parameter lives on one stage, so the stages' lists
    /// padded with zeros sum to the whole (a collective over the pipeline group).
    pub fn gather(&self, local: &[(String, Tensor)]) -> anyhow::Result<Vec<(String, Tensor)>> {
        let device = local.first().map_or(Device::Cpu, |(_, t)| t.device());
        let flat: Vec<Tensor> = self
            .full_shapes
            .iter()
            .map(|(name, shape)| match local.iter().find(|(n, _)| n == name) {
                Some((_, t)) => Ok(t.f_to_kind(Kind::Float)?.f_reshape([-1])?),
                None => Ok(Tensor::f_zeros([shape.iter().product::<i64>()], (Kind::Float, device))?),
            })
            .collect::<anyhow::Result<_>>()?;
        let flat = Tensor::f_cat(&flat, 0)?;
        self.pp.all_reduce(&flat, ReduceOp::Sum)?;
        let mut offset = 0;
        self.full_shapes
            .iter()
            .map(|(name, shape)| {
                let n: i64 = shape.iter().product();
                let t = flat.f_narrow(0, offset, n)?.f_view(shape.as_slice())?;
                offset += n;
                Ok((name.clone(), t))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use engine::parallel::pipeline::FnLayer;
    use suite_tests::{dist_test, TestResult};

    use super::*;

    dist_test!(every_rank_cuts_rank_0s_measured_split, 2, |world| {
        // Each rank finds a different part slow (rank 0 the last, rank 1 the first): measured
        // alone they would cut 0..3 | 3..4 and 0..1 | 1..4. Both must cut rank 0's split.
        let slow = if world.rank() == 0 { 3 } else { 0 };
        let layers: Vec<Box<dyn pipeline::Layer>> = (0..4)
            .map(|i| {
                let delay = Duration::from_millis(if i == slow { 20 } else { 0 });
                Box::new(FnLayer::new(Vec::new(), move |x: &Tensor, _: &[Param]| {
                    std::thread::sleep(delay);
                    Ok(x.f_mul_scalar(2.0)?)
                })) as Box<dyn pipeline::Layer>
            })
            .collect();
        let sample = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        let cut = measured_split(&layers, 2, &sample, &world.group)?;
        assert_eq!(cut.ranges, vec![0..3, 3..4], "rank {}: {cut}", world.rank());
        assert!(cut.costs[3] >= 0.02, "rank 0's slow part: {:?}", cut.costs);
        TestResult::Ok(())
    });
}
