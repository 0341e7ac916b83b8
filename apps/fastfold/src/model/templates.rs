//! Template embedding (supplementary 1.7.1, AlphaFold's monomer `TemplateEmbedding` and the
//! template torsion-angle features), under AlphaFold's parameter names:
//!
//! | module | AlphaFold name (below `alphafold/alphafold_iteration/evoformer`) |
//! |---|---|
//! | pair features → `c_t` | `template_embedding/single_template_embedding/embedding2d` |
//! | template pair stack (stacked blocks) | `.../single_template_embedding/template_pair_stack/__layer_stack_no_state/{triangle_attention_starting_node, triangle_attention_ending_node, triangle_multiplication_outgoing, triangle_multiplication_incoming, pair_transition}` |
//! | final norm | `.../single_template_embedding/output_layer_norm` |
//! | pointwise attention (query: pair; keys: templates) | `template_embedding/attention` (`query_w`, `key_w`, `value_w`, `output_w`, `output_b`; no gating) |
//! | torsion-angle features → extra MSA rows | `template_single_embedding`, `template_projection` |
//!
//! The pair features of a template are its pseudo-beta distogram (39 bins, 3.25–50.75 Å), the
//! pseudo-beta pair mask, both residues' types, the unit vectors between backbone frames (zero:
//! AlphaFold's monomer models run with `use_template_unit_vector = False`) and the backbone pair
//! mask, all multiplied by the backbone pair mask. The torsion features are the residue type
//! and AlphaFold's seven torsion angles (with their pi-periodic alternatives and masks), as
//! `atom37_to_torsion_angles` computes them for `zero_init` models (undefined angles are not
//! replaced by a placeholder). Undefined angles (the first residue's omega, chis with an absent
//! atom) still enter the template rows, with values that are rounding artefacts of degenerate
//! frames; they are computed in the operation order of AlphaFold's `r3` code, so they equal
//! DeepMind's model run op by op (jit-compiled, XLA fuses these operations and AlphaFold itself
//! gives other values). Templates run whole on every rank, outside DAP.
//!
//! In training (a key and an [`Exec`] with dropout rates), the pair stack's blocks drop their
//! sub-modules' updates as DeepMind's do ([`crate::model::dropout`]): the monomer's
//! `TemplatePairStack` block splits its key in six and carries the first on to the next block,
//! the Multimer's `TemplateEmbeddingIteration` splits the second key of its stack's per-block
//! split in twenty; either way the sub-modules take the second key on, in the order they run.
//! Each template gets its own key (the monomer's template key split per template, a
//! derivation of ours: DeepMind's monomer draws it from haiku's rng sequence; the Multimer's
//! as `TemplateEmbedding` splits it, see [`crate::model::multimer::templates`]).
use engine::parallel::dap::Dap;
use tch::{Kind, Tensor};

use crate::features::TemplateFeatures;
use crate::jax_random::Key;
use crate::model::config::TemplateConfig;
use crate::model::dropout::{DropMask, Rates, Shared};
use crate::model::embedders::distance_one_hot_between;
use crate::model::exec::{ChunkOp, Exec, Stage};
use crate::model::keys::{EMBEDDINGS, PAIR_STACK, SINGLE_TEMPLATE, TEMPLATE_EMBEDDING};
use crate::model::layers::{chunked, narrow, step, LayerNorm, Linear, Stream};
use crate::model::msa::Transition;
use crate::model::pair_rows::PairRows;
use crate::model::params::Params;
use crate::model::scope::{Builder, Init, Scope};
use crate::model::triangle::{Direction, TriangleAttention, TriangleMultiplication};
use crate::model::{ensure, Result};
use crate::residue_constants::Tables;

/// Pseudo-beta distogram of a template (`dgram_features`: 39 bins, lower edges 3.25 to
/// 50.75 Å), the monomer's and the Multimer's alike.
pub const DGRAM_BINS: i64 = 39;
/// The distogram's first bin edge, Å.
pub const DGRAM_MIN: f64 = 3.25;
/// The distogram's last bin edge, Å.
pub const DGRAM_MAX: f64 = 50.75;
/// Template pair features: distogram, pseudo-beta mask, two residue one-hots (22), unit
/// vector (3), backbone mask.
pub const PAIR_FEATURES: i64 = DGRAM_BINS + 1 + 22 + 22 + 3 + 1;
/// Template torsion features: residue one-hot (22), 7 (sin, cos), 7 alternative (sin, cos), 7
/// masks.
pub const ANGLE_FEATURES: i64 = 22 + 14 + 14 + 7;

/// Vectors as three coordinate tensors, for arithmetic in the operation order of AlphaFold's
/// `r3` module. Undefined torsion angles (the first residue's omega, chis with an absent atom)
/// are still features of the template rows, and for degenerate atom sets their values are
/// rounding artefacts: only the same sequence of fp32 operations reproduces them.
struct Vecs {
    x: Tensor,
    y: Tensor,
    z: Tensor,
}

impl Vecs {
    /// From `[.., 3]`.
    fn of(t: &Tensor) -> Result<Vecs> {
        Ok(Vecs { x: t.f_select(-1, 0)?, y: t.f_select(-1, 1)?, z: t.f_select(-1, 2)? })
    }

