//! The structure module (supplementary 1.8, AlphaFold's `folding.py`) under AlphaFold's
//! parameter names (module path `alphafold/alphafold_iteration/structure_module`):
//!
//! | module | AlphaFold name |
//! |---|---|
//! | input norms and projection | `single_layer_norm`, `pair_layer_norm`, `initial_projection` |
//! | invariant point attention | `fold_iteration/invariant_point_attention/{q_scalar, kv_scalar, q_point_local, kv_point_local, trainable_point_weights, attention_2d, output_projection}` |
//! | after attention | `fold_iteration/attention_layer_norm`, `transition`, `transition_1`, `transition_2`, `transition_layer_norm` |
//! | backbone update | `fold_iteration/affine_update` (quaternion vector part and translation, composed onto the frame) |
//! | angle resnet | `fold_iteration/rigid_sidechain/{input_projection, input_projection_1, resblock1, resblock2, resblock1_1, resblock2_1, unnormalized_angles}` |
//!
//! One `fold_iteration` (shared weights) runs `layers` times from identity frames; the frames'
//! rotations are detached between iterations, as AlphaFold does. Translations are in nm inside
//! (AlphaFold's `position_scale` 10) and Å outside. The torsion angles of the last iteration
//! place the eight rigid groups of every residue (`torsion_angles_to_frames`) and the atoms
//! at their literature positions in those groups (atom14), then in the atom37 layout.
//!
//! AlphaFold-Multimer's module (`folding_multimer.py`, [`Variant::Multimer`]) is the same
//! maths under other names and bookkeeping: see [`crate::model::multimer::structure`].
//!
//! Activations keep the parameters' kind (bf16 inference); the geometry — quaternions,
//! frames, points, attention over points, atom positions — is computed in fp32, its matrix
//! products IEEE under any `--fp32-matmul` ([`IeeeScope`]).
//!
//! In training ([`StructureModule::run`] given a dropout key) the activation is dropped after
//! the attention's residual sum and after the transition's, before each norm, as
//! `FoldIteration` does (the whole activation, no shared dimension, AlphaFold's rate 0.1):
//! iteration `i` splits the `i`th key of the module's key split per iteration in three and
//! drops with the second and the third.
use engine::fp32_matmul::IeeeScope;
use tch::{Kind, Tensor};

use crate::geometry::Rigid;
use crate::jax_random::Key;
use crate::model::config::{PresetSizes, StructureConfig};
use crate::model::dropout::drop_whole;
use crate::model::keys::STRUCTURE_MODULE;
use crate::model::layers::{chunked, narrow, LayerNorm, Linear};
use crate::model::pair_rows::PairRows;
use crate::model::params::Params;
use crate::model::scope::{Builder, Init, Scope};
use crate::model::{ensure, Error, Result};
use crate::residue_constants::Tables;

fn fp32(t: &Tensor) -> Result<Tensor> {
    Ok(t.f_to_kind(Kind::Float)?)
}

/// Which of DeepMind's two structure modules a module follows; they share the maths but
/// not the parameter layout, the backbone update's bookkeeping or every epsilon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// `folding.py`: the backbone kept as quaternions, renormalised after each update.
    Monomer,
    /// `folding_multimer.py`: the backbone kept as rotation matrices, each update composed
    /// onto them (`QuatRigid`); the invariant point attention's projections per head.
    Multimer,
}

/// The projections of the invariant point attention in each variant's parameter layout.
enum IpaProjections {
    /// `q_scalar`, `kv_scalar` (with biases), `q_point_local`, `kv_point_local` (all x, then
    /// all y, then all z).
    Monomer { q_scalar: Linear, kv_scalar: Linear, q_point_local: Linear, kv_point_local: Linear },
    /// `{q,k,v}_scalar_projection` (no biases) and `{q,k,v}_point_projection/point_projection`
    /// (per head: its x, then y, then z), weights [c_s, heads, width].
    Multimer { q_scalar: Linear, k_scalar: Linear, v_scalar: Linear, q_point: Linear, k_point: Linear, v_point: Linear },
}

/// Scalar queries [N, H, C] (the activations' kind), keys and values [N, H, C] and query,
/// key and value points [N, H, P, 3] in global coordinates (fp32).
type Projected = (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor);

/// Invariant point attention (Algorithm 22).
struct InvariantPointAttention {
    projections: IpaProjections,
    trainable_point_weights: Tensor,
    attention_2d: Linear,
    output_projection: Linear,
    cfg: StructureConfig,
}

