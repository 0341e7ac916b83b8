//! The processing that turns [`RawFeatures`] into the model's [`Features`], step by step as
//! AlphaFold's `input_pipeline.process_tensors_from_config` runs it for the monomer eval
//! config: per recycling iteration, `sample_msa` (query first, the rest shuffled; rows past
//! `max_msa_clusters` become the extra MSA), `make_masked_msa` (BERT-style corruption of the
//! sampled rows), `nearest_neighbor_clusters` and `summarize_clusters` (each extra row joins
//! the sampled row it agrees with at most positions, ignoring gaps and the mask token),
//! `crop_extra_msa` (a random `max_extra_msa` of the extra rows), `make_msa_feat`, and
//! optionally `make_fixed_size`. Random choices come from [`Rng`] stream `r` of the seed
//! for iteration `r`, so one seed gives one batch on every device; they cannot match
//! TensorFlow's draws, only their distribution.
use std::f64::consts::PI;

use data::{Error, Result};
use tch::{Device, Kind, Tensor};

use super::rng::Rng;
use super::{FeatureConfig, Features, RawFeatures, TemplateFeatures, MAX_TEMPLATES};
use crate::residue_constants::{aatype_of, atom_order, msa_class_of, Tables, ATOM_TYPE_NUM};
use crate::search::templates::TemplateHitFeatures;

/// MSA classes including the masked-MSA token (22).
const MSA_CLASSES: i64 = 23;
/// Index of the mask token.
const MASK_TOKEN: i64 = 22;
/// Extra rows compared against the cluster centres per matrix product (bounds memory).
const CLUSTER_CHUNK: i64 = 1024;

fn long_tensor(rows: &[Vec<i64>], n: usize, device: Device) -> Tensor {
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, n as i64]).to_device(device)
}

fn float_tensor(rows: &[Vec<f32>], n: usize, device: Device) -> Tensor {
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, n as i64]).to_device(device)
}

/// `2 / pi * atan(d / 3)`, AlphaFold's squashing of deletion counts into [0, 1).
fn deletion_value(d: &Tensor) -> Tensor {
    (d / 3.0).atan() * (2.0 / PI)
}

fn one_hot(t: &Tensor, classes: i64) -> Tensor {
    t.one_hot(classes).to_kind(Kind::Float)
}

/// Pads dimension 0 of `t` with zeros up to `rows`.
fn pad_rows(t: Tensor, rows: i64) -> Tensor {
    let have = t.size()[0];
    if have >= rows {
        return t;
    }
    let mut shape = t.size();
    shape[0] = rows - have;
    let zeros = Tensor::zeros(shape.as_slice(), (t.kind(), t.device()));
    Tensor::cat(&[t, zeros], 0)
}

/// The MSA features of one recycling iteration (no leading R dimension).
struct MsaSample {
    msa_feat: Tensor,
    msa_mask: Tensor,
    msa_row_mask: Tensor,
    bert_mask: Tensor,
    true_msa: Tensor,
    extra_msa: Tensor,
    extra_has_deletion: Tensor,
    extra_deletion_value: Tensor,
    extra_msa_mask: Tensor,
    extra_msa_row_mask: Tensor,
}

/// The column profile of the whole MSA over the 22 classes (`make_hhblits_profile`).
fn profile(raw: &RawFeatures) -> Vec<[f64; 22]> {
    let mut p = vec![[0.0f64; 22]; raw.seq_length];
    for row in &raw.msa {
        for (j, &c) in row.iter().enumerate() {
            p[j][c as usize] += 1.0;
        }
    }
    let s = raw.msa.len() as f64;
    p.iter_mut().for_each(|col| col.iter_mut().for_each(|v| *v /= s));
    p
}

/// The sampled rows after `make_masked_msa`.
struct MaskedRows {
    /// The rows the network sees.
    masked: Vec<Vec<i64>>,
    /// The rows before masking (the masked-MSA head's targets).
    truth: Vec<Vec<i64>>,
    /// 1 where an entry was replaced.
    bert: Vec<Vec<f32>>,
}

