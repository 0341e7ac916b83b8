//! Megatron's two linear layers. Weights have PyTorch's `[out_features, in_features]` layout
//! and the names `weight` and `bias` under the layer's path, as in a serial `nn.Linear`.
//!
//! - [`ColumnParallelLinear`] keeps rows `rank * out/tp ..` of the weight (and of the bias):
//!   each rank computes a block of the output features. Its input is replicated (backward
//!   sums the input gradient over the group), or with sequence parallelism split along the
//!   sequence and all-gathered first (backward reduce-scatters; only the local block is kept
//!   for backward, see `gathered_linear`). With `gather_output` the
//!   output blocks are gathered into a replicated full output.
//! - [`RowParallelLinear`] keeps columns `rank * in/tp ..` of the weight: each rank multiplies
//!   its block of the input features and the partial products are summed over the group, or
//!   with sequence parallelism reduce-scattered along the sequence. The bias is whole and added
//!   once, after the sum.
use tch::{nn, Tensor};

use super::gathered_linear::all_gather_linear;
use super::init::{self, Init};
use super::{dim_index, TensorParallel};
use crate::error::ensure;
use crate::Result;

/// How a [`ColumnParallelLinear`] is built and wired.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColumnConfig {
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Gather the output blocks into a replicated full output (false: each rank keeps its
    /// block of the output features, for a [`RowParallelLinear`] with `input_is_parallel`).
    pub gather_output: bool,
    /// The input is this rank's block of the sequence (dim `sequence_dim`) and is all-gathered.
    pub sequence_parallel: bool,
    /// The sequence dimension of the input (0 in Megatron's `[seq, batch, hidden]` layout).
    pub sequence_dim: i64,
    /// Seed of the serial-equivalent initialisation.
    pub seed: u64,
    /// The weight's initialisation; `None`: PyTorch's `nn.Linear` (uniform, bound
    /// `1/sqrt(in_features)`).
    pub weight_init: Option<Init>,
    /// The bias's initialisation; `None`: PyTorch's `nn.Linear`.
    pub bias_init: Option<Init>,
}

impl Default for ColumnConfig {
    fn default() -> Self {
        ColumnConfig {
            bias: true,
            gather_output: false,
            sequence_parallel: false,
            sequence_dim: 0,
            seed: 0,
            weight_init: None,
            bias_init: None,
        }
    }
}

/// How a [`RowParallelLinear`] is built and wired.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowConfig {
    /// Whether the layer has a bias.
    pub bias: bool,
    /// The input is already split over the input features (the output of a
    /// [`ColumnParallelLinear`] without `gather_output`); false: a replicated input is split
    /// here (backward gathers its gradient).
    pub input_is_parallel: bool,
    /// Reduce-scatter the output along dim `sequence_dim` instead of all-reducing it.
    pub sequence_parallel: bool,
    /// The sequence dimension of the output.
    pub sequence_dim: i64,
    /// Seed of the serial-equivalent initialisation.
    pub seed: u64,
    /// The weight's initialisation; `None`: PyTorch's `nn.Linear`.
    pub weight_init: Option<Init>,
    /// The bias's initialisation; `None`: PyTorch's `nn.Linear`.
    pub bias_init: Option<Init>,
}

impl Default for RowConfig {
    fn default() -> Self {
        RowConfig {
            bias: true,
            input_is_parallel: true,
            sequence_parallel: false,
            sequence_dim: 0,
            seed: 0,
            weight_init: None,
            bias_init: None,
        }
    }
}

/// PyTorch's `nn.Linear` default for weight and bias.
fn torch_default(in_features: i64) -> Init {
    Init::Uniform { bound: 1.0 / (in_features as f64).sqrt() }
}

/// A linear layer whose output features are split over the tensor-parallel group.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    in_features: i64,
    out_features: i64,
    cfg: ColumnConfig,
    tp: TensorParallel,
}

impl ColumnParallelLinear {
    /// A layer of `in_features -> out_features` (full sizes) with this rank's block of the
    /// output features, initialised as the tp=1 layer at path `p` would be.
    pub fn new(
        p: &nn::Path,
        in_features: i64,
        out_features: i64,
        cfg: ColumnConfig,
        tp: &TensorParallel,
    ) -> Result<Self> {
        ensure!(
            in_features > 0,
            "column-parallel linear {}: in_features must be positive, got {in_features}",
            p.path("weight")
        );
        tp.partition(out_features, &format!("column-parallel linear {}: out_features", p.path("weight")))?;
        let (rank, n) = (tp.rank(), tp.size());
        let w_init = cfg.weight_init.unwrap_or(torch_default(in_features));
        let weight = init::shard(w_init, cfg.seed, &p.path("weight"), &[out_features, in_features], 0, rank, n)?;
        let bias = match cfg.bias {
            true => {
                let b_init = cfg.bias_init.unwrap_or(torch_default(in_features));
                Some(init::shard(b_init, cfg.seed, &p.path("bias"), &[out_features], 0, rank, n)?)
            }
            false => None,
        };
        Self::register(p, &weight, bias.as_ref(), in_features, out_features, cfg, tp)
    }