impl InvariantPointAttention {
    fn new(p: &Scope, c: &StructureConfig, variant: Variant) -> Result<Self> {
        let (h, s) = (c.heads, c.c_s);
        let out_in = h * c.c_ipa + h * c.v_points * 4 + h * c.c_z;
        let projections = match variant {
            Variant::Monomer => IpaProjections::Monomer {
                q_scalar: Linear::new(&p.sub("q_scalar"), s, h * c.c_ipa, true)?,
                kv_scalar: Linear::new(&p.sub("kv_scalar"), s, 2 * h * c.c_ipa, true)?,
                q_point_local: Linear::new(&p.sub("q_point_local"), s, 3 * h * c.qk_points, true)?,
                kv_point_local: Linear::new(&p.sub("kv_point_local"), s, 3 * h * (c.qk_points + c.v_points), true)?,
            },
            Variant::Multimer => {
                let points = |name: &str, per_head: i64| {
                    Linear::per_head(&p.sub(name).sub("point_projection"), s, h, 3 * per_head, true)
                };
                IpaProjections::Multimer {
                    q_scalar: Linear::per_head(&p.sub("q_scalar_projection"), s, h, c.c_ipa, false)?,
                    k_scalar: Linear::per_head(&p.sub("k_scalar_projection"), s, h, c.c_ipa, false)?,
                    v_scalar: Linear::per_head(&p.sub("v_scalar_projection"), s, h, c.c_ipa, false)?,
                    q_point: points("q_point_projection", c.qk_points)?,
                    k_point: points("k_point_projection", c.qk_points)?,
                    v_point: points("v_point_projection", c.v_points)?,
                }
            }
        };
        Ok(InvariantPointAttention {
            projections,
            trainable_point_weights: p.param("trainable_point_weights", &[h], Init::Small)?,
            attention_2d: Linear::new(&p.sub("attention_2d"), c.c_z, h, true)?,
            output_projection: Linear::new(&p.sub("output_projection"), out_in, s, true)?,
            cfg: *c,
        })
    }

