//! Parameter storage under AlphaFold's own names, so `params_model_N.npz` loads as it is.
//!
//! A weight's name is its module path: constructors ask a [`Scope`] for `p.sub("attention")
//! .param("query_w", ..)`, and the key is `<module path>//<name>` exactly as in AlphaFold's
//! files (haiku module path, `//`, parameter name). The mapping table from our modules to
//! AlphaFold's names is therefore the constructors themselves, one name per call; the table of
//! module names is:
//!
//! | module | AlphaFold module path (below a block) | arrays |
//! |---|---|---|
//! | [`LayerNorm`](crate::model::layers::LayerNorm) | `query_norm`, `feat_2d_norm`, `input_layer_norm`, `layer_norm_input`, `center_layer_norm` | `scale`, `offset` |
//! | [`Linear`](crate::model::layers::Linear) | `transition1/2`, `left/right_projection`, `left/right_gate`, `output_projection`, `gating_linear` | `weights` [in, out], `bias` |
//! | [`Attention`](crate::model::attention::Attention) | `.../attention` | `query_w`, `key_w`, `value_w`, `gating_w` [c, heads, dim], `gating_b` [heads, dim], `output_w` [heads, dim, c], `output_b` |
//! | [`GlobalAttention`](crate::model::attention::GlobalAttention) | `msa_column_global_attention/attention` | as above, but `key_w`, `value_w` [c, dim] |
//! | pair bias | `msa_row_attention_with_pair_bias`, `triangle_attention_*` | `feat_2d_weights` [c_z, heads] |
//! | [`OuterProductMean`](crate::model::msa::OuterProductMean) | `outer_product_mean` | `output_w` [opm, opm, c_z], `output_b` |
//!
//! A stack's arrays carry a leading block dimension (`[num_blocks, ...]`, as haiku's
//! `layer_stack` writes them); block `i`'s modules hold `select(0, i)` views of them, so
//! gradients of the blocks land in the stacked arrays.
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::model::config::{EvoformerConfig, ModelConfig};
use crate::model::embedders::Embedders;
use crate::model::evoformer::EvoformerStack;
use crate::model::heads::Heads;
use crate::model::structure::{StructureModule, STRUCTURE_MODULE};
use crate::model::templates::Templates;
use crate::model::{Error, Result};

/// Module path of the Evoformer stack's (stacked) block.
pub const EVOFORMER: &str = "alphafold/alphafold_iteration/evoformer/evoformer_iteration";
/// Key prefix of every template array (the pair embedding and the torsion-angle embedding).
const TEMPLATE_ARRAYS: &str = "alphafold/alphafold_iteration/evoformer/template_";
/// Module path of the extra-MSA stack's (stacked) block.
pub const EXTRA_MSA: &str = "alphafold/alphafold_iteration/evoformer/extra_msa_stack";

/// How [`Params::random`] draws an array. Every array gets non-degenerate values (AlphaFold's
/// training init zeroes output and gating weights, which would hide errors in tests).
#[derive(Clone, Copy, Debug)]
pub enum Init {
    /// Normal with variance `1 / fan_in`.
    Weight {
        /// Inputs summed per output.
        fan_in: i64,
    },
    /// Normal around 0 with standard deviation 0.1 (biases, LayerNorm offsets).
    Small,
    /// Normal around 1 with standard deviation 0.1 (LayerNorm scales, gating biases).
    One,
}

/// Named arrays of the Evoformer and extra-MSA stacks (and, from [`Params::random_model`] or
/// [`Params::load_model_npz`], of the embedders and heads), and the sizes they imply.
pub struct Params {
    arrays: BTreeMap<String, Tensor>,
    config: EvoformerConfig,
}

impl Params {
    /// Freshly drawn arrays for `config`, seeded, as fp32 on the CPU.
    pub fn random(config: &EvoformerConfig, seed: i64) -> Result<Params> {
        Self::init(config, None, seed)
    }

    /// Freshly drawn arrays of a whole model for `config` and `model`: the stacks, the
    /// embedders ([`crate::model::embedders`]) and the heads ([`crate::model::heads`]).
    pub fn random_model(config: &EvoformerConfig, model: &ModelConfig, seed: i64) -> Result<Params> {
        Self::init(config, Some(model), seed)
    }