    /// A layer holding this rank's block of the full `weight` (`[out, in]`) and `bias`
    /// (`[out]`), e.g. from a checkpoint written at another tp size. `cfg.bias` must agree
    /// with whether a bias is given.
    pub fn from_full(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cfg: ColumnConfig,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let (out_features, in_features) = full_shape(weight, bias, cfg.bias, &p.path("weight"))?;
        let what = format!("column-parallel linear {}: out_features", p.path("weight"));
        let w = tp.shard_of(weight, 0, &what)?;
        let b = bias.map(|b| tp.shard_of(b, 0, &what)).transpose()?;
        Self::register(p, &w, b.as_ref(), in_features, out_features, cfg, tp)
    }

    fn register(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        in_features: i64,
        out_features: i64,
        cfg: ColumnConfig,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let weight = p.f_var_copy("weight", weight)?;
        let bias = bias.map(|b| p.f_var_copy("bias", b)).transpose()?;
        Ok(ColumnParallelLinear { weight, bias, in_features, out_features, cfg, tp: tp.clone() })
    }

    /// `x [.., in_features]` (with sequence parallelism, this rank's block of the sequence)
    /// to this rank's block of the output features, or with `gather_output` all of them.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let last = *x.size().last().unwrap_or(&0);
        ensure!(
            last == self.in_features,
            "column-parallel linear: input has {last} features in its last dimension, expected {}",
            self.in_features
        );
        let y = match (self.cfg.sequence_parallel, self.tp.active()) {
            (true, Some(g)) => {
                dim_index(x, self.cfg.sequence_dim)?;
                all_gather_linear(x, &self.weight, self.bias.as_ref(), self.cfg.sequence_dim, g)?
            }
            _ => self.tp.copy_to(x)?.f_linear(&self.weight, self.bias.as_ref())?,
        };
        match self.cfg.gather_output {
            true => self.tp.gather(&y, -1),
            false => Ok(y),
        }
    }

    /// This rank's block of the weight, `[out/tp, in]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's block of the bias, `[out/tp]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The full weight `[out, in]` on every rank, as the tp=1 layer holds it (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        self.tp.gather_full(&self.weight, 0)
    }

    /// The full bias `[out]` on every rank.
    pub fn full_bias(&self) -> Result<Option<Tensor>> {
        self.bias.as_ref().map(|b| self.tp.gather_full(b, 0)).transpose()
    }

    /// The full features of the layer: `(in_features, out_features)`.
    pub fn features(&self) -> (i64, i64) {
        (self.in_features, self.out_features)
    }
}

/// A linear layer whose input features are split over the tensor-parallel group.
#[derive(Debug)]
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    in_features: i64,
    out_features: i64,
    cfg: RowConfig,
    tp: TensorParallel,
}

impl RowParallelLinear {
    /// A layer of `in_features -> out_features` (full sizes) with this rank's block of the
    /// input features, initialised as the tp=1 layer at path `p` would be.
    pub fn new(p: &nn::Path, in_features: i64, out_features: i64, cfg: RowConfig, tp: &TensorParallel) -> Result<Self> {
        ensure!(
            out_features > 0,
            "row-parallel linear {}: out_features must be positive, got {out_features}",
            p.path("weight")
        );
        tp.partition(in_features, &format!("row-parallel linear {}: in_features", p.path("weight")))?;
        let w_init = cfg.weight_init.unwrap_or(torch_default(in_features));
        let weight =
            init::shard(w_init, cfg.seed, &p.path("weight"), &[out_features, in_features], 1, tp.rank(), tp.size())?;
        let bias = match cfg.bias {
            true => {
                let b_init = cfg.bias_init.unwrap_or(torch_default(in_features));
                Some(init::full(b_init, cfg.seed, &p.path("bias"), &[out_features])?)
            }
            false => None,
        };
        Self::register(p, &weight, bias.as_ref(), in_features, out_features, cfg, tp)
    }

    /// A layer holding this rank's block of the full `weight` (`[out, in]`) and the whole
    /// `bias` (`[out]`).
    pub fn from_full(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cfg: RowConfig,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let (out_features, in_features) = full_shape(weight, bias, cfg.bias, &p.path("weight"))?;
        let w = tp.shard_of(weight, 1, &format!("row-parallel linear {}: in_features", p.path("weight")))?;
        let b = bias.map(|b| b.detach().copy());
        Self::register(p, &w, b.as_ref(), in_features, out_features, cfg, tp)
    }

    fn register(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        in_features: i64,
        out_features: i64,
        cfg: RowConfig,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let weight = p.f_var_copy("weight", weight)?;
        let bias = bias.map(|b| p.f_var_copy("bias", b)).transpose()?;
        Ok(RowParallelLinear { weight, bias, in_features, out_features, cfg, tp: tp.clone() })
    }