/// `make_masked_msa` on the sampled rows `sel`: each entry is replaced with probability
/// `masked_msa_replace_fraction` by a draw from uniform, profile, same or mask-token choices.
fn masked_msa(
    raw: &RawFeatures,
    sel: &[usize],
    profile: &[[f64; 22]],
    config: &FeatureConfig,
    rng: &mut Rng,
) -> MaskedRows {
    let n = raw.seq_length;
    let mask_prob = (1.0 - config.uniform_prob - config.profile_prob - config.same_prob).max(0.0);
    let mut true_rows = Vec::with_capacity(sel.len());
    let mut masked_rows = Vec::with_capacity(sel.len());
    let mut bert_rows = Vec::with_capacity(sel.len());
    for &i in sel {
        let row = &raw.msa[i];
        let mut masked = row.clone();
        let mut bert = vec![0.0f32; n];
        for j in 0..n {
            if rng.uniform() < config.masked_msa_replace_fraction {
                let mut probs = [0.0f64; MSA_CLASSES as usize];
                for (k, p) in probs.iter_mut().enumerate().take(22) {
                    let uniform = if k < 20 { 0.05 } else { 0.0 };
                    *p = config.uniform_prob * uniform + config.profile_prob * profile[j][k];
                }
                probs[row[j] as usize] += config.same_prob;
                probs[MASK_TOKEN as usize] = mask_prob;
                masked[j] = rng.categorical(&probs) as i64;
                bert[j] = 1.0;
            }
        }
        true_rows.push(row.clone());
        masked_rows.push(masked);
        bert_rows.push(bert);
    }
    MaskedRows { masked: masked_rows, truth: true_rows, bert: bert_rows }
}

/// `nearest_neighbor_clusters` then `summarize_clusters`: each extra row joins the cluster
/// centre it agrees with most (residue and X classes only, weight 0 for the gap and the mask
/// token; ties go to the first centre, as argmax does), and each centre gets the profile and
/// mean deletion over itself and its members. `msa_1hot` [S, N, 23] and `deletion` [S, N] are
/// the centres', `extra_msa` [E, N] and `extra_del` [E, N] the others'.
fn cluster_profiles(msa_1hot: &Tensor, deletion: &Tensor, extra_msa: &Tensor, extra_del: &Tensor) -> (Tensor, Tensor) {
    let (s, n) = (deletion.size()[0], deletion.size()[1]);
    let e = extra_msa.size()[0];
    let device = deletion.device();
    let weights =
        Tensor::cat(&[Tensor::ones([21], (Kind::Float, device)), Tensor::zeros([2], (Kind::Float, device))], 0);
    let centres = (msa_1hot * &weights).reshape([s, n * MSA_CLASSES]);
    let assignment = if e == 0 {
        Tensor::zeros([0], (Kind::Int64, device))
    } else {
        let parts: Vec<Tensor> = (0..e)
            .step_by(CLUSTER_CHUNK as usize)
            .map(|start| {
                let len = CLUSTER_CHUNK.min(e - start);
                let rows = one_hot(&extra_msa.narrow(0, start, len), MSA_CLASSES).reshape([len, n * MSA_CLASSES]);
                rows.matmul(&centres.tr()).argmax(1, false)
            })
            .collect();
        Tensor::cat(&parts, 0)
    };
    let extra_mask = Tensor::ones([e, n], (Kind::Float, device));
    let counts = Tensor::zeros([s, n], (Kind::Float, device)).index_add(0, &assignment, &extra_mask) + 1.0 + 1e-6;
    let extra_1hot = one_hot(extra_msa, MSA_CLASSES);
    let profile_sum =
        Tensor::zeros([s, n, MSA_CLASSES], (Kind::Float, device)).index_add(0, &assignment, &extra_1hot) + msa_1hot;
    let cluster_profile = profile_sum / counts.unsqueeze(-1);
    let del_sum = Tensor::zeros([s, n], (Kind::Float, device)).index_add(0, &assignment, extra_del) + deletion;
    (cluster_profile, del_sum / &counts)
}

