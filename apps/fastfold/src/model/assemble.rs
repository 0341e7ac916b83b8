//! Creating and loading a whole [`Params`] store. Both build every module over the arrays (an
//! initialising builder draws the arrays the modules ask for; a loading one checks each shape
//! and then that no array under a module's prefix went unused), so this file sits above every
//! module, while the store itself ([`crate::model::params`]) sits below them.
use std::collections::BTreeMap;
use std::path::Path;

use tch::Kind;

use crate::model::config::{EvoformerConfig, ModelConfig};
use crate::model::embedders::Embedders;
use crate::model::evoformer::EvoformerStack;
use crate::model::heads::Heads;
use crate::model::keys::{EVOFORMER, EXTRA_MSA, MULTIMER_RELATIVE_ENCODING};
use crate::model::params::{read_arrays, Params};
use crate::model::scope::{Builder, Mode};
use crate::model::structure::{StructureModule, Variant};
use crate::model::templates::Templates;
use crate::model::{Error, Result};

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
        engine::random::seeded(seed, || {
            let builder = Builder::new(Mode::Init, BTreeMap::new(), None);
            build(&builder, config, model)?;
            Ok(Params::from_parts(builder.into_used(), *config))
        })
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

    /// As [`Params::load_model_npz`], from AlphaFold's `.npz` or from a `.safetensors` file
    /// under the same names (what `fastfold convert` writes), by extension.
    pub fn load_model(path: impl AsRef<Path>) -> Result<Params> {
        Self::load(path.as_ref(), true)
    }

    fn load(path: &Path, with_model: bool) -> Result<Params> {
        let file = path.display().to_string();
        let arrays = read_arrays(path)?;
        if arrays.iter().any(|(n, _)| n == MULTIMER_RELATIVE_ENCODING) {
            return Err(Error::Invalid(format!(
                "{file} holds AlphaFold-Multimer's parameters, which the monomer network cannot load: name the \
                 file as its release is named (params_model_N_multimer_v3.npz) for fastfold predict to run it as \
                 AlphaFold-Multimer"
            )));
        }
        let mut map = BTreeMap::new();
        for (name, t) in arrays {
            let t = if t.kind() == Kind::Float { t } else { t.f_to_kind(Kind::Float)? };
            // A NaN weight would only surface as NaN coordinates at the PDB writer.
            if !bool::try_from(t.f_isfinite()?.f_all()?)? {
                return Err(Error::Invalid(format!("parameter {name} has NaN or infinite values (in {file})")));
            }
            map.insert(name, t);
        }
        let config = EvoformerConfig::infer(&map).map_err(|e| with_file(e, &file))?;
        let model = match with_model {
            true => Some(ModelConfig::infer(&map).map_err(|e| with_file(e, &file))?),
            false => None,
        };
        let builder = Builder::new(Mode::Load, map, Some(file.clone()));
        build(&builder, &config, model.as_ref())?;
        // Optional modules (templates, the PAE head) are built when their first array is there,
        // so a file missing one of their others would drop the module silently: with the model,
        // every array of the file must have a user.
        let checked = match model {
            Some(_) => vec![String::new()],
            None => vec![format!("{EVOFORMER}/"), format!("{EXTRA_MSA}/")],
        };
        for prefix in checked {
            let unused = builder.unused_under(&prefix);
            if !unused.is_empty() {
                return Err(Error::Invalid(format!(
                    "{file}: {} arrays no module uses (is an array of their module missing?): {:?}",
                    unused.len(),
                    &unused[..unused.len().min(8)]
                )));
            }
        }
        Ok(Params::from_parts(builder.into_used(), config))
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
        StructureModule::build(builder, &model.structure, Variant::Monomer)?;
    }
    Ok(())
}

fn with_file(e: Error, file: &str) -> Error {
    match e {
        Error::Missing { key, .. } => Error::Missing { key, file: Some(file.into()) },
        Error::Shape { key, expected, found, .. } => Error::Shape { key, expected, found, file: Some(file.into()) },
        other => Error::Invalid(format!("{file}: {other}")),
    }
}
