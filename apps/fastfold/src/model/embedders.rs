//! The embedders in front of the stacks (supplementary Algorithms 2-5 and 32), under
//! AlphaFold's parameter names (module path `alphafold/alphafold_iteration/evoformer/<name>`):
//!
//! | module | AlphaFold name | input → output |
//! |---|---|---|
//! | [`InputEmbedder`] | `preprocess_1d`, `preprocess_msa` | target_feat [N, 22], msa_feat [S, N, 49] → msa [S, N, c_m] |
//! | | `left_single`, `right_single` | target_feat → pair [N, N, c_z] (outer sum) |
//! | | `pair_activiations` (sic) | relative position one-hot [N, N, 2·32 + 1] → pair |
//! | [`RecyclingEmbedder`] | `prev_msa_first_row_norm` | previous MSA row 0 → added to MSA row 0 |
//! | | `prev_pair_norm` | previous pair → added to pair |
//! | | `prev_pos_linear` | previous pseudo-beta distances, 15 bins 3.25-20.75 Å → pair |
//! | [`ExtraMsaEmbedder`] | `extra_msa_activations` | one-hot 23 + has_deletion + deletion_value → [S_e, N, c_e] |
//!
//! Every Linear has `weights` [in, out] and `bias`; every LayerNorm `scale` and `offset`.
//! The additions commute, so the embedders may be applied in either order.
use tch::{Device, Kind, Tensor};

use crate::model::config::{EvoformerConfig, ModelConfig};
use crate::model::exec::{ChunkOp, Exec, Stage};
use crate::model::keys::EMBEDDINGS;
use crate::model::layers::{chunked, narrow, LayerNorm, Linear, Stream};
use crate::model::pair_rows::PairRows;
use crate::model::params::Params;
use crate::model::scope::{Builder, Scope};
use crate::model::{ensure, Error, Result};

/// Lower edge of the first bin of recycled pseudo-beta distances, Å (`prev_pos.min_bin`).
pub const RECYCLE_MIN_BIN: f64 = 3.25;
/// Lower edge of the last (open) bin of recycled pseudo-beta distances, Å (`prev_pos.max_bin`).
pub const RECYCLE_MAX_BIN: f64 = 20.75;
/// Classes of the extra-MSA one-hot (20 amino acids, unknown, gap, mask).
pub const EXTRA_MSA_CLASSES: i64 = 23;
/// Channels of the extra-MSA feature: the one-hot, `has_deletion` and `deletion_value`.
pub const EXTRA_MSA_FEAT: i64 = EXTRA_MSA_CLASSES + 2;
/// Residue type of glycine in AlphaFold's ordering, whose pseudo-beta is its C-alpha.
pub const GLYCINE: i64 = 7;
/// atom37 index of C-alpha.
pub const CA: i64 = 1;
/// atom37 index of C-beta.
pub const CB: i64 = 3;

/// "{what}: expected shape {expected}, found {found:?}", the one wording of input errors.
pub(crate) fn shape_error(what: &str, expected: String, found: Vec<i64>) -> Error {
    Error::Invalid(format!("{what}: expected shape {expected}, found {found:?}"))
}

/// The relative-position one-hot (Algorithm 4): for residues `i`, `j`, the bin
/// `clip(residue_index[i] - residue_index[j] + k, 0, 2k)` of `2k + 1`, `k` = `max_relative`.
/// `residue_index` `[N]` (any numeric kind); the result [N, N, 2k + 1] has kind `kind`.
pub fn relative_position_one_hot(residue_index: &Tensor, max_relative: i64, kind: Kind) -> Result<Tensor> {
    let size = residue_index.size();
    if size.len() != 1 {
        return Err(shape_error("residue_index", "[residues]".into(), size));
    }
    ensure!(max_relative > 0, "max_relative_feature must be positive, got {max_relative}");
    let pos = residue_index.f_to_kind(Kind::Int64)?;
    let offset = pos.f_unsqueeze(1)?.f_sub(&pos.f_unsqueeze(0)?)?;
    let bins = offset.f_add_scalar(max_relative)?.f_clamp(0, 2 * max_relative)?;
    Ok(bins.f_one_hot(2 * max_relative + 1)?.f_to_kind(kind)?)
}

