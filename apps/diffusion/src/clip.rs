//! CLIP's text encoder with transformers' `CLIPTextModel` key names (and
//! `CLIPTextModelWithProjection`'s `text_projection`, SDXL's second encoder), so a diffusers
//! `text_encoder/` folder (`config.json` + `model.safetensors`) loads by name:
//! `text_model.embeddings.{token,position}_embedding`,
//! `text_model.encoder.layers.{i}.{self_attn.{q,k,v,out}_proj,layer_norm1,layer_norm2,mlp.fc1,mlp.fc2}`,
//! `text_model.final_layer_norm`. Pre-norm blocks with a causal mask; the activation is
//! `quick_gelu` (SD 1.x) or `gelu` (SD 2.x) as `hidden_act` says.
//!
//! Files come in two layouts ([`KeyLayout`]): every key under `text_model.` (transformers 4,
//! and transformers 5 when it saves a model it loaded from such a file), or the same keys
//! without that prefix (transformers 5 saving a `CLIPTextModel` it created). Both load; files
//! this crate writes use the prefixed layout, which every transformers version loads.
use std::path::Path;

use serde::Deserialize;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use crate::config::read_json;
use crate::error::{Error, Result};
use crate::weights::{ComponentFiles, TRANSFORMERS_STEM};

/// `text_encoder/config.json` as transformers writes it (`CLIPTextConfig`); other keys are ignored.
#[derive(Clone, Debug, Deserialize)]
pub struct ClipTextConfigFile {
    /// Vocabulary entries.
    pub vocab_size: i64,
    /// Embedding width.
    pub hidden_size: i64,
    /// MLP hidden width.
    pub intermediate_size: i64,
    /// Transformer layers.
    pub num_hidden_layers: i64,
    /// Attention heads.
    pub num_attention_heads: i64,
    /// Positions (77 for SD's CLIP).
    pub max_position_embeddings: i64,
    /// `quick_gelu` or `gelu`.
    pub hidden_act: String,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// The end-of-text id the pooled output is taken at (2 means "the largest id", an old config).
    pub eos_token_id: Option<i64>,
    /// Width of `text_projection` (`CLIPTextModelWithProjection` only).
    #[serde(default)]
    pub projection_dim: Option<i64>,
}

/// The MLP activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(1.702 x)`, OpenAI CLIP's (SD 1.x).
    QuickGelu,
    /// Exact (erf) GELU (OpenCLIP ViT-H, SD 2.x).
    Gelu,
}

/// A validated text-encoder architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipTextConfig {
    /// Vocabulary entries.
    pub vocab_size: i64,
    /// Embedding width.
    pub hidden_size: i64,
    /// MLP hidden width.
    pub intermediate_size: i64,
    /// Transformer layers.
    pub num_layers: usize,
    /// Attention heads.
    pub heads: i64,
    /// Positions.
    pub max_positions: i64,
    /// MLP activation.
    pub activation: Activation,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// The end-of-text id (`None` or 2: pool at the largest id, as old configs did).
    pub eos_token_id: Option<i64>,
    /// Width of `text_projection` (`CLIPTextModelWithProjection`).
    pub projection_dim: Option<i64>,
}

impl ClipTextConfig {
    /// Reads and validates a `config.json`; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<ClipTextConfig> {
        let raw: ClipTextConfigFile = read_json(path)?;
        Self::from_raw(&raw).map_err(|msg| Error::Format { path: path.to_path_buf(), msg })
    }

    /// Validates the file's numbers; the message names the offending key.
    pub fn from_raw(raw: &ClipTextConfigFile) -> std::result::Result<ClipTextConfig, String> {
        let activation = match raw.hidden_act.as_str() {
            "quick_gelu" => Activation::QuickGelu,
            "gelu" => Activation::Gelu,
            other => return Err(format!("hidden_act {other:?} is not quick_gelu or gelu")),
        };
        let positive = [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("max_position_embeddings", raw.max_position_embeddings),
        ];
        if let Some((key, v)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(format!("{key} is {v}, expected a positive integer"));
        }
        if raw.hidden_size % raw.num_attention_heads != 0 {
            return Err(format!(
                "hidden_size {} does not split into num_attention_heads {}",
                raw.hidden_size, raw.num_attention_heads
            ));
        }
        Ok(ClipTextConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers as usize,
            heads: raw.num_attention_heads,
            max_positions: raw.max_position_embeddings,
            activation,
            layer_norm_eps: raw.layer_norm_eps,
            eos_token_id: raw.eos_token_id,
            projection_dim: raw.projection_dim,
        })
    }
}

#[derive(Debug)]
struct Attention {
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    out_proj: nn::Linear,
    heads: i64,
}

