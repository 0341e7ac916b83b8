//! AlphaFold-Multimer's template embedding (`TemplateEmbedding` in `modules_multimer.py`):
//! each template's pair features embedded ([`TemplatePairEmbedding`]), through the template
//! pair stack (`template_embedding_iteration`, stacked: the monomer's blocks in the
//! Evoformer's pair order, with v3's fused triangle projections when the arrays have them)
//! and `output_layer_norm`; the sum over templates (padding ones too) divided by their
//! number, ReLU, and `output_linear` back to the pair width ([`MultimerTemplates`]). Unlike
//! the monomer's there is no attention over templates.
//!
//! The stack's input (`SingleTemplateEmbedding`'s `construct_input`) is each pair feature of
//! one template through a Linear of its own, `template_pair_embedding_<i>` under
//! `alphafold/alphafold_iteration/evoformer/template_embedding/single_template_embedding`,
//! summed with the normalised query pair (`query_embedding_norm`, then Linear 8):
//!
//! | i | feature | channels |
//! |---|---|---|
//! | 0 | pseudo-beta distogram (39 bins, 3.25-50.75 Å), times the pseudo-beta pair mask | 39 |
//! | 1 | pseudo-beta pair mask (pseudo-beta from the atoms: C-beta, C-alpha for glycine) | scalar |
//! | 2, 3 | residue `j`'s and residue `i`'s template type, one-hot | 22 each |
//! | 4, 5, 6 | x, y, z of the unit vector from residue `i`'s backbone frame to `j`'s C-alpha, times the backbone pair mask | scalar each |
//! | 7 | backbone pair mask (N, C-alpha and C all present at both residues) | scalar |
//! | 8 | the query pair, LayerNorm | c_z |
//!
//! Every distance-based feature and mask is zero between chains (`asym_id` differs): each
//! chain's templates are its own. A scalar feature's "Linear" (haiku's `num_input_dims=0`)
//! has `weights` `[c_t]` and `bias` `[c_t]`: `x w + b`.
//!
//! The backbone frame is `Rot3Array.from_two_vectors(C - CA, N - CA)` at CA, its vectors
//! normalised as AlphaFold's `Vec3Array.normalized` does (by `sqrt(max(|v|², 1e-12))`, so a
//! residue without atoms gives a zero frame and zero unit vectors, not NaN). A residue's own
//! C-alpha in its own frame is exactly zero here, as in DeepMind's code run op by op;
//! jit-compiled (inside `TemplateEmbedding`'s scan) XLA's fused arithmetic leaves a rounding
//! residue there that normalises to an arbitrary unit vector, and the embedding changes with it
//! (by 5% of its largest value on the test's fixture), so the comparison is with the op-by-op
//! run.
use std::path::Path;

use tch::{Kind, Tensor};

use crate::jax_random::Key;
use crate::model::config::TemplateConfig;
use crate::model::embedders::{distance_one_hot_between, pseudo_beta, shape_error, CA, CB, GLYCINE};
use crate::model::exec::{ChunkOp, Exec, Stage};
use crate::model::keys::{MULTIMER_TEMPLATE_STACK, SINGLE_TEMPLATE, TEMPLATE_EMBEDDING};
use crate::model::layers::{chunked, narrow, LayerNorm, Linear, Stream};
use crate::model::multimer::Arrays;
use crate::model::pair_rows::PairRows;
use crate::model::scope::{Builder, Init, Scope};
use crate::model::templates::{run_stack, TemplatePairBlock, DGRAM_BINS, DGRAM_MAX, DGRAM_MIN};
use crate::model::{Error, Result};

/// Classes of the template residue one-hot (20 amino acids, unknown, gap).
pub const TEMPLATE_CLASSES: i64 = 22;
/// atom37 indices of the backbone's N and C.
const N_ATOM: i64 = 0;
const C_ATOM: i64 = 2;
/// `Vec3Array.norm`'s clipping: the norm is at least 1e-6.
const NORM_EPSILON: f64 = 1e-6;

