//! The parameter store: named arrays under AlphaFold's own keys, so `params_model_N.npz` loads
//! as it is, and the files they are read from and written to (`.npz`, `.safetensors`).
//!
//! Creating a store ([`Params::random`]) and loading one ([`Params::load_model`]) build every
//! module over its arrays, so those constructors live above the modules, in `model/assemble.rs`;
//! this file sits below the modules, which take a `&Params` to build themselves over it.
use std::collections::BTreeMap;
use std::path::Path;

use kernels::Backend;
use tch::{Device, Kind, Tensor};

use crate::model::config::{EvoformerConfig, ModelConfig};
use crate::model::scope::{Builder, Mode};
use crate::model::AttentionKernel;
use crate::model::{Error, Result};

/// Named arrays of the Evoformer and extra-MSA stacks (and, from [`Params::random_model`] or
/// [`Params::load_model_npz`], of the embedders and heads), and the sizes they imply.
pub struct Params {
    arrays: BTreeMap<String, Tensor>,
    config: EvoformerConfig,
    kernels: Backend,
    attention: AttentionKernel,
}

impl Params {
    /// A store of `arrays` (already checked against `config` by building the modules).
    pub(super) fn from_parts(arrays: BTreeMap<String, Tensor>, config: EvoformerConfig) -> Params {
        Params { arrays, config, kernels: Backend::Torch, attention: AttentionKernel::Logits }
    }

    /// The same arrays, building modules that run `kernels` (the fused CUDA kernels, or
    /// libtorch's compositions: the default).
    pub fn with_kernels(mut self, kernels: Backend) -> Params {
        self.kernels = kernels;
        self
    }

    /// The same arrays, building modules whose attentions run `attention` without autograd
    /// on the fused kernels (the default: [`AttentionKernel::Logits`]).
    pub fn with_attention(mut self, attention: AttentionKernel) -> Params {
        self.attention = attention;
        self
    }

    /// The kernels modules built from here run, and their attention without autograd.
    pub fn kernels(&self) -> (Backend, AttentionKernel) {
        (self.kernels, self.attention)
    }

    /// The same arrays, their Evoformer blocks running the outer product mean `first`
    /// (AlphaFold-Multimer's block order, for a file of the stacks alone, whose shapes cannot
    /// tell; see [`EvoformerConfig::outer_product_mean_first`]).
    pub fn with_outer_product_mean_first(mut self, first: bool) -> Params {
        self.config.outer_product_mean_first = first;
        self
    }

    /// The same arrays converted to `kind` (e.g. bf16 for inference).
    pub fn to_kind(&self, kind: Kind) -> Result<Params> {
        let arrays = self.arrays.iter().map(|(k, t)| Ok((k.clone(), t.f_to_kind(kind)?))).collect::<Result<_>>()?;
        Ok(Params { arrays, config: self.config, kernels: self.kernels, attention: self.attention })
    }