    fn sub(&self, o: &Vecs) -> Result<Vecs> {
        Ok(Vecs { x: self.x.f_sub(&o.x)?, y: self.y.f_sub(&o.y)?, z: self.z.f_sub(&o.z)? })
    }

    fn dot(&self, o: &Vecs) -> Result<Tensor> {
        Ok(self.x.f_mul(&o.x)?.f_add(&self.y.f_mul(&o.y)?)?.f_add(&self.z.f_mul(&o.z)?)?)
    }

    fn cross(&self, o: &Vecs) -> Result<Vecs> {
        let d =
            |a: &Tensor, b: &Tensor, c: &Tensor, e: &Tensor| -> Result<Tensor> { Ok(a.f_mul(b)?.f_sub(&c.f_mul(e)?)?) };
        Ok(Vecs {
            x: d(&self.y, &o.z, &self.z, &o.y)?,
            y: d(&self.z, &o.x, &self.x, &o.z)?,
            z: d(&self.x, &o.y, &self.y, &o.x)?,
        })
    }

    /// `v / sqrt(x² + y² + z² + 1e-8)` (`vecs_robust_normalize`).
    fn robust_normalize(&self) -> Result<Vecs> {
        let sq = self.x.f_square()?.f_add(&self.y.f_square()?)?.f_add(&self.z.f_square()?)?;
        let norm = ieee_sqrt(&sq.f_add_scalar(1e-8)?)?;
        Ok(Vecs { x: self.x.f_div(&norm)?, y: self.y.f_div(&norm)?, z: self.z.f_div(&norm)? })
    }
}

/// The correctly rounded square root (fp32 through fp64, where rounding twice is exact for
/// square roots): libtorch's vectorised fp32 `sqrt` can be one ulp off, which the degenerate
/// frames above amplify.
fn ieee_sqrt(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_to_kind(Kind::Double)?.f_sqrt()?.f_to_kind(x.kind())?)
}

/// The y and z coordinates of `a3` in the frame with origin `a2`, negative x axis towards
/// `a1` and `a0` in the xy plane (`rigids_from_3_points` by Gram-Schmidt, then the inverted
/// frame applied as `R^T a3 - R^T a2`, as AlphaFold computes them).
fn fourth_atom_in_frame(a0: &Vecs, a1: &Vecs, a2: &Vecs, a3: &Vecs) -> Result<(Tensor, Tensor)> {
    let e0 = a2.sub(a1)?.robust_normalize()?;
    let e1_raw = a0.sub(a2)?;
    let c = e1_raw.dot(&e0)?;
    let e1 = Vecs {
        x: e1_raw.x.f_sub(&c.f_mul(&e0.x)?)?,
        y: e1_raw.y.f_sub(&c.f_mul(&e0.y)?)?,
        z: e1_raw.z.f_sub(&c.f_mul(&e0.z)?)?,
    }
    .robust_normalize()?;
    let e2 = e0.cross(&e1)?;
    let along = |axis: &Vecs| -> Result<Tensor> { Ok(axis.dot(a3)?.f_add(&axis.dot(a2)?.f_neg()?)?) };
    Ok((along(&e1)?, along(&e2)?))
}