    fn init(config: &EvoformerConfig, model: Option<&ModelConfig>, seed: i64) -> Result<Params> {
        tch::manual_seed(seed);
        let builder = Builder::new(Mode::Init, BTreeMap::new(), None);
        build(&builder, config, model)?;
        Ok(Params { arrays: builder.arrays.into_inner(), config: *config })
    }

    /// Reads an AlphaFold `.npz` (or one written by [`Params::save`]). Sizes are inferred
    /// from the shapes; every array the stacks need must be present with the shape the sizes
    /// imply, else the error names the key and both shapes; an array under a stack's path
    /// that no module uses is an error too. Arrays of other modules (embedders, structure
    /// module, heads) are left out.
    pub fn load_npz(path: impl AsRef<Path>) -> Result<Params> {
        Self::load(path.as_ref(), false)
    }

    /// As [`Params::load_npz`], and the embedders' and heads' arrays too, with their sizes
    /// inferred from the shapes ([`ModelConfig::infer`]) and every array checked the same way;
    /// the aligned-error head is loaded when the file has it. The structure module's arrays
    /// are left out.
    pub fn load_model_npz(path: impl AsRef<Path>) -> Result<Params> {
        Self::load(path.as_ref(), true)
    }

    fn load(path: &Path, with_model: bool) -> Result<Params> {
        let file = path.display().to_string();
        let arrays = read_arrays(path)?;
        let mut map = BTreeMap::new();
        for (name, t) in arrays {
            let t = if t.kind() == Kind::Float { t } else { t.f_to_kind(Kind::Float)? };
            map.insert(name, t);
        }
        let config = EvoformerConfig::infer(&map).map_err(|e| with_file(e, &file))?;
        let model = match with_model {
            true => Some(ModelConfig::infer(&map).map_err(|e| with_file(e, &file))?),
            false => None,
        };
        let builder = Builder::new(Mode::Load, map, Some(file.clone()));
        build(&builder, &config, model.as_ref())?;
        let mut checked = vec![format!("{EVOFORMER}/"), format!("{EXTRA_MSA}/")];
        if let Some(m) = &model {
            checked.push(format!("{STRUCTURE_MODULE}/"));
            if m.templates.is_some() {
                checked.push(TEMPLATE_ARRAYS.to_string());
            }
        }
        for prefix in checked {
            let unused = builder.unused_under(&prefix);
            if !unused.is_empty() {
                return Err(Error::Invalid(format!("{file}: arrays no module of the stacks uses: {unused:?}")));
            }
        }
        let used = builder.used.into_inner();
        let arrays = builder.arrays.into_inner().into_iter().filter(|(k, _)| used.contains(k)).collect();
        Ok(Params { arrays, config })
    }

    /// As [`Params::load_model_npz`], from AlphaFold's `.npz` or from a `.safetensors` file
    /// under the same names (what `fastfold convert` writes), by extension.
    pub fn load_model(path: impl AsRef<Path>) -> Result<Params> {
        Self::load(path.as_ref(), true)
    }

    /// The same arrays converted to `kind` (e.g. bf16 for inference).
    pub fn to_kind(&self, kind: Kind) -> Result<Params> {
        let arrays = self.arrays.iter().map(|(k, t)| Ok((k.clone(), t.f_to_kind(kind)?))).collect::<Result<_>>()?;
        Ok(Params { arrays, config: self.config })
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
        Ok(Params { arrays, config: self.config })
    }

    /// Builds the modules of one stack over these arrays, checking every shape and that every
    /// array of the stack is used.
    pub(crate) fn builder(&self) -> Builder {
        let arrays = self.arrays.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        Builder::new(Mode::Load, arrays, None)
    }
}

/// Builds (or creates the arrays of) the stacks and, with `model`, the embedders and heads.
fn build(builder: &Builder, config: &EvoformerConfig, model: Option<&ModelConfig>) -> Result<()> {
    EvoformerStack::build(builder, config, false)?;
    if config.num_extra_blocks > 0 {
        EvoformerStack::build(builder, config, true)?;
    }
    if let Some(model) = model {
        Embedders::build(builder, config, model)?;
        Heads::build(builder, config, model)?;
        if let Some(t) = &model.templates {
            Templates::build(builder, t, config.c_z, config.c_m)?;
        }
        StructureModule::build(builder, &model.structure)?;
    }
    Ok(())
}

