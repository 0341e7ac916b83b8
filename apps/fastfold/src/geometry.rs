//! Rigid transforms and the point error built on them, as AlphaFold defines them (Jumper et al.
//! 2021, supplementary 1.8 and 1.9): frames from three atoms (Algorithm 21, AlphaFold's `r3`)
//! and frame-aligned point error (FAPE, Algorithm 28). Everything works on batched tch tensors
//! with leading dimensions `[...]`. Their matrix products are IEEE fp32 under any
//! `--fp32-matmul` ([`IeeeScope`]): AlphaFold keeps coordinate geometry off the tensor cores.
use engine::fp32_matmul::IeeeScope;
use tch::{Kind, Tensor};

/// Rigid transforms `x -> R x + t`: rotations `[..., 3, 3]` and translations `[..., 3]`.
#[derive(Debug)]
pub struct Rigid {
    /// Rotation matrices.
    pub rot: Tensor,
    /// Translations.
    pub trans: Tensor,
}

impl Rigid {
    /// The frame with origin `x2`, first axis towards `x3` and `x1` in the plane of the first
    /// two axes (Gram-Schmidt; AlphaFold's `rigid_from_three_points` with
    /// `x1 = N, x2 = CA, x3 = C`). `eps` keeps the normalisation finite for coincident atoms.
    pub fn from_three_points(x1: &Tensor, x2: &Tensor, x3: &Tensor, eps: f64) -> Rigid {
        Rigid::from_two_vectors(&(x3 - x2), &(x1 - x2), x2, eps)
    }

    /// The frame at `origin` whose x axis points along `e0` and whose xy plane holds `e1`
    /// (Gram-Schmidt, AlphaFold's `r3.rots_from_two_vecs`; `eps` is added to the squared norms
    /// before the square root, as its `vecs_robust_normalize`, so coincident atoms give a zero
    /// frame rather than NaN).
    pub fn from_two_vectors(e0: &Tensor, e1: &Tensor, origin: &Tensor, eps: f64) -> Rigid {
        let norm = |v: &Tensor| v / (v.square().sum_dim_intlist(-1, true, Kind::Float) + eps).sqrt();
        let e0 = norm(e0);
        let u1 = e1 - &e0 * (e1 * &e0).sum_dim_intlist(-1, true, Kind::Float);
        let e1 = norm(&u1);
        let e2 = e0.cross(&e1, -1);
        Rigid { rot: Tensor::stack(&[e0, e1, e2], -1), trans: origin.shallow_clone() }
    }

    /// AlphaFold's `r3.rigids_from_3_points`: the frame at `origin` with
    /// `point_on_neg_x_axis` on its negative x axis and `point_on_xy_plane` in its xy plane.
    pub fn from_3_points(point_on_neg_x_axis: &Tensor, origin: &Tensor, point_on_xy_plane: &Tensor) -> Rigid {
        Rigid::from_two_vectors(&(origin - point_on_neg_x_axis), &(point_on_xy_plane - origin), origin, 1e-8)
    }

    /// Rotates every frame by `rot` [..., 3, 3] in its own coordinates: `R -> R rot`, the
    /// origin unchanged (AlphaFold's `r3.rigids_mul_rots`).
    pub fn mul_rots(&self, rot: &Tensor) -> Rigid {
        let _ieee = IeeeScope::enter();
        Rigid { rot: self.rot.matmul(rot), trans: self.trans.shallow_clone() }
    }

    /// Applies the transform to points `[..., 3]` (broadcast against the frames).
    pub fn apply(&self, x: &Tensor) -> Tensor {
        let _ieee = IeeeScope::enter();
        self.rot.matmul(&x.unsqueeze(-1)).squeeze_dim(-1) + &self.trans
    }

    /// Applies the inverse transform: `R^T (x - t)`.
    pub fn invert_apply(&self, x: &Tensor) -> Tensor {
        let _ieee = IeeeScope::enter();
        self.rot.transpose(-1, -2).matmul(&(x - &self.trans).unsqueeze(-1)).squeeze_dim(-1)
    }

    /// Every point `x` [..., P, 3] in the coordinates of every frame [..., F]: [..., F, P, 3].
    pub fn in_every_frame(&self, x: &Tensor) -> Tensor {
        let f = Rigid { rot: self.rot.unsqueeze(-3), trans: self.trans.unsqueeze(-2) };
        f.invert_apply(&x.unsqueeze(-3))
    }