/// A Linear from a scalar feature (haiku's `num_input_dims=0`): `x w + b`, `w`, `b` [c].
struct ScalarLinear {
    weights: Tensor,
    bias: Tensor,
}

impl ScalarLinear {
    fn new(p: &Scope, c: i64) -> Result<Self> {
        Ok(ScalarLinear {
            weights: p.param("weights", &[c], Init::Weight { fan_in: 1 })?,
            bias: p.param("bias", &[c], Init::Small)?,
        })
    }

    /// `x` [..] → [.., c].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_unsqueeze(-1)?.f_mul(&self.weights)?.f_add(&self.bias)?)
    }
}

/// One template's atoms: `aatype` `[N]` (classes 0-21), `positions` [N, 37, 3] (Å), `mask`
/// [N, 37].
pub struct TemplateAtoms<'a> {
    /// Residue types.
    pub aatype: &'a Tensor,
    /// atom37 positions.
    pub positions: &'a Tensor,
    /// atom37 masks.
    pub mask: &'a Tensor,
}

/// The multimer template pair embedding (see the module docs).
pub struct TemplatePairEmbedding {
    dgram: Linear,
    pseudo_beta_mask: ScalarLinear,
    aatype_j: Linear,
    aatype_i: Linear,
    unit_vector: [ScalarLinear; 3],
    backbone_mask: ScalarLinear,
    query: Linear,
    query_embedding_norm: LayerNorm,
    c_z: i64,
}

impl TemplatePairEmbedding {
    /// The embedding over the arrays of an AlphaFold-Multimer parameter file (`.npz` or
    /// `.safetensors`; arrays of other modules are left alone), its widths read from the
    /// shapes; a missing or mis-shaped array is an error naming the key and the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let arrays = Arrays::open(path.as_ref())?;
        let c_z = arrays.size(&format!("{SINGLE_TEMPLATE}/query_embedding_norm//scale"), 1, 0)?;
        let c_t = arrays.size(&format!("{SINGLE_TEMPLATE}/template_pair_embedding_0//weights"), 2, 1)?;
        Self::build(&arrays.builder(), c_z, c_t)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) the embedding from
    /// `c_z` query pair channels to `c_t` template channels.
    pub(crate) fn build(b: &Builder, c_z: i64, c_t: i64) -> Result<Self> {
        let p = b.root(SINGLE_TEMPLATE);
        let at = |i: usize| p.sub(&format!("template_pair_embedding_{i}"));
        Ok(TemplatePairEmbedding {
            dgram: Linear::new(&at(0), DGRAM_BINS, c_t, true)?,
            pseudo_beta_mask: ScalarLinear::new(&at(1), c_t)?,
            aatype_j: Linear::new(&at(2), TEMPLATE_CLASSES, c_t, true)?,
            aatype_i: Linear::new(&at(3), TEMPLATE_CLASSES, c_t, true)?,
            unit_vector: [
                ScalarLinear::new(&at(4), c_t)?,
                ScalarLinear::new(&at(5), c_t)?,
                ScalarLinear::new(&at(6), c_t)?,
            ],
            backbone_mask: ScalarLinear::new(&at(7), c_t)?,
            query: Linear::new(&at(8), c_z, c_t, true)?,
            query_embedding_norm: LayerNorm::new(&p.sub("query_embedding_norm"), c_z)?,
            c_z,
        })
    }

    /// The template stack's input [N, N, c_t] for one template's atoms, the query pair
    /// [N, N, c_z] and the residues' chains `asym_id` `[N]`.
    pub fn forward(&self, query: &Tensor, template: &TemplateAtoms, asym_id: &Tensor) -> Result<Tensor> {
        self.embed(query, template, asym_id, &Exec::serial())
    }

    /// [`TemplatePairEmbedding::forward`], made `exec`'s
    /// [`ChunkOp::PairEmbedding`] rows at a time
    /// (each chunk's pair features only): the same values, the features never whole.
    pub fn embed(&self, query: &Tensor, template: &TemplateAtoms, asym_id: &Tensor, exec: &Exec) -> Result<Tensor> {
        let n = match template.aatype.size().as_slice() {
            [n] => *n,
            _ => return Err(shape_error("template_aatype", "[residues]".into(), template.aatype.size())),
        };
        if query.size() != [n, n, self.c_z] {
            return Err(shape_error("query pair", format!("[{n}, {n}, {}]", self.c_z), query.size()));
        }
        if template.mask.size() != [n, 37] {
            return Err(shape_error("template_all_atom_mask", format!("[{n}, 37]"), template.mask.size()));
        }
        if asym_id.size() != [n] {
            return Err(shape_error("asym_id", format!("[{n}]"), asym_id.size()));
        }
        let kind = query.kind();
        let residues = residue_features(template, asym_id, kind)?;
        chunked(n, exec.chunk_for(ChunkOp::PairEmbedding), |start, rows| {
            let f = pair_features(&residues, start, rows, kind)?;
            let mut act = self.dgram.forward(&f.dgram)?;
            act = act.f_add(&self.pseudo_beta_mask.forward(&f.pseudo_beta_mask)?)?;
            act = act.f_add(&self.aatype_j.forward(&residues.aatype.f_unsqueeze(0)?)?)?;
            act = act.f_add(&self.aatype_i.forward(&narrow(&residues.aatype, 0, start, rows)?.f_unsqueeze(1)?)?)?;
            for (layer, v) in self.unit_vector.iter().zip(&f.unit_vector) {
                act = act.f_add(&layer.forward(v)?)?;
            }
            act = act.f_add(&self.backbone_mask.forward(&f.backbone_mask)?)?;
            let normed = self.query_embedding_norm.forward(&narrow(query, 0, start, rows)?)?;
            Ok(act.f_add(&self.query.forward(&normed)?)?)
        })
    }
}