/// Copies every array of an `.npz` or `.safetensors` parameter file into the other format (by
/// the extensions), names, kinds and values unchanged, including arrays the model does not
/// read (template stacks); returns the number of arrays.
pub fn convert(input: &Path, output: &Path) -> Result<usize> {
    let arrays = read_arrays(input)?;
    write_arrays(&arrays, output)?;
    Ok(arrays.len())
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
fn read_arrays(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let file = path.display().to_string();
    if is_safetensors(path) {
        let map = data::checkpoint::read_tensors(path).map_err(|e| Error::Invalid(format!("{e}")))?;
        return Ok(map.into_iter().collect());
    }
    Tensor::read_npz(path).map_err(|source| Error::File { path: file, source })
}

fn with_file(e: Error, file: &str) -> Error {
    match e {
        Error::Missing { key, .. } => Error::Missing { key, file: Some(file.into()) },
        Error::Shape { key, expected, found, .. } => Error::Shape { key, expected, found, file: Some(file.into()) },
        other => other,
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Look arrays up and check their shapes.
    Load,
    /// Create arrays that are absent.
    Init,
}

/// The arrays being read (or created) while modules are built, and which keys were used.
pub(crate) struct Builder {
    mode: Mode,
    arrays: RefCell<BTreeMap<String, Tensor>>,
    used: RefCell<BTreeSet<String>>,
    file: Option<String>,
}

impl Builder {
    fn new(mode: Mode, arrays: BTreeMap<String, Tensor>, file: Option<String>) -> Builder {
        Builder { mode, arrays: RefCell::new(arrays), used: RefCell::new(BTreeSet::new()), file }
    }

    /// Keys under `prefix` that no module asked for.
    pub(crate) fn unused_under(&self, prefix: &str) -> Vec<String> {
        let used = self.used.borrow();
        self.arrays.borrow().keys().filter(|k| k.starts_with(prefix) && !used.contains(*k)).cloned().collect()
    }

    /// A scope at an unstacked module path (embedders, heads).
    pub(crate) fn root(&self, path: &str) -> Scope<'_> {
        Scope { builder: self, path: path.to_string(), block: None }
    }

    /// A scope at the root of a stack of `blocks` blocks, for block `index`.
    pub(crate) fn block(&self, path: &str, index: i64, blocks: i64) -> Scope<'_> {
        Scope { builder: self, path: path.to_string(), block: Some((index, blocks)) }
    }
}

/// A module path inside a [`Builder`] (haiku's module names joined by `/`).
pub struct Scope<'a> {
    builder: &'a Builder,
    path: String,
    /// (this block, blocks in the stack) when the arrays are stacked.
    block: Option<(i64, i64)>,
}

impl Scope<'_> {
    /// The sub-module `name`.
    pub fn sub(&self, name: &str) -> Self {
        Scope { builder: self.builder, path: format!("{}/{name}", self.path), block: self.block }
    }

    /// The array `name` of this module with per-block shape `shape`.
    pub fn param(&self, name: &str, shape: &[i64], init: Init) -> Result<Tensor> {
        let key = format!("{}//{name}", self.path);
        let full: Vec<i64> = match self.block {
            Some((_, n)) => std::iter::once(n).chain(shape.iter().copied()).collect(),
            None => shape.to_vec(),
        };
        let b = self.builder;
        let mut arrays = b.arrays.borrow_mut();
        if !arrays.contains_key(&key) {
            match b.mode {
                Mode::Load => return Err(Error::Missing { key, file: b.file.clone() }),
                Mode::Init => {
                    arrays.insert(key.clone(), draw(&full, init)?);
                }
            }
        }
        let t = &arrays[&key];
        if t.size() != full {
            return Err(Error::Shape { key, expected: full, found: t.size(), file: b.file.clone() });
        }
        let out = match self.block {
            Some((i, _)) => t.f_select(0, i)?,
            None => t.shallow_clone(),
        };
        b.used.borrow_mut().insert(key);
        Ok(out)
    }
}

fn draw(shape: &[i64], init: Init) -> Result<Tensor> {
    let opts = (Kind::Float, Device::Cpu);
    let n = Tensor::f_randn(shape, opts)?;
    Ok(match init {
        Init::Weight { fan_in } => n.f_mul_scalar(1.0 / (fan_in.max(1) as f64).sqrt())?,
        Init::Small => n.f_mul_scalar(0.1)?,
        Init::One => n.f_mul_scalar(0.1)?.f_add_scalar(1.0)?,
    })
}
