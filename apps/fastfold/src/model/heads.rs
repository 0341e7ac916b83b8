//! The output heads (supplementary 1.9) and the single-representation projection they read,
//! under AlphaFold's parameter names (module path `alphafold/alphafold_iteration/<head>`):
//!
//! | module | AlphaFold name | input → logits |
//! |---|---|---|
//! | [`SingleActivations`] | `evoformer/single_activations` | MSA row 0 [N, c_m] → single [N, c_s] |
//! | [`DistogramHead`] | `distogram_head/half_logits` | pair [N, N, c_z] → [N, N, 64], symmetrised |
//! | [`PredictedLddtHead`] | `predicted_lddt_head/input_layer_norm`, `act_0`, `act_1`, `logits` | structure-module single [N, c_s] → [N, 50] |
//! | [`MaskedMsaHead`] | `masked_msa_head/logits` | MSA [S, N, c_m] → [S, N, 23] |
//! | [`ExperimentallyResolvedHead`] | `experimentally_resolved_head/logits` | single [N, c_s] → [N, 37] |
//! | [`PredictedAlignedErrorHead`] | `predicted_aligned_error_head/logits` | pair → [N, N, 64] (`_ptm` sets only) |
//!
//! Confidence measures (pLDDT, PAE, pTM) come from the logits through [`crate::confidence`].
use tch::{Device, Tensor};

use crate::confidence;
use crate::model::config::{EvoformerConfig, ModelConfig};
use crate::model::embedders::shape_error;
use crate::model::evoformer::StackMsa;
use crate::model::keys::{EMBEDDINGS, ITERATION};
use crate::model::layers::{LayerNorm, Linear};
use crate::model::masked_rows::MsaRows;
use crate::model::pair_rows::PairRows;
use crate::model::params::Params;
use crate::model::scope::Builder;
use crate::model::{ensure, Result};

/// First distogram break, Å (`distogram.first_break`).
pub const DISTOGRAM_FIRST_BREAK: f64 = 2.3125;
/// Last distogram break, Å (`distogram.last_break`).
pub const DISTOGRAM_LAST_BREAK: f64 = 21.6875;
/// Upper break of the aligned-error bins, Å (`predicted_aligned_error.max_error_bin`).
pub const MAX_ERROR_BIN: f64 = 31.0;

/// Checks that `t` is `[lead.., channels]` with the leading sizes `lead` (`None`: any size).
fn check(what: &str, t: &Tensor, lead: &[Option<i64>], channels: i64) -> Result<()> {
    let size = t.size();
    let ok = size.len() == lead.len() + 1
        && size.last() == Some(&channels)
        && lead.iter().zip(&size).all(|(want, got)| want.is_none_or(|w| w == *got));
    if ok {
        return Ok(());
    }
    let dims: Vec<String> = lead.iter().map(|d| d.map_or("_".to_string(), |d| d.to_string())).collect();
    Err(shape_error(what, format!("[{}, {channels}]", dims.join(", ")), size))
}

/// The single representation: a linear map of the Evoformer's first MSA row (Algorithm 2,
/// line 17), which the experimentally-resolved head and the structure module read.
pub struct SingleActivations {
    linear: Linear,
    c_m: i64,
}

impl SingleActivations {
    /// The projection over `params`.
    pub fn new(params: &Params) -> Result<Self> {
        Self::build(&params.builder(), params.config(), &params.model_config()?)
    }

    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        let p = b.root(EMBEDDINGS).sub("single_activations");
        Ok(SingleActivations { linear: Linear::new(&p, cfg.c_m, model.c_s, true)?, c_m: cfg.c_m })
    }

    /// `msa` [S, N, c_m] → single [N, c_s] (from row 0).
    pub fn forward(&self, msa: &Tensor) -> Result<Tensor> {
        check("msa", msa, &[None, None], self.c_m)?;
        self.linear.forward(&msa.f_select(0, 0)?)
    }
}

/// Distance-bin logits of every residue pair (1.9.8): `half_logits` plus its transpose, so
/// the prediction for (i, j) equals that for (j, i).
pub struct DistogramHead {
    half_logits: Linear,
    c_z: i64,
}