impl MsaSample {
    /// Every MSA feature padded with masked rows to `rows` and the extra ones to `extra_rows`
    /// (AlphaFold's fixed-size batches).
    fn padded(self, rows: i64, extra_rows: i64) -> MsaSample {
        MsaSample {
            msa_feat: pad_rows(self.msa_feat, rows),
            msa_mask: pad_rows(self.msa_mask, rows),
            msa_row_mask: pad_rows(self.msa_row_mask, rows),
            bert_mask: pad_rows(self.bert_mask, rows),
            true_msa: pad_rows(self.true_msa, rows),
            extra_msa: pad_rows(self.extra_msa, extra_rows),
            extra_has_deletion: pad_rows(self.extra_has_deletion, extra_rows),
            extra_deletion_value: pad_rows(self.extra_deletion_value, extra_rows),
            extra_msa_mask: pad_rows(self.extra_msa_mask, extra_rows),
            extra_msa_row_mask: pad_rows(self.extra_msa_row_mask, extra_rows),
        }
    }
}

/// One recycling iteration's MSA features: `sample_msa` (the query first, the other rows
/// shuffled, the first `max_msa_clusters` the cluster centres), the masked MSA, the cluster
/// profiles, `crop_extra_msa` (a random subset of the rest, in random order) and
/// `make_msa_feat`, in AlphaFold's order of random draws.
fn sample_msa(
    raw: &RawFeatures,
    profile: &[[f64; 22]],
    config: &FeatureConfig,
    rng: &mut Rng,
    device: Device,
) -> MsaSample {
    let n = raw.seq_length;
    let total = raw.msa.len();
    let mut order: Vec<usize> = (1..total).collect();
    rng.shuffle(&mut order);
    order.insert(0, 0);
    let num_sel = config.max_msa_clusters.max(1).min(total);
    let (sel, extra) = order.split_at(num_sel);
    let rows = masked_msa(raw, sel, profile, config, rng);
    let msa = long_tensor(&rows.masked, n, device);
    let true_msa = long_tensor(&rows.truth, n, device);
    let bert_mask = float_tensor(&rows.bert, n, device);
    let sel_del: Vec<Vec<f32>> = sel.iter().map(|&i| raw.deletion_matrix[i].clone()).collect();
    let deletion = float_tensor(&sel_del, n, device);
    let extra_rows: Vec<Vec<i64>> = extra.iter().map(|&i| raw.msa[i].clone()).collect();
    let extra_del_rows: Vec<Vec<f32>> = extra.iter().map(|&i| raw.deletion_matrix[i].clone()).collect();
    let extra_msa = long_tensor(&extra_rows, n, device);
    let extra_del = float_tensor(&extra_del_rows, n, device);
    let msa_1hot = one_hot(&msa, MSA_CLASSES);
    let (cluster_profile, deletion_mean) = cluster_profiles(&msa_1hot, &deletion, &extra_msa, &extra_del);

    // crop_extra_msa: a random subset, in random order.
    let mut keep: Vec<i64> = (0..extra.len() as i64).collect();
    rng.shuffle(&mut keep);
    keep.truncate(config.max_extra_msa);
    let keep = Tensor::from_slice(&keep).to_device(device);
    let extra_msa = extra_msa.index_select(0, &keep);
    let extra_del = extra_del.index_select(0, &keep);
    let (s, e, n) = (sel.len() as i64, keep.size()[0], n as i64);

    let msa_feat = Tensor::cat(
        &[
            msa_1hot,
            deletion.clamp(0.0, 1.0).unsqueeze(-1),
            deletion_value(&deletion).unsqueeze(-1),
            cluster_profile,
            deletion_value(&deletion_mean).unsqueeze(-1),
        ],
        -1,
    );
    let out = MsaSample {
        msa_feat,
        msa_mask: Tensor::ones([s, n], (Kind::Float, device)),
        msa_row_mask: Tensor::ones([s], (Kind::Float, device)),
        bert_mask,
        true_msa,
        extra_has_deletion: extra_del.clamp(0.0, 1.0),
        extra_deletion_value: deletion_value(&extra_del),
        extra_msa,
        extra_msa_mask: Tensor::ones([e, n], (Kind::Float, device)),
        extra_msa_row_mask: Tensor::ones([e], (Kind::Float, device)),
    };
    match config.pad_msa {
        true => out.padded(config.max_msa_clusters as i64, config.max_extra_msa as i64),
        false => out,
    }
}