/// The distance one-hot of recycled positions (AlphaFold's `dgram_from_positions`):
/// `bins` lower edges evenly from `min_bin` to `max_bin` Å, the last bin open; a distance
/// below `min_bin` (as for the all-zero positions of the first pass) falls in no bin.
/// `positions` [.., N, 3] → [.., N, N, bins] of the positions' kind.
pub fn distance_one_hot(positions: &Tensor, bins: i64, min_bin: f64, max_bin: f64) -> Result<Tensor> {
    distance_one_hot_between(positions, positions, bins, min_bin, max_bin)
}

/// [`distance_one_hot`] of the distances from `rows` [.., R, 3] to `positions` [.., N, 3]:
/// [.., R, N, bins] (some rows of the whole one-hot).
pub fn distance_one_hot_between(
    rows: &Tensor,
    positions: &Tensor,
    bins: i64,
    min_bin: f64,
    max_bin: f64,
) -> Result<Tensor> {
    for t in [rows, positions] {
        let size = t.size();
        if size.len() < 2 || size.last() != Some(&3) {
            return Err(shape_error("pseudo-beta positions", "[.., residues, 3]".into(), size));
        }
    }
    ensure!(bins > 1, "distance bins must be at least 2, got {bins}");
    let opts = (positions.kind(), positions.device());
    let lower = Tensor::f_linspace(min_bin, max_bin, bins, opts)?.f_square()?;
    let upper = Tensor::f_cat(&[lower.f_narrow(0, 1, bins - 1)?, Tensor::f_full([1], 1e8, opts)?], 0)?;
    let diff = rows.f_unsqueeze(-2)?.f_sub(&positions.f_unsqueeze(-3)?)?;
    let d2 = diff.f_square()?.f_sum_dim_intlist(-1, true, positions.kind())?;
    Ok(d2.f_gt_tensor(&lower)?.f_logical_and(&d2.f_lt_tensor(&upper)?)?.f_to_kind(positions.kind())?)
}

/// Pseudo-beta positions (AlphaFold's `pseudo_beta_fn`): C-beta, or C-alpha for glycine.
/// `aatype` `[N]` (integer), `atom37` [N, 37, 3] → [N, 3].
pub fn pseudo_beta(aatype: &Tensor, atom37: &Tensor) -> Result<Tensor> {
    let n = match aatype.size().as_slice() {
        [n] => *n,
        _ => return Err(shape_error("aatype", "[residues]".into(), aatype.size())),
    };
    if atom37.size() != [n, 37, 3] {
        return Err(shape_error("atom37 positions", format!("[{n}, 37, 3]"), atom37.size()));
    }
    let gly = aatype.f_eq(GLYCINE)?.f_unsqueeze(-1)?;
    Ok(atom37.f_select(1, CA)?.f_where_self(&gly, &atom37.f_select(1, CB)?)?)
}

/// The extra-MSA feature (AlphaFold's `create_extra_msa_feature`): the 23-class one-hot of
/// `extra_msa` [S, N] (integer classes), then `has_deletion` and `deletion_value` [S, N], as
/// [S, N, 25] of the kind of `deletion_value`.
pub fn extra_msa_feat(extra_msa: &Tensor, has_deletion: &Tensor, deletion_value: &Tensor) -> Result<Tensor> {
    check_extra_msa(extra_msa, has_deletion, deletion_value)?;
    one_hot_extra_msa(extra_msa, has_deletion, deletion_value)
}