impl DistogramHead {
    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        let p = b.root(ITERATION).sub("distogram_head").sub("half_logits");
        Ok(DistogramHead { half_logits: Linear::new(&p, cfg.c_z, model.distogram_bins, true)?, c_z: cfg.c_z })
    }

    /// `pair` [N, N, c_z] → symmetric logits [N, N, bins], bins split at evenly spaced breaks
    /// from [`DISTOGRAM_FIRST_BREAK`] to [`DISTOGRAM_LAST_BREAK`] (as the distogram loss
    /// takes them).
    pub fn forward(&self, pair: &Tensor) -> Result<Tensor> {
        let n = pair.size().first().copied();
        check("pair", pair, &[n, n], self.c_z)?;
        let half = self.half_logits.forward(pair)?;
        Ok(half.f_add(&half.f_transpose(0, 1)?)?)
    }

    /// [`DistogramHead::forward`] of the real pair rows `rows` holds ([`PairRows::real`] x N x
    /// c_z): the same rows of the logits. Without autograd the half logits are symmetrised in
    /// place ([`PairRows::symmetrised`]; under DAP a collective), so that one process holds one
    /// [N, N, bins] buffer, not two, and a DAP rank only its rows.
    pub fn forward_rows(&self, pair: &Tensor, rows: &PairRows) -> Result<Tensor> {
        check("pair", pair, &[Some(rows.real()), Some(rows.residues())], self.c_z)?;
        let half = self.half_logits.forward(pair)?;
        if half.requires_grad() {
            ensure!(!rows.is_split(), "the distogram of a pass that records gradients takes the whole pair");
            return Ok(half.f_add(&half.f_transpose(0, 1)?)?);
        }
        rows.symmetrised(half)
    }
}

/// Per-residue lDDT-bin logits from the structure module's single representation (1.9.6).
pub struct PredictedLddtHead {
    input_layer_norm: LayerNorm,
    act_0: Linear,
    act_1: Linear,
    logits: Linear,
    c_s: i64,
}

impl PredictedLddtHead {
    pub(crate) fn build(b: &Builder, model: &ModelConfig) -> Result<Self> {
        let p = b.root(ITERATION).sub("predicted_lddt_head");
        let h = model.lddt_channels;
        Ok(PredictedLddtHead {
            input_layer_norm: LayerNorm::new(&p.sub("input_layer_norm"), model.c_s)?,
            act_0: Linear::new(&p.sub("act_0"), model.c_s, h, true)?,
            act_1: Linear::new(&p.sub("act_1"), h, h, true)?,
            logits: Linear::new(&p.sub("logits"), h, model.lddt_bins, true)?,
            c_s: model.c_s,
        })
    }

    /// `single` [N, c_s] (the structure module's) → logits [N, bins]; LayerNorm, then two
    /// ReLU linears, then the output linear.
    pub fn forward(&self, single: &Tensor) -> Result<Tensor> {
        check("structure module single representation", single, &[None], self.c_s)?;
        let x = self.input_layer_norm.forward(single)?;
        let x = self.act_0.forward(&x)?.f_relu()?;
        let x = self.act_1.forward(&x)?.f_relu()?;
        self.logits.forward(&x)
    }
}

/// Logits of the residue class under each masked MSA position (1.9.9, BERT-style).
pub struct MaskedMsaHead {
    logits: Linear,
    c_m: i64,
}

impl MaskedMsaHead {
    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        let p = b.root(ITERATION).sub("masked_msa_head").sub("logits");
        Ok(MaskedMsaHead { logits: Linear::new(&p, cfg.c_m, model.masked_msa_classes, true)?, c_m: cfg.c_m })
    }

    /// `msa` [S, N, c_m] → logits [S, N, 23].
    pub fn forward(&self, msa: &Tensor) -> Result<Tensor> {
        check("msa", msa, &[None, None], self.c_m)?;
        self.logits.forward(msa)
    }
}

/// Logits (independent sigmoids) of each atom37 atom being resolved in the experiment (1.9.10).
pub struct ExperimentallyResolvedHead {
    logits: Linear,
    c_s: i64,
}

impl ExperimentallyResolvedHead {
    pub(crate) fn build(b: &Builder, model: &ModelConfig) -> Result<Self> {
        let p = b.root(ITERATION).sub("experimentally_resolved_head").sub("logits");
        Ok(ExperimentallyResolvedHead {
            logits: Linear::new(&p, model.c_s, model.resolved_atoms, true)?,
            c_s: model.c_s,
        })
    }

    /// `single` [N, c_s] (the Evoformer's, from [`SingleActivations`]) → logits [N, 37].
    pub fn forward(&self, single: &Tensor) -> Result<Tensor> {
        check("single representation", single, &[None], self.c_s)?;
        self.logits.forward(single)
    }
}