    /// Local points `[N, H, P, 3]` to global ones (fp32, nm).
    fn to_global(local: &Tensor, frames: &Rigid) -> Result<Tensor> {
        let rot = frames.rot.f_unsqueeze(1)?.f_unsqueeze(1)?;
        let trans = frames.trans.f_unsqueeze(1)?.f_unsqueeze(1)?;
        Ok(rot.f_matmul(&local.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?.f_add(&trans)?)
    }

    /// Monomer points `[N, 3 * H * P]` (x block, y block, z block, as haiku splits them) in
    /// the local frames to global points [N, H, P, 3] (fp32, nm).
    fn monomer_points(&self, local: &Tensor, frames: &Rigid, per_head: i64) -> Result<Tensor> {
        let n = local.size()[0];
        let h = self.cfg.heads;
        let xyz = fp32(local)?.f_reshape([n, 3, h, per_head])?.f_permute([0, 2, 3, 1])?;
        Self::to_global(&xyz, frames)
    }

    /// Multimer points `[N, H * 3 * P]` (per head x, y, z blocks, `PointProjection`'s split)
    /// to global points [N, H, P, 3] (fp32, nm).
    fn multimer_points(&self, local: &Tensor, frames: &Rigid, per_head: i64) -> Result<Tensor> {
        let n = local.size()[0];
        let xyz = fp32(local)?.f_reshape([n, self.cfg.heads, 3, per_head])?.f_transpose(2, 3)?;
        Self::to_global(&xyz, frames)
    }

    fn project(&self, single: &Tensor, frames: &Rigid) -> Result<Projected> {
        let c = &self.cfg;
        let (n, h) = (single.size()[0], c.heads);
        let heads = |t: Tensor| t.f_reshape([n, h, c.c_ipa]);
        Ok(match &self.projections {
            IpaProjections::Monomer { q_scalar, kv_scalar, q_point_local, kv_point_local } => {
                let kv = kv_scalar.forward(single)?.f_reshape([n, h, 2 * c.c_ipa])?;
                let kv_pts = self.monomer_points(&kv_point_local.forward(single)?, frames, c.qk_points + c.v_points)?;
                (
                    heads(q_scalar.forward(single)?)?,
                    fp32(&kv.f_narrow(-1, 0, c.c_ipa)?)?,
                    fp32(&kv.f_narrow(-1, c.c_ipa, c.c_ipa)?)?,
                    self.monomer_points(&q_point_local.forward(single)?, frames, c.qk_points)?,
                    kv_pts.f_narrow(2, 0, c.qk_points)?,
                    kv_pts.f_narrow(2, c.qk_points, c.v_points)?,
                )
            }
            IpaProjections::Multimer { q_scalar, k_scalar, v_scalar, q_point, k_point, v_point } => (
                heads(q_scalar.forward(single)?)?,
                fp32(&heads(k_scalar.forward(single)?)?)?,
                fp32(&heads(v_scalar.forward(single)?)?)?,
                self.multimer_points(&q_point.forward(single)?, frames, c.qk_points)?,
                self.multimer_points(&k_point.forward(single)?, frames, c.qk_points)?,
                self.multimer_points(&v_point.forward(single)?, frames, c.v_points)?,
            ),
        })
    }

    /// The norm of each attended point in its query's frame: `folding.py` adds 1e-8 to the
    /// squared norm, `folding_multimer.py` clips it at (1e-8)² (`Vec3Array.norm(1e-8)`).
    fn point_norm(&self, local: &Tensor) -> Result<Tensor> {
        let norm2 = local.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?;
        let norm2 = match self.projections {
            IpaProjections::Monomer { .. } => norm2.f_add_scalar(1e-8)?,
            IpaProjections::Multimer { .. } => norm2.f_clamp_min(1e-16)?,
        };
        Ok(norm2.f_sqrt()?)
    }

    /// `single` [N, c_s], `pair` the real rows `rows` holds ([`PairRows::real`] x N x c_z;
    /// normalised, or with `norm` the raw pair, each chunk's rows normalised as they are
    /// read), `mask` [N], frames in nm → [N, c_s]; the attention of `chunk` query residues at a
    /// time (every per-pair term is per query row). Under DAP a rank attends from its rows'
    /// queries and the ranks' results are gathered before the output projection.
    fn forward(
        &self,
        single: &Tensor,
        (pair, norm): (&Tensor, Option<&LayerNorm>),
        rows: &PairRows,
        mask: &Tensor,
        frames: &Rigid,
        chunk: Option<i64>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let h = c.heads;
        let kind = single.kind();
        let (q, k, v, q_pts, k_pts, v_pts) = self.project(single, frames)?;

        // Each of the three logit terms gets a third of the variance: `folding.py` scales each
        // term, then subtracts the mask's 1e5; `folding_multimer.py` scales their masked sum.
        // In fp32 a logit near 1e5 keeps about 3 digits, so a padding query's attention
        // (uniform in exact arithmetic) depends on which.
        let third = (1.0f64 / 3.0).sqrt();
        let (term_scale, logit_scale) = match self.projections {
            IpaProjections::Monomer { .. } => (third, 1.0),
            IpaProjections::Multimer { .. } => (1.0, third),
        };
        let scalar_w = (1.0 / c.c_ipa.max(1) as f64).sqrt() * term_scale;
        let point_var = c.qk_points.max(1) as f64 * 9.0 / 2.0;
        let point_w =
            fp32(&self.trainable_point_weights)?.f_softplus()?.f_mul_scalar((1.0 / point_var).sqrt() * term_scale)?;
        let m = fp32(mask)?;
        let first = rows.start();
        let features = chunked(rows.real(), chunk, |local, count| {
            // Query rows [start, start + count), the pair's [local, local + count).
            let (start, rows) = (first + local, count);
            let q = fp32(&narrow(&q, 0, start, rows)?)?;
            let scalar = Tensor::f_einsum("ihc,jhc->hij", &[&q, &k], None::<&[i64]>)?.f_mul_scalar(scalar_w)?;
            let diff = narrow(&q_pts, 0, start, rows)?.f_unsqueeze(1)?.f_sub(&k_pts.f_unsqueeze(0)?)?; // [n, Nj, H, P, 3]
            let dist2 = diff.f_square()?.f_sum_dim_intlist([-1, -2].as_slice(), false, Kind::Float)?; // [n, Nj, H]
            drop(diff);
            let points = dist2.f_mul(&point_w)?.f_mul_scalar(-0.5)?.f_permute([2, 0, 1])?;
            drop(dist2);
            let pair = match norm {
                Some(norm) => norm.forward(&narrow(pair, 0, local, rows)?)?,
                None => narrow(pair, 0, local, rows)?,
            };
            let bias = fp32(&self.attention_2d.forward(&pair)?)?.f_permute([2, 0, 1])?.f_mul_scalar(term_scale)?;
            let mask_2d = narrow(&m, 0, start, rows)?.f_unsqueeze(1)?.f_mul(&m.f_unsqueeze(0)?)?;
            let logits = scalar
                .f_add(&points)?
                .f_add(&bias)?
                .f_sub(&mask_2d.f_rsub_scalar(1.0)?.f_mul_scalar(1e5)?)?
                .f_mul_scalar(logit_scale)?;
            drop((scalar, points, bias, mask_2d));
            let attn = logits.f_softmax(-1, Kind::Float)?; // [H, n, Nj]
            drop(logits);

            let out_scalar =
                Tensor::f_einsum("hij,jhc->ihc", &[&attn, &v], None::<&[i64]>)?.f_reshape([rows, h * c.c_ipa])?;
            let out_global = Tensor::f_einsum("hij,jhpx->ihpx", &[&attn, &v_pts], None::<&[i64]>)?; // [n, H, Pv, 3]
            let flat = out_global.f_reshape([rows, h * c.v_points, 3])?;
            let (rot, trans) = (narrow(&frames.rot, 0, start, rows)?, narrow(&frames.trans, 0, start, rows)?);
            let local = rot
                .f_unsqueeze(1)?
                .f_transpose(-1, -2)?
                .f_matmul(&flat.f_sub(&trans.f_unsqueeze(1)?)?.f_unsqueeze(-1)?)?
                .f_squeeze_dim(-1)?; // [n, H*Pv, 3]
            let norm = self.point_norm(&local)?;
            let over_pair = Tensor::f_einsum("hij,ijc->ihc", &[&attn, &fp32(&pair)?], None::<&[i64]>)?
                .f_reshape([rows, h * c.c_z])?;
            Ok(Tensor::f_cat(
                &[out_scalar, local.f_select(-1, 0)?, local.f_select(-1, 1)?, local.f_select(-1, 2)?, norm, over_pair],
                -1,
            )?)
        })?;
        self.output_projection.forward(&rows.gather(&features)?.f_to_kind(kind)?)
    }
}

/// The angle resnet (Algorithm 20, lines 11-14): seven torsion angles per residue.
struct AngleResnet {
    input_projection: Linear,
    input_projection_1: Linear,
    blocks: Vec<(Linear, Linear)>,
    unnormalized_angles: Linear,
}

impl AngleResnet {
    fn new(p: &Scope, c: &StructureConfig) -> Result<Self> {
        let r = c.c_resnet;
        let block = |suffix: &str| -> Result<(Linear, Linear)> {
            Ok((
                Linear::new(&p.sub(&format!("resblock1{suffix}")), r, r, true)?,
                Linear::new(&p.sub(&format!("resblock2{suffix}")), r, r, true)?,
            ))
        };
        Ok(AngleResnet {
            input_projection: Linear::new(&p.sub("input_projection"), c.c_s, r, true)?,
            input_projection_1: Linear::new(&p.sub("input_projection_1"), c.c_s, r, true)?,
            blocks: vec![block("")?, block("_1")?],
            unnormalized_angles: Linear::new(&p.sub("unnormalized_angles"), r, 14, true)?,
        })
    }