/// The shapes and classes [`extra_msa_feat`] takes. Reading the classes' range waits for the
/// device that holds them: checked once where the whole input lies (a GPU's `predict` keeps it
/// on the host), not once per chunk of rows on the device.
fn check_extra_msa(extra_msa: &Tensor, has_deletion: &Tensor, deletion_value: &Tensor) -> Result<()> {
    let size = extra_msa.size();
    if size.len() != 2 {
        return Err(shape_error("extra_msa", "[sequences, residues]".into(), size));
    }
    for (what, t) in [("extra_has_deletion", has_deletion), ("extra_deletion_value", deletion_value)] {
        if t.size() != size {
            return Err(shape_error(what, format!("{size:?}"), t.size()));
        }
    }
    if extra_msa.numel() > 0 {
        let (lo, hi) = (extra_msa.f_min()?.int64_value(&[]), extra_msa.f_max()?.int64_value(&[]));
        ensure!(
            lo >= 0 && hi < EXTRA_MSA_CLASSES,
            "extra_msa: classes must lie in [0, {EXTRA_MSA_CLASSES}), found values from {lo} to {hi}"
        );
    }
    Ok(())
}

/// [`extra_msa_feat`] of inputs already checked.
fn one_hot_extra_msa(extra_msa: &Tensor, has_deletion: &Tensor, deletion_value: &Tensor) -> Result<Tensor> {
    let kind = deletion_value.kind();
    Ok(Tensor::f_cat(
        &[
            extra_msa.f_to_kind(Kind::Int64)?.f_one_hot(EXTRA_MSA_CLASSES)?.f_to_kind(kind)?,
            has_deletion.f_to_kind(kind)?.f_unsqueeze(-1)?,
            deletion_value.f_unsqueeze(-1)?,
        ],
        -1,
    )?)
}

/// The target and MSA features' projections (Algorithm 3): the initial MSA representation and
/// the pair's outer sum, shared by the monomer's [`InputEmbedder`] and AlphaFold-Multimer's
/// (`crate::model::multimer`), which differ only in the relative encoding added to the pair.
pub(crate) struct FeatureProjections {
    preprocess_1d: Linear,
    preprocess_msa: Linear,
    left_single: Linear,
    right_single: Linear,
    target_feat: i64,
    msa_feat: i64,
}

impl FeatureProjections {
    /// The four projections under `p` (`alphafold/alphafold_iteration/evoformer`) from
    /// `target_feat` and `msa_feat` channels.
    pub(crate) fn build(p: &Scope, target_feat: i64, msa_feat: i64, c_m: i64, c_z: i64) -> Result<Self> {
        Ok(FeatureProjections {
            preprocess_1d: Linear::new(&p.sub("preprocess_1d"), target_feat, c_m, true)?,
            preprocess_msa: Linear::new(&p.sub("preprocess_msa"), msa_feat, c_m, true)?,
            left_single: Linear::new(&p.sub("left_single"), target_feat, c_z, true)?,
            right_single: Linear::new(&p.sub("right_single"), target_feat, c_z, true)?,
            target_feat,
            msa_feat,
        })
    }

    /// The residue count N of `target_feat` [N, target_feat], or the error naming it.
    fn target_residues(&self, target_feat: &Tensor) -> Result<i64> {
        let ts = target_feat.size();
        if ts.len() != 2 || ts[1] != self.target_feat {
            return Err(shape_error("target_feat", format!("[residues, {}]", self.target_feat), ts));
        }
        Ok(ts[0])
    }

    /// The residue count N of `target_feat` [N, target_feat] and `msa_feat` [S, N, msa_feat],
    /// or the error naming the feature whose shape is wrong.
    pub(crate) fn residues(&self, target_feat: &Tensor, msa_feat: &Tensor) -> Result<i64> {
        let n = self.target_residues(target_feat)?;
        let ms = msa_feat.size();
        if ms.len() != 3 || ms[1] != n || ms[2] != self.msa_feat {
            return Err(shape_error("msa_feat", format!("[sequences, {n}, {}]", self.msa_feat), ms));
        }
        Ok(n)
    }

    /// `target_feat` [N, target_feat] and `msa_feat` [S, N, msa_feat] to the MSA
    /// representation [S, N, c_m] (without autograd, the sum made in place: no second MSA).
    pub(crate) fn embed_msa(&self, target_feat: &Tensor, msa_feat: &Tensor) -> Result<Tensor> {
        self.residues(target_feat, msa_feat)?;
        let mut msa = self.preprocess_msa.forward(msa_feat)?;
        let single = self.preprocess_1d.forward(target_feat)?;
        Ok(match msa.requires_grad() || single.requires_grad() {
            true => msa.f_add(&single)?,
            false => msa.f_add_(&single)?,
        })
    }

