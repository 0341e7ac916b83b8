//! diffusers' `UNet2DConditionModel`, the noise predictor of Stable Diffusion 1.x, 2.x and XL,
//! with diffusers' parameter names so `unet/diffusion_pytorch_model.safetensors` loads by name:
//! `conv_in`, `time_embedding.linear_{1,2}`, SDXL's `add_embedding.linear_{1,2}`,
//! `down_blocks.*`, `mid_block.*`, `up_blocks.*`, `conv_norm_out`, `conv_out`. Each down, mid and up block can be run under activation
//! checkpointing (`engine::autograd::checkpoint`) to trade compute for memory in fine-tuning.
mod blocks;
pub(crate) mod resnet;
mod transformer;

use std::path::Path;
use std::sync::{Arc, Mutex};

use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

use crate::config::{TextTimeConfig, UNetConfig, UNetConfigFile};
use crate::weights::{self, ComponentFiles};
use crate::{Error, Result};
use blocks::{Attention, DownBlock, MidBlock, Shared, UpBlock, UpWidths};
use resnet::{conv3x3, group_norm};

/// Sinusoidal embedding `[B, dim]` of timesteps `[B]` (DDPM's, as diffusers'
/// `get_timestep_embedding` with scale 1 and period 10000): frequencies
/// `exp(-ln(10000) i / (dim/2 - shift))`, `sin` then `cos` (`cos` first when `flip_sin_to_cos`).
/// Computed in float32 whatever the model's precision.
pub fn timestep_embedding(timesteps: &Tensor, dim: i64, flip_sin_to_cos: bool, shift: f64) -> Tensor {
    let half = dim / 2;
    let opts = (Kind::Float, timesteps.device());
    let freqs = (Tensor::arange(half, opts) * (-(10000f64.ln()) / (half as f64 - shift))).exp();
    let args = timesteps.to_kind(Kind::Float).unsqueeze(1) * freqs.unsqueeze(0);
    let (sin, cos) = (args.sin(), args.cos());
    let emb = if flip_sin_to_cos { Tensor::cat(&[cos, sin], 1) } else { Tensor::cat(&[sin, cos], 1) };
    if dim % 2 == 1 {
        emb.constant_pad_nd([0, 1])
    } else {
        emb
    }
}

/// SDXL's added conditions (diffusers' `added_cond_kwargs`).
#[derive(Debug)]
pub struct TextTime {
    /// The second text encoder's pooled projection `[B, pooled]`.
    pub text_embeds: Tensor,
    /// Original size, crop top-left and target size, `[B, 6]` (height before width).
    pub time_ids: Tensor,
}

/// What the UNet is conditioned on besides the noisy sample and the timestep.
#[derive(Debug)]
pub struct Conditioning {
    /// The text encoder's hidden states `[B, tokens, cross_attention_dim]`.
    pub context: Tensor,
    /// SDXL's added conditions; `None` for SD 1.x/2.x.
    pub text_time: Option<TextTime>,
}

impl Conditioning {
    /// Text states alone (SD 1.x/2.x).
    pub fn text(context: Tensor) -> Conditioning {
        Conditioning { context, text_time: None }
    }

    /// Rows of `parts` one after the other (classifier-free guidance's negative then positive).
    pub fn cat(parts: &[&Conditioning]) -> Result<Conditioning> {
        let context = Tensor::f_cat(&parts.iter().map(|c| &c.context).collect::<Vec<_>>(), 0)?;
        let text_time = match parts.iter().map(|c| c.text_time.as_ref()).collect::<Option<Vec<_>>>() {
            Some(tt) if !tt.is_empty() => Some(TextTime {
                text_embeds: Tensor::f_cat(&tt.iter().map(|t| &t.text_embeds).collect::<Vec<_>>(), 0)?,
                time_ids: Tensor::f_cat(&tt.iter().map(|t| &t.time_ids).collect::<Vec<_>>(), 0)?,
            }),
            _ => None,
        };
        Ok(Conditioning { context, text_time })
    }

