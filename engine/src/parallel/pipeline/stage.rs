//! What a pipeline runs: a model given as an ordered list of layers, and the chunks of it that
//! one rank holds. Layer boundaries are where the split backward cuts (see
//! [`super::Pipeline`]), so they are kept per chunk.
use tch::Tensor;

use super::partition::Split;
use crate::error::ensure;
use crate::optim::Param;
use crate::Result;

/// One layer of a model: a function of one tensor holding its own parameters.
pub trait Layer {
    /// The layer's output for `input`, recorded by autograd.
    fn forward(&self, input: &Tensor) -> Result<Tensor>;
    /// The layer's trainable parameters (handles on the same tensors).
    fn params(&self) -> Vec<Param>;
}

/// A layer from a closure over its parameters.
pub struct FnLayer<F> {
    params: Vec<Param>,
    f: F,
}

impl<F: Fn(&Tensor, &[Param]) -> Result<Tensor>> FnLayer<F> {
    /// A layer computing `f(input, params)`.
    pub fn new(params: Vec<Param>, f: F) -> FnLayer<F> {
        FnLayer { params, f }
    }
}

impl<F: Fn(&Tensor, &[Param]) -> Result<Tensor>> Layer for FnLayer<F> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        (self.f)(input, &self.params)
    }

    fn params(&self) -> Vec<Param> {
        self.params.iter().map(Param::shallow_copy).collect()
    }
}

/// The layers of one virtual stage.
pub struct Chunk {
    /// The virtual stage this chunk is.
    pub stage: usize,
    /// Its layers, in order.
    pub layers: Vec<Box<dyn Layer>>,
}

impl Chunk {
    /// Every parameter of the chunk's layers, in layer order.
    pub fn params(&self) -> Vec<Param> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }
}

/// Takes the chunks of `layers` that pipeline rank `rank` of `pp` holds under `split` (one range
/// per virtual stage, `pp * v` of them): virtual stage `c * pp + rank` becomes chunk `c`. Every
/// rank may build the whole model and keep its part; the other layers are dropped.
pub fn assign(layers: Vec<Box<dyn Layer>>, split: &Split, rank: usize, pp: usize) -> Result<Vec<Chunk>> {
    let stages = split.ranges.len();
    ensure!(pp >= 1 && rank < pp, "pipeline: rank {rank} is not among pp={pp} ranks");
    ensure!(stages.is_multiple_of(pp), "pipeline: {stages} stages do not divide among pp={pp} ranks");
    ensure!(
        split.ranges.last().map(|r| r.end) == Some(layers.len()),
        "pipeline: the split covers {} layers but the model has {}",
        split.ranges.last().map_or(0, |r| r.end),
        layers.len()
    );
    let mut chunks: Vec<Chunk> = (rank..stages).step_by(pp).map(|stage| Chunk { stage, layers: Vec::new() }).collect();
    for (i, layer) in layers.into_iter().enumerate() {
        let stage = split
            .ranges
            .iter()
            .position(|r| r.contains(&i))
            .ok_or_else(|| crate::Error::invalid(format!("pipeline: the split leaves out layer {i}")))?;
        if stage % pp == rank {
            chunks[stage / pp].layers.push(layer);
        }
    }
    Ok(chunks)
}