    /// `target_feat` [N, target_feat] to the pair representation's real rows `rows` holds
    /// ([`PairRows::real`] x N x c_z; [N, N, c_z] whole), `exec`'s [`ChunkOp::PairEmbedding`]
    /// at a time with `relative(start, rows)` ([rows, N, c_z], the embedded relative encoding
    /// of the pair's rows `[start, start + rows)`) added. The MSA and pair are embedded apart
    /// so that a pass can make its MSA only when a stack reads it.
    pub(crate) fn embed_pair(
        &self,
        target_feat: &Tensor,
        exec: &Exec,
        rows: &PairRows,
        relative: impl Fn(i64, i64) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let n = self.target_residues(target_feat)?;
        ensure!(rows.residues() == n, "target_feat: {n} residues, the pair's rows are of {}", rows.residues());
        let (first, real) = (rows.start(), rows.real());
        let left = self.left_single.forward(&target_feat.f_narrow(0, first, real)?)?.f_unsqueeze(1)?;
        let right = self.right_single.forward(target_feat)?.f_unsqueeze(0)?;
        chunked(real, exec.chunk_for(ChunkOp::PairEmbedding), |start, count| {
            Ok(narrow(&left, 0, start, count)?.f_add(&right)?.f_add(&relative(first + start, count)?)?)
        })
    }
}

/// Target and MSA features to the initial MSA and pair representations (Algorithm 3) plus
/// the relative-position encoding (Algorithm 4).
pub struct InputEmbedder {
    features: FeatureProjections,
    pair_activiations: Linear,
    max_relative: i64,
}

impl InputEmbedder {
    /// The input embedder over `params` (a store from [`Params::random_model`] or
    /// [`Params::load_model_npz`]).
    pub fn new(params: &Params) -> Result<Self> {
        Self::build(&params.builder(), params.config(), &params.model_config()?)
    }

    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        let p = b.root(EMBEDDINGS);
        let rel = 2 * model.max_relative_feature + 1;
        Ok(InputEmbedder {
            features: FeatureProjections::build(&p, model.target_feat, model.msa_feat, cfg.c_m, cfg.c_z)?,
            pair_activiations: Linear::new(&p.sub("pair_activiations"), rel, cfg.c_z, true)?,
            max_relative: model.max_relative_feature,
        })
    }

    /// `target_feat` [N, 22], `msa_feat` [S, N, 49] and `residue_index` `[N]` to the MSA
    /// [S, N, c_m] and pair [N, N, c_z] representations.
    pub fn forward(&self, target_feat: &Tensor, msa_feat: &Tensor, residue_index: &Tensor) -> Result<(Tensor, Tensor)> {
        self.embed(target_feat, msa_feat, residue_index, &Exec::serial())
    }

    /// [`InputEmbedder::forward`], the pair made `exec`'s [`ChunkOp::PairEmbedding`] rows at a
    /// time (the relative-position one-hot of those rows only).
    pub fn embed(
        &self,
        target_feat: &Tensor,
        msa_feat: &Tensor,
        residue_index: &Tensor,
        exec: &Exec,
    ) -> Result<(Tensor, Tensor)> {
        let msa = self.embed_msa(target_feat, msa_feat)?;
        let rows = PairRows::whole(residue_index.size()[0]);
        let pair = self.embed_pair(target_feat, residue_index, exec, &rows)?;
        Ok((msa, pair))
    }

    /// The MSA representation of [`InputEmbedder::embed`] alone.
    pub fn embed_msa(&self, target_feat: &Tensor, msa_feat: &Tensor) -> Result<Tensor> {
        self.features.embed_msa(target_feat, msa_feat)
    }

    /// The pair representation of [`InputEmbedder::embed`] alone (from `target_feat` and
    /// `residue_index`), its real rows that `rows` holds ([`PairRows::real`] x N x c_z).
    pub fn embed_pair(
        &self,
        target_feat: &Tensor,
        residue_index: &Tensor,
        exec: &Exec,
        rows: &PairRows,
    ) -> Result<Tensor> {
        let n = self.features.target_residues(target_feat)?;
        if residue_index.size() != [n] {
            return Err(shape_error("residue_index", format!("[{n}]"), residue_index.size()));
        }
        self.features.embed_pair(target_feat, exec, rows, |start, rows| {
            let rel =
                relative_position_one_hot_rows(residue_index, start, rows, self.max_relative, target_feat.kind())?;
            self.pair_activiations.forward(&rel)
        })
    }
}