    /// `act` and `initial` [N, c_s] → (normalised, unnormalised) (sin, cos) [N, 7, 2], fp32.
    fn forward(&self, act: &Tensor, initial: &Tensor) -> Result<(Tensor, Tensor)> {
        let mut x = self
            .input_projection
            .forward(&act.f_relu()?)?
            .f_add(&self.input_projection_1.forward(&initial.f_relu()?)?)?;
        for (a, b) in &self.blocks {
            let y = b.forward(&a.forward(&x.f_relu()?)?.f_relu()?)?;
            x = x.f_add(&y)?;
        }
        let n = act.size()[0];
        let raw = fp32(&self.unnormalized_angles.forward(&x.f_relu()?)?)?.f_reshape([n, 7, 2])?;
        let norm = raw.f_square()?.f_sum_dim_intlist(-1, true, Kind::Float)?.f_clamp_min(1e-12)?.f_sqrt()?;
        Ok((raw.f_div(&norm)?, raw))
    }
}

/// The eight rigid-group frames of every residue in global coordinates
/// (`torsion_angles_to_frames`): default frames rotated about x by the torsions, chi2..chi4
/// chained onto chi1, all composed onto the backbone frame. `backbone` `[N]`, `angles`
/// [N, 7, 2] (sin, cos) → [N, 8].
pub fn torsion_angles_to_frames(tables: &Tables, aatype: &Tensor, backbone: &Rigid, angles: &Tensor) -> Result<Rigid> {
    let _ieee = IeeeScope::enter();
    let m = tables.default_frames.f_index_select(0, aatype)?; // [N, 8, 4, 4]
    let default =
        Rigid { rot: m.f_narrow(-2, 0, 3)?.f_narrow(-1, 0, 3)?, trans: m.f_narrow(-2, 0, 3)?.f_select(-1, 3)? };
    let n = aatype.size()[0];
    let opts = (Kind::Float, angles.device());
    let sin = Tensor::f_cat(&[Tensor::f_zeros([n, 1], opts)?, angles.f_select(-1, 0)?], 1)?;
    let cos = Tensor::f_cat(&[Tensor::f_ones([n, 1], opts)?, angles.f_select(-1, 1)?], 1)?;
    let (zero, one) = (sin.f_zeros_like()?, sin.f_ones_like()?);
    let rows = [
        Tensor::f_stack(&[&one, &zero, &zero], -1)?,
        Tensor::f_stack(&[&zero, &cos, &sin.f_neg()?], -1)?,
        Tensor::f_stack(&[&zero, &sin, &cos], -1)?,
    ];
    let rot_x = Tensor::f_stack(&rows, -2)?; // [N, 8, 3, 3]
    let local = Rigid { rot: default.rot.f_matmul(&rot_x)?, trans: default.trans };
    let group =
        |g: i64| -> Result<Rigid> { Ok(Rigid { rot: local.rot.f_select(1, g)?, trans: local.trans.f_select(1, g)? }) };
    let mut frames = (0..5).map(group).collect::<Result<Vec<_>>>()?;
    for g in 5..8 {
        let chained = frames[g as usize - 1].compose(&group(g)?);
        frames.push(chained);
    }
    let rot = Tensor::f_stack(&frames.iter().map(|f| f.rot.shallow_clone()).collect::<Vec<_>>(), 1)?;
    let trans = Tensor::f_stack(&frames.iter().map(|f| f.trans.shallow_clone()).collect::<Vec<_>>(), 1)?;
    let to_backbone = Rigid { rot, trans };
    let global = Rigid { rot: backbone.rot.f_unsqueeze(1)?, trans: backbone.trans.f_unsqueeze(1)? };
    Ok(global.compose(&to_backbone))
}

/// Atom14 positions [N, 14, 3] from the rigid-group frames [N, 8]: each atom's literature
/// position in its group's frame (`frames_and_literature_positions_to_atom14_pos`); atoms a
/// residue type does not have are zero.
pub fn frames_to_atom14(tables: &Tables, aatype: &Tensor, frames: &Rigid) -> Result<Tensor> {
    let _ieee = IeeeScope::enter();
    let group = tables.group_idx.f_index_select(0, aatype)?; // [N, 14]
    let one_hot = group.f_one_hot(8)?.f_to_kind(Kind::Float)?; // [N, 14, 8]
    let rot = Tensor::f_einsum("nag,ngij->naij", &[&one_hot, &frames.rot], None::<&[i64]>)?;
    let trans = Tensor::f_einsum("nag,ngi->nai", &[&one_hot, &frames.trans], None::<&[i64]>)?;
    let lit = tables.lit_positions.f_index_select(0, aatype)?; // [N, 14, 3]
    let pos = Rigid { rot, trans }.apply(&lit);
    Ok(pos.f_mul(&tables.atom14_mask.f_index_select(0, aatype)?.f_unsqueeze(-1)?)?)
}

/// Atom14 positions [N, 14, 3] to atom37 [N, 37, 3] and the atom37 mask [N, 37].
pub fn atom14_to_atom37(tables: &Tables, aatype: &Tensor, atom14: &Tensor) -> Result<(Tensor, Tensor)> {
    let idx = tables.atom37_to_atom14.f_index_select(0, aatype)?; // [N, 37]
    let mask = tables.atom37_mask.f_index_select(0, aatype)?;
    let n = aatype.size()[0];
    let gathered = atom14.f_gather(1, &idx.f_unsqueeze(-1)?.f_expand([n, 37, 3], false)?, false)?;
    Ok((gathered.f_mul(&mask.f_unsqueeze(-1)?)?, mask))
}

/// What the structure module returns.
pub struct StructureOutput {
    /// Final activations [N, c_s] (the lDDT head's input).
    pub single: Tensor,
    /// Backbone rotations of every iteration [layers, N, 3, 3].
    pub rotations: Tensor,
    /// Backbone translations (CA positions) of every iteration [layers, N, 3], Å.
    pub translations: Tensor,
    /// Normalised torsion (sin, cos) of every iteration [layers, N, 7, 2].
    pub angles: Tensor,
    /// Unnormalised torsion (sin, cos) [layers, N, 7, 2].
    pub unnormalized_angles: Tensor,
    /// The eight rigid-group frames of the last iteration [N, 8], Å (side-chain FAPE's).
    pub frames: Rigid,
    /// Final atom positions [N, 14, 3], Å.
    pub atom14: Tensor,
    /// Final atom positions [N, 37, 3], Å.
    pub atom37: Tensor,
    /// Which atom37 atoms the residue types have [N, 37].
    pub atom37_mask: Tensor,
}

/// The structure module over one parameter store.
pub struct StructureModule {
    single_layer_norm: LayerNorm,
    initial_projection: Linear,
    pair_layer_norm: LayerNorm,
    ipa: InvariantPointAttention,
    attention_layer_norm: LayerNorm,
    transitions: Vec<Linear>,
    transition_layer_norm: LayerNorm,
    backbone_update: Linear,
    sidechain: AngleResnet,
    cfg: StructureConfig,
    variant: Variant,
}

impl StructureModule {
    /// The structure module over `params`, with AlphaFold's iteration count.
    pub fn new(params: &Params) -> Result<Self> {
        Self::with_preset(params, &PresetSizes::default())
    }