/// Aligned-error-bin logits of every residue pair (1.9.7), the input of PAE and pTM.
pub struct PredictedAlignedErrorHead {
    logits: Linear,
    c_z: i64,
}

impl PredictedAlignedErrorHead {
    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, bins: i64) -> Result<Self> {
        let p = b.root(ITERATION).sub("predicted_aligned_error_head").sub("logits");
        Ok(PredictedAlignedErrorHead { logits: Linear::new(&p, cfg.c_z, bins, true)?, c_z: cfg.c_z })
    }

    /// `pair` [N, N, c_z] → logits [N, N, bins], bins up to [`MAX_ERROR_BIN`] Å.
    pub fn forward(&self, pair: &Tensor) -> Result<Tensor> {
        let n = pair.size().first().copied();
        check("pair", pair, &[n, n], self.c_z)?;
        self.logits.forward(pair)
    }

    /// [`PredictedAlignedErrorHead::forward`] of the real pair rows `rows` holds
    /// ([`PairRows::real`] x N x c_z): the same rows of the logits.
    pub fn forward_rows(&self, pair: &Tensor, rows: &PairRows) -> Result<Tensor> {
        check("pair", pair, &[Some(rows.real()), Some(rows.residues())], self.c_z)?;
        self.logits.forward(pair)
    }
}

/// What a pass reads of the Evoformer's MSA ([`Heads::read_msa`]), all of it before the
/// structure module, so that the MSA is gone before the pass's last steps.
pub struct MsaReadout {
    /// The first row [N, c_m], a tensor of its own (recycling it keeps no whole MSA).
    pub first_row: Tensor,
    /// The single representation [N, c_s] ([`SingleActivations`]).
    pub single: Tensor,
    /// The masked-MSA head's logits [S, N, 23].
    pub masked_msa: Tensor,
}

/// The representations the heads read.
pub struct HeadInputs<'a> {
    /// What was read of the Evoformer's MSA.
    pub msa: &'a MsaReadout,
    /// The Evoformer's pair: [N, N, c_z], or under DAP the real rows `pair_rows` holds.
    pub pair: &'a Tensor,
    /// Which of the pair's rows `pair` is.
    pub pair_rows: &'a PairRows,
    /// The structure module's final single representation [N, c_s].
    pub structure_single: &'a Tensor,
}

/// Every head's logits.
pub struct HeadOutputs {
    /// [N, N, distogram bins], symmetric; under DAP inference the real rows `rows` holds
    /// ([`HeadOutputs::whole`] and [`HeadOutputs::whole_on_host`] gather them).
    pub distogram: Tensor,
    /// [N, lDDT bins].
    pub lddt: Tensor,
    /// [S, N, 23].
    pub masked_msa: Tensor,
    /// [N, 37].
    pub experimentally_resolved: Tensor,
    /// [N, N, aligned-error bins], with the aligned-error head only; under DAP inference the
    /// real rows `rows` holds.
    pub aligned_error: Option<Tensor>,
    /// Which rows of the pair logits these are: all, or under DAP inference this rank's
    /// ([`PairRows`]), which the confidence measures take as they are.
    pub rows: PairRows,
}

impl HeadOutputs {
    /// Per-residue pLDDT in [0, 100] ([`confidence::plddt`]).
    pub fn plddt(&self) -> Tensor {
        confidence::plddt(&self.lddt)
    }

    /// The predicted aligned error [N, N] in Å and its largest possible value
    /// ([`confidence::predicted_aligned_error`]; a collective under DAP), with the
    /// aligned-error head only.
    pub fn predicted_aligned_error(&self) -> Result<Option<(Tensor, f64)>> {
        let rows = &self.rows;
        self.aligned_error.as_ref().map(|l| confidence::predicted_aligned_error(l, rows, MAX_ERROR_BIN)).transpose()
    }

    /// The predicted TM-score ([`confidence::predicted_tm_score`]; a collective under DAP),
    /// with the aligned-error head only.
    pub fn ptm(&self) -> Result<Option<f64>> {
        let rows = &self.rows;
        self.aligned_error.as_ref().map(|l| confidence::predicted_tm_score(l, rows, MAX_ERROR_BIN)).transpose()
    }

