//! Multi-chain permutation alignment (Evans et al. 2021, AlphaFold-Multimer, supplement
//! section 7.3): before the Multimer loss compares a complex with its true structure, the
//! true chains of each entity (identical sequences, interchangeable copies) are put in the
//! order that best matches the predicted chains, so that a prediction with two copies of a
//! homodimer swapped is not penalised. DeepMind's release does not ship it; this follows the
//! paper's procedure:
//!
//! 1. The true anchor is a chain of the entity with the fewest copies (the least ambiguous),
//!    the longest of them (ties: the first).
//! 2. For every predicted chain of that entity, the truth is superposed onto the prediction by
//!    that pair of chains' resolved Cα atoms (Kabsch); then every other predicted chain, in
//!    order, takes the unassigned true chain of its entity whose resolved Cα centroid lies
//!    closest to its own.
//! 3. Of those assignments, the one whose superposed truth has the lowest Cα RMSD to the
//!    prediction (over every resolved Cα) is kept.
//!
//! The choice is made without gradients; the loss then reads the truth in the chosen order.
use tch::{Device, Kind, Tensor};

use crate::model::{ensure, Result};

/// One chain of a complex: its `asym_id`, `entity_id` and residues `start..start + len` (a
/// chain's residues are consecutive, as Multimer's features lay them out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    /// The chain's id.
    pub asym_id: i64,
    /// Its entity's id: chains of one entity have one sequence.
    pub entity_id: i64,
    /// Its first residue.
    pub start: usize,
    /// Its residues.
    pub len: usize,
}

/// The chains of `asym_id` and `entity_id` `[N]`, in residue order. An error when a chain's
/// residues are not consecutive, when a chain spans two entities, or when two chains of one
/// entity differ in length (they would not be interchangeable).
pub fn chains(asym_id: &Tensor, entity_id: &Tensor) -> Result<Vec<Chain>> {
    let out = chain_runs(asym_id, entity_id)?;
    for c in &out {
        if let Some(other) = out.iter().find(|o| o.entity_id == c.entity_id && o.len != c.len) {
            ensure!(
                false,
                "chains {} and {} of entity {} have {} and {} residues: copies must match",
                c.asym_id,
                other.asym_id,
                c.entity_id,
                c.len,
                other.len
            );
        }
    }
    Ok(out)
}

/// The chains of `asym_id` and `entity_id` `[N]` as [`chains`] finds them, copies of an entity
/// of any lengths (a crop's).
pub fn chain_runs(asym_id: &Tensor, entity_id: &Tensor) -> Result<Vec<Chain>> {
    let asym: Vec<i64> = Vec::try_from(asym_id.f_to_kind(Kind::Int64)?.f_to_device(Device::Cpu)?)?;
    let entity: Vec<i64> = Vec::try_from(entity_id.f_to_kind(Kind::Int64)?.f_to_device(Device::Cpu)?)?;
    ensure!(asym.len() == entity.len(), "asym_id has {} residues, entity_id {}", asym.len(), entity.len());
    let mut out: Vec<Chain> = Vec::new();
    for (i, (&a, &e)) in asym.iter().zip(&entity).enumerate() {
        match out.last_mut() {
            Some(c) if c.asym_id == a => {
                ensure!(c.entity_id == e, "chain {a} spans entities {} and {e}", c.entity_id);
                c.len += 1;
            }
            _ => {
                ensure!(out.iter().all(|c| c.asym_id != a), "the residues of chain {a} are not consecutive");
                out.push(Chain { asym_id: a, entity_id: e, start: i, len: 1 });
            }
        }
    }
    Ok(out)
}

/// Each residue's place in its chain when the prediction is the whole complex: 0, 1, ... in
/// every chain of `chains`.
pub fn places_in_chains(chains: &[Chain]) -> Vec<usize> {
    chains.iter().flat_map(|c| 0..c.len).collect()
}

/// Cα positions and their mask, as f64 rows on the CPU.
struct Points {
    xyz: Vec<[f64; 3]>,
    mask: Vec<bool>,
}

impl Points {
    fn new(positions: &Tensor, mask: &Tensor) -> Result<Points> {
        let flat: Vec<f64> =
            Vec::try_from(positions.f_to_kind(Kind::Double)?.f_to_device(Device::Cpu)?.f_reshape([-1])?)?;
        let m: Vec<f64> = Vec::try_from(mask.f_to_kind(Kind::Double)?.f_to_device(Device::Cpu)?.f_reshape([-1])?)?;
        ensure!(
            flat.len() == 3 * m.len(),
            "Cα positions {:?} do not match their mask {:?}",
            positions.size(),
            mask.size()
        );
        Ok(Points {
            xyz: flat.chunks(3).map(|p| [p[0], p[1], p[2]]).collect(),
            mask: m.iter().map(|&v| v > 0.0).collect(),
        })
    }
}

