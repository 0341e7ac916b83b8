//! Where a parameter's shard lies in the full tensor, as the tensor-parallel layouts
//! ([`crate::tensor_parallel`]'s 1D, [`crate::multi_dim`]'s grids and cubes) describe it to
//! [`crate::tensor_parallel::Sharding`], which cuts and gathers checkpoints' full tensors by it.
use engine::dist::ProcessGroup;

/// Where a parameter's shard lies in the full tensor: the cuts made in turn, each along a
/// dimension (negative: from the end) into as many blocks as its group has ranks, the block
/// being the rank's index in that group.
#[derive(Clone, Debug)]
pub struct Placement {
    /// `qkv`: rows regrouped by head into this many blocks (timm's `[3, n, ..]` to `[n, 3, ..]`)
    /// before the cuts.
    pub heads: Option<i64>,
    /// The patch embedding's convolution weight `[out, c, p, p]`, cut as a matrix `[out, c p p]`.
    pub flatten: bool,
    /// `(dim, group)` per cut, outermost first.
    pub cuts: Vec<(i64, ProcessGroup)>,
    /// How many ranks of the tensor-parallel group hold this same shard.
    pub copies: usize,
}
