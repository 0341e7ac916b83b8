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
//! Activations keep the parameters' kind (bf16 inference); the geometry — quaternions,
//! frames, points, attention over points, atom positions — is computed in fp32.
use tch::{Kind, Tensor};

use crate::geometry::Rigid;
use crate::model::config::{PresetSizes, StructureConfig};
use crate::model::keys::STRUCTURE_MODULE;
use crate::model::layers::{chunked, LayerNorm, Linear};
use crate::model::params::Params;
use crate::model::scope::{Builder, Init, Scope};
use crate::model::{ensure, Error, Result};
use crate::residue_constants::Tables;

fn fp32(t: &Tensor) -> Result<Tensor> {
    Ok(t.f_to_kind(Kind::Float)?)
}

/// Invariant point attention (Algorithm 22).
struct InvariantPointAttention {
    q_scalar: Linear,
    kv_scalar: Linear,
    q_point_local: Linear,
    kv_point_local: Linear,
    trainable_point_weights: Tensor,
    attention_2d: Linear,
    output_projection: Linear,
    cfg: StructureConfig,
}

impl InvariantPointAttention {
    fn new(p: &Scope, c: &StructureConfig) -> Result<Self> {
        let (h, s) = (c.heads, c.c_s);
        let out_in = h * c.c_ipa + h * c.v_points * 4 + h * c.c_z;
        Ok(InvariantPointAttention {
            q_scalar: Linear::new(&p.sub("q_scalar"), s, h * c.c_ipa, true)?,
            kv_scalar: Linear::new(&p.sub("kv_scalar"), s, 2 * h * c.c_ipa, true)?,
            q_point_local: Linear::new(&p.sub("q_point_local"), s, 3 * h * c.qk_points, true)?,
            kv_point_local: Linear::new(&p.sub("kv_point_local"), s, 3 * h * (c.qk_points + c.v_points), true)?,
            trainable_point_weights: p.param("trainable_point_weights", &[h], Init::Small)?,
            attention_2d: Linear::new(&p.sub("attention_2d"), c.c_z, h, true)?,
            output_projection: Linear::new(&p.sub("output_projection"), out_in, s, true)?,
            cfg: *c,
        })
    }