    /// Writes every array under its AlphaFold name to `.npz` (stored, as numpy's `savez`) or, by
    /// extension, `.safetensors`, through a temporary file renamed into place.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let named: Vec<(String, Tensor)> = self.arrays.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        write_arrays(&named, path)
    }

    /// The sizes these arrays imply.
    pub fn config(&self) -> &EvoformerConfig {
        &self.config
    }

    /// The sizes of the embedders and heads, read from the shapes of their arrays (an error
    /// naming the key for a store of the stacks only).
    pub fn model_config(&self) -> Result<ModelConfig> {
        let map = self.arrays.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        ModelConfig::infer(&map)
    }

    /// The array under an AlphaFold key.
    pub fn get(&self, key: &str) -> Result<&Tensor> {
        self.arrays.get(key).ok_or_else(|| Error::Missing { key: key.to_string(), file: None })
    }

    /// Every key and array, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.arrays.iter().map(|(k, t)| (k.as_str(), t))
    }

    /// Number of arrays.
    pub fn len(&self) -> usize {
        self.arrays.len()
    }

    /// Whether there are no arrays.
    pub fn is_empty(&self) -> bool {
        self.arrays.is_empty()
    }

    /// Replaces the array under `key` (same shape), e.g. after moving it to a device or
    /// marking it as requiring gradients.
    pub fn set(&mut self, key: &str, value: Tensor) -> Result<()> {
        let old = self.get(key)?;
        if old.size() != value.size() {
            return Err(Error::Shape { key: key.into(), expected: old.size(), found: value.size(), file: None });
        }
        self.arrays.insert(key.to_string(), value);
        Ok(())
    }

    /// Moves every array to `device` and marks each as requiring gradients or not (the
    /// arrays become fresh leaves).
    pub fn to_device(&self, device: Device, requires_grad: bool) -> Result<Params> {
        let arrays = self
            .arrays
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.f_detach()?.f_to_device(device)?.f_set_requires_grad(requires_grad)?)))
            .collect::<Result<_>>()?;
        Ok(Params { arrays, config: self.config, kernels: self.kernels, attention: self.attention })
    }

    /// Builds the modules of one stack over these arrays, checking every shape and that every
    /// array of the stack is used.
    pub(crate) fn builder(&self) -> Builder {
        let arrays = self.arrays.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        Builder::new(Mode::Load, arrays, None).with_kernels(self.kernels())
    }
}

/// Copies every array of an `.npz` or `.safetensors` parameter file into the other format (by
/// the extensions), names, kinds and values unchanged (but bfloat16 into an `.npz`: float32,
/// the same values), including arrays the model does not read (template stacks).
pub fn convert(input: &Path, output: &Path) -> Result<Converted> {
    // The output's extension picks the format: another one would get an .npz under its name.
    if !output.extension().is_some_and(|e| e == "npz" || e == "safetensors") {
        return Err(Error::Invalid(format!("{}: the output must end in .npz or .safetensors", output.display())));
    }
    // Otherwise the writer's error names its temporary file, not the missing folder.
    let parent = output.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(Error::Invalid(format!("{}: the folder {} does not exist", output.display(), parent.display())));
    }
    let mut arrays = read_arrays(input)?;
    if arrays.is_empty() {
        return Err(Error::Invalid(format!("{}: holds no arrays", input.display())));
    }
    // NumPy has no bfloat16: an .npz gets such arrays widened to float32, which keeps every
    // value (AlphaFold's own files hold float32).
    let mut widened = 0;
    if !is_safetensors(output) {
        for (_, t) in arrays.iter_mut().filter(|(_, t)| t.kind() == tch::Kind::BFloat16) {
            *t = t.f_to_kind(tch::Kind::Float)?;
            widened += 1;
        }
    }
    write_arrays(&arrays, output)?;
    Ok(Converted { arrays: arrays.len(), widened })
}

/// What [`convert`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Converted {
    /// Arrays written.
    pub arrays: usize,
    /// Of them, bfloat16 arrays written to an `.npz` as float32.
    pub widened: usize,
}

fn write_arrays(named: &[(String, Tensor)], path: &Path) -> Result<()> {
    let write = match is_safetensors(path) {
        true => data::checkpoint::save_tensors,
        false => data::checkpoint::save_npz,
    };
    write(named, path).map_err(|e| Error::Invalid(format!("writing {}: {e}", path.display())))
}

fn is_safetensors(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

/// Every array of an `.npz` or `.safetensors` file, by name.
/// `.npz` goes through the checked reader: a header that claims more data than the file holds
/// is an error naming the file and array, not a read past the buffer.
pub(crate) fn read_arrays(path: &Path) -> Result<Vec<(String, Tensor)>> {
    if is_safetensors(path) {
        let map = data::checkpoint::read_tensors(path).map_err(|e| Error::Invalid(format!("{e}")))?;
        return Ok(map.into_iter().collect());
    }
    data::npz::read(path).map_err(|e| Error::Invalid(format!("{e}")))
}