impl Attention {
    fn new(p: nn::Path, width: i64, heads: i64) -> Attention {
        let lin = |name: &str| nn::linear(&p / name, width, width, Default::default());
        Attention {
            q_proj: lin("q_proj"),
            k_proj: lin("k_proj"),
            v_proj: lin("v_proj"),
            out_proj: lin("out_proj"),
            heads,
        }
    }

    /// `mask`: `None` for plain causal attention, else a boolean `[b, 1, n, n]` (true attends).
    fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let (b, n, d) = x.size3().expect("checked by ClipTextModel::check_ids");
        let split = |t: Tensor| t.reshape([b, n, self.heads, d / self.heads]).transpose(1, 2);
        let (q, k, v) = (split(self.q_proj.forward(x)), split(self.k_proj.forward(x)), split(self.v_proj.forward(x)));
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, mask, 0.0, mask.is_none(), None, false);
        self.out_proj.forward(&out.transpose(1, 2).reshape([b, n, d]))
    }
}

#[derive(Debug)]
struct EncoderLayer {
    layer_norm1: nn::LayerNorm,
    self_attn: Attention,
    layer_norm2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    activation: Activation,
}

impl EncoderLayer {
    fn new(p: nn::Path, cfg: &ClipTextConfig) -> EncoderLayer {
        let (w, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        let ln = |name: &str| nn::layer_norm(&p / name, vec![w], nn::LayerNormConfig { eps, ..Default::default() });
        EncoderLayer {
            layer_norm1: ln("layer_norm1"),
            self_attn: Attention::new(&p / "self_attn", w, cfg.heads),
            layer_norm2: ln("layer_norm2"),
            fc1: nn::linear(&p / "mlp" / "fc1", w, cfg.intermediate_size, Default::default()),
            fc2: nn::linear(&p / "mlp" / "fc2", cfg.intermediate_size, w, Default::default()),
            activation: cfg.activation,
        }
    }

    fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let x = x + self.self_attn.forward(&self.layer_norm1.forward(x), mask);
        let h = self.fc1.forward(&self.layer_norm2.forward(&x));
        let h = match self.activation {
            Activation::QuickGelu => &h * (&h * 1.702).sigmoid(),
            Activation::Gelu => h.gelu("none"),
        };
        x + self.fc2.forward(&h)
    }
}

/// CLIP's text transformer (see the module docs).
#[derive(Debug)]
pub struct ClipTextModel {
    token_embedding: nn::Embedding,
    position_embedding: nn::Embedding,
    layers: Vec<EncoderLayer>,
    final_layer_norm: nn::LayerNorm,
    /// `CLIPTextModelWithProjection`'s `text_projection` (no bias).
    text_projection: Option<nn::Linear>,
    cfg: ClipTextConfig,
    layout: KeyLayout,
}

/// Keys a `CLIPTextModel` file may hold that are buffers, not parameters.
const BUFFER_KEYS: [&str; 1] = ["text_model.embeddings.position_ids"];

/// The prefix of every key in transformers 4's layout.
const PREFIX: &str = "text_model.";

/// How a text-encoder file names its keys (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLayout {
    /// `text_model.embeddings...`: transformers 4 (and diffusers' files).
    Prefixed,
    /// `embeddings...`: transformers 5's `CLIPTextModel.save_pretrained` of a new model.
    Bare,
}

impl KeyLayout {
    /// The layout of a file's keys, from where its token embedding is; `None` when it has none.
    fn detect<'a>(mut keys: impl Iterator<Item = &'a String>) -> Option<KeyLayout> {
        let token = "embeddings.token_embedding.weight";
        keys.find_map(|k| match k.strip_prefix(PREFIX) {
            Some(rest) if rest == token => Some(KeyLayout::Prefixed),
            None if k == token => Some(KeyLayout::Bare),
            _ => None,
        })
    }
}

impl std::fmt::Display for KeyLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KeyLayout::Prefixed => "keys under text_model. (transformers 4 layout)",
            KeyLayout::Bare => "keys without the text_model. prefix (transformers 5 layout)",
        })
    }
}

impl ClipTextModel {
    /// Builds the model under `p` (the root of its variable store), randomly initialised.
    pub fn new(p: &nn::Path, cfg: &ClipTextConfig) -> ClipTextModel {
        let t = p / "text_model";
        let emb = &t / "embeddings";
        let w = cfg.hidden_size;
        ClipTextModel {
            token_embedding: nn::embedding(&emb / "token_embedding", cfg.vocab_size, w, Default::default()),
            position_embedding: nn::embedding(&emb / "position_embedding", cfg.max_positions, w, Default::default()),
            layers: (0..cfg.num_layers).map(|i| EncoderLayer::new(&t / "encoder" / "layers" / i, cfg)).collect(),
            final_layer_norm: nn::layer_norm(
                &t / "final_layer_norm",
                vec![w],
                nn::LayerNormConfig { eps: cfg.layer_norm_eps, ..Default::default() },
            ),
            text_projection: None,
            cfg: cfg.clone(),
            layout: KeyLayout::Prefixed,
        }
    }