/// Rows `[start, start + rows)` of [`relative_position_one_hot`] ([rows, N, 2k + 1]).
fn relative_position_one_hot_rows(
    residue_index: &Tensor,
    start: i64,
    rows: i64,
    max_relative: i64,
    kind: Kind,
) -> Result<Tensor> {
    ensure!(max_relative > 0, "max_relative_feature must be positive, got {max_relative}");
    let pos = residue_index.f_to_kind(Kind::Int64)?;
    let offset = narrow(&pos, 0, start, rows)?.f_unsqueeze(1)?.f_sub(&pos.f_unsqueeze(0)?)?;
    let bins = offset.f_add_scalar(max_relative)?.f_clamp(0, 2 * max_relative)?;
    Ok(bins.f_one_hot(2 * max_relative + 1)?.f_to_kind(kind)?)
}

/// What the previous pass hands to the next (Algorithm 2, lines 6 and 32): the first MSA
/// row [N, c_m], the pair representation [N, N, c_z] and the pseudo-beta positions [N, 3].
pub struct Recycled {
    /// First row of the previous pass's MSA representation.
    pub msa_first_row: Tensor,
    /// The previous pass's pair representation: [N, N, c_z], or under DAP inference this
    /// rank's block of its rows ([`PairRows`]).
    pub pair: Tensor,
    /// The previous pass's pseudo-beta positions, Å (see [`pseudo_beta`]).
    pub pseudo_beta: Tensor,
}

impl Recycled {
    /// Another handle to each tensor, for a pass that takes the outputs while the caller keeps
    /// them.
    pub fn shallow_clone(&self) -> Recycled {
        Recycled {
            msa_first_row: self.msa_first_row.shallow_clone(),
            pair: self.pair.shallow_clone(),
            pseudo_beta: self.pseudo_beta.shallow_clone(),
        }
    }

    /// Zeros, what the first pass recycles (AlphaFold's `prev` initialisation), like `like`'s
    /// kind and device, the pair the rows a pass holds ([`PairRows::block_shape`]).
    pub fn zeros(rows: &PairRows, cfg: &EvoformerConfig, like: &Tensor) -> Result<Self> {
        let (opts, residues) = ((like.kind(), like.device()), rows.residues());
        Ok(Recycled {
            msa_first_row: Tensor::f_zeros([residues, cfg.c_m], opts)?,
            pair: Tensor::f_zeros(rows.block_shape(cfg.c_z), opts)?,
            pseudo_beta: Tensor::f_zeros([residues, 3], opts)?,
        })
    }
}

/// Adds the previous pass's outputs to the new representations (Algorithm 32).
pub struct RecyclingEmbedder {
    prev_pos_linear: Linear,
    prev_msa_first_row_norm: LayerNorm,
    prev_pair_norm: LayerNorm,
    bins: i64,
    c_m: i64,
    c_z: i64,
}