/// Every template of a complex: [`TemplateAtoms`] with a leading template axis, `aatype`
/// [T, N], `positions` [T, N, 37, 3], `mask` [T, N, 37] (AlphaFold's `template_aatype`,
/// `template_all_atom_positions`, `template_all_atom_mask`; padding templates all zero).
pub type TemplateBatch<'a> = TemplateAtoms<'a>;

/// The whole multimer template embedding (see the module docs).
pub struct MultimerTemplates {
    config: TemplateConfig,
    pair_embedding: TemplatePairEmbedding,
    blocks: Vec<TemplatePairBlock>,
    output_layer_norm: LayerNorm,
    output_linear: Linear,
}

impl MultimerTemplates {
    /// The template embedding over the arrays of an AlphaFold-Multimer parameter file, its
    /// sizes read from the shapes (v3's fused triangle projections when the file has them); a
    /// missing or mis-shaped array is an error naming the key and the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let arrays = Arrays::open(path.as_ref())?;
        Self::from_arrays(&arrays, &arrays.shared_builder())
    }

    /// The embedding built by `b` over `arrays`, its sizes read from their shapes.
    pub(super) fn from_arrays(arrays: &Arrays, b: &Builder) -> Result<Self> {
        let key = |module: &str, name: &str| format!("{MULTIMER_TEMPLATE_STACK}/{module}//{name}");
        let c_z = arrays.size(&format!("{SINGLE_TEMPLATE}/query_embedding_norm//scale"), 1, 0)?;
        let att = |dim| arrays.size(&key("triangle_attention_starting_node/attention", "query_w"), 4, dim);
        let (blocks, c_t, pair_heads, pair_head_dim) = (att(0)?, att(1)?, att(2)?, att(3)?);
        let fused = arrays.contains(&key("triangle_multiplication_outgoing/projection", "weights"));
        let tri_mul_channels = match fused {
            true => arrays.size(&key("triangle_multiplication_outgoing/projection", "weights"), 3, 2)? / 2,
            false => arrays.size(&key("triangle_multiplication_outgoing/left_projection", "weights"), 3, 2)?,
        };
        let hidden = arrays.size(&key("pair_transition/transition1", "weights"), 3, 2)?;
        let config = TemplateConfig {
            c_t,
            blocks,
            pair_heads,
            pair_head_dim,
            tri_mul_channels,
            transition_factor: hidden / c_t.max(1),
            attention_heads: 0,
            attention_head_dim: 0,
            torsion_angles: false,
        };
        Self::build(b, &config, c_z, fused)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) the embedding for the
    /// pair width `c_z` and the template sizes `c` (its pointwise-attention and torsion sizes
    /// unused), the stack's triangle multiplications `fused` or not.
    pub(crate) fn build(b: &Builder, c: &TemplateConfig, c_z: i64, fused: bool) -> Result<Self> {
        let blocks = (0..c.blocks)
            .map(|i| TemplatePairBlock::multimer(&b.block(MULTIMER_TEMPLATE_STACK, i, c.blocks), c, fused))
            .collect::<Result<_>>()?;
        Ok(MultimerTemplates {
            config: *c,
            pair_embedding: TemplatePairEmbedding::build(b, c_z, c.c_t)?,
            blocks,
            output_layer_norm: LayerNorm::new(&b.root(SINGLE_TEMPLATE).sub("output_layer_norm"), c.c_t)?,
            output_linear: Linear::new(&b.root(TEMPLATE_EMBEDDING).sub("output_linear"), c.c_t, c_z, true)?,
        })
    }

    /// The stack's sizes (its pointwise-attention and torsion sizes unused).
    pub fn config(&self) -> &TemplateConfig {
        &self.config
    }

    /// The templates' update of the query pair `pair` (the real rows `rows` holds: [N, N, c_z]
    /// whole) added to it, in place where the stream allows: [`MultimerTemplates::average`]
    /// projected to the pair's width ([`MultimerTemplates::project`]) and added `exec`'s
    /// [`ChunkOp::PairEmbedding`] rows at a time in the template stage (whole, the projection
    /// would be one more pair beside the pair and the update).
    #[allow(clippy::too_many_arguments)]
    pub fn add_update(
        &self,
        pair: &mut Stream,
        templates: &TemplateBatch,
        pair_mask: &Tensor,
        asym_id: &Tensor,
        exec: &Exec,
        key: Option<Key>,
        rows: &PairRows,
    ) -> Result<()> {
        // The templates' embedding reads the query pair whole: under DAP inference the ranks'
        // rows are gathered for it, and each rank adds the update of its own.
        let query = rows.gather(pair.get())?;
        let averaged = self.average(&query, templates, pair_mask, asym_id, exec, key)?;
        drop(query);
        let averaged = averaged.f_narrow(0, rows.start(), rows.real())?;
        let chunk = exec.in_stage(Stage::Templates).chunk_for(ChunkOp::PairEmbedding);
        pair.add_chunked(0, chunk, |_, start, rows| self.project(&narrow(&averaged, 0, start, rows)?))
    }

    /// `output_linear`: rows of [`MultimerTemplates::average`] to the pair's width, the
    /// templates' update of those rows.
    pub fn project(&self, averaged: &Tensor) -> Result<Tensor> {
        self.output_linear.forward(averaged)
    }

    /// The templates' embeddings [N, N, c_t] of the query pair `query` [N, N, c_z] averaged,
    /// through ReLU: what [`MultimerTemplates::project`] makes the update of. The stack masked
    /// by `pair_mask` [N, N] (padding residues), the features by the chains `asym_id` `[N]`.
    /// Every rank runs it whole (`exec`'s chunk sizes, not its DAP group), one template at a
    /// time. Without autograd the sum, the mean and the ReLU are one buffer, updated in place.
    ///
    /// In training: with `key` (the templates', [`stack_keys`]) and `exec`'s dropout rates,
    /// the stacks drop as `TemplateEmbedding` keys them: the second half of `key`'s split is
    /// split per template, and each template's `SingleTemplateEmbedding` hands the second half
    /// of its key's split to its stack.
    ///
    /// [`stack_keys`]: crate::model::multimer::stack_keys
    pub fn average(
        &self,
        query: &Tensor,
        templates: &TemplateBatch,
        pair_mask: &Tensor,
        asym_id: &Tensor,
        exec: &Exec,
        key: Option<Key>,
    ) -> Result<Tensor> {
        let size = templates.aatype.size();
        let (count, n) = match size.as_slice() {
            [t, n] if *t > 0 => (*t, *n),
            _ => return Err(shape_error("template_aatype", "[templates (at least 1), residues]".into(), size)),
        };
        for (what, t, want) in [
            ("template_all_atom_positions", templates.positions, vec![count, n, 37, 3]),
            ("template_all_atom_mask", templates.mask, vec![count, n, 37]),
            ("pair mask", pair_mask, vec![n, n]),
        ] {
            if t.size() != want {
                return Err(shape_error(what, format!("{want:?}"), t.size()));
            }
        }
        let exec = exec.without_dap().in_stage(Stage::Templates);
        let mask = pair_mask.f_to_kind(query.kind())?;
        let keys = key.filter(|_| exec.dropout().is_some()).map(|k| k.split(2)[1].split(count as usize));
        let mut sum: Option<Tensor> = None;
        for i in 0..count {
            let atoms = TemplateAtoms {
                aatype: &templates.aatype.f_select(0, i)?,
                positions: &templates.positions.f_select(0, i)?,
                mask: &templates.mask.f_select(0, i)?,
            };
            let mut x = Stream::new(self.pair_embedding.embed(query, &atoms, asym_id, &exec)?, true);
            let stack_key = keys.as_ref().map(|k| k[i as usize].split(2)[1]);
            run_stack(&self.blocks, &mut x, &mask, &exec, stack_key)?;
            let embedded = self.output_layer_norm.forward(x.get())?;
            sum = Some(match sum {
                Some(mut s) if !s.requires_grad() && !embedded.requires_grad() => s.f_add_(&embedded)?,
                Some(s) => s.f_add(&embedded)?,
                None => embedded,
            });
        }
        let mut sum = sum.ok_or_else(|| Error::Invalid("template_aatype: no templates".into()))?;
        Ok(match sum.requires_grad() {
            true => sum.f_div_scalar(count as f64)?.f_relu()?,
            false => sum.f_div_scalar_(count as f64)?.f_relu_()?,
        })
    }
}