    /// Points `[N, 3 * H * P]` (x block, y block, z block, as haiku splits them) in the local
    /// frames to global points [N, H, P, 3] (fp32, nm).
    fn global_points(&self, local: &Tensor, frames: &Rigid, per_head: i64) -> Result<Tensor> {
        let n = local.size()[0];
        let h = self.cfg.heads;
        let xyz = fp32(local)?.f_reshape([n, 3, h * per_head])?.f_transpose(1, 2)?; // [N, H*P, 3]
        let rot = frames.rot.f_unsqueeze(1)?;
        let trans = frames.trans.f_unsqueeze(1)?;
        let global = rot.f_matmul(&xyz.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?.f_add(&trans)?;
        Ok(global.f_reshape([n, h, per_head, 3])?)
    }

    /// `single` [N, c_s], `pair` [N, N, c_z], `mask` [N], frames in nm → [N, c_s]; the
    /// attention of `chunk` query residues at a time (every per-pair term is per query row).
    fn forward(
        &self,
        single: &Tensor,
        pair: &Tensor,
        mask: &Tensor,
        frames: &Rigid,
        chunk: Option<i64>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (n, h) = (single.size()[0], c.heads);
        let kind = single.kind();
        let q = self.q_scalar.forward(single)?.f_reshape([n, h, c.c_ipa])?;
        let kv = self.kv_scalar.forward(single)?.f_reshape([n, h, 2 * c.c_ipa])?;
        let (k, v) = (fp32(&kv.f_narrow(-1, 0, c.c_ipa)?)?, fp32(&kv.f_narrow(-1, c.c_ipa, c.c_ipa)?)?);
        let q_pts = self.global_points(&self.q_point_local.forward(single)?, frames, c.qk_points)?;
        let kv_pts = self.global_points(&self.kv_point_local.forward(single)?, frames, c.qk_points + c.v_points)?;
        let k_pts = kv_pts.f_narrow(2, 0, c.qk_points)?;
        let v_pts = kv_pts.f_narrow(2, c.qk_points, c.v_points)?;

        // Each of the three logit terms gets a third of the variance.
        let scalar_w = (1.0 / (3.0 * c.c_ipa.max(1) as f64)).sqrt();
        let point_var = c.qk_points.max(1) as f64 * 9.0 / 2.0;
        let point_w =
            fp32(&self.trainable_point_weights)?.f_softplus()?.f_mul_scalar((1.0 / (3.0 * point_var)).sqrt())?;
        let m = fp32(mask)?;
        let features = chunked(n, chunk, |start, rows| {
            let q = fp32(&q.f_narrow(0, start, rows)?)?;
            let scalar = Tensor::f_einsum("ihc,jhc->hij", &[&q, &k], None::<&[i64]>)?.f_mul_scalar(scalar_w)?;
            let diff = q_pts.f_narrow(0, start, rows)?.f_unsqueeze(1)?.f_sub(&k_pts.f_unsqueeze(0)?)?; // [n, Nj, H, P, 3]
            let dist2 = diff.f_square()?.f_sum_dim_intlist([-1, -2].as_slice(), false, Kind::Float)?; // [n, Nj, H]
            drop(diff);
            let points = dist2.f_mul(&point_w)?.f_mul_scalar(-0.5)?.f_permute([2, 0, 1])?;
            drop(dist2);
            let pair = pair.f_narrow(0, start, rows)?;
            let bias =
                fp32(&self.attention_2d.forward(&pair)?)?.f_permute([2, 0, 1])?.f_mul_scalar((1.0f64 / 3.0).sqrt())?;
            let mask_2d = m.f_narrow(0, start, rows)?.f_unsqueeze(1)?.f_mul(&m.f_unsqueeze(0)?)?;
            let logits = scalar.f_add(&points)?.f_add(&bias)?.f_sub(&mask_2d.f_rsub_scalar(1.0)?.f_mul_scalar(1e5)?)?;
            drop((scalar, points, bias, mask_2d));
            let attn = logits.f_softmax(-1, Kind::Float)?; // [H, n, Nj]
            drop(logits);

            let out_scalar =
                Tensor::f_einsum("hij,jhc->ihc", &[&attn, &v], None::<&[i64]>)?.f_reshape([rows, h * c.c_ipa])?;
            let out_global = Tensor::f_einsum("hij,jhpx->ihpx", &[&attn, &v_pts], None::<&[i64]>)?; // [n, H, Pv, 3]
            let flat = out_global.f_reshape([rows, h * c.v_points, 3])?;
            let (rot, trans) = (frames.rot.f_narrow(0, start, rows)?, frames.trans.f_narrow(0, start, rows)?);
            let local = rot
                .f_unsqueeze(1)?
                .f_transpose(-1, -2)?
                .f_matmul(&flat.f_sub(&trans.f_unsqueeze(1)?)?.f_unsqueeze(-1)?)?
                .f_squeeze_dim(-1)?; // [n, H*Pv, 3]
            let norm = local.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(1e-8)?.f_sqrt()?;
            let over_pair = Tensor::f_einsum("hij,ijc->ihc", &[&attn, &fp32(&pair)?], None::<&[i64]>)?
                .f_reshape([rows, h * c.c_z])?;
            Ok(Tensor::f_cat(
                &[out_scalar, local.f_select(-1, 0)?, local.f_select(-1, 1)?, local.f_select(-1, 2)?, norm, over_pair],
                -1,
            )?)
        })?;
        self.output_projection.forward(&features.f_to_kind(kind)?)
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
/// chained onto chi1, all composed onto the backbone frame. `backbone` [N], `angles`
/// [N, 7, 2] (sin, cos) → [N, 8].
pub fn torsion_angles_to_frames(tables: &Tables, aatype: &Tensor, backbone: &Rigid, angles: &Tensor) -> Result<Rigid> {
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
    affine_update: Linear,
    sidechain: AngleResnet,
    cfg: StructureConfig,
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
        Self::build(&params.builder(), &params.model_config()?.structure.with_preset(preset))
    }

    /// Builds (or, with an initialising builder, creates the arrays of) the module.
    pub(crate) fn build(b: &Builder, c: &StructureConfig) -> Result<Self> {
        let p = b.root(STRUCTURE_MODULE);
        let f = p.sub("fold_iteration");
        Ok(StructureModule {
            single_layer_norm: LayerNorm::new(&p.sub("single_layer_norm"), c.c_s)?,
            initial_projection: Linear::new(&p.sub("initial_projection"), c.c_s, c.c_s, true)?,
            pair_layer_norm: LayerNorm::new(&p.sub("pair_layer_norm"), c.c_z)?,
            ipa: InvariantPointAttention::new(&f.sub("invariant_point_attention"), c)?,
            attention_layer_norm: LayerNorm::new(&f.sub("attention_layer_norm"), c.c_s)?,
            transitions: ["transition", "transition_1", "transition_2"]
                .iter()
                .map(|name| Linear::new(&f.sub(name), c.c_s, c.c_s, true))
                .collect::<Result<_>>()?,
            transition_layer_norm: LayerNorm::new(&f.sub("transition_layer_norm"), c.c_s)?,
            affine_update: Linear::new(&f.sub("affine_update"), c.c_s, 6, true)?,
            sidechain: AngleResnet::new(&f.sub("rigid_sidechain"), c)?,
            cfg: *c,
        })
    }

    /// One invariant point attention of the fold iteration on `act` [N, c_s] (after the input
    /// projection) and `pair` [N, N, c_z] (after its norm) with backbone `frames` [N] in nm:
    /// the update added to `act`. Exposed to check its invariance to global rigid motions.
    pub fn invariant_point_attention(
        &self,
        act: &Tensor,
        pair: &Tensor,
        mask: &Tensor,
        frames: &Rigid,
    ) -> Result<Tensor> {
        self.ipa.forward(act, pair, mask, frames, None)
    }

    /// `single` [N, c_s] (the Evoformer's single representation), `pair` [N, N, c_z],
    /// `aatype` [N] (integer), `seq_mask` [N].
    pub fn forward(
        &self,
        single: &Tensor,
        pair: &Tensor,
        aatype: &Tensor,
        seq_mask: &Tensor,
    ) -> Result<StructureOutput> {
        self.run(single, pair, aatype, seq_mask, None)
    }

    /// [`StructureModule::forward`], the invariant point attention `chunk` query residues at a
    /// time (`None`: all).
    pub fn run(
        &self,
        single: &Tensor,
        pair: &Tensor,
        aatype: &Tensor,
        seq_mask: &Tensor,
        chunk: Option<i64>,
    ) -> Result<StructureOutput> {
        let n = aatype.size().first().copied().unwrap_or(0);
        ensure!(
            single.size() == [n, self.cfg.c_s],
            "single: expected shape [{n}, {}], found {:?}",
            self.cfg.c_s,
            single.size()
        );
        ensure!(
            pair.size() == [n, n, self.cfg.c_z],
            "pair: expected shape [{n}, {n}, {}], found {:?}",
            self.cfg.c_z,
            pair.size()
        );
        ensure!(seq_mask.size() == [n], "seq_mask: expected shape [{n}], found {:?}", seq_mask.size());
        let device = single.device();
        let tables = Tables::new(device);
        let aatype = aatype.f_to_kind(Kind::Int64)?.f_clamp(0, 20)?;
        let initial = self.single_layer_norm.forward(single)?;
        let pair = self.pair_layer_norm.forward(pair)?;
        let mut act = self.initial_projection.forward(&initial)?;
        let opts = (Kind::Float, device);
        let mut quaternion = Tensor::f_cat(&[Tensor::f_ones([n, 1], opts)?, Tensor::f_zeros([n, 3], opts)?], 1)?;
        let mut translation = Tensor::f_zeros([n, 3], opts)?;
        let (mut rotations, mut translations, mut angles, mut raw_angles) = (vec![], vec![], vec![], vec![]);
        let mut last_frames = None;
        for i in 0..self.cfg.layers {
            let frames = Rigid::from_quaternion(&quaternion, &translation);
            act = act.f_add(&self.ipa.forward(&act, &pair, seq_mask, &frames, chunk)?)?;
            act = self.attention_layer_norm.forward(&act)?;
            let input = act.shallow_clone();
            for (t, layer) in self.transitions.iter().enumerate() {
                act = layer.forward(&act)?;
                if t + 1 < self.transitions.len() {
                    act = act.f_relu()?;
                }
            }
            act = self.transition_layer_norm.forward(&act.f_add(&input)?)?;
            // Backbone update: q <- q + q * (0, b, c, d), t <- t + R(q) (x, y, z), then the
            // quaternion is renormalised (inside `from_quaternion`).
            let update = fp32(&self.affine_update.forward(&act)?)?;
            let v = update.f_narrow(1, 0, 3)?;
            let pure = Tensor::f_cat(&[v.f_zeros_like()?.f_narrow(1, 0, 1)?, v], 1)?;
            quaternion = quaternion.f_add(&quaternion_product(&quaternion, &pure)?)?;
            quaternion =
                quaternion.f_div(&quaternion.f_square()?.f_sum_dim_intlist(-1, true, Kind::Float)?.f_sqrt()?)?;
            translation = translation
                .f_add(&frames.rot.f_matmul(&update.f_narrow(1, 3, 3)?.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?)?;
            let updated = Rigid::from_quaternion(&quaternion, &translation);
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
            quaternion = quaternion.f_detach()?;
        }
        let (backbone, torsions) =
            last_frames.ok_or_else(|| Error::Invalid("the structure module has no iterations".into()))?;
        let frames = torsion_angles_to_frames(&tables, &aatype, &backbone, &torsions)?;
        let atom14 = frames_to_atom14(&tables, &aatype, &frames)?;
        let (atom37, atom37_mask) = atom14_to_atom37(&tables, &aatype, &atom14)?;
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
