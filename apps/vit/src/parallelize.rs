//! Applies a job's [`Layout`] to the ViT, as torchtitan's `parallelize` does, in one fixed
//! order:
//!
//! 1. the serial model is built from the seed as one process builds it, so every layout starts
//!    from the same weights;
//! 2. tensor and sequence parallelism split its layers and keep this rank's slices
//!    ([`Sharding::build`]: [`crate::tensor_parallel`]'s 1D, [`crate::multi_dim`]'s grids and
//!    cube, [`crate::sequence_parallel`]'s token split);
//! 3. activation checkpointing marks the layout's blocks;
//! 4. a pipeline cuts the model into stages and this rank keeps its own
//!    ([`crate::pipeline_parallel`]);
//! 5. data parallelism (ZeRO, mixed precision's fp32 masters, offload) wires the parameters
//!    this rank trains over its data x sequence group ([`engine::parallel::parallelize()`]).
//!
//! The model files know none of this: they are written once, serially.
use engine::dist::World;
use engine::optim::{Optimizer, Param};
use engine::parallel::{parallelize as wire_data_parallel, ParallelPlan, Parallelized};
use tch::nn::VarStore;
use tch::{Device, Kind};

use crate::layout::Layout;
use crate::mesh::Mesh;
use crate::model::{Vit, VitConfig};
use crate::pipeline_parallel::Model;
use crate::tensor_parallel::Sharding;

/// How this rank computes: what the layout does not decide but the model's build needs.
#[derive(Clone, Copy, Debug)]
pub struct Compute {
    /// Where the weights live.
    pub device: Device,
    /// The weights' and activations' kind (fp32 masters are kept below fp32).
    pub kind: Kind,
    /// What runs the blocks' LayerNorms (`--kernels`; `None`: the device's default).
    pub kernels: Option<kernels::Backend>,
    /// The seed of the initial weights.
    pub seed: u64,
    /// Keep the fp32 masters and optimizer state in CPU memory.
    pub offload_optimizer: bool,
}

/// The model laid out on this rank.
pub struct Parallel {
    /// The model's split over the tensor- and sequence-parallel groups.
    pub sharding: Sharding,
    /// The weights this rank holds (its slices; under a pipeline its stages', the others
    /// empty).
    pub vs: VarStore,
    /// The whole model, or this rank's stages.
    pub model: Model,
    /// The data-parallel wiring of the parameters this rank trains, with their optimizer
    /// (made by the `optimizer` given to [`parallelize`]).
    pub parallel: Parallelized,
}

/// Lays `cfg` out on this rank of `world` as `layout` says, over `mesh` (the layout's groups),
/// in the order of the module docs; `optimizer` makes the optimizer over the parameters it
/// should step. `layout` must have been checked against `cfg` ([`Layout::check`]).
pub fn parallelize(
    cfg: VitConfig,
    layout: &Layout,
    mesh: &Mesh,
    world: &World,
    compute: &Compute,
    optimizer: impl FnOnce(Vec<Param>) -> Box<dyn Optimizer>,
) -> anyhow::Result<Parallel> {
    let Compute { device, kind, kernels, seed, offload_optimizer } = *compute;
    if layout.splits_model() && kernels == Some(kernels::Backend::Fused) {
        anyhow::bail!(
            "--kernels fused covers the serial model's LayerNorms; with --tp {} --sp {} the layers are libtorch's",
            layout.tp,
            layout.sp
        );
    }
    let backend = kernels::Backend::resolve(kernels, device)?;
    kernels::install_optimizer_steps(backend);

    // 1 and 2: on every rank from the same seed. Split layouts build the serial model as one
    // process would and keep their slices of it.
    let sharding = Sharding::new(mesh, layout, &cfg)?;
    let (mut vs, mut model) = engine::random::seeded(seed as i64, || -> anyhow::Result<_> {
        let vs = VarStore::new(device);
        let model = match layout.splits_model() {
            false => Vit::with_kernels(&vs.root(), cfg, backend),
            true => {
                let serial = VarStore::new(device);
                let _ = Vit::new(&serial.root(), cfg);
                sharding.build(&serial, &vs)?
            }
        };
        Ok((vs, model))
    })?;
    if kind != Kind::Float {
        vs.set_kind(kind);
    }
    // 3.
    model.set_checkpointed_blocks(layout.checkpointing.blocks(cfg.depth as usize));
    // 4.
    let pp = mesh.pipeline.as_ref();
    let (model, params) = Model::place(model, &vs, &sharding, pp, layout, &world.group, device, world.rank() == 0)?;
    // 5. (DataParallel also broadcasts rank 0's weights.)
    let plan = ParallelPlan { zero: layout.zero, compute: kind, offload_optimizer, device, ..ParallelPlan::default() };
    let parallel = model.wire(wire_data_parallel(params, sharding.grads(), &plan, optimizer)?);
    Ok(Parallel { sharding, vs, model, parallel })
}