    /// The structure module over `params` with the preset's iteration count and position
    /// scale (which the arrays cannot show).
    pub fn with_preset(params: &Params, preset: &PresetSizes) -> Result<Self> {
        ensure!(
            preset.structure_iterations >= 1,
            "the structure module needs at least 1 iteration, not {}",
            preset.structure_iterations
        );
        Self::build(&params.builder(), &params.model_config()?.structure.with_preset(preset), Variant::Monomer)
    }

    /// The module's sizes.
    pub fn config(&self) -> &StructureConfig {
        &self.cfg
    }

    /// Builds (or, with an initialising builder, creates the arrays of) the module.
    pub(crate) fn build(b: &Builder, c: &StructureConfig, variant: Variant) -> Result<Self> {
        let p = b.root(STRUCTURE_MODULE);
        let f = p.sub("fold_iteration");
        Ok(StructureModule {
            single_layer_norm: LayerNorm::new(&p.sub("single_layer_norm"), c.c_s)?,
            initial_projection: Linear::new(&p.sub("initial_projection"), c.c_s, c.c_s, true)?,
            pair_layer_norm: LayerNorm::new(&p.sub("pair_layer_norm"), c.c_z)?,
            ipa: InvariantPointAttention::new(&f.sub("invariant_point_attention"), c, variant)?,
            attention_layer_norm: LayerNorm::new(&f.sub("attention_layer_norm"), c.c_s)?,
            transitions: ["transition", "transition_1", "transition_2"]
                .iter()
                .map(|name| Linear::new(&f.sub(name), c.c_s, c.c_s, true))
                .collect::<Result<_>>()?,
            transition_layer_norm: LayerNorm::new(&f.sub("transition_layer_norm"), c.c_s)?,
            backbone_update: match variant {
                Variant::Monomer => Linear::new(&f.sub("affine_update"), c.c_s, 6, true)?,
                Variant::Multimer => Linear::new(&f.sub("quat_rigid").sub("rigid"), c.c_s, 6, true)?,
            },
            sidechain: AngleResnet::new(&f.sub("rigid_sidechain"), c)?,
            cfg: *c,
            variant,
        })
    }