    /// transformers' `CLIPTextModelWithProjection` under `p`: the text model and
    /// `text_projection` (hidden to `projection_dim`, no bias), randomly initialised.
    pub fn new_with_projection(p: &nn::Path, cfg: &ClipTextConfig) -> Result<ClipTextModel> {
        let width = cfg.projection_dim.filter(|&d| d > 0).ok_or_else(|| {
            Error::Invalid("CLIPTextModelWithProjection needs a positive projection_dim in its config".into())
        })?;
        let mut model = ClipTextModel::new(p, cfg);
        let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
        model.text_projection = Some(nn::linear(p / "text_projection", cfg.hidden_size, width, no_bias));
        Ok(model)
    }

    /// Loads a diffusers `text_encoder/` folder (`config.json`, `model.safetensors` or its fp16
    /// variant or shards: see [`crate::weights`]) onto `device`.
    pub fn load(dir: &Path, device: Device) -> Result<(nn::VarStore, ClipTextModel)> {
        let files = ComponentFiles::with_stem(dir, TRANSFORMERS_STEM)?;
        Self::load_files(&files.config, &files.weights, device)
    }

    /// Loads a config and a weights file. A missing key or wrong shape is an error naming the
    /// file and key, and so is a key of the file that no parameter uses.
    pub fn load_files(config: &Path, weights: &Path, device: Device) -> Result<(nn::VarStore, ClipTextModel)> {
        Self::load_as(config, weights, device, false)
    }

    /// Loads a `CLIPTextModelWithProjection` folder (SDXL's `text_encoder_2/`): the text
    /// model and `text_projection.weight`.
    pub fn load_with_projection(dir: &Path, device: Device) -> Result<(nn::VarStore, ClipTextModel)> {
        let files = ComponentFiles::with_stem(dir, TRANSFORMERS_STEM)?;
        Self::load_as(&files.config, &files.weights, device, true)
    }