/// The rotation and translation that best superpose points `from` onto `to` (least squares,
/// Kabsch): `to ≈ rot · from + trans`. Fewer than three points give the identity rotation.
fn kabsch(from: &[[f64; 3]], to: &[[f64; 3]]) -> Result<([[f64; 3]; 3], [f64; 3])> {
    let (cf, ct) = (mean(from.iter().copied()), mean(to.iter().copied()));
    let mut rot = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]];
    if from.len() >= 3 {
        // H = sum (from - cf)(to - ct)^T; rot = V diag(1, 1, d) U^T with H = U S V^T.
        let mut h = [0.0f64; 9];
        for (a, b) in from.iter().zip(to) {
            for i in 0..3 {
                for j in 0..3 {
                    h[3 * i + j] += (a[i] - cf[i]) * (b[j] - ct[j]);
                }
            }
        }
        let (u, _, v) = Tensor::f_from_slice(&h)?.f_view([3, 3])?.f_svd(true, true)?;
        let ut = u.f_transpose(0, 1)?;
        let r: Vec<f64> = Vec::try_from(v.f_matmul(&ut)?.f_reshape([-1])?)?;
        // A reflection superposes better but is no motion: flip the least singular direction.
        let det = r[0] * (r[4] * r[8] - r[5] * r[7]) - r[1] * (r[3] * r[8] - r[5] * r[6])
            + r[2] * (r[3] * r[7] - r[4] * r[6]);
        let fix = Tensor::f_from_slice(&[1.0, 1.0, if det < 0.0 { -1.0 } else { 1.0 }])?.f_diag(0)?;
        let r: Vec<f64> = Vec::try_from(v.f_matmul(&fix)?.f_matmul(&ut)?.f_reshape([-1])?)?;
        rot = [[r[0], r[1], r[2]], [r[3], r[4], r[5]], [r[6], r[7], r[8]]];
    }
    let moved = apply(&rot, &[0.0; 3], &cf);
    Ok((rot, [ct[0] - moved[0], ct[1] - moved[1], ct[2] - moved[2]]))
}

fn apply(rot: &[[f64; 3]; 3], trans: &[f64; 3], x: &[f64; 3]) -> [f64; 3] {
    let mut y = *trans;
    for (i, row) in rot.iter().enumerate() {
        y[i] += row[0] * x[0] + row[1] * x[1] + row[2] * x[2];
    }
    y
}

/// The mean of points (the origin for none).
fn mean(points: impl Iterator<Item = [f64; 3]>) -> [f64; 3] {
    let (mut sum, mut n) = ([0.0; 3], 0.0);
    for x in points {
        (0..3).for_each(|k| sum[k] += x[k]);
        n += 1.0;
    }
    if n > 0.0 {
        (0..3).for_each(|k| sum[k] /= n);
    }
    sum
}

fn distance2(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    (0..3).map(|k| (a[k] - b[k]).powi(2)).sum()
}

/// For each predicted chain, the true chain to compare it with (indices into `chains`), chosen
/// as the module describes, from predicted Cα positions `pred_ca` [N, 3], true ones `true_ca`
/// [N, 3] and their resolution mask `true_mask` `[N]`, the truth laid out by the same `chains`.
pub fn align_chains(chains: &[Chain], pred_ca: &Tensor, true_ca: &Tensor, true_mask: &Tensor) -> Result<Vec<usize>> {
    align_crop(chains, chains, &places_in_chains(chains), pred_ca, true_ca, true_mask)
}