    /// One invariant point attention of the fold iteration on `act` [N, c_s] (after the input
    /// projection) and `pair` [N, N, c_z] (after its norm) with backbone `frames` `[N]` in nm:
    /// the update added to `act`. Exposed to check its invariance to global rigid motions.
    pub fn invariant_point_attention(
        &self,
        act: &Tensor,
        pair: &Tensor,
        mask: &Tensor,
        frames: &Rigid,
    ) -> Result<Tensor> {
        let _ieee = IeeeScope::enter();
        self.ipa.forward(act, (pair, None), &PairRows::whole(act.size()[0]), mask, frames, None)
    }

    /// `single` [N, c_s] (the Evoformer's single representation), `pair` [N, N, c_z],
    /// `aatype` `[N]` (integer), `seq_mask` `[N]`; the invariant point attention `chunk` query
    /// residues at a time (`None`: all). In training, with `dropout` (the module's key and
    /// rate) the activation is dropped as the module docs say.
    pub fn run(
        &self,
        single: &Tensor,
        pair: &Tensor,
        aatype: &Tensor,
        seq_mask: &Tensor,
        chunk: Option<i64>,
        dropout: Option<(Key, f64)>,
    ) -> Result<StructureOutput> {
        let rows = PairRows::whole(aatype.size().first().copied().unwrap_or(0));
        self.run_rows(single, pair, &rows, aatype, seq_mask, chunk, dropout)
    }