    fn load_as(
        config: &Path,
        weights: &Path,
        device: Device,
        projection: bool,
    ) -> Result<(nn::VarStore, ClipTextModel)> {
        let cfg = ClipTextConfig::from_file(config)?;
        let vs = nn::VarStore::new(device);
        let mut model = match projection {
            true => ClipTextModel::new_with_projection(&vs.root(), &cfg)
                .map_err(|e| Error::Format { path: config.to_path_buf(), msg: e.to_string() })?,
            false => ClipTextModel::new(&vs.root(), &cfg),
        };
        let mut file = crate::weights::read(weights)?;
        model.layout = KeyLayout::detect(file.keys()).ok_or_else(|| Error::Format {
            path: weights.to_path_buf(),
            msg: format!(
                "no token embedding: neither key {PREFIX}embeddings.token_embedding.weight nor embeddings.token_embedding.weight"
            ),
        })?;
        // The parameters under the file's names, so errors name keys as the file has them.
        let in_file = |k: &str| match model.layout {
            KeyLayout::Prefixed => k.to_owned(),
            KeyLayout::Bare => k.strip_prefix(PREFIX).unwrap_or(k).to_owned(),
        };
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(k, t)| (in_file(&k), t)).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        data::checkpoint::copy_into(&vars, &mut file, weights)?;
        let buffers: Vec<String> = BUFFER_KEYS.iter().map(|k| in_file(k)).collect();
        let mut unused: Vec<String> = file.into_keys().filter(|k| !buffers.contains(k)).collect();
        unused.sort();
        if !unused.is_empty() {
            return Err(Error::Format {
                path: weights.to_path_buf(),
                msg: format!("keys no CLIPTextModel parameter uses: {}", unused.join(", ")),
            });
        }
        Ok((vs, model))
    }

    /// The architecture.
    pub fn config(&self) -> &ClipTextConfig {
        &self.cfg
    }

    /// The key layout of the file the weights came from ([`KeyLayout::Prefixed`] when built).
    pub fn key_layout(&self) -> KeyLayout {
        self.layout
    }

    /// `last_hidden_state` `[b, n, hidden]` of int64 ids `[b, n]`; `attention_mask` (`[b, n]`,
    /// 1 keeps a token, 0 hides it from every query) joins the causal mask when given.
    pub fn forward(&self, ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.forward_skip(ids, attention_mask, 0)
    }

    /// diffusers' `clip_skip`: the output of layer `layers - clip_skip` through the final layer
    /// norm (`clip_skip` 0 is `last_hidden_state`; 1 is the penultimate layer).
    pub fn forward_skip(&self, ids: &Tensor, attention_mask: Option<&Tensor>, clip_skip: usize) -> Result<Tensor> {
        if clip_skip >= self.layers.len() {
            return Err(Error::Invalid(format!(
                "clip_skip {clip_skip} must be below the {} layers of the text encoder",
                self.layers.len()
            )));
        }
        let (b, n) = self.check_ids(ids)?;
        let positions = Tensor::f_arange(n, (Kind::Int64, ids.device()))?;
        let mut x = self.token_embedding.forward(ids) + self.position_embedding.forward(&positions).unsqueeze(0);
        let mask = match attention_mask {
            None => None,
            Some(m) => {
                if m.size() != [b, n] {
                    return Err(Error::Invalid(format!(
                        "attention mask has shape {:?}, expected [{b}, {n}]",
                        m.size()
                    )));
                }
                let causal = Tensor::f_ones([n, n], (Kind::Bool, ids.device()))?.f_tril(0)?;
                let keys = m.f_ne(0)?.f_view([b, 1, 1, n])?;
                Some(causal.f_logical_and(&keys)?)
            }
        };
        for layer in &self.layers[..self.layers.len() - clip_skip] {
            x = layer.forward(&x, mask.as_ref());
        }
        Ok(self.final_layer_norm.forward(&x))
    }

    /// `(last_hidden_state, hidden_states[-2])` as transformers returns them with
    /// `output_hidden_states=True`: the final layer norm's output, and the penultimate layer's
    /// output without it (what SDXL conditions on). No attention mask, as SDXL runs them.
    pub fn forward_penultimate(&self, ids: &Tensor) -> Result<(Tensor, Tensor)> {
        self.check_ids(ids)?;
        let n = ids.size()[1];
        let positions = Tensor::f_arange(n, (Kind::Int64, ids.device()))?;
        let mut x = self.token_embedding.forward(ids) + self.position_embedding.forward(&positions).unsqueeze(0);
        let last = self.layers.len() - 1;
        let mut penultimate = x.shallow_clone();
        for (i, layer) in self.layers.iter().enumerate() {
            if i == last {
                penultimate = x.shallow_clone();
            }
            x = layer.forward(&x, None);
        }
        Ok((self.final_layer_norm.forward(&x), penultimate))
    }

    /// `CLIPTextModelWithProjection`'s `text_embeds`: `text_projection` of the pooled output
    /// (see [`ClipTextModel::pooled`]); an error for a model without the projection.
    pub fn text_embeds(&self, ids: &Tensor, last_hidden: &Tensor) -> Result<Tensor> {
        let proj = self.text_projection.as_ref().ok_or_else(|| {
            Error::Invalid("this text encoder has no text_projection (not a CLIPTextModelWithProjection)".into())
        })?;
        Ok(proj.forward(&self.pooled(ids, last_hidden)?))
    }

    /// transformers' `pooler_output`: each row of `last_hidden` at the row's first end-of-text
    /// id (at its largest id when the config's eos id is absent or the legacy 2).
    pub fn pooled(&self, ids: &Tensor, last_hidden: &Tensor) -> Result<Tensor> {
        let (b, _) = self.check_ids(ids)?;
        let at = match self.cfg.eos_token_id {
            Some(eos) if eos != 2 => ids.f_eq(eos)?.f_to_kind(Kind::Int)?.f_argmax(-1, false)?,
            _ => ids.f_argmax(-1, false)?,
        };
        let rows = Tensor::f_arange(b, (Kind::Int64, ids.device()))?;
        Ok(last_hidden.f_index(&[Some(rows), Some(at)])?)
    }

    /// Checks `ids` is int64 `[b, n]` with `n` within the positions and ids within the vocabulary.
    fn check_ids(&self, ids: &Tensor) -> Result<(i64, i64)> {
        let size = ids.size();
        let (b, n) = match size[..] {
            [b, n] if n >= 1 && n <= self.cfg.max_positions && ids.kind() == Kind::Int64 => (b, n),
            _ => {
                return Err(Error::Invalid(format!(
                    "token ids must be int64 [batch, 1..={}], got {:?} {:?}",
                    self.cfg.max_positions,
                    ids.kind(),
                    size
                )))
            }
        };
        if b > 0 {
            let (lo, hi) = (ids.f_min()?.int64_value(&[]), ids.f_max()?.int64_value(&[]));
            if lo < 0 || hi >= self.cfg.vocab_size {
                return Err(Error::Invalid(format!(
                    "token ids span {lo}..={hi}, outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
        }
        Ok((b, n))
    }
}