    /// Every logit on the host of rank 0, the pair logits' every row (`--save-outputs` writes
    /// them): `Some` there, `None` on the other ranks under DAP inference (a collective: every
    /// rank calls it). The pair logits cross a rank's block at a time
    /// ([`PairRows::gather_to_host`]), so no device holds them whole beyond the pass.
    pub fn whole_on_host(&self) -> Result<Option<HeadOutputs>> {
        let rows = &self.rows;
        let distogram = rows.gather_to_host(&self.distogram)?;
        let aligned_error = self.aligned_error.as_ref().map(|l| rows.gather_to_host(l)).transpose()?;
        let Some(distogram) = distogram else { return Ok(None) };
        let host = |t: &Tensor| t.f_to_device(Device::Cpu);
        Ok(Some(HeadOutputs {
            distogram,
            lddt: host(&self.lddt)?,
            masked_msa: host(&self.masked_msa)?,
            experimentally_resolved: host(&self.experimentally_resolved)?,
            aligned_error: aligned_error.flatten(),
            rows: PairRows::whole(rows.residues()),
        }))
    }

    /// The logits with every pair row on every rank (a collective under DAP inference, where
    /// each rank holds its rows: every rank calls it; validation's losses read them whole).
    pub fn whole(&self) -> Result<HeadOutputs> {
        let rows = &self.rows;
        Ok(HeadOutputs {
            distogram: rows.gather(&self.distogram)?,
            lddt: self.lddt.shallow_clone(),
            masked_msa: self.masked_msa.shallow_clone(),
            experimentally_resolved: self.experimentally_resolved.shallow_clone(),
            aligned_error: self.aligned_error.as_ref().map(|l| rows.gather(l)).transpose()?,
            rows: PairRows::whole(rows.residues()),
        })
    }
}

/// Every head, and the single projection, built together.
pub struct Heads {
    /// `evoformer/single_activations`.
    pub single: SingleActivations,
    /// `distogram_head`.
    pub distogram: DistogramHead,
    /// `predicted_lddt_head`.
    pub lddt: PredictedLddtHead,
    /// `masked_msa_head`.
    pub masked_msa: MaskedMsaHead,
    /// `experimentally_resolved_head`.
    pub experimentally_resolved: ExperimentallyResolvedHead,
    /// `predicted_aligned_error_head`, in `_ptm` parameter sets.
    pub aligned_error: Option<PredictedAlignedErrorHead>,
}

impl Heads {
    /// Every head over `params`.
    pub fn new(params: &Params) -> Result<Self> {
        Self::build(&params.builder(), params.config(), &params.model_config()?)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) every head.
    pub(crate) fn build(b: &Builder, cfg: &EvoformerConfig, model: &ModelConfig) -> Result<Self> {
        Ok(Heads {
            single: SingleActivations::build(b, cfg, model)?,
            distogram: DistogramHead::build(b, cfg, model)?,
            lddt: PredictedLddtHead::build(b, model)?,
            masked_msa: MaskedMsaHead::build(b, cfg, model)?,
            experimentally_resolved: ExperimentallyResolvedHead::build(b, model)?,
            aligned_error: match model.aligned_error_bins {
                Some(bins) => Some(PredictedAlignedErrorHead::build(b, cfg, bins)?),
                None => None,
            },
        })
    }

    /// The first row, the single representation and the masked-MSA logits, on `device`, of the
    /// Evoformer's MSA as its stack left it (`msa`), whose rows `msa_rows` chose: the logits of
    /// the MSA's own rows that ran, restored to every one of its rows. Under DAP a collective:
    /// each rank projects its block of rows and only the logits and the first row are gathered,
    /// never the MSA.
    pub fn read_msa(&self, msa: StackMsa, msa_rows: &MsaRows, device: Device) -> Result<MsaReadout> {
        let msa = msa.first_rows(msa_rows.own_kept(), device)?;
        let first_row = msa.first_row()?;
        let single = self.single.forward(&first_row.f_unsqueeze(0)?)?;
        let masked_msa = msa_rows.restore(&msa.map_rows(|rows| self.masked_msa.forward(rows))?)?;
        Ok(MsaReadout { first_row, single, masked_msa })
    }

    /// Every head's logits.
    pub fn forward(&self, x: &HeadInputs) -> Result<HeadOutputs> {
        Ok(HeadOutputs {
            distogram: self.distogram.forward_rows(x.pair, x.pair_rows)?,
            lddt: self.lddt.forward(x.structure_single)?,
            masked_msa: x.msa.masked_msa.shallow_clone(),
            experimentally_resolved: self.experimentally_resolved.forward(&x.msa.single)?,
            aligned_error: self.aligned_error.as_ref().map(|h| h.forward_rows(x.pair, x.pair_rows)).transpose()?,
            rows: x.pair_rows.clone(),
        })
    }
}