/// AlphaFold's seven torsion angles of every residue (`atom37_to_torsion_angles`): omega,
/// phi, psi and chi1..chi4, as (sin, cos) [.., N, 7, 2], their pi-periodic alternatives (chis
/// of symmetric side chains turned by pi) and their masks [.., N, 7]. `aatype` [.., N],
/// `positions` [.., N, 37, 3], `masks` [.., N, 37]; computed in fp32.
pub fn torsion_angles(aatype: &Tensor, positions: &Tensor, masks: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let tables = Tables::new(positions.device());
    let aatype = aatype.f_clamp(0, 20)?;
    let kind = match positions.kind() {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    };
    let pos = positions.f_to_kind(kind)?;
    let mask = masks.f_to_kind(kind)?;
    let n_dim = aatype.dim() as i64 - 1;
    // The previous residue's atoms (zero before the first).
    let shift = |t: &Tensor| -> Result<Tensor> {
        let n = t.size()[n_dim as usize];
        let first = t.f_narrow(n_dim, 0, 1)?.f_zeros_like()?;
        Ok(Tensor::f_cat(&[first, t.f_narrow(n_dim, 0, n - 1)?], n_dim)?)
    };
    let (prev_pos, prev_mask) = (shift(&pos)?, shift(&mask)?);
    let atoms = |t: &Tensor, idx: &[i64]| -> Result<Tensor> {
        Ok(t.f_index_select(n_dim + 1, &Tensor::from_slice(idx).to_device(t.device()))?)
    };
    // atom37: N 0, CA 1, C 2, O 4.
    let omega = Tensor::f_cat(&[atoms(&prev_pos, &[1, 2])?, atoms(&pos, &[0, 1])?], -2)?;
    let phi = Tensor::f_cat(&[atoms(&prev_pos, &[2])?, atoms(&pos, &[0, 1, 2])?], -2)?;
    let psi = atoms(&pos, &[0, 1, 2, 4])?;
    let prod = |t: Tensor| -> Result<Tensor> { Ok(t.f_prod_dim_int(-1, false, kind)?) };
    let omega_mask = prod(atoms(&prev_mask, &[1, 2])?)?.f_mul(&prod(atoms(&mask, &[0, 1])?)?)?;
    let phi_mask = prod(atoms(&prev_mask, &[2])?)?.f_mul(&prod(atoms(&mask, &[0, 1, 2])?)?)?;
    let psi_mask = prod(atoms(&mask, &[0, 1, 2, 4])?)?;
    // Chi atoms: gather the four atoms of each chi of each residue.
    let chi_idx = tables.chi_angles_atom_indices.f_index_select(0, &aatype.f_flatten(0, -1)?)?; // [B, 4, 4]
    let flat_pos = pos.f_flatten(0, n_dim)?; // [B, 37, 3]
    let flat_mask = mask.f_flatten(0, n_dim)?; // [B, 37]
    let b = flat_pos.size()[0];
    let gather_idx = chi_idx.f_reshape([b, 16])?;
    let chi_pos = flat_pos
        .f_gather(1, &gather_idx.f_unsqueeze(-1)?.f_expand([b, 16, 3], false)?, false)?
        .f_reshape([b, 4, 4, 3])?;
    let chi_atom_mask = flat_mask.f_gather(1, &gather_idx, false)?.f_reshape([b, 4, 4])?;
    let chi_mask = tables
        .chi_angles_mask
        .f_index_select(0, &aatype.f_flatten(0, -1)?)?
        .f_mul(&chi_atom_mask.f_prod_dim_int(-1, false, kind)?)?;
    let lead: Vec<i64> = aatype.size();
    let unflat = |t: Tensor, tail: &[i64]| -> Result<Tensor> {
        let shape: Vec<i64> = lead.iter().chain(tail).copied().collect();
        Ok(t.f_reshape(shape.as_slice())?)
    };
    let chi_pos = unflat(chi_pos, &[4, 4, 3])?;
    let chi_mask = unflat(chi_mask, &[4])?;
    let all = Tensor::f_cat(&[omega.f_unsqueeze(-3)?, phi.f_unsqueeze(-3)?, psi.f_unsqueeze(-3)?, chi_pos], -3)?;
    let mask7 = Tensor::f_cat(
        &[omega_mask.f_unsqueeze(-1)?, phi_mask.f_unsqueeze(-1)?, psi_mask.f_unsqueeze(-1)?, chi_mask],
        -1,
    )?;
    // Frame: origin the third atom, negative x towards the second, the first in the xy plane;
    // (sin, cos) from the fourth atom's z and y there (AlphaFold's convention).
    let point = |k: i64| -> Result<Vecs> { Vecs::of(&all.f_select(-2, k)?) };
    let (a0, a1, a2, a3) = (point(0)?, point(1)?, point(2)?, point(3)?);
    let (y, z) = fourth_atom_in_frame(&a0, &a1, &a2, &a3)?;
    let sin_cos = Tensor::f_stack(&[z, y], -1)?;
    let sq = sin_cos.f_select(-1, 0)?.f_square()?.f_add(&sin_cos.f_select(-1, 1)?.f_square()?)?;
    let sin_cos = sin_cos.f_div(&ieee_sqrt(&sq.f_add_scalar(1e-8)?)?.f_unsqueeze(-1)?)?;
    // psi came from O, which sits opposite the next N: turn it by pi.
    let sign = Tensor::from_slice(&[1f32, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0]).to_device(pos.device()).f_unsqueeze(-1)?;
    let sin_cos = sin_cos.f_mul(&sign)?;
    let periodic = unflat(tables.chi_pi_periodic.f_index_select(0, &aatype.f_flatten(0, -1)?)?, &[4])?;
    let mirror = Tensor::f_cat(
        &[periodic.f_narrow(-1, 0, 3)?.f_ones_like()?, periodic.f_mul_scalar(-2.0)?.f_add_scalar(1.0)?],
        -1,
    )?;
    let alt = sin_cos.f_mul(&mirror.f_unsqueeze(-1)?)?;
    Ok((sin_cos, alt, mask7))
}

/// The [T, N, 57] torsion features of templates ([`ANGLE_FEATURES`]) and their psi masks
/// [T, N], which become the MSA mask of the template rows.
pub fn angle_features(t: &TemplateFeatures) -> Result<(Tensor, Tensor)> {
    let (sin_cos, alt, mask) = torsion_angles(&t.aatype, &t.all_atom_positions, &t.all_atom_masks)?;
    let size = t.aatype.size();
    let flat = |x: Tensor| -> Result<Tensor> { Ok(x.f_reshape([size[0], size[1], 14])?) };
    let one_hot = t.aatype.f_one_hot(22)?.f_to_kind(Kind::Float)?;
    let features = Tensor::f_cat(&[one_hot, flat(sin_cos)?, flat(alt)?, mask.shallow_clone()], -1)?;
    Ok((features, mask.f_select(-1, 2)?))
}

/// The [T, N, N, 88] pair features of one recycling slice's templates ([`PAIR_FEATURES`]).
pub fn pair_features(t: &TemplateFeatures) -> Result<Tensor> {
    pair_feature_rows(t, 0, t.aatype.size().get(1).copied().unwrap_or(0))
}