    /// The same in `kind` (the time ids stay float32: they are embedded in float32).
    pub fn to_kind(&self, kind: Kind) -> Result<Conditioning> {
        Ok(Conditioning {
            context: self.context.f_to_kind(kind)?,
            text_time: match &self.text_time {
                Some(t) => Some(TextTime {
                    text_embeds: t.text_embeds.f_to_kind(kind)?,
                    time_ids: t.time_ids.f_to_kind(Kind::Float)?,
                }),
                None => None,
            },
        })
    }
}

/// SDXL's `add_embedding` (see [`TextTimeConfig`]).
#[derive(Debug)]
struct AddEmbedding {
    cfg: TextTimeConfig,
    linear_1: nn::Linear,
    linear_2: nn::Linear,
}

impl AddEmbedding {
    /// The input of `add_embedding`: the pooled text and each time id's sinusoidal embedding
    /// (`add_time_proj`, the timestep embedding's frequencies), in `kind`.
    fn input(&self, added: &TextTime, flip: bool, shift: f64, kind: Kind) -> Result<Tensor> {
        let (b, ids) = (added.time_ids.size()[0], added.time_ids.size()[1]);
        let time = timestep_embedding(&added.time_ids.f_flatten(0, -1)?, self.cfg.time_embed_dim, flip, shift)
            .f_reshape([b, ids * self.cfg.time_embed_dim])?;
        Ok(Tensor::f_cat(&[added.text_embeds.f_to_kind(Kind::Float)?, time], -1)?.f_to_kind(kind)?)
    }
}

/// A block shared with the checkpointed segment that may recompute it during backward.
type SharedBlock<B> = Arc<Mutex<B>>;

/// The conditional UNet: `forward(noisy latents, timesteps, text states) -> predicted noise`.
#[derive(Debug)]
pub struct UNet2DConditionModel {
    cfg: UNetConfig,
    conv_in: nn::Conv2D,
    linear_1: nn::Linear,
    linear_2: nn::Linear,
    add_embedding: Option<AddEmbedding>,
    down_blocks: Vec<SharedBlock<DownBlock>>,
    mid_block: SharedBlock<MidBlock>,
    up_blocks: Vec<SharedBlock<UpBlock>>,
    conv_norm_out: nn::GroupNorm,
    conv_out: nn::Conv2D,
    checkpointing: bool,
}

impl UNet2DConditionModel {
    /// Creates the parameters under `p` (the root of a VarStore, for diffusers' key names).
    pub fn new(p: &nn::Path, cfg: &UNetConfig) -> UNet2DConditionModel {
        let s = Shared::new(cfg);
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        let c0 = ch[0];
        let down = p / "down_blocks";
        let down_blocks = (0..n)
            .map(|i| {
                let cin = if i == 0 { c0 } else { ch[i - 1] };
                let attention =
                    cfg.down_attention[i].then_some(Attention { heads: cfg.heads[i], depth: cfg.down_depth[i] });
                let block = DownBlock::new(&down / i, &s, cin, ch[i], cfg.layers_per_block, attention, i == n - 1);
                Arc::new(Mutex::new(block))
            })
            .collect();
        let mid = Attention { heads: cfg.heads[n - 1], depth: cfg.down_depth[n - 1] };
        let mid_block = Arc::new(Mutex::new(MidBlock::new(p / "mid_block", &s, ch[n - 1], mid)));
        let up = p / "up_blocks";
        let up_blocks = (0..n)
            .map(|i| {
                // Up block i works at level n-1-i; its last resnet takes the skip from the
                // level below (the down path's first state at the top level).
                let level = n - 1 - i;
                let widths =
                    UpWidths { prev: ch[(level + 1).min(n - 1)], out: ch[level], skip_in: ch[level.saturating_sub(1)] };
                let attention =
                    cfg.up_attention[i].then_some(Attention { heads: cfg.heads[level], depth: cfg.up_depth[i] });
                let block = UpBlock::new(&up / i, &s, widths, cfg.layers_per_block + 1, attention, i == n - 1);
                Arc::new(Mutex::new(block))
            })
            .collect();
        UNet2DConditionModel {
            conv_in: conv3x3(p / "conv_in", cfg.in_channels, c0, 1),
            linear_1: nn::linear(p / "time_embedding" / "linear_1", c0, s.temb, Default::default()),
            linear_2: nn::linear(p / "time_embedding" / "linear_2", s.temb, s.temb, Default::default()),
            add_embedding: cfg.text_time.as_ref().map(|tt| AddEmbedding {
                cfg: tt.clone(),
                linear_1: nn::linear(p / "add_embedding" / "linear_1", tt.input_dim, s.temb, Default::default()),
                linear_2: nn::linear(p / "add_embedding" / "linear_2", s.temb, s.temb, Default::default()),
            }),
            down_blocks,
            mid_block,
            up_blocks,
            conv_norm_out: group_norm(p / "conv_norm_out", cfg.norm_num_groups, c0, cfg.norm_eps),
            conv_out: conv3x3(p / "conv_out", c0, cfg.out_channels, 1),
            cfg: cfg.clone(),
            checkpointing: false,
        }
    }