/// [`align_chains`] for a prediction of a crop of the complex: predicted chains `pred_chains`
/// (some maybe cut short or left out, copies of different lengths), predicted residue `i` being
/// residue `places[i]` of its whole chain, against the whole truth laid out by `truth_chains`
/// (copies of one length). Each predicted chain is compared with the same residues of the true
/// chain assigned to it; indices into `truth_chains`.
pub fn align_crop(
    pred_chains: &[Chain],
    truth_chains: &[Chain],
    places: &[usize],
    pred_ca: &Tensor,
    true_ca: &Tensor,
    true_mask: &Tensor,
) -> Result<Vec<usize>> {
    let pred = Points::new(pred_ca, &pred_ca.f_select(1, 0)?.f_ones_like()?)?;
    let truth = Points::new(true_ca, true_mask)?;
    ensure!(pred.xyz.len() == places.len(), "{} predicted residues, {} places", pred.xyz.len(), places.len());
    let whole = |t: &Chain, p: &Chain| (0..p.len).all(|k| places[p.start + k] < t.len);
    for p in pred_chains {
        let fits = truth_chains.iter().filter(|t| t.entity_id == p.entity_id).all(|t| whole(t, p));
        ensure!(fits, "predicted chain {} has residues past its entity's true chains", p.asym_id);
    }
    let copies = |e: i64| pred_chains.iter().filter(|c| c.entity_id == e).count();
    // The anchor: a true chain of a predicted entity with the fewest copies, then the longest,
    // then the first.
    let Some(anchor) = (0..truth_chains.len())
        .filter(|&i| copies(truth_chains[i].entity_id) > 0)
        .min_by_key(|&i| (copies(truth_chains[i].entity_id), usize::MAX - truth_chains[i].len, i))
    else {
        return Ok(Vec::new());
    };
    // Resolved Cα of true chain `t` paired with the same residues of predicted chain `p`.
    let pairs = |p: &Chain, t: &Chain| -> (Vec<[f64; 3]>, Vec<[f64; 3]>) {
        (0..p.len)
            .map(|k| (t.start + places[p.start + k], p.start + k))
            .filter(|&(row, _)| truth.mask[row])
            .map(|(row, i)| (truth.xyz[row], pred.xyz[i]))
            .unzip()
    };
    // A predicted chain's centroid over all its residues; a true chain's over its resolved ones
    // among those residues, superposed.
    let pred_centroid = |c: &Chain| mean((0..c.len).map(|k| pred.xyz[c.start + k]));
    let true_centroid =
        |p: &Chain, t: &Chain, moved: &dyn Fn(&[f64; 3]) -> [f64; 3]| mean(pairs(p, t).0.iter().map(moved));
    let mut best: Option<(f64, Vec<usize>)> = None;
    let anchor_entity = truth_chains[anchor].entity_id;
    for candidate in (0..pred_chains.len()).filter(|&p| pred_chains[p].entity_id == anchor_entity) {
        let (from, to) = pairs(&pred_chains[candidate], &truth_chains[anchor]);
        let (rot, trans) = kabsch(&from, &to)?;
        let moved = |x: &[f64; 3]| apply(&rot, &trans, x);
        let mut assigned: Vec<Option<usize>> = vec![None; pred_chains.len()];
        assigned[candidate] = Some(anchor);
        for p in 0..pred_chains.len() {
            if p == candidate {
                continue;
            }
            let (pc, target) = (&pred_chains[p], pred_centroid(&pred_chains[p]));
            let free = (0..truth_chains.len())
                .filter(|&t| truth_chains[t].entity_id == pc.entity_id && !assigned.contains(&Some(t)));
            let closest = free.min_by(|&a, &b| {
                let da = distance2(&true_centroid(pc, &truth_chains[a], &moved), &target);
                let db = distance2(&true_centroid(pc, &truth_chains[b], &moved), &target);
                da.total_cmp(&db)
            });
            assigned[p] = closest;
        }
        let assignment: Vec<usize> = assigned.into_iter().map(|t| t.unwrap_or(0)).collect();
        let (mut sum, mut count) = (0.0, 0usize);
        for (p, &t) in assignment.iter().enumerate() {
            let (from, to) = pairs(&pred_chains[p], &truth_chains[t]);
            sum += from.iter().zip(&to).map(|(f, t)| distance2(&moved(f), t)).sum::<f64>();
            count += from.len();
        }
        let rmsd = (sum / count.max(1) as f64).sqrt();
        if best.as_ref().is_none_or(|(b, _)| rmsd < *b) {
            best = Some((rmsd, assignment));
        }
    }
    Ok(best.map(|(_, a)| a).unwrap_or_default())
}

/// The residue order that puts each predicted chain's true chain in its place: index `i` of the
/// result is the true residue to compare with predicted residue `i` (for `Tensor::index_select`
/// on the truth's rows).
pub fn residue_order(chains: &[Chain], assignment: &[usize]) -> Vec<i64> {
    crop_residue_order(chains, chains, &places_in_chains(chains), assignment)
}