/// Rows `[start, start + rows)` of [`pair_features`]: [T, rows, N, 88]. Every feature of an
/// entry (i, j) is made from residues i and j alone, so rows made apart equal the whole's.
pub fn pair_feature_rows(t: &TemplateFeatures, start: i64, rows: i64) -> Result<Tensor> {
    let size = t.aatype.size();
    ensure!(size.len() == 2, "template_aatype: expected shape [templates, residues], found {size:?}");
    let (templates, n) = (size[0], size[1]);
    let checks = [
        ("template_all_atom_positions", &t.all_atom_positions, vec![templates, n, 37, 3]),
        ("template_all_atom_masks", &t.all_atom_masks, vec![templates, n, 37]),
        ("template_mask", &t.mask, vec![templates]),
        ("template_pseudo_beta", &t.pseudo_beta, vec![templates, n, 3]),
        ("template_pseudo_beta_mask", &t.pseudo_beta_mask, vec![templates, n]),
    ];
    for (what, x, want) in checks {
        ensure!(x.size() == want, "{what}: expected shape {want:?}, found {:?}", x.size());
    }
    // Residue i's side of an entry: the rows' own slice of a per-residue array.
    let row_side = |x: &Tensor| x.f_narrow(1, start, rows);
    let outer = |m: &Tensor| -> Result<Tensor> { Ok(row_side(m)?.f_unsqueeze(-1)?.f_mul(&m.f_unsqueeze(-2)?)?) };
    let float = |x: &Tensor| x.f_to_kind(Kind::Float);
    let pseudo_beta = float(&t.pseudo_beta)?;
    let dgram = distance_one_hot_between(&row_side(&pseudo_beta)?, &pseudo_beta, DGRAM_BINS, DGRAM_MIN, DGRAM_MAX)?;
    let pb_mask = outer(&float(&t.pseudo_beta_mask)?)?;
    let one_hot = t.aatype.f_one_hot(22)?.f_to_kind(Kind::Float)?;
    let shape = [templates, rows, n, 22];
    let aatype_j = one_hot.f_unsqueeze(1)?.f_expand(shape, false)?;
    let aatype_i = row_side(&one_hot)?.f_unsqueeze(2)?.f_expand(shape, false)?;
    let masks = float(&t.all_atom_masks)?;
    let backbone = masks.f_select(-1, 0)?.f_mul(&masks.f_select(-1, 1)?)?.f_mul(&masks.f_select(-1, 2)?)?;
    let backbone = outer(&backbone)?.f_unsqueeze(-1)?;
    let unit_vector = Tensor::f_zeros([templates, rows, n, 3], (Kind::Float, t.aatype.device()))?;
    let features = Tensor::f_cat(
        &[
            dgram.f_to_kind(Kind::Float)?,
            pb_mask.f_unsqueeze(-1)?,
            aatype_j,
            aatype_i,
            unit_vector,
            backbone.shallow_clone(),
        ],
        -1,
    )?;
    Ok(features.f_mul(&backbone)?)
}

/// One block of the template pair stack: AlphaFold's monomer order (triangle attentions
/// first) or AlphaFold-Multimer's (`TemplateEmbeddingIteration`: the Evoformer's pair order,
/// triangle multiplications first).
pub(crate) struct TemplatePairBlock {
    tri_att_start: TriangleAttention,
    tri_att_end: TriangleAttention,
    tri_mul_out: TriangleMultiplication,
    tri_mul_in: TriangleMultiplication,
    pair_transition: Transition,
    multiplications_first: bool,
}

impl TemplatePairBlock {
    fn new(p: &Scope, c: &TemplateConfig) -> Result<Self> {
        Self::build(p, c, false, false)
    }

    /// AlphaFold-Multimer's block, its triangle multiplications with v3's fused arrays when
    /// `fused` ([`TriangleMultiplication::fused`]).
    pub(crate) fn multimer(p: &Scope, c: &TemplateConfig, fused: bool) -> Result<Self> {
        Self::build(p, c, true, fused)
    }

    fn build(p: &Scope, c: &TemplateConfig, multiplications_first: bool, fused: bool) -> Result<Self> {
        let att = |name: &str, d| TriangleAttention::new(&p.sub(name), d, c.c_t, c.pair_heads, c.pair_head_dim);
        let mul = |name: &str, d| match fused {
            true => TriangleMultiplication::fused(&p.sub(name), d, c.c_t, c.tri_mul_channels),
            false => TriangleMultiplication::new(&p.sub(name), d, c.c_t, c.tri_mul_channels),
        };
        Ok(TemplatePairBlock {
            tri_att_start: att("triangle_attention_starting_node", Direction::Outgoing)?,
            tri_att_end: att("triangle_attention_ending_node", Direction::Incoming)?,
            tri_mul_out: mul("triangle_multiplication_outgoing", Direction::Outgoing)?,
            tri_mul_in: mul("triangle_multiplication_incoming", Direction::Incoming)?,
            pair_transition: Transition::new(&p.sub("pair_transition"), c.c_t, c.transition_factor)?,
            multiplications_first,
        })
    }