    /// `x`: this rank's block of the input features `[.., in/tp]` (with `input_is_parallel`)
    /// or the whole replicated input `[.., in]`. The output `[.., out]` is replicated, or with
    /// sequence parallelism this rank's block of the sequence.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let last = *x.size().last().unwrap_or(&0);
        let expected = if self.cfg.input_is_parallel { self.in_features / self.tp.size() } else { self.in_features };
        ensure!(
            last == expected,
            "row-parallel linear: input has {last} features in its last dimension, expected {expected} \
             (in_features {} over tensor-parallel size {}, input_is_parallel {})",
            self.in_features,
            self.tp.size(),
            self.cfg.input_is_parallel
        );
        let x = match self.cfg.input_is_parallel {
            true => x.shallow_clone(),
            false => self.tp.scatter(x, -1)?,
        };
        let partial = x.f_linear(&self.weight, None::<Tensor>)?;
        let y = match self.cfg.sequence_parallel {
            true => {
                let d = dim_index(&partial, self.cfg.sequence_dim)?;
                let (len, n) = (partial.size()[d], self.tp.size());
                ensure!(
                    len % n == 0,
                    "row-parallel linear: sequence length {len} (dim {d}) does not divide by the tensor-parallel size {n}"
                );
                self.tp.reduce_scatter(&partial, self.cfg.sequence_dim)?
            }
            false => self.tp.reduce_from(&partial)?,
        };
        match &self.bias {
            // Under sequence parallelism each rank adds the bias to its own block only, so the
            // bias's gradient is summed over the group (copy_to's backward).
            Some(b) if self.cfg.sequence_parallel => Ok(y.f_add(&self.tp.copy_to(b)?)?),
            Some(b) => Ok(y.f_add(b)?),
            None => Ok(y),
        }
    }

    /// This rank's block of the weight, `[out, in/tp]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[out]`, whole on every rank.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The full weight `[out, in]` on every rank, as the tp=1 layer holds it (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        self.tp.gather_full(&self.weight, 1)
    }

    /// The full features of the layer: `(in_features, out_features)`.
    pub fn features(&self) -> (i64, i64) {
        (self.in_features, self.out_features)
    }
}

/// `(out, in)` of a full weight, checked against its bias and the config.
fn full_shape(weight: &Tensor, bias: Option<&Tensor>, with_bias: bool, name: &str) -> Result<(i64, i64)> {
    let shape = weight.size();
    ensure!(shape.len() == 2, "{name}: a linear weight is [out_features, in_features], got shape {shape:?}");
    ensure!(
        bias.is_some() == with_bias,
        "{name}: the config says bias = {with_bias} but a bias was {}given",
        if bias.is_some() { "" } else { "not " }
    );
    if let Some(b) = bias {
        ensure!(b.size() == [shape[0]], "{name}: bias has shape {:?}, expected [{}]", b.size(), shape[0]);
    }
    Ok((shape[0], shape[1]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{nn::VarStore, Device, Kind};

    /// With one process both layers are `nn.Linear`: `x W^T + b`, weights named as a serial
    /// model's, and PyTorch's default initialisation bound.
    #[test]
    fn one_process_layers_are_nn_linear() {
        let vs = VarStore::new(Device::Cpu);
        let none = TensorParallel::none();
        let (w, b) =
            (Tensor::randn([5, 3], (Kind::Float, Device::Cpu)), Tensor::randn([5], (Kind::Float, Device::Cpu)));
        let x = Tensor::randn([2, 4, 3], (Kind::Float, Device::Cpu));
        let want = x.matmul(&w.tr()) + &b;
        let col =
            ColumnParallelLinear::from_full(&(vs.root() / "c"), &w, Some(&b), ColumnConfig::default(), &none).unwrap();
        let row = RowParallelLinear::from_full(&(vs.root() / "r"), &w, Some(&b), RowConfig::default(), &none).unwrap();
        assert!(col.forward(&x).unwrap().allclose(&want, 1e-6, 1e-6, false));
        assert!(row.forward(&x).unwrap().allclose(&want, 1e-6, 1e-6, false));
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        assert_eq!(names, ["c.bias", "c.weight", "r.bias", "r.weight"]);

        let fresh = ColumnParallelLinear::new(&(vs.root() / "d"), 16, 8, ColumnConfig::default(), &none).unwrap();
        let bound = fresh.weight().abs().max().double_value(&[]);
        assert!(bound <= 0.25 && bound > 0.2, "uniform(-1/sqrt(16), 1/sqrt(16)): max |w| = {bound}");
    }

    #[test]
    fn bad_full_tensors_are_errors() {
        let vs = VarStore::new(Device::Cpu);
        let none = TensorParallel::none();
        let w = Tensor::zeros([4, 3], (Kind::Float, Device::Cpu));
        let err = ColumnParallelLinear::from_full(&(vs.root() / "a"), &w, None, ColumnConfig::default(), &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the config says bias = true but a bias was not given"), "{err}");
        let b = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let err = RowParallelLinear::from_full(&(vs.root() / "b"), &w, Some(&b), RowConfig::default(), &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bias has shape [3], expected [4]"), "{err}");
    }
}
