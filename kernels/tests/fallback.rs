//! The libtorch compositions (the CPU path, and the reference the fused kernels are tested
//! against on a GPU) equal the operations written out in f64, forward and backward, and the
//! optimizer steps equal the engine's optimizers. Also: the fused path's argument checks.
use engine::optim::{AdamW, AdamWConfig, Lamb, LambConfig, Lars, LarsConfig, Optimizer, Param};
use kernels::{Backend, LarsTensors, OptimTensors};
use tch::{Device, Kind, Tensor};

/// libtorch's generators are global and the tests run on parallel threads: each test holds
/// this while it seeds and draws, so that a seed gives the same numbers every run.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rng() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|p| p.into_inner())
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let d = max_diff(a, b);
    assert!(d <= tol, "{what}: max difference {d:e} > {tol:e}");
}

fn leaf(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

/// Gradients of `sum(y * dy)` with respect to `inputs`.
fn grads(y: &Tensor, dy: &Tensor, inputs: &[&Tensor]) -> Vec<Tensor> {
    Tensor::run_backward(&[(y * dy).sum(Kind::Float)], inputs, false, false)
}

#[test]
fn attention_softmax_equals_the_written_out_softmax() {
    let _rng = rng();
    tch::manual_seed(0);
    let (b, h, q, k) = (3, 2, 5, 7);
    let x = leaf(&[b, h, q, k]);
    let mask = Tensor::from_slice(&[1f32, 1., 0., 1., 1., 0., 1.]).repeat([b, 1]);
    for bias_shape in [vec![h, q, k], vec![b, h, q, k]] {
        let bias = leaf(&bias_shape);
        let y = kernels::attention_softmax(&x, 0.3, Some(&mask), Some(&bias), Backend::Torch).unwrap();
        // In f64: z = 0.3 x + 1e9 (mask - 1) + bias; exp(z - max) / sum.
        let (xd, bd) = (x.to_kind(Kind::Double), bias.to_kind(Kind::Double));
        let z = xd * 0.3 + (mask.to_kind(Kind::Double) - 1.0).reshape([b, 1, 1, k]) * 1e9 + bd;
        let e = (&z - z.amax([-1], true)).exp();
        let want = &e / e.sum_dim_intlist(-1, true, Kind::Double);
        assert_close(&y, &want, 1e-6, "weights");
        assert!(y.select(3, 2).abs().max().double_value(&[]) == 0.0, "a masked key has weight 0");
        let dy = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
        let got = grads(&y, &dy, &[&x, &bias]);
        let want = grads(&want, &dy.to_kind(Kind::Double), &[&x, &bias]);
        assert_close(&got[0], &want[0], 1e-6, "dx");
        assert_close(&got[1], &want[1], 1e-6, "dbias");
    }
}

#[test]
fn memory_efficient_attention_equals_the_written_out_attention() {
    let _rng = rng();
    tch::manual_seed(9);
    let (b, h, nq, nk, d) = (2, 3, 5, 7, 4);
    let (q, k, v) = (leaf(&[b, h, nq, d]), leaf(&[b, h, nk, d]), leaf(&[b, h, nk, d]));
    let mask = Tensor::from_slice(&[1f32, 1., 0., 1., 1., 0., 1.]).repeat([b, 1]);
    for bias_shape in [vec![h, nq, nk], vec![b, h, nq, nk]] {
        let bias = leaf(&bias_shape);
        let y = kernels::memory_efficient_attention(&q, &k, &v, 0.5, Some(&mask), Some(&bias), Backend::Torch).unwrap();
        let d64 = |t: &Tensor| t.to_kind(Kind::Double);
        let z = d64(&q).matmul(&d64(&k).transpose(-2, -1)) * 0.5
            + (d64(&mask) - 1.0).reshape([b, 1, 1, nk]) * 1e9
            + d64(&bias);
        let e = (&z - z.amax([-1], true)).exp();
        let want = (&e / e.sum_dim_intlist(-1, true, Kind::Double)).matmul(&d64(&v));
        assert_close(&y, &want, 1e-6, "out");
        let dy = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
        let inputs = [&q, &k, &v, &bias];
        let (got, want) = (grads(&y, &dy, &inputs), grads(&want, &dy.to_kind(Kind::Double), &inputs));
        for (i, name) in ["dq", "dk", "dv", "dbias"].iter().enumerate() {
            assert_close(&got[i], &want[i], 1e-5, name);
        }
    }
    let err = kernels::memory_efficient_attention(&q, &k, &v.narrow(2, 0, 3), 1.0, None, None, Backend::Torch);
    assert!(err.unwrap_err().to_string().contains("memory_efficient_attention: v is [2, 3, 3, 4], k is [2, 3, 7, 4]"));
    let wide = Tensor::zeros([1, 1, 2, 65], (Kind::Float, Device::Cpu));
    let err = kernels::memory_efficient_attention(&wide, &wide, &wide, 1.0, None, None, Backend::Fused).unwrap_err();
    assert!(err.to_string().contains("at most 64"), "{err}");
}

#[test]
fn layer_norm_equals_the_written_out_normalisation() {
    let _rng = rng();
    tch::manual_seed(1);
    let x = leaf(&[4, 3, 33]);
    let (w, b) = (leaf(&[33]), leaf(&[33]));
    let y = kernels::layer_norm(&x, &w, &b, 1e-5, Backend::Torch).unwrap();
    let xd = x.to_kind(Kind::Double);
    let mean = xd.mean_dim(-1, true, Kind::Double);
    let var = (&xd - &mean).square().mean_dim(-1, true, Kind::Double);
    let want = (&xd - &mean) / (var + 1e-5).sqrt() * w.to_kind(Kind::Double) + b.to_kind(Kind::Double);
    assert_close(&y, &want, 1e-5, "y");
    let dy = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
    let (got, want) = (grads(&y, &dy, &[&x, &w, &b]), grads(&want, &dy.to_kind(Kind::Double), &[&x, &w, &b]));
    for (i, name) in ["dx", "dweight", "dbias"].iter().enumerate() {
        assert_close(&got[i], &want[i], 1e-4, name);
    }
    // The layer names its parameters as torch.nn.LayerNorm does.
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _ = kernels::LayerNorm::new(vs.root() / "norm", 8, 1e-6, Backend::Torch);
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort();
    assert_eq!(names, ["norm.bias", "norm.weight"]);
}

#[test]
fn bias_gelu_equals_the_written_out_erf_gelu() {
    let _rng = rng();
    tch::manual_seed(2);
    let (x, b) = (leaf(&[5, 2, 19]), leaf(&[19]));
    let y = kernels::bias_gelu(&x, &b, Backend::Torch).unwrap();
    let z = x.to_kind(Kind::Double) + b.to_kind(Kind::Double);
    let want = &z * 0.5 * ((&z / 2f64.sqrt()).erf() + 1.0);
    assert_close(&y, &want, 1e-6, "y");
    let dy = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
    let (got, want) = (grads(&y, &dy, &[&x, &b]), grads(&want, &dy.to_kind(Kind::Double), &[&x, &b]));
    assert_close(&got[0], &want[0], 1e-5, "dx");
    assert_close(&got[1], &want[1], 1e-4, "dbias");
}

#[test]
fn sigmoid_gate_equals_the_written_out_gate() {
    let _rng = rng();
    tch::manual_seed(7);
    let (x, g, xb, gb) = (leaf(&[4, 3, 6]), leaf(&[4, 3, 6]), leaf(&[6]), leaf(&[6]));
    let mask = Tensor::from_slice(&[1f32, 0., 1., 1., 1., 0., 1., 1., 0., 1., 1., 1.]).reshape([4, 3]);
    for m in [Some(&mask), None] {
        let y = kernels::sigmoid_gate(&x, &xb, &g, &gb, m, Backend::Torch).unwrap();
        // In f64: m (x + xb) / (1 + exp(-(g + gb))).
        let d = |t: &Tensor| t.to_kind(Kind::Double);
        let mut want = (d(&x) + d(&xb)) / ((-(d(&g) + d(&gb))).exp() + 1.0);
        if let Some(m) = m {
            want *= d(m).unsqueeze(-1);
        }
        assert_close(&y, &want, 1e-6, "y");
        if m.is_some() {
            assert_eq!(y.select(0, 0).select(0, 1).abs().max().double_value(&[]), 0.0, "a masked row is 0");
        }
        let dy = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
        let inputs = [&x, &xb, &g, &gb];
        let (got, want) = (grads(&y, &dy, &inputs), grads(&want, &dy.to_kind(Kind::Double), &inputs));
        for (i, name) in ["dx", "dx_bias", "dgate", "dgate_bias"].iter().enumerate() {
            assert_close(&got[i], &want[i], 1e-5, name);
        }
    }
    let err = kernels::sigmoid_gate(&x, &xb, &g, &gb, Some(&mask.reshape([12])), Backend::Torch).unwrap_err();
    assert!(err.to_string().contains("sigmoid_gate: mask is [12], expected [4, 3]"), "{err}");
}

#[test]
fn bias_dropout_residual_keeps_what_its_mask_keeps() {
    let _rng = rng();
    let (x, b, r) = (leaf(&[64, 31]), leaf(&[31]), leaf(&[64, 31]));
    tch::manual_seed(3);
    let y = kernels::bias_dropout_residual(&x, &b, &r, 0.25, true, Backend::Torch).unwrap();
    tch::manual_seed(3);
    let keep = kernels::dropout_mask(&[64, 31], 0.25, Device::Cpu).unwrap();
    let kept = keep.to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
    assert!((0.7..0.8).contains(&kept), "kept fraction {kept}");
    let want = r.to_kind(Kind::Double)
        + (x.to_kind(Kind::Double) + b.to_kind(Kind::Double)) * keep.to_kind(Kind::Double) / 0.75;
    assert_close(&y, &want, 1e-5, "train");
    let dy = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
    let (got, want) = (grads(&y, &dy, &[&x, &b, &r]), grads(&want, &dy.to_kind(Kind::Double), &[&x, &b, &r]));
    for (i, name) in ["dx", "dbias", "dresidual"].iter().enumerate() {
        assert_close(&got[i], &want[i], 1e-4, name);
    }
    let eval = kernels::bias_dropout_residual(&x, &b, &r, 0.25, false, Backend::Torch).unwrap();
    assert_close(&eval, &(&r + &x + &b), 1e-6, "eval");
    let err = kernels::dropout_mask(&[2], 1.0, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("outside [0, 1)"), "{err}");
}

/// Parameters with gradients, as (param, grad) pairs; the biases do not adapt.
fn problem(seed: i64) -> Vec<(Tensor, Tensor, bool)> {
    tch::manual_seed(seed);
    [vec![7, 5], vec![5], vec![3, 2, 4], vec![1]]
        .into_iter()
        .map(|s| {
            let adapt = s.len() >= 2;
            (Tensor::randn(&s, (Kind::Float, Device::Cpu)), Tensor::randn(&s, (Kind::Float, Device::Cpu)), adapt)
        })
        .collect()
}

/// Three steps of `ours` against three of the engine's optimizer on the same parameters.
fn against_engine(ours: impl Fn(&[OptimTensors], i32), engine_opt: impl FnOnce(Vec<Param>) -> Box<dyn Optimizer>) {
    let mine = problem(4);
    let state: Vec<(Tensor, Tensor)> = mine.iter().map(|(w, _, _)| (w.zeros_like(), w.zeros_like())).collect();
    let theirs: Vec<Tensor> = mine.iter().map(|(w, _, _)| w.copy().set_requires_grad(true)).collect();
    let params: Vec<Param> =
        theirs.iter().enumerate().map(|(i, t)| Param::new(format!("p{i}"), t).with_adapt(mine[i].2)).collect();
    let mut opt = engine_opt(params);
    for step in 1..=3 {
        for ((_, g, _), t) in mine.iter().zip(&theirs) {
            engine::autograd::set_grad(t, Some(&(g * step as f64))).unwrap();
        }
        let grads: Vec<Tensor> = mine.iter().map(|(_, g, _)| g * step as f64).collect();
        let tensors: Vec<OptimTensors> = mine
            .iter()
            .zip(&state)
            .zip(&grads)
            .map(|(((w, _, adapt), (m, v)), g)| OptimTensors {
                param: w,
                grad: g,
                exp_avg: m,
                exp_avg_sq: v,
                adapt: *adapt,
            })
            .collect();
        ours(&tensors, step);
        opt.step().unwrap();
    }
    for (i, ((w, _, _), t)) in mine.iter().zip(&theirs).enumerate() {
        assert_close(w, &t.detach(), 1e-6, &format!("parameter {i}"));
    }
}

#[test]
fn adamw_step_equals_the_engines_adamw() {
    let _rng = rng();
    let cfg = AdamWConfig { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    against_engine(
        |t, step| kernels::adamw_step(t, &cfg, step, Backend::Torch).unwrap(),
        |p| Box::new(AdamW::new(p, cfg)),
    );
}

#[test]
fn lamb_step_equals_the_engines_lamb() {
    let _rng = rng();
    let cfg = LambConfig { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    against_engine(
        |t, step| kernels::lamb_step(t, &cfg, step, Backend::Torch).unwrap(),
        |p| Box::new(Lamb::new(p, cfg)),
    );
}

#[test]
fn lars_step_equals_the_engines_lars_with_and_without_momentum() {
    let _rng = rng();
    for momentum in [0.9, 0.0] {
        let cfg = LarsConfig { lr: 0.5, momentum, weight_decay: 1e-3, ..Default::default() };
        let mine = problem(6);
        let buffers: Vec<Tensor> = mine.iter().map(|(w, _, _)| w.zeros_like()).collect();
        let theirs: Vec<Tensor> = mine.iter().map(|(w, _, _)| w.copy().set_requires_grad(true)).collect();
        let params: Vec<Param> =
            theirs.iter().enumerate().map(|(i, t)| Param::new(format!("p{i}"), t).with_adapt(mine[i].2)).collect();
        let mut opt = Lars::new(params, cfg);
        for step in 1..=3 {
            let grads: Vec<Tensor> = mine.iter().map(|(_, g, _)| g * step as f64).collect();
            for (g, t) in grads.iter().zip(&theirs) {
                engine::autograd::set_grad(t, Some(g)).unwrap();
            }
            let tensors: Vec<LarsTensors> = mine
                .iter()
                .zip(&buffers)
                .zip(&grads)
                .map(|(((w, _, adapt), b), g)| LarsTensors {
                    param: w,
                    grad: g,
                    momentum_buffer: Some(b),
                    adapt: *adapt,
                })
                .collect();
            kernels::lars_step(&tensors, &cfg, step, Backend::Torch).unwrap();
            opt.step().unwrap();
        }
        for (i, ((w, _, _), t)) in mine.iter().zip(&theirs).enumerate() {
            assert_close(w, &t.detach(), 1e-6, &format!("momentum {momentum}: parameter {i}"));
        }
        if momentum == 0.0 {
            assert!(buffers.iter().all(|b| b.abs().max().double_value(&[]) == 0.0), "no momentum: buffers untouched");
        }
    }
    // Momentum without a buffer is an error naming the tensor.
    let (w, g) = (Tensor::ones([3], (Kind::Float, Device::Cpu)), Tensor::ones([3], (Kind::Float, Device::Cpu)));
    let t = [LarsTensors { param: &w, grad: &g, momentum_buffer: None, adapt: true }];
    let err = kernels::lars_step(&t, &LarsConfig::default(), 1, Backend::Torch).unwrap_err().to_string();
    assert!(err.contains("lars_step: momentum 0.9 needs tensor 0's momentum_buffer"), "{err}");
}

#[test]
fn the_fused_path_names_what_it_cannot_take() {
    let _rng = rng();
    let x = Tensor::zeros([2, 3, 4, 5], (Kind::Float, Device::Cpu));
    let err = kernels::attention_softmax(&x, 1.0, None, None, Backend::Fused).unwrap_err().to_string();
    assert!(err.contains("attention_softmax: x is on Cpu") && err.contains("CUDA"), "{err}");
    let bad_bias = Tensor::zeros([3, 4], (Kind::Float, Device::Cpu));
    let err = kernels::attention_softmax(&x, 1.0, None, Some(&bad_bias), Backend::Torch).unwrap_err().to_string();
    assert!(err.contains("bias is [3, 4]"), "{err}");
    let v = Tensor::zeros([2, 5], (Kind::Float, Device::Cpu));
    let c = Tensor::zeros([5], (Kind::Float, Device::Cpu));
    let err = kernels::sigmoid_gate(&v, &c, &v, &c, None, Backend::Fused).unwrap_err().to_string();
    assert!(err.contains("sigmoid_gate: x is on Cpu") && err.contains("CUDA"), "{err}");
    let w = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let err = kernels::layer_norm(&x, &w, &w, 1e-5, Backend::Torch).unwrap_err().to_string();
    assert!(err.contains("must be [5]"), "{err}");
    let err = kernels::Backend::resolve(Some(Backend::Fused), Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("--kernels fused needs a CUDA device"), "{err}");
    assert_eq!(Backend::resolve(None, Device::Cpu).unwrap(), Backend::Torch);
    assert_eq!(Backend::resolve(None, Device::Cuda(0)).unwrap(), Backend::Fused);
    let g = Tensor::zeros([2], (Kind::Double, Device::Cpu));
    let t = [OptimTensors { param: &g, grad: &g, exp_avg: &g, exp_avg_sq: &g, adapt: false }];
    let err = kernels::adamw_step(&t, &AdamWConfig::default(), 1, Backend::Torch).unwrap_err().to_string();
    assert!(err.contains("tensor 0's param is Double"), "{err}");
}