    /// Updates `x` [N, N, c_t] of one template, `mask` [N, N], whole on this rank (`exec`
    /// without DAP); in training with `key`, the block's own key (see the module docs).
    pub(crate) fn run(&self, x: &mut Stream, mask: &Tensor, exec: &Exec, key: Option<Key>) -> Result<()> {
        let rates = exec.dropout().map(|d| d.template_pair_stack);
        let splits = if self.multiplications_first { 20 } else { 6 };
        let keys = key.filter(|_| rates.is_some()).map(|k| k.split(splits)).unwrap_or_default();
        let size = x.get().size();
        let (shape, kind, device) = ([size[0], size[1], size[2]], x.get().kind(), x.get().device());
        let mut next = 0;
        let mut draw = |rate: fn(&Rates) -> f64, shared: Shared| -> Result<Option<DropMask>> {
            let (Some(rates), false) = (rates, keys.is_empty()) else { return Ok(None) };
            next += 1;
            DropMask::draw(keys[next], rate(&rates), shape, shared, shape, None, &Dap::none(), kind, device)
        };
        if self.multiplications_first {
            x.drop_next(draw(|r| r.triangle_multiplication_outgoing, Shared::Rows)?);
            self.tri_mul_out.update(x, mask, exec)?;
            x.drop_next(draw(|r| r.triangle_multiplication_incoming, Shared::Rows)?);
            self.tri_mul_in.update(x, mask, exec)?;
        }
        x.drop_next(draw(|r| r.triangle_attention_starting_node, Shared::Rows)?);
        self.tri_att_start.update(x, mask, exec)?;
        x.drop_next(draw(|r| r.triangle_attention_ending_node, Shared::Columns)?);
        self.tri_att_end.update(x, mask, exec)?;
        if !self.multiplications_first {
            x.drop_next(draw(|r| r.triangle_multiplication_outgoing, Shared::Rows)?);
            self.tri_mul_out.update(x, mask, exec)?;
            x.drop_next(draw(|r| r.triangle_multiplication_incoming, Shared::Rows)?);
            self.tri_mul_in.update(x, mask, exec)?;
        }
        x.drop_next(draw(|r| r.pair_transition, Shared::Rows)?);
        self.pair_transition.update(x, ChunkOp::PairTransition, exec)
    }
}

/// Runs a template pair stack's `blocks` on one template's `x`, in training from `key` (the
/// stack's), the blocks' keys chained as DeepMind's stacks chain them: the monomer's block
/// takes the key as it is and hands on the first of its split in six, the Multimer's layer
/// stack splits in two, the block taking the second and handing on the first.
pub(crate) fn run_stack(
    blocks: &[TemplatePairBlock],
    x: &mut Stream,
    mask: &Tensor,
    exec: &Exec,
    key: Option<Key>,
) -> Result<()> {
    let mut chain = key;
    for block in blocks {
        let block_key = match (chain, block.multiplications_first) {
            (Some(k), true) => {
                let s = k.split(2);
                chain = Some(s[0]);
                Some(s[1])
            }
            (Some(k), false) => {
                chain = Some(k.split(6)[0]);
                Some(k)
            }
            (None, _) => None,
        };
        block.run(x, mask, exec, block_key)?;
    }
    Ok(())
}

/// Attention of each pair entry (query) over the templates' entries at the same position
/// (keys and values), without gating (`template_embedding/attention`).
struct PointwiseAttention {
    query_w: Tensor,
    key_w: Tensor,
    value_w: Tensor,
    output_w: Tensor,
    output_b: Tensor,
    head_dim: i64,
}

impl PointwiseAttention {
    fn new(p: &Scope, c_z: i64, c_t: i64, heads: i64, head_dim: i64) -> Result<Self> {
        Ok(PointwiseAttention {
            query_w: p.param("query_w", &[c_z, heads, head_dim], Init::Weight { fan_in: c_z })?,
            key_w: p.param("key_w", &[c_t, heads, head_dim], Init::Weight { fan_in: c_t })?,
            value_w: p.param("value_w", &[c_t, heads, head_dim], Init::Weight { fan_in: c_t })?,
            output_w: p.param("output_w", &[heads, head_dim, c_z], Init::Weight { fan_in: heads * head_dim })?,
            output_b: p.param("output_b", &[c_z], Init::Small)?,
            head_dim,
        })
    }

    /// Rows `[start, start + n)` of the update of `pair` [N, N, c_z] from `templates` [T, N, N,
    /// c_t] with the mask's bias `bias` [T] → [n, N, c_z].
    fn rows(&self, pair: &Tensor, templates: &Tensor, bias: &Tensor, start: i64, n: i64) -> Result<Tensor> {
        let e = |eq: &str, a: &Tensor, b: &Tensor| Tensor::f_einsum(eq, &[a, b], None::<&[i64]>);
        let x = narrow(pair, 0, start, n)?;
        let t = narrow(templates, 1, start, n)?;
        let q = e("ija,ahc->ijhc", &x, &self.query_w)?.f_mul_scalar((self.head_dim as f64).powf(-0.5))?;
        let k = e("tija,ahc->tijhc", &t, &self.key_w)?;
        let v = e("tija,ahc->tijhc", &t, &self.value_w)?;
        let logits = e("ijhc,tijhc->ijht", &q, &k)?.f_add(bias)?;
        let avg = e("ijht,tijhc->ijhc", &logits.f_softmax(-1, None)?, &v)?;
        self.output(&avg)
    }