/// [`residue_order`] for a crop ([`align_crop`]'s chains, places and assignment): index `i` is
/// the row of the whole truth to compare with predicted residue `i`.
pub fn crop_residue_order(
    pred_chains: &[Chain],
    truth_chains: &[Chain],
    places: &[usize],
    assignment: &[usize],
) -> Vec<i64> {
    let mut order = Vec::new();
    for (p, &t) in assignment.iter().enumerate() {
        let c = &pred_chains[p];
        order.extend((c.start..c.start + c.len).map(|i| (truth_chains[t].start + places[i]) as i64));
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kabsch recovers a turn and a shift from exact points, and keeps a proper rotation
    /// when the points are mirrored.
    #[test]
    fn kabsch_recovers_a_rigid_motion() {
        let from = [[0.0, 0.0, 0.0], [1.5, 0.2, 0.0], [0.3, 2.0, 0.5], [-1.0, 0.4, 1.7], [0.8, -0.9, -1.2]];
        let (c, s) = (0.6f64.cos(), 0.6f64.sin());
        let rot = [[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]];
        let trans = [3.0, -2.0, 7.5];
        let to: Vec<[f64; 3]> = from.iter().map(|x| apply(&rot, &trans, x)).collect();
        let (r, t) = kabsch(&from, &to).unwrap();
        for (x, y) in from.iter().zip(&to) {
            assert!(distance2(&apply(&r, &t, x), y) < 1e-18, "{:?} -> {:?}, want {y:?}", x, apply(&r, &t, x));
        }
        let mirrored: Vec<[f64; 3]> = to.iter().map(|y| [y[0], y[1], -y[2]]).collect();
        let (r, _) = kabsch(&from, &mirrored).unwrap();
        let det = r[0][0] * (r[1][1] * r[2][2] - r[1][2] * r[2][1]) - r[0][1] * (r[1][0] * r[2][2] - r[1][2] * r[2][0])
            + r[0][2] * (r[1][0] * r[2][1] - r[1][1] * r[2][0]);
        assert!((det - 1.0).abs() < 1e-12, "a rotation, not a reflection: det {det}");
    }

    #[test]
    fn chains_are_read_from_the_ids_and_copies_must_match() {
        let ids = |v: &[i64]| Tensor::from_slice(v);
        let c = chains(&ids(&[1, 1, 2, 2, 3]), &ids(&[1, 1, 1, 1, 2])).unwrap();
        assert_eq!(
            c.iter().map(|c| (c.asym_id, c.entity_id, c.start, c.len)).collect::<Vec<_>>(),
            [(1, 1, 0, 2), (2, 1, 2, 2), (3, 2, 4, 1)]
        );
        let err = chains(&ids(&[1, 1, 2]), &ids(&[1, 1, 1])).unwrap_err().to_string();
        assert!(err.contains("copies must match"), "{err}");
        assert!(chains(&ids(&[1, 2, 1]), &ids(&[1, 1, 1])).is_err(), "a chain split in two");
        assert_eq!(residue_order(&c, &[1, 0, 2]), [2, 3, 0, 1, 4]);
    }

    /// A homotrimer's copies (10 residues each, on three separate helices) cropped differently
    /// (chain 1 residues 2..9, chain 2 residues 0..4, chain 3 left out), predicted as the truth
    /// turned and moved with copies 1 and 2 swapped: the crop's alignment assigns each predicted
    /// chain the true copy it is, and the residue order picks, for each predicted residue, the
    /// whole truth's row of its number in that copy.
    #[test]
    fn a_crop_aligns_its_copies_with_the_whole_truth() {
        let helix = |c: usize, k: usize| {
            let a = 1.7 * k as f64;
            [12.0 * c as f64 + 2.3 * a.cos(), 2.3 * a.sin() + 0.4 * c as f64, 1.5 * k as f64]
        };
        let truth: Vec<[f64; 3]> = (0..3).flat_map(|c| (0..10).map(move |k| helix(c, k))).collect();
        let chain = |asym_id: i64, start: usize, len: usize| Chain { asym_id, entity_id: 1, start, len };
        let truth_chains = [chain(1, 0, 10), chain(2, 10, 10), chain(3, 20, 10)];
        // Predicted chain 1 is true copy 2's residues 2..9, predicted chain 2 copy 1's 0..4.
        let (c, s) = (0.8f64.cos(), 0.8f64.sin());
        let moved = |x: &[f64; 3]| apply(&[[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], &[5.0, -3.0, 2.0], x);
        let places: Vec<usize> = (2..9).chain(0..4).collect();
        let pred: Vec<[f64; 3]> =
            (2..9).map(|k| moved(&truth[10 + k])).chain((0..4).map(|k| moved(&truth[k]))).collect();
        let pred_chains = [chain(1, 0, 7), chain(2, 7, 4)];
        let tensor = |p: &[[f64; 3]]| Tensor::from_slice(&p.concat()).view([p.len() as i64, 3]);
        let mask = Tensor::ones([30], (Kind::Double, Device::Cpu));
        let assignment =
            align_crop(&pred_chains, &truth_chains, &places, &tensor(&pred), &tensor(&truth), &mask).unwrap();
        assert_eq!(assignment, vec![1, 0]);
        let rows = crop_residue_order(&pred_chains, &truth_chains, &places, &assignment);
        let want: Vec<i64> = (12..19).chain(0..4).collect();
        assert_eq!(rows, want);
        // A place past the true chains is an error, not a wrong row.
        let bad: Vec<usize> = (2..9).chain([0, 1, 2, 10]).collect();
        assert!(align_crop(&pred_chains, &truth_chains, &bad, &tensor(&pred), &tensor(&truth), &mask).is_err());
    }
}