    /// Reads the config and weights of a diffusers `unet` folder into a new VarStore on
    /// `device` (see [`weights::load_into`] for what is checked).
    pub fn load(files: &ComponentFiles, device: Device) -> Result<(VarStore, UNet2DConditionModel)> {
        let file: UNetConfigFile = crate::config::read_json(&files.config)?;
        let cfg = UNetConfig::new(&file, &files.config)?;
        let vs = VarStore::new(device);
        let model = UNet2DConditionModel::new(&vs.root(), &cfg);
        weights::load_into(&vs, &files.weights, |_| None)?;
        Ok((vs, model))
    }

    /// Writes `dir/config.json` and `dir/diffusion_pytorch_model.safetensors` (float32, the
    /// variables of `vs`, which must hold this model at its root) as diffusers'
    /// `save_pretrained` lays them out, so `UNet2DConditionModel.from_pretrained(dir)` loads it.
    pub fn save(&self, vs: &VarStore, dir: &Path) -> Result<()> {
        weights::save_component(vs, &self.cfg.source, "UNet2DConditionModel", dir)
    }

    /// The architecture.
    pub fn config(&self) -> &UNetConfig {
        &self.cfg
    }

    /// Runs each down, mid and up block under activation checkpointing when gradients are
    /// recorded: its activations are recomputed in backward instead of kept. Parameter
    /// gradients then reach `.grad` through `backward` (not `Tensor::run_backward` on inputs).
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }

    /// Calls `f` on every attention module (down, mid, up), e.g. to put LoRA adapters on them.
    pub fn visit_attentions(&self, f: &mut dyn FnMut(&mut crate::attention::Attention)) -> Result<()> {
        for b in &self.down_blocks {
            b.lock().map_err(|_| poisoned())?.visit_attentions(f);
        }
        self.mid_block.lock().map_err(|_| poisoned())?.visit_attentions(f);
        for b in &self.up_blocks {
            b.lock().map_err(|_| poisoned())?.visit_attentions(f);
        }
        Ok(())
    }

    /// Predicted noise `[B, out_channels, H, W]` for `sample` `[B, in_channels, H, W]` at
    /// `timesteps` (`[B]`, or one for the whole batch) given `encoder_hidden_states`
    /// `[B, L, cross_attention_dim]`. H and W must be multiples of 2^(levels-1).
    /// SDXL's UNet needs [`UNet2DConditionModel::forward_cond`].
    pub fn forward(&self, sample: &Tensor, timesteps: &Tensor, encoder_hidden_states: &Tensor) -> Result<Tensor> {
        self.forward_with(sample, timesteps, &Conditioning::text(encoder_hidden_states.shallow_clone()), &Direct)
    }

    /// [`UNet2DConditionModel::forward`] with SDXL's added conditions where the model has them.
    pub fn forward_cond(&self, sample: &Tensor, timesteps: &Tensor, cond: &Conditioning) -> Result<Tensor> {
        self.forward_with(sample, timesteps, cond, &Direct)
    }

    /// The parameter-name prefixes of each part of the model, in the order the forward runs
    /// them: `time_embedding` (with SDXL's `add_embedding`), `conv_in`, `down_blocks.i`, `mid_block`, `up_blocks.i`, and the
    /// head (`conv_norm_out`, `conv_out`).
    pub fn parts(&self) -> Vec<Vec<String>> {
        let n = self.down_blocks.len();
        let mut time = vec!["time_embedding".to_string()];
        if self.add_embedding.is_some() {
            time.push("add_embedding".to_string());
        }
        let mut parts = vec![time, vec!["conv_in".to_string()]];
        parts.extend((0..n).map(|i| vec![format!("down_blocks.{i}")]));
        parts.push(vec!["mid_block".to_string()]);
        parts.extend((0..n).map(|i| vec![format!("up_blocks.{i}")]));
        parts.push(vec!["conv_norm_out".to_string(), "conv_out".to_string()]);
        parts
    }

    /// [`UNet2DConditionModel::forward`] with each part (see [`UNet2DConditionModel::parts`])
    /// run through `runner`.
    pub fn forward_with(
        &self,
        sample: &Tensor,
        timesteps: &Tensor,
        cond: &Conditioning,
        runner: &dyn PartRunner,
    ) -> Result<Tensor> {
        let encoder_hidden_states = &cond.context;
        let (b, timesteps) = self.check_inputs(sample, timesteps, encoder_hidden_states)?;
        let added = self.check_added(b, cond)?;
        let timesteps = timesteps.to_device(sample.device()).reshape([-1]).expand([b], false);
        let emb = timestep_embedding(
            &timesteps,
            self.cfg.block_out_channels[0],
            self.cfg.flip_sin_to_cos,
            self.cfg.freq_shift,
        )
        .to_kind(sample.kind());
        let one = |outs: Vec<Tensor>| {
            outs.into_iter().next().ok_or_else(|| Error::Invalid("a UNet part returned no output".into()))
        };
        // Parts are numbered in the order they run.
        let part = std::cell::Cell::new(0);
        let next = || part.replace(part.get() + 1);
        let time_mlp = |l1: &nn::Linear, l2: &nn::Linear, x: &Tensor| l2.forward(&l1.forward(x).silu());
        let temb = match (&self.add_embedding, added) {
            (Some(add), Some(added)) => {
                let input = add.input(added, self.cfg.flip_sin_to_cos, self.cfg.freq_shift, sample.kind())?;
                one(runner.run(next(), &[&emb, &input], &|x| {
                    let aug = time_mlp(&add.linear_1, &add.linear_2, &x[1]);
                    Ok(vec![time_mlp(&self.linear_1, &self.linear_2, &x[0]) + aug])
                })?)?
            }
            _ => one(runner.run(next(), &[&emb], &|x| Ok(vec![time_mlp(&self.linear_1, &self.linear_2, &x[0])]))?)?,
        };
        let ctx = encoder_hidden_states;
        let mut h = one(runner.run(next(), &[sample], &|x| Ok(vec![self.conv_in.forward(&x[0])]))?)?;
        let mut skips = vec![h.shallow_clone()];
        for block in &self.down_blocks {
            let outs = runner
                .run(next(), &[&h, &temb, ctx], &|x| self.run(block, x, |b, x| b.forward(&x[0], &x[1], &x[2])))?;
            h = outs.last().map(Tensor::shallow_clone).unwrap_or(h);
            skips.extend(outs);
        }
        h = one(runner.run(next(), &[&h, &temb, ctx], &|x| {
            self.run(&self.mid_block, x, |b, x| vec![b.forward(&x[0], &x[1], &x[2])])
        })?)?;
        for block in &self.up_blocks {
            let layers = block.lock().map_err(|_| poisoned())?.layers();
            let mut taken = skips.split_off(skips.len().saturating_sub(layers));
            taken.reverse();
            let mut inputs = vec![&h, &temb, ctx];
            inputs.extend(taken.iter());
            h = one(runner.run(next(), &inputs, &|x| {
                self.run(block, x, |b, x| vec![b.forward(&x[0], &x[3..], &x[1], &x[2])])
            })?)?;
        }
        one(runner
            .run(next(), &[&h], &|x| Ok(vec![self.conv_out.forward(&self.conv_norm_out.forward(&x[0]).silu())]))?)
    }

    /// Checks shapes; returns the batch size and the timesteps.
    fn check_inputs<'a>(&self, sample: &Tensor, timesteps: &'a Tensor, ctx: &Tensor) -> Result<(i64, &'a Tensor)> {
        let c = &self.cfg;
        let s = sample.size();
        let factor = 1i64 << (c.block_out_channels.len() - 1);
        if s.len() != 4 || s[1] != c.in_channels || s[2] % factor != 0 || s[3] % factor != 0 {
            return Err(Error::Invalid(format!(
                "UNet sample has shape {s:?}, expected [batch, {}, H, W] with H and W multiples of {factor}",
                c.in_channels
            )));
        }
        let e = ctx.size();
        if e.len() != 3 || e[0] != s[0] || e[2] != c.cross_attention_dim {
            return Err(Error::Invalid(format!(
                "UNet encoder_hidden_states have shape {e:?}, expected [{}, tokens, {}]",
                s[0], c.cross_attention_dim
            )));
        }
        let n = timesteps.numel() as i64;
        if timesteps.dim() > 1 || (n != 1 && n != s[0]) {
            return Err(Error::Invalid(format!(
                "UNet timesteps have shape {:?}, expected [{}] or a scalar",
                timesteps.size(),
                s[0]
            )));
        }
        Ok((s[0], timesteps))
    }

    /// Checks SDXL's added conditions: present with the right shapes exactly when the model
    /// has `add_embedding`.
    fn check_added<'a>(&self, b: i64, cond: &'a Conditioning) -> Result<Option<&'a TextTime>> {
        match (&self.add_embedding, &cond.text_time) {
            (None, None) => Ok(None),
            (None, Some(_)) => {
                Err(Error::Invalid("text_embeds and time_ids given to a UNet without addition_embed_type".into()))
            }
            (Some(_), None) => Err(Error::Invalid(
                "this UNet (addition_embed_type \"text_time\", SDXL) needs text_embeds and time_ids".into(),
            )),
            (Some(add), Some(tt)) => {
                let (t, p) = (tt.time_ids.size(), tt.text_embeds.size());
                let ids = t.get(1).copied().unwrap_or(0);
                let pooled = add.cfg.pooled_dim(ids);
                if t.len() != 2 || t[0] != b || ids <= 0 || p != [b, pooled] {
                    return Err(Error::Invalid(format!(
                        "UNet added conditions: time_ids {t:?} and text_embeds {p:?}; expected [{b}, ids] and \
                         [{b}, pooled] with pooled + ids * {} = projection_class_embeddings_input_dim {}",
                        add.cfg.time_embed_dim, add.cfg.input_dim
                    )));
                }
                Ok(Some(tt))
            }
        }
    }

    /// Runs `f` on `block`, under checkpointing when it is on and gradients flow.
    fn run<B: Send + 'static>(
        &self,
        block: &SharedBlock<B>,
        inputs: &[Tensor],
        f: fn(&B, &[Tensor]) -> Vec<Tensor>,
    ) -> Result<Vec<Tensor>> {
        if self.checkpointing && inputs.iter().any(Tensor::requires_grad) {
            let block = block.clone();
            let refs: Vec<&Tensor> = inputs.iter().collect();
            let outs = engine::autograd::checkpoint(&refs, move |x| {
                let b = block.lock().map_err(|_| engine::Error::invalid(poisoned().to_string()))?;
                Ok(f(&b, x))
            })?;
            return Ok(outs);
        }
        let b = block.lock().map_err(|_| poisoned())?;
        Ok(f(&b, inputs))
    }
}

/// How the UNet runs its parts (see [`UNet2DConditionModel::parts`]): directly, or under a
/// parameter manager such as Gemini that makes a part's parameters resident around it.
pub trait PartRunner {
    /// Runs part number `part` as `f(inputs)`. `inputs[0]` is the part's main path: its
    /// gradient is the last the part's backward produces.
    fn run(&self, part: usize, inputs: &[&Tensor], f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>)
        -> Result<Vec<Tensor>>;
}

/// Runs every part as it is.
pub struct Direct;

impl PartRunner for Direct {
    fn run(
        &self,
        _part: usize,
        inputs: &[&Tensor],
        f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        f(&inputs.iter().map(|t| t.shallow_clone()).collect::<Vec<_>>())
    }
}

fn poisoned() -> Error {
    Error::Invalid("a UNet block panicked in an earlier call; rebuild the model".into())
}