    /// `self ∘ other`: first `other`, then `self`.
    pub fn compose(&self, other: &Rigid) -> Rigid {
        let _ieee = IeeeScope::enter();
        Rigid { rot: self.rot.matmul(&other.rot), trans: self.apply(&other.trans) }
    }

    /// Rotation matrices from (not necessarily normalised) quaternions `[..., 4]` `(w, x, y, z)`,
    /// and translations: AlphaFold's backbone update (Algorithm 23) parameterisation.
    pub fn from_quaternion(q: &Tensor, trans: &Tensor) -> Rigid {
        let q = q / q.square().sum_dim_intlist(-1, true, Kind::Float).sqrt();
        let [w, x, y, z] = [0, 1, 2, 3].map(|i| q.select(-1, i));
        let rows = [
            [&w * &w + &x * &x - &y * &y - &z * &z, (&x * &y - &w * &z) * 2.0, (&x * &z + &w * &y) * 2.0],
            [(&x * &y + &w * &z) * 2.0, &w * &w - &x * &x + &y * &y - &z * &z, (&y * &z - &w * &x) * 2.0],
            [(&x * &z - &w * &y) * 2.0, (&y * &z + &w * &x) * 2.0, &w * &w - &x * &x - &y * &y + &z * &z],
        ];
        let rows: Vec<Tensor> = rows.into_iter().map(|r| Tensor::stack(&r, -1)).collect();
        Rigid { rot: Tensor::stack(&rows, -2), trans: trans.shallow_clone() }
    }
}