    /// The output projection of the averaged values `avg` [n, N, heads, head_dim].
    fn output(&self, avg: &Tensor) -> Result<Tensor> {
        let out = Tensor::f_einsum("ijhc,hco->ijo", &[avg, &self.output_w], None::<&[i64]>)?;
        Ok(out.f_add(&self.output_b)?)
    }

    /// Folds template `index` (`template` [N, N, c_t], its key bias `bias` [T]) into the online
    /// softmax `acc` over the templates so far, pair rows `[start, start + n)`: its logits
    /// against the query of those rows of `pair` [N, N, c_z], the running maximum and sum of
    /// the exponentials and the running weighted values rescaled to the new maximum. The
    /// first template sets them (weight 1).
    fn fold(&self, acc: &OnlineSoftmax, pair: &Tensor, template: &Tensor, bias: &Tensor, index: i64) -> Result<()> {
        let e = |eq: &str, a: &Tensor, b: &Tensor| Tensor::f_einsum(eq, &[a, b], None::<&[i64]>);
        let fold_rows = |start: i64, n: i64| -> Result<()> {
            let x = narrow(pair, 0, start, n)?;
            let t = narrow(template, 0, start, n)?;
            let q = e("ija,ahc->ijhc", &x, &self.query_w)?.f_mul_scalar((self.head_dim as f64).powf(-0.5))?;
            let k = e("ija,ahc->ijhc", &t, &self.key_w)?;
            // The running terms are in f32 at a reduced precision (see `OnlineSoftmax`): the
            // logits and values widened to them, as they are made.
            let logits = {
                let logits = q.f_mul(&k)?.f_sum_dim_intlist(-1, false, None)?.f_add(&bias.f_get(index)?)?;
                drop((q, k));
                logits.f_to_kind(acc.kind)?
            };
            let mut v = e("ija,ahc->ijhc", &t, &self.value_w)?.f_to_kind(acc.kind)?;
            let (mut max, mut sum, mut values) =
                (narrow(&acc.max, 0, start, n)?, narrow(&acc.sum, 0, start, n)?, narrow(&acc.values, 0, start, n)?);
            if index == 0 {
                max.f_copy_(&logits)?;
                let _ = sum.f_fill_(1.0)?;
                return Ok(values.f_copy_(&v)?);
            }
            let new_max = max.f_maximum(&logits)?;
            let mut rescale = max.f_sub(&new_max)?;
            let _ = rescale.f_exp_()?;
            let mut weight = logits.f_sub(&new_max)?;
            let _ = weight.f_exp_()?;
            drop(logits);
            let _ = sum.f_mul_(&rescale)?.f_add_(&weight)?;
            let _ = v.f_mul_(&weight.f_unsqueeze(-1)?)?;
            let _ = values.f_mul_(&rescale.f_unsqueeze(-1)?)?.f_add_(&v)?;
            Ok(max.f_copy_(&new_max)?)
        };
        let len = pair.size()[0];
        let chunk = step(len, acc.chunk)?;
        let mut start = 0;
        while start < len {
            let n = chunk.min(len - start);
            fold_rows(start, n)?;
            start += n;
        }
        Ok(())
    }
}

/// The pointwise attention's softmax over the templates taken one template at a time (the
/// inference path): per pair entry and head the largest logit so far, the sum of the
/// exponentials relative to it, and the values weighted by them. Only these and one
/// template's embedding are alive, never the templates' stack [T, N, N, c_t]. At a reduced
/// precision (bf16, fp16) they are kept in f32, so that folding in template after template
/// rounds no more than the stacked softmax's one pass does.
struct OnlineSoftmax {
    max: Tensor,
    sum: Tensor,
    values: Tensor,
    /// Pair rows a fold takes at a time (`None`: all).
    chunk: Option<i64>,
    /// The running terms' kind, and the pair's (the averaged values' on the way out).
    kind: Kind,
    pair_kind: Kind,
}

impl OnlineSoftmax {
    /// Empty terms for the pair rows `pair` [rows, N, c_z] (their kind and device).
    fn new(pair: &Tensor, a: &PointwiseAttention, chunk: Option<i64>) -> Result<Self> {
        let kind = match pair.kind() {
            Kind::BFloat16 | Kind::Half => Kind::Float,
            other => other,
        };
        let (rows, n, heads, opts) = (pair.size()[0], pair.size()[1], a.query_w.size()[1], (kind, pair.device()));
        Ok(OnlineSoftmax {
            max: Tensor::f_empty([rows, n, heads], opts)?,
            sum: Tensor::f_empty([rows, n, heads], opts)?,
            values: Tensor::f_empty([rows, n, heads, a.head_dim], opts)?,
            chunk,
            kind,
            pair_kind: pair.kind(),
        })
    }