impl RecyclingEmbedder {
    /// The recycling embedder over `params`.
    pub fn new(params: &Params) -> Result<Self> {
        Self::build(&params.builder(), params.config(), &params.model_config()?)
    }

    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        let p = b.root(EMBEDDINGS);
        Ok(RecyclingEmbedder {
            prev_pos_linear: Linear::new(&p.sub("prev_pos_linear"), model.recycle_bins, cfg.c_z, true)?,
            prev_msa_first_row_norm: LayerNorm::new(&p.sub("prev_msa_first_row_norm"), cfg.c_m)?,
            prev_pair_norm: LayerNorm::new(&p.sub("prev_pair_norm"), cfg.c_z)?,
            bins: model.recycle_bins,
            c_m: cfg.c_m,
            c_z: cfg.c_z,
        })
    }

    /// `msa` [S, N, c_m] and `pair` [N, N, c_z] with the normalised previous first row added
    /// to row 0, and the normalised previous pair and the embedded pseudo-beta distances
    /// added to the pair.
    pub fn forward(&self, msa: &Tensor, pair: &Tensor, prev: &Recycled) -> Result<(Tensor, Tensor)> {
        let mut msa = Stream::new(msa.shallow_clone(), false);
        let mut pair = Stream::new(pair.shallow_clone(), false);
        self.update(&mut msa, &mut pair, prev, &Exec::serial())?;
        Ok((msa.into_inner(), pair.into_inner()))
    }

    /// [`RecyclingEmbedder::forward`] on streams (in place where they allow), the pair's terms
    /// `exec`'s [`ChunkOp::PairEmbedding`] rows at a time.
    pub fn update(&self, msa: &mut Stream, pair: &mut Stream, prev: &Recycled, exec: &Exec) -> Result<()> {
        let row = self.first_row(prev)?;
        self.add_first_row(msa, &row)?;
        self.update_pair(pair, prev, exec, &PairRows::whole(row.size()[1]))
    }

    /// The normalised previous first row [1, N, c_m], which
    /// [`RecyclingEmbedder::add_first_row`] adds to an MSA: made before the previous pass's
    /// outputs are given up, so that the MSA itself can be embedded later.
    pub fn first_row(&self, prev: &Recycled) -> Result<Tensor> {
        let size = prev.msa_first_row.size();
        if size.len() != 2 || size[1] != self.c_m {
            return Err(shape_error("recycled msa first row", format!("[residues, {}]", self.c_m), size));
        }
        Ok(self.prev_msa_first_row_norm.forward(&prev.msa_first_row)?.f_unsqueeze(0)?)
    }

    /// Adds `row` ([`RecyclingEmbedder::first_row`]) to row 0 of `msa` [S, N, c_m].
    pub fn add_first_row(&self, msa: &mut Stream, row: &Tensor) -> Result<()> {
        let (ms, n) = (msa.get().size(), row.size()[1]);
        if ms.len() != 3 || ms[0] < 1 || ms[1] != n || ms[2] != self.c_m {
            return Err(shape_error("msa", format!("[sequences, {n}, {}]", self.c_m), ms));
        }
        msa.add_chunked(0, Some(1), |_, start, _| match start {
            0 => Ok(row.shallow_clone()),
            _ => Ok(row.f_zeros_like()?),
        })
    }

    /// The pair's part of [`RecyclingEmbedder::update`]: the normalised previous pair and the
    /// embedded pseudo-beta distances added to `pair`, the real rows `rows` holds
    /// ([`PairRows::real`] x N x c_z; [N, N, c_z] whole). The recycled pair is the previous
    /// pass's rows alike, or whole.
    pub fn update_pair(&self, pair: &mut Stream, prev: &Recycled, exec: &Exec, rows: &PairRows) -> Result<()> {
        let n = prev.msa_first_row.size()[0];
        ensure!(
            rows.residues() == n,
            "recycled msa first row: {n} residues, the pair's rows are of {}",
            rows.residues()
        );
        let prev_pair = rows.real_of(&prev.pair).map_err(|e| Error::Invalid(format!("recycled {e}")))?;
        let checks = [
            ("pair", pair.get(), vec![rows.real(), n, self.c_z]),
            ("recycled pair", &prev_pair, vec![rows.real(), n, self.c_z]),
            ("recycled pseudo-beta positions", &prev.pseudo_beta, vec![n, 3]),
        ];
        for (what, t, expected) in checks {
            if t.size() != expected {
                return Err(shape_error(what, format!("{expected:?}"), t.size()));
            }
        }
        let chunk = exec.chunk_for(ChunkOp::PairEmbedding);
        pair.add_chunked(0, chunk, |_, start, count| {
            self.prev_pair_norm.forward(&narrow(&prev_pair, 0, start, count)?)
        })?;
        let kind = pair.get().kind();
        pair.add_chunked(0, chunk, |_, start, count| {
            let here = narrow(&prev.pseudo_beta, 0, rows.start() + start, count)?;
            let dgram =
                distance_one_hot_between(&here, &prev.pseudo_beta, self.bins, RECYCLE_MIN_BIN, RECYCLE_MAX_BIN)?;
            self.prev_pos_linear.forward(&dgram.f_to_kind(kind)?)
        })
    }
}