/// Frame-aligned point error (AlphaFold's Algorithm 28, `all_atom.frame_aligned_point_error`):
/// every position `[..., P, 3]` seen from every frame `[..., F]`, predicted against true,
/// distances `sqrt(d^2 + 1e-4)` clamped at `clamp` (Å, AlphaFold 10) when given, divided by
/// `length_scale` (Å, AlphaFold 10) and averaged over the masked pairs (the sum over
/// `sum(frame_mask) * sum(position_mask) + 1e-4`, AlphaFold's epsilon in both places). Masks
/// are `[..., F]` and `[..., P]` (1 = present). Identical structures score `0.01 / length_scale`.
#[allow(clippy::too_many_arguments)]
pub fn fape(
    pred_frames: &Rigid,
    true_frames: &Rigid,
    frame_mask: &Tensor,
    pred_positions: &Tensor,
    true_positions: &Tensor,
    position_mask: &Tensor,
    clamp: Option<f64>,
    length_scale: f64,
) -> Tensor {
    const EPS: f64 = 1e-4;
    let diff = pred_frames.in_every_frame(pred_positions) - true_frames.in_every_frame(true_positions);
    let mut d = (diff.square().sum_dim_intlist(-1, false, Kind::Float) + EPS).sqrt();
    if let Some(c) = clamp {
        d = d.clamp_max(c);
    }
    let mask = frame_mask.unsqueeze(-1) * position_mask.unsqueeze(-2);
    let dims: Vec<i64> = vec![-1, -2];
    let count =
        frame_mask.sum_dim_intlist(-1, false, Kind::Float) * position_mask.sum_dim_intlist(-1, false, Kind::Float);
    (d / length_scale * &mask).sum_dim_intlist(dims.as_slice(), false, Kind::Float) / (count + EPS)
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    const F: (Kind, Device) = (Kind::Float, Device::Cpu);

    fn close(a: &Tensor, b: &Tensor, tol: f64) -> bool {
        (a - b).abs().max().double_value(&[]) <= tol
    }

    /// A random rotation (from a quaternion) and translation, `n` of them.
    fn random_rigid(n: i64) -> Rigid {
        Rigid::from_quaternion(&Tensor::randn([n, 4], F), &(Tensor::randn([n, 3], F) * 5.0))
    }

    #[test]
    fn frames_from_three_points_are_proper_rotations() {
        // Fixed, well-spread points (unseeded random ones were now and then nearly collinear,
        // where a frame's rounding exceeds any fixed tolerance). Backbone-like: C 1.5 A from
        // CA along a varying direction, N off that line.
        let at = |f: &dyn Fn(f64) -> [f64; 3]| {
            let v: Vec<f32> = (0..6).flat_map(|i| f(i as f64).map(|x| x as f32)).collect();
            Tensor::from_slice(&v).view([6, 3])
        };
        let ca = at(&|i| [(1.3 * i).sin() * 4.0, (0.7 * i).cos() * 3.0, i - 2.5]);
        let c = &ca + at(&|i| [1.5 * (0.9 * i).cos(), 1.5 * (0.9 * i).sin(), 0.3]);
        let n = &ca + at(&|i| [-0.4 * (0.5 * i).sin(), 1.2, 0.8 * (1.1 * i).cos() - 0.5]);
        let r = Rigid::from_three_points(&n, &ca, &c, 1e-8);
        let eye = Tensor::eye(3, F).expand([6, 3, 3], false);
        assert!(close(&r.rot.transpose(-1, -2).matmul(&r.rot), &eye, 1e-5), "orthonormal");
        assert!(close(&r.rot.det(), &Tensor::ones([6], F), 1e-5), "det 1");
        // In its own frame CA is the origin, C lies on +x and N in the x-y plane (y > 0).
        assert!(close(&r.invert_apply(&ca), &Tensor::zeros([6, 3], F), 1e-5));
        let lc = r.invert_apply(&c);
        assert!(
            close(&lc.narrow(-1, 1, 2), &Tensor::zeros([6, 2], F), 1e-5)
                && lc.select(-1, 0).min().double_value(&[]) > 0.0
        );
        let ln = r.invert_apply(&n);
        assert!(
            close(&ln.select(-1, 2), &Tensor::zeros([6], F), 1e-5) && ln.select(-1, 1).min().double_value(&[]) >= 0.0
        );
        // apply and invert_apply are inverse; compose applies right then left.
        let x = Tensor::randn([6, 3], F);
        assert!(close(&r.apply(&r.invert_apply(&x)), &x, 1e-5));
        let s = random_rigid(6);
        assert!(close(&r.compose(&s).apply(&x), &r.apply(&s.apply(&x)), 1e-4));
    }

    #[test]
    fn fape_is_zero_for_the_truth_invariant_to_global_motion_and_clamped() {
        let frames = random_rigid(5);
        let x = Tensor::randn([7, 3], F) * 4.0;
        let (fm, pm) = (Tensor::ones([5], F), Tensor::ones([7], F));
        // The truth scores sqrt(1e-4) / 10 per pair: AlphaFold's epsilon.
        let l = fape(&frames, &frames, &fm, &x, &x, &pm, Some(10.0), 10.0);
        assert!((l.double_value(&[]) - 1e-3).abs() < 1e-5, "{l:?}");
        // A perturbed prediction, then the same prediction moved as a whole: same loss.
        let pred = random_rigid(5);
        let px = &x + Tensor::randn([7, 3], F);
        let l1 = fape(&pred, &frames, &fm, &px, &x, &pm, Some(10.0), 10.0);
        let g = random_rigid(1);
        let g1 = Rigid { rot: g.rot.get(0), trans: g.trans.get(0) };
        let moved = g1.compose(&pred);
        let l2 = fape(&moved, &frames, &fm, &g1.apply(&px), &x, &pm, Some(10.0), 10.0);
        assert!((l1.double_value(&[]) - l2.double_value(&[])).abs() < 1e-4, "{l1:?} {l2:?}");
        assert!(l1.double_value(&[]) > 0.0);
        // Far off: every distance clamps at 10 A, so the loss is 10 / 10 = 1.
        let far = &x + 1000.0;
        let l = fape(&frames, &frames, &fm, &far, &x, &pm, Some(10.0), 10.0);
        assert!((l.double_value(&[]) - 1.0).abs() < 1e-5, "{l:?}");
        // Masked-out positions do not count.
        let far_one = x.copy();
        let _ = far_one.get(0).f_add_scalar_(1000.0).unwrap();
        let mask = Tensor::from_slice(&[0f32, 1., 1., 1., 1., 1., 1.]);
        let l = fape(&frames, &frames, &fm, &far_one, &x, &mask, None, 10.0);
        assert!((l.double_value(&[]) - 1e-3).abs() < 1e-5, "{l:?}");
    }
}