/// One template's per-residue quantities its pair features are made from.
struct ResidueFeatures {
    /// [N, 3] pseudo-beta positions and [N] their mask.
    pseudo_beta: Tensor,
    pseudo_beta_mask: Tensor,
    /// [N] N, C-alpha and C all present.
    backbone: Tensor,
    /// The backbone frames' axes e0, e1, e2, each [N, 3].
    frames: [Tensor; 3],
    /// [N, 3] C-alpha positions.
    ca: Tensor,
    /// [N, 22] residue types, one-hot.
    aatype: Tensor,
    /// [N] chains.
    asym_id: Tensor,
}

fn residue_features(t: &TemplateAtoms, asym_id: &Tensor, kind: Kind) -> Result<ResidueFeatures> {
    let positions = t.positions.f_to_kind(kind)?;
    let mask = t.mask.f_to_kind(kind)?;
    let aatype = t.aatype.f_to_kind(Kind::Int64)?;
    let pseudo_beta = pseudo_beta(&aatype, &positions)?;
    let gly = aatype.f_eq(GLYCINE)?;
    let pseudo_beta_mask = mask.f_select(1, CA)?.f_where_self(&gly, &mask.f_select(1, CB)?)?;
    let atom = |i: i64| positions.f_select(1, i);
    let (n_xyz, ca, c_xyz) = (atom(N_ATOM)?, atom(CA)?, atom(C_ATOM)?);
    let backbone = mask.f_select(1, N_ATOM)?.f_mul(&mask.f_select(1, CA)?)?.f_mul(&mask.f_select(1, C_ATOM)?)?;
    // Rot3Array.from_two_vectors(C - CA, N - CA): the frame's axes e0, e1, e2 [N, 3].
    let e0 = normalized(&c_xyz.f_sub(&ca)?)?;
    let e1 = n_xyz.f_sub(&ca)?;
    let e1 = normalized(&e1.f_sub(&e0.f_mul(&dot(&e1, &e0)?.f_unsqueeze(-1)?)?)?)?;
    let e2 = e0.f_cross(&e1, -1)?;
    Ok(ResidueFeatures {
        pseudo_beta,
        pseudo_beta_mask,
        backbone,
        frames: [e0, e1, e2],
        ca,
        aatype: aatype.f_one_hot(TEMPLATE_CLASSES)?.f_to_kind(kind)?,
        asym_id: asym_id.shallow_clone(),
    })
}