    /// Rows `[start, start + n)` of the averaged values [n, N, heads, head_dim], in the pair's
    /// kind.
    fn averaged(&self, start: i64, n: i64) -> Result<Tensor> {
        let sum = narrow(&self.sum, 0, start, n)?.f_unsqueeze(-1)?;
        Ok(narrow(&self.values, 0, start, n)?.f_div(&sum)?.f_to_kind(self.pair_kind)?)
    }
}

/// The template embedding: the pair update from the templates and, with torsion features, the
/// template rows of the MSA.
pub struct Templates {
    embedding2d: Linear,
    blocks: Vec<TemplatePairBlock>,
    output_layer_norm: LayerNorm,
    attention: PointwiseAttention,
    single: Option<(Linear, Linear)>,
}

impl Templates {
    /// The template modules over `params`, when its arrays have a template embedding.
    pub fn new(params: &Params) -> Result<Option<Self>> {
        let cfg = params.config();
        match params.model_config()?.templates {
            Some(t) => Ok(Some(Self::build(&params.builder(), &t, cfg.c_z, cfg.c_m)?)),
            None => Ok(None),
        }
    }

    /// Builds (or creates the arrays of) the template modules for pair width `c_z` and MSA
    /// width `c_m`.
    pub(crate) fn build(b: &Builder, c: &TemplateConfig, c_z: i64, c_m: i64) -> Result<Self> {
        let single = b.root(SINGLE_TEMPLATE);
        let blocks = (0..c.blocks)
            .map(|i| TemplatePairBlock::new(&b.block(PAIR_STACK, i, c.blocks), c))
            .collect::<Result<_>>()?;
        let root = b.root(EMBEDDINGS);
        Ok(Templates {
            embedding2d: Linear::new(&single.sub("embedding2d"), PAIR_FEATURES, c.c_t, true)?,
            blocks,
            output_layer_norm: LayerNorm::new(&single.sub("output_layer_norm"), c.c_t)?,
            attention: PointwiseAttention::new(
                &b.root(TEMPLATE_EMBEDDING).sub("attention"),
                c_z,
                c.c_t,
                c.attention_heads,
                c.attention_head_dim,
            )?,
            single: match c.torsion_angles {
                true => Some((
                    Linear::new(&root.sub("template_single_embedding"), ANGLE_FEATURES, c_m, true)?,
                    Linear::new(&root.sub("template_projection"), c_m, c_m, true)?,
                )),
                false => None,
            },
        })
    }

    /// The update of `pair` [N, N, c_z] from the templates (`pair_mask` [N, N]): zero when no
    /// template is real.
    pub fn pair_update(&self, pair: &Tensor, t: &TemplateFeatures, pair_mask: &Tensor, exec: &Exec) -> Result<Tensor> {
        let stacked = self.pair_stack(t, pair_mask, pair.kind(), exec, None)?;
        self.pointwise_attention(pair, &stacked, &t.mask, exec)
    }

    /// Adds the templates' update to `pair` ([`Templates::pair_update`]), pair rows a chunk at
    /// a time (in place where the stream allows). Without gradients each template is folded
    /// into an online softmax as it leaves the pair stack (`OnlineSoftmax`), so the stack
    /// [T, N, N, c_t], a long query's largest buffer with templates, is never made; a masked
    /// template's logits carry the same bias as in the stacked softmax (its weight 0).
    /// In training, `key` (the templates' keys) keys the pair stack's dropout
    /// ([`Templates::pair_stack`]). `pair` holds the real rows `rows` holds (whole in training);
    /// the templates' stacks run whole on every rank, `pair_mask` [N, N] whole.
    pub fn add_pair_update(
        &self,
        pair: &mut Stream,
        t: &TemplateFeatures,
        pair_mask: &Tensor,
        exec: &Exec,
        key: Option<Key>,
        rows: &PairRows,
    ) -> Result<()> {
        let kind = pair.get().kind();
        let (bias, any) = self.mask_terms(&t.mask, kind)?;
        let chunk = exec.chunk_for(ChunkOp::TemplatePointwise);
        // Training (anything recording gradients, the checkpointed blocks' first forward
        // included, so that their recomputation repeats it, and every pass that drops out)
        // keeps the templates' stack and one softmax over it; inference folds the templates in
        // one at a time.
        if pair.get().requires_grad() || self.attention.query_w.requires_grad() || exec.dropout().is_some() {
            ensure!(!rows.is_split(), "the templates' update in training takes the whole pair");
            let stacked = self.pair_stack(t, pair_mask, kind, exec, key)?;
            return pair.add_chunked(0, chunk, |z, start, n| {
                Ok(self.attention.rows(z, &stacked, &bias, start, n)?.f_mul(&any)?)
            });
        }
        let (stage, mask) = (exec.without_dap().in_stage(Stage::Templates), pair_mask.f_to_kind(kind)?);
        let mut acc = None;
        for i in 0..t.aatype.size()[0] {
            let embedded = self.embed(t, i, &mask, kind, &stage, None)?;
            let embedded = embedded.f_narrow(0, rows.start(), rows.real())?;
            // Made after the first template's stack, whose peak they would raise.
            let acc = match &mut acc {
                Some(acc) => acc,
                None => acc.insert(OnlineSoftmax::new(pair.get(), &self.attention, chunk)?),
            };
            self.attention.fold(acc, pair.get(), &embedded, &bias, i)?;
        }
        // No template: no update (`any` is 0).
        let Some(acc) = acc else { return Ok(()) };
        pair.add_chunked(0, chunk, |_, start, n| Ok(self.attention.output(&acc.averaged(start, n)?)?.f_mul(&any)?))
    }

