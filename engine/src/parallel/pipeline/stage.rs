//! What a pipeline runs: a model given as an ordered list of layers, and the chunks of it that
//! one rank holds (cut by [`super::partition`]). Layer boundaries are where the split backward cuts (see
//! [`super::Pipeline`]), so they are kept per chunk.
use tch::Tensor;

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