/// Repeats `t` R times along a new leading dimension.
fn repeat(t: &Tensor, r: i64) -> Tensor {
    let mut reps = vec![r];
    reps.extend(std::iter::repeat_n(1, t.dim()));
    t.unsqueeze(0).repeat(reps.as_slice())
}

/// The processed batch of `raw` under `config`, on `device`, with R = `num_recycle + 1`
/// independently sampled MSA iterations drawn from `seed`.
pub fn process(raw: &RawFeatures, config: &FeatureConfig, seed: u64, device: Device) -> Result<Features> {
    let n = raw.seq_length;
    let bad = |msg: String| Error::Format { path: "<features>".into(), msg };
    if n == 0 || raw.aatype.len() != n || raw.residue_index.len() != n || raw.between_segment_residues.len() != n {
        return Err(bad(format!("sequence features disagree with seq_length {n}")));
    }
    if raw.msa.is_empty() || raw.msa.len() != raw.deletion_matrix.len() {
        return Err(bad("the MSA needs at least the query row and one deletion row per MSA row".into()));
    }
    if let Some(i) = raw.msa.iter().zip(&raw.deletion_matrix).position(|(m, d)| m.len() != n || d.len() != n) {
        return Err(bad(format!("MSA row {i} does not have {n} columns")));
    }
    if let Some(c) = raw.msa.iter().flatten().find(|&&c| !(0..22).contains(&c)) {
        return Err(bad(format!("MSA class {c} outside 0..22")));
    }
    if let Some(a) = raw.aatype.iter().find(|&&a| !(0..21).contains(&a)) {
        return Err(bad(format!("aatype {a} outside 0..21")));
    }
    let r = config.num_recycle as i64 + 1;
    let tables = Tables::new(device);
    let aatype = Tensor::from_slice(&raw.aatype).to_device(device);
    let residue_index = Tensor::from_slice(&raw.residue_index).to_device(device);
    let breaks = Tensor::from_slice(&raw.between_segment_residues).to_device(device).to_kind(Kind::Float);
    let target_feat = Tensor::cat(&[breaks.clamp(0.0, 1.0).unsqueeze(-1), one_hot(&aatype, 21)], -1);

    let profile = profile(raw);
    let samples: Vec<MsaSample> =
        (0..r).map(|i| sample_msa(raw, &profile, config, &mut Rng::new(seed, i as u64), device)).collect();
    let stack = |f: fn(&MsaSample) -> &Tensor| Tensor::stack(&samples.iter().map(f).collect::<Vec<_>>(), 0);

    Ok(Features {
        aatype: repeat(&aatype, r),
        residue_index: repeat(&residue_index, r),
        seq_length: Tensor::full([r], n as i64, (Kind::Int64, device)),
        seq_mask: Tensor::ones([r, n as i64], (Kind::Float, device)),
        target_feat: repeat(&target_feat, r),
        msa_feat: stack(|s| &s.msa_feat),
        msa_mask: stack(|s| &s.msa_mask),
        msa_row_mask: stack(|s| &s.msa_row_mask),
        bert_mask: stack(|s| &s.bert_mask),
        true_msa: stack(|s| &s.true_msa),
        extra_msa: stack(|s| &s.extra_msa),
        extra_has_deletion: stack(|s| &s.extra_has_deletion),
        extra_deletion_value: stack(|s| &s.extra_deletion_value),
        extra_msa_mask: stack(|s| &s.extra_msa_mask),
        extra_msa_row_mask: stack(|s| &s.extra_msa_row_mask),
        residx_atom14_to_atom37: repeat(&tables.atom14_to_atom37.index_select(0, &aatype), r),
        residx_atom37_to_atom14: repeat(&tables.atom37_to_atom14.index_select(0, &aatype), r),
        atom14_atom_exists: repeat(&tables.atom14_mask.index_select(0, &aatype), r),
        atom37_atom_exists: repeat(&tables.atom37_mask.index_select(0, &aatype), r),
        templates: raw.templates.as_ref().map(|hits| templates(hits, n, r, device)).transpose()?,
    })
}