    /// [`StructureModule::run`] on the real pair rows `rows` holds ([`PairRows::real`] x N x
    /// c_z): under DAP inference each rank attends from its rows' queries, the ranks' results
    /// gathered in every iteration, and every rank ends with the same whole outputs.
    #[allow(clippy::too_many_arguments)]
    pub fn run_rows(
        &self,
        single: &Tensor,
        pair: &Tensor,
        rows: &PairRows,
        aatype: &Tensor,
        seq_mask: &Tensor,
        chunk: Option<i64>,
        dropout: Option<(Key, f64)>,
    ) -> Result<StructureOutput> {
        let n = aatype.size().first().copied().unwrap_or(0);
        ensure!(
            single.size() == [n, self.cfg.c_s],
            "single: expected shape [{n}, {}], found {:?}",
            self.cfg.c_s,
            single.size()
        );
        ensure!(
            pair.size() == [rows.real(), n, self.cfg.c_z] && rows.residues() == n,
            "pair: expected shape [{}, {n}, {}], found {:?}",
            rows.real(),
            self.cfg.c_z,
            pair.size()
        );
        ensure!(seq_mask.size() == [n], "seq_mask: expected shape [{n}], found {:?}", seq_mask.size());
        // Its products IEEE fp32 under any --fp32-matmul: the module is geometry throughout
        // (points and frames through the attention, the backbone updates, the atoms), small
        // beside the stacks, and AlphaFold keeps its geometry off the tensor cores.
        let _ieee = IeeeScope::enter();
        let device = single.device();
        let tables = Tables::new(device);
        let aatype = aatype.f_to_kind(Kind::Int64)?.f_clamp(0, 20)?;
        let initial = self.single_layer_norm.forward(single)?;
        // The normalised pair whole, or, where the attention runs in query-row chunks and
        // nothing records gradients, each chunk's rows normalised as the attention reads them
        // (every iteration again): whole, it is a second pair beside the Evoformer's.
        let by_rows =
            chunk.is_some_and(|c| c < rows.real()) && !pair.requires_grad() && !self.pair_layer_norm.records();
        let pair = match by_rows {
            true => (pair.shallow_clone(), Some(&self.pair_layer_norm)),
            false => (self.pair_layer_norm.forward(pair)?, None),
        };
        let mut act = self.initial_projection.forward(&initial)?;
        let mut backbone = Backbone::identity(n, self.variant, device)?;
        let (mut rotations, mut translations, mut angles, mut raw_angles) = (vec![], vec![], vec![], vec![]);
        let mut last_frames = None;
        let keys = dropout.map(|(key, rate)| (key.split(self.cfg.layers as usize), rate));
        for i in 0..self.cfg.layers {
            // DeepMind's `safe_key, *sub_keys = safe_key.split(3)`: the first goes unused.
            let drop = |x: Tensor, sub: usize| -> Result<Tensor> {
                match &keys {
                    Some((keys, rate)) => drop_whole(&x, keys[i as usize].split(3)[sub], *rate),
                    None => Ok(x),
                }
            };
            let frames = backbone.frames();
            act = act.f_add(&self.ipa.forward(&act, (&pair.0, pair.1), rows, seq_mask, &frames, chunk)?)?;
            act = self.attention_layer_norm.forward(&drop(act, 1)?)?;
            let input = act.shallow_clone();
            for (t, layer) in self.transitions.iter().enumerate() {
                act = layer.forward(&act)?;
                if t + 1 < self.transitions.len() {
                    act = act.f_relu()?;
                }
            }
            act = self.transition_layer_norm.forward(&drop(act.f_add(&input)?, 2)?)?;
            backbone = backbone.updated(&frames, &fp32(&self.backbone_update.forward(&act)?)?)?;
            let updated = backbone.frames();
            let scaled =
                Rigid { rot: updated.rot.shallow_clone(), trans: updated.trans.f_mul_scalar(self.cfg.position_scale)? };
            let (normalized, raw) = self.sidechain.forward(&act, &initial)?;
            rotations.push(scaled.rot.shallow_clone());
            translations.push(scaled.trans.shallow_clone());
            angles.push(normalized.shallow_clone());
            raw_angles.push(raw);
            if i + 1 == self.cfg.layers {
                last_frames = Some((scaled, normalized));
            }
            // Rotations do not carry gradients into the next iteration (AlphaFold's
            // stop_gradient on the rotation), translations do.
            backbone = backbone.detach_rotation()?;
        }
        let (backbone, torsions) =
            last_frames.ok_or_else(|| Error::Invalid("the structure module has no iterations".into()))?;
        let frames = torsion_angles_to_frames(&tables, &aatype, &backbone, &torsions)?;
        let atom14 = frames_to_atom14(&tables, &aatype, &frames)?;
        let (mut atom37, mut atom37_mask) = atom14_to_atom37(&tables, &aatype, &atom14)?;
        if self.variant == Variant::Multimer {
            // `folding_multimer.py` masks the padding residues' atoms too.
            atom37_mask = atom37_mask.f_mul(&fp32(seq_mask)?.f_unsqueeze(-1)?)?;
            atom37 = atom37.f_mul(&atom37_mask.f_unsqueeze(-1)?)?;
        }
        Ok(StructureOutput {
            single: act,
            rotations: Tensor::f_stack(&rotations, 0)?,
            translations: Tensor::f_stack(&translations, 0)?,
            angles: Tensor::f_stack(&angles, 0)?,
            unnormalized_angles: Tensor::f_stack(&raw_angles, 0)?,
            frames,
            atom14,
            atom37,
            atom37_mask,
        })
    }
}

/// The backbone frames between fold iterations (translations in nm).
enum Backbone {
    /// `folding.py`'s `QuatAffine`: unit quaternions and translations [N, 3].
    Quaternion { quaternion: Tensor, translation: Tensor },
    /// `folding_multimer.py`'s `Rigid3Array`: rotation matrices and translations.
    Frames(Rigid),
}

impl Backbone {
    /// Identity frames of `n` residues.
    fn identity(n: i64, variant: Variant, device: tch::Device) -> Result<Backbone> {
        let opts = (Kind::Float, device);
        let translation = Tensor::f_zeros([n, 3], opts)?;
        Ok(match variant {
            Variant::Monomer => Backbone::Quaternion {
                quaternion: Tensor::f_cat(&[Tensor::f_ones([n, 1], opts)?, Tensor::f_zeros([n, 3], opts)?], 1)?,
                translation,
            },
            Variant::Multimer => {
                let rot = Tensor::f_eye(3, opts)?.f_expand([n, 3, 3], false)?.f_contiguous()?;
                Backbone::Frames(Rigid { rot, trans: translation })
            }
        })
    }