/// Rows `[start, start + rows)` of one template's pair features (the module docs' table,
/// without the residue types and the query).
struct PairFeatures {
    /// [rows, N, 39], masked.
    dgram: Tensor,
    /// [rows, N].
    pseudo_beta_mask: Tensor,
    /// x, y, z, each [rows, N], masked.
    unit_vector: [Tensor; 3],
    /// [rows, N].
    backbone_mask: Tensor,
}

fn pair_features(r: &ResidueFeatures, start: i64, rows: i64, kind: Kind) -> Result<PairFeatures> {
    let of_rows = |t: &Tensor| t.f_narrow(0, start, rows);
    // Row i's value times column j's, [rows, N].
    let outer = |m: &Tensor| -> Result<Tensor> { Ok(of_rows(m)?.f_unsqueeze(1)?.f_mul(&m.f_unsqueeze(0)?)?) };
    let same_chain = of_rows(&r.asym_id)?.f_unsqueeze(1)?.f_eq_tensor(&r.asym_id.f_unsqueeze(0)?)?.f_to_kind(kind)?;
    let pb_mask_2d = outer(&r.pseudo_beta_mask)?.f_mul(&same_chain)?;
    let dgram = distance_one_hot_between(&of_rows(&r.pseudo_beta)?, &r.pseudo_beta, DGRAM_BINS, DGRAM_MIN, DGRAM_MAX)?
        .f_mul(&pb_mask_2d.f_unsqueeze(-1)?)?;
    let backbone_2d = outer(&r.backbone)?.f_mul(&same_chain)?;
    // rigid_i⁻¹(CA_j) = R_iᵀ CA_j - R_iᵀ CA_i, per axis: e_i · CA_j - e_i · CA_i, both dot
    // products summed in the same order (x, y, z), so that the diagonal is exactly zero (a
    // rounding residue there would normalise to a unit vector).
    let (ca_i, ca_j) = (of_rows(&r.ca)?.f_unsqueeze(1)?, r.ca.f_unsqueeze(0)?);
    let local = r
        .frames
        .iter()
        .map(|e| {
            let e = of_rows(e)?.f_unsqueeze(1)?;
            Ok(dot(&e, &ca_j)?.f_sub(&dot(&e, &ca_i)?)?)
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let norm2 = local.iter().try_fold(Tensor::f_zeros_like(&local[0])?, |acc, v| acc.f_add(&v.f_square()?))?;
    let norm = norm2.f_clamp_min(NORM_EPSILON * NORM_EPSILON)?.f_sqrt()?;
    let unit = |i: usize| -> Result<Tensor> { Ok(local[i].f_div(&norm)?.f_mul(&backbone_2d)?) };
    Ok(PairFeatures {
        dgram,
        pseudo_beta_mask: pb_mask_2d,
        unit_vector: [unit(0)?, unit(1)?, unit(2)?],
        backbone_mask: backbone_2d,
    })
}

/// `a · b` over the last dimension (of 3, broadcast), as `Vec3Array.dot`: `x x' + y y' + z z'`
/// added left to right.
fn dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let term = |i: i64| -> Result<Tensor> { Ok(a.f_select(-1, i)?.f_mul(&b.f_select(-1, i)?)?) };
    Ok(term(0)?.f_add(&term(1)?)?.f_add(&term(2)?)?)
}

/// `v / max(|v|, 1e-6)` over the last dimension (`Vec3Array.normalized`).
fn normalized(v: &Tensor) -> Result<Tensor> {
    let norm = dot(v, v)?.f_clamp_min(NORM_EPSILON * NORM_EPSILON)?.f_sqrt()?;
    Ok(v.f_div(&norm.f_unsqueeze(-1)?)?)
}