/// The extra MSA's features to the extra-MSA stack's input (Algorithm 2, line 14).
pub struct ExtraMsaEmbedder {
    extra_msa_activations: Linear,
}

impl ExtraMsaEmbedder {
    /// The extra-MSA embedder over `params`.
    pub fn new(params: &Params) -> Result<Self> {
        Self::build(&params.builder(), params.config())
    }

    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig) -> Result<Self> {
        ensure!(cfg.c_e > 0, "the extra-MSA embedder needs extra-MSA channels, the configuration has none");
        let p = b.root(EMBEDDINGS).sub("extra_msa_activations");
        Ok(ExtraMsaEmbedder { extra_msa_activations: Linear::new(&p, EXTRA_MSA_FEAT, cfg.c_e, true)? })
    }

    /// `extra_msa` [S, N] (classes), `has_deletion` and `deletion_value` [S, N] to the
    /// extra-MSA representation [S, N, c_e] (see [`extra_msa_feat`]), `exec`'s
    /// [`ChunkOp::ExtraMsaEmbedding`] rows at a time (the one-hot of every row, in int64, is
    /// larger than the representation made from it). Inputs on the host (a GPU's `predict`
    /// keeps them there) reach the device a chunk at a time. When the extra-MSA stack keeps its
    /// MSA on the host ([`crate::model::exec::ChunkPlan::offloading`]) and nothing records
    /// gradients, the representation is made there, each chunk moved as it is made.
    pub fn forward(
        &self,
        extra_msa: &Tensor,
        has_deletion: &Tensor,
        deletion_value: &Tensor,
        exec: &Exec,
    ) -> Result<Tensor> {
        check_extra_msa(extra_msa, has_deletion, deletion_value)?;
        let offloaded = exec.plan().offloads(Stage::ExtraMsa);
        chunked(extra_msa.size()[0], exec.chunk_for(ChunkOp::ExtraMsaEmbedding), |start, n| {
            let device = self.extra_msa_activations.device();
            let [msa, has, value] =
                [extra_msa, has_deletion, deletion_value].map(|t| t.f_narrow(0, start, n)?.f_to_device(device));
            let part = self.extra_msa_activations.forward(&one_hot_extra_msa(&msa?, &has?, &value?)?)?;
            Ok(match offloaded && !part.requires_grad() {
                true => part.f_to_device(Device::Cpu)?,
                false => part,
            })
        })
    }
}

/// The three embedders, built together so that a store's embedder arrays are checked at once.
pub struct Embedders {
    /// Target and MSA features and relative positions.
    pub input: InputEmbedder,
    /// The previous pass's outputs.
    pub recycling: RecyclingEmbedder,
    /// The extra MSA (absent when the configuration has no extra-MSA stack).
    pub extra_msa: Option<ExtraMsaEmbedder>,
}

impl Embedders {
    /// Every embedder over `params`.
    pub fn new(params: &Params) -> Result<Self> {
        Self::build(&params.builder(), params.config(), &params.model_config()?)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) every embedder.
    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        Ok(Embedders {
            input: InputEmbedder::build(b, cfg, model)?,
            recycling: RecyclingEmbedder::build(b, cfg, model)?,
            extra_msa: match cfg.num_extra_blocks > 0 {
                true => Some(ExtraMsaEmbedder::build(b, cfg)?),
                false => None,
            },
        })
    }
}