    fn frames(&self) -> Rigid {
        match self {
            Backbone::Quaternion { quaternion, translation } => Rigid::from_quaternion(quaternion, translation),
            Backbone::Frames(f) => Rigid { rot: f.rot.shallow_clone(), trans: f.trans.shallow_clone() },
        }
    }

    /// The backbone after `update` [N, 6] (a quaternion's vector part `(b, c, d)`, then a
    /// translation, both in the current `frames`): the monomer's `q + q (0, b, c, d)`,
    /// renormalised, and `t + R (x, y, z)`; Multimer's `QuatRigid`, the frames composed with
    /// the rigid of the normalised `(1, b, c, d)` and `(x, y, z)` (the same rotation, kept as
    /// a matrix rather than a quaternion).
    fn updated(&self, frames: &Rigid, update: &Tensor) -> Result<Backbone> {
        let v = update.f_narrow(1, 0, 3)?;
        let t = update.f_narrow(1, 3, 3)?;
        Ok(match self {
            Backbone::Quaternion { quaternion, translation } => {
                let pure = Tensor::f_cat(&[v.f_zeros_like()?.f_narrow(1, 0, 1)?, v], 1)?;
                let q = quaternion.f_add(&quaternion_product(quaternion, &pure)?)?;
                let q = q.f_div(&q.f_square()?.f_sum_dim_intlist(-1, true, Kind::Float)?.f_sqrt()?)?;
                let translation = translation.f_add(&frames.rot.f_matmul(&t.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?)?;
                Backbone::Quaternion { quaternion: q, translation }
            }
            Backbone::Frames(f) => {
                let q = Tensor::f_cat(&[v.f_ones_like()?.f_narrow(1, 0, 1)?, v], 1)?;
                Backbone::Frames(f.compose(&Rigid::from_quaternion(&q, &t)))
            }
        })
    }

    fn detach_rotation(self) -> Result<Backbone> {
        Ok(match self {
            Backbone::Quaternion { quaternion, translation } => {
                Backbone::Quaternion { quaternion: quaternion.f_detach()?, translation }
            }
            Backbone::Frames(f) => Backbone::Frames(Rigid { rot: f.rot.f_detach()?, trans: f.trans }),
        })
    }
}

/// Hamilton product of quaternions `(w, x, y, z)` [.., 4].
fn quaternion_product(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let c = |t: &Tensor, i: i64| t.f_select(-1, i);
    let (aw, ax, ay, az) = (c(a, 0)?, c(a, 1)?, c(a, 2)?, c(a, 3)?);
    let (bw, bx, by, bz) = (c(b, 0)?, c(b, 1)?, c(b, 2)?, c(b, 3)?);
    let w = &aw * &bw - &ax * &bx - &ay * &by - &az * &bz;
    let x = &aw * &bx + &ax * &bw + &ay * &bz - &az * &by;
    let y = &aw * &by - &ax * &bz + &ay * &bw + &az * &bx;
    let z = &aw * &bz + &ax * &by - &ay * &bx + &az * &bw;
    Ok(Tensor::f_stack(&[w, x, y, z], -1)?)
}