    /// The pointwise attention's key bias [T] from `template_mask` [T] (AlphaFold's
    /// `1e9 (mask - 1)`) and the factor 1, or 0 when no template is real.
    fn mask_terms(&self, template_mask: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let bias = template_mask.f_to_kind(kind)?.f_sub_scalar(1.0)?.f_mul_scalar(1e9)?;
        let any = template_mask.f_sum(Kind::Float)?.f_gt(0.0)?.f_to_kind(kind)?;
        Ok((bias, any))
    }

    /// Every template's pair features through `embedding2d`, the template pair stack and the
    /// final norm: [T, N, N, c_t] in `kind`. The stack's mask is the query's `pair_mask`
    /// [N, N], as in AlphaFold (the template's own masks are part of its features). Every rank
    /// runs it whole, whatever `exec`'s DAP group, one template at a time (its features made
    /// only when it runs). In training, with `key` and `exec`'s dropout rates, template `i`'s
    /// stack drops from the `i`th key of `key`'s split in as many as there are templates.
    pub fn pair_stack(
        &self,
        t: &TemplateFeatures,
        pair_mask: &Tensor,
        kind: Kind,
        exec: &Exec,
        key: Option<Key>,
    ) -> Result<Tensor> {
        let exec = exec.without_dap().in_stage(Stage::Templates);
        let mask = pair_mask.f_to_kind(kind)?;
        let count = t.aatype.size()[0];
        let keys = key.filter(|_| exec.dropout().is_some()).map(|k| k.split(count as usize));
        chunked(count, Some(1), |i, _| {
            let key = keys.as_ref().map(|k| k[i as usize]);
            self.embed(t, i, &mask, kind, &exec, key)?.f_unsqueeze(0).map_err(Into::into)
        })
    }

    /// Template `i`'s pair features through `embedding2d`, the pair stack (`mask` [N, N] in
    /// `kind`; `exec` the templates' stage, without DAP; in training from the stack's `key`)
    /// and the final norm: [N, N, c_t].
    fn embed(
        &self,
        t: &TemplateFeatures,
        i: i64,
        mask: &Tensor,
        kind: Kind,
        exec: &Exec,
        key: Option<Key>,
    ) -> Result<Tensor> {
        let one = t.map(|x| x.narrow(0, i, 1));
        // The features a chunk of rows at a time: at 88 channels, wider than the stack's,
        // they would be the largest buffer of a long query's templates whole.
        let rows = one.aatype.size()[1];
        let embedded = chunked(rows, exec.chunk_for(ChunkOp::PairEmbedding), |start, n| {
            let features = pair_feature_rows(&one, start, n)?.f_to_kind(kind)?.f_squeeze_dim(0)?;
            self.embedding2d.forward(&features)
        })?;
        let mut x = Stream::new(embedded, true);
        run_stack(&self.blocks, &mut x, mask, exec, key)?;
        self.output_layer_norm.forward(x.get())
    }

    /// The pair stack's blocks alone on one template's embedded pair `x` [N, N, c_t] (`mask`
    /// [N, N]), in training from the stack's `key` (before the final norm).
    pub fn pair_stack_blocks(&self, x: &Tensor, mask: &Tensor, exec: &Exec, key: Option<Key>) -> Result<Tensor> {
        let exec = exec.without_dap().in_stage(Stage::Templates);
        let mut x = Stream::new(x.shallow_clone(), false);
        run_stack(&self.blocks, &mut x, mask, &exec, key)?;
        Ok(x.into_inner())
    }

    /// The pointwise attention of `pair` [N, N, c_z] over the stacked templates [T, N, N,
    /// c_t] (`template_mask` `[T]`), times zero when no template is real.
    pub fn pointwise_attention(
        &self,
        pair: &Tensor,
        stacked: &Tensor,
        template_mask: &Tensor,
        exec: &Exec,
    ) -> Result<Tensor> {
        let (bias, any) = self.mask_terms(template_mask, pair.kind())?;
        let update = chunked(pair.size()[0], exec.chunk_for(ChunkOp::TemplatePointwise), |start, n| {
            self.attention.rows(pair, stacked, &bias, start, n)
        })?;
        Ok(update.f_mul(&any)?)
    }

    /// The template rows of the MSA [T, N, c_m] and their mask [T, N], when the parameters
    /// embed torsion angles.
    pub fn msa_rows(&self, t: &TemplateFeatures, kind: Kind) -> Result<Option<(Tensor, Tensor)>> {
        let Some((embed, project)) = &self.single else { return Ok(None) };
        let (features, mask) = angle_features(t)?;
        let x = embed.forward(&features.f_to_kind(kind)?)?.f_relu()?;
        Ok(Some((project.forward(&x)?, mask.f_to_kind(kind)?)))
    }
}