/// The processed template features of `hits` (the first [`MAX_TEMPLATES`], padded to that
/// many), repeated R times: as AlphaFold's `fix_templates_aatype` (residue types in our
/// order, gaps 21), `make_template_mask` and `make_pseudo_beta` (Cβ, Cα for glycine) make them.
fn templates(hits: &[TemplateHitFeatures], n: usize, r: i64, device: Device) -> Result<TemplateFeatures> {
    let t = MAX_TEMPLATES;
    let (ca, cb, gly) = (atom_order("CA").unwrap(), atom_order("CB").unwrap(), aatype_of('G') as i64);
    let mut aatype = vec![0i64; t * n];
    let mut positions = vec![0f32; t * n * ATOM_TYPE_NUM * 3];
    let mut masks = vec![0f32; t * n * ATOM_TYPE_NUM];
    let mut mask = vec![0f32; t];
    let mut beta = vec![0f32; t * n * 3];
    let mut beta_mask = vec![0f32; t * n];
    for (k, hit) in hits.iter().take(t).enumerate() {
        if hit.sequence.chars().count() != n || hit.positions.len() != n || hit.masks.len() != n {
            return Err(Error::Format {
                path: "<templates>".into(),
                msg: format!("template {} does not have {n} residues", hit.domain_name),
            });
        }
        mask[k] = 1.0;
        for (i, c) in hit.sequence.chars().enumerate() {
            let a = msa_class_of(c).ok_or_else(|| Error::Format {
                path: "<templates>".into(),
                msg: format!("template {}: {c:?} is not a residue", hit.domain_name),
            })? as i64;
            let at = k * n + i;
            aatype[at] = a;
            for j in 0..ATOM_TYPE_NUM {
                positions[(at * ATOM_TYPE_NUM + j) * 3..][..3].copy_from_slice(&hit.positions[i][j]);
                masks[at * ATOM_TYPE_NUM + j] = hit.masks[i][j];
            }
            let atom = if a == gly { ca } else { cb };
            beta[at * 3..][..3].copy_from_slice(&hit.positions[i][atom]);
            beta_mask[at] = hit.masks[i][atom];
        }
    }
    let (t, n, k) = (t as i64, n as i64, ATOM_TYPE_NUM as i64);
    let on = |v: Tensor, shape: &[i64]| repeat(&v.reshape(shape).to_device(device), r);
    Ok(TemplateFeatures {
        aatype: on(Tensor::from_slice(&aatype), &[t, n]),
        all_atom_positions: on(Tensor::from_slice(&positions), &[t, n, k, 3]),
        all_atom_masks: on(Tensor::from_slice(&masks), &[t, n, k]),
        mask: on(Tensor::from_slice(&mask), &[t]),
        pseudo_beta: on(Tensor::from_slice(&beta), &[t, n, 3]),
        pseudo_beta_mask: on(Tensor::from_slice(&beta_mask), &[t, n]),
    })
}
