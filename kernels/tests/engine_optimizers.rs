//! The engine's tensor optimizers with multi-tensor steps installed (`engine::optim::fused`)
//! equal the same optimizers stepping tensor by tensor. On the CPU the installed steps are the
//! compositions (`MultiTensor(Backend::Torch)`), which checks the engine's side: what it hands
//! over (state, adapt flags, LARS's first step) and when it steps by itself instead. The fused
//! kernels run on a GPU (scripts/gpu-check.sh runs this binary there), else on the CPU emulator.
//! The installed steps and the emulator switch are process-wide, so this binary's tests take
//! turns.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use engine::optim::flat::{CpuRule, DeviceOptimizer, Segment};
use engine::optim::fused::{self, MultiTensorSteps, Rule, StepTensors};
use engine::optim::{AdamW, AdamWConfig, Lamb, LambConfig, Lars, LarsConfig, Optimizer, Param};
use kernels::{Backend, MultiTensor};
use tch::{Device, Kind, Tensor};

static TURN: Mutex<()> = Mutex::new(());

/// Counts the calls it passes on.
#[derive(Debug)]
struct Counting(MultiTensor, AtomicUsize);

impl MultiTensorSteps for Counting {
    fn accepts(&self, t: &Tensor) -> bool {
        self.0.accepts(t)
    }
    fn step(&self, rule: Rule, tensors: &[StepTensors], step: i32) -> engine::Result<()> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.step(rule, tensors, step)
    }
}

/// Four steps of the optimizer `make` builds over the same parameters, tensor by tensor and
/// with `steps` installed; the second parameter has no gradient on the first step (LARS's
/// buffers then start on different steps). Returns how many steps went through `steps`.
fn compare(dev: Device, backend: Backend, tol: f64, make: &dyn Fn(Vec<Param>) -> Box<dyn Optimizer>) -> usize {
    tch::manual_seed(11);
    let shapes: [&[i64]; 4] = [&[7, 5], &[5], &[16384 + 3], &[30, 31]];
    let start: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, dev))).collect();
    let grads: Vec<Vec<Tensor>> =
        (0..4).map(|_| shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, dev))).collect()).collect();
    let run = |steps: Option<Arc<dyn MultiTensorSteps>>| {
        fused::install(steps);
        let leaves: Vec<Tensor> = start.iter().map(|t| t.copy().set_requires_grad(true)).collect();
        let params = leaves.iter().enumerate().map(|(i, t)| Param::new(format!("p{i}"), t)).collect();
        let mut opt = make(params);
        for (s, g) in grads.iter().enumerate() {
            for (i, (t, g)) in leaves.iter().zip(g).enumerate() {
                let g = (s > 0 || i != 1).then_some(g);
                engine::autograd::set_grad(t, g).unwrap();
            }
            opt.step().unwrap();
        }
        fused::install(None);
        leaves.iter().map(|t| t.detach()).collect::<Vec<_>>()
    };
    let plain = run(None);
    let counting = Arc::new(Counting(MultiTensor(backend), AtomicUsize::new(0)));
    let multi = run(Some(counting.clone()));
    for (i, (a, b)) in multi.iter().zip(&plain).enumerate() {
        let scale = b.abs().max().double_value(&[]).max(1.0);
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= tol * scale, "parameter {i}: differs by {d:e} (tolerance {tol:e} of {scale})");
    }
    counting.1.load(Ordering::SeqCst)
}

/// Builds an optimizer over parameters.
type Make = Box<dyn Fn(Vec<Param>) -> Box<dyn Optimizer>>;

fn rules() -> Vec<(&'static str, Make, usize)> {
    let adamw = AdamWConfig { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    let lamb = LambConfig { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    let lars = LarsConfig { lr: 0.5, weight_decay: 1e-3, ..Default::default() };
    let lars0 = LarsConfig { momentum: 0.0, ..lars };
    // Steps through the installed implementation out of 4: all for Adam's rules and for LARS
    // without momentum; with momentum not the second, whose buffers are one new, three running.
    vec![
        ("adamw", Box::new(move |p| Box::new(AdamW::new(p, adamw)) as Box<dyn Optimizer>), 4),
        ("lamb", Box::new(move |p| Box::new(Lamb::new(p, lamb)) as Box<dyn Optimizer>), 4),
        ("lars", Box::new(move |p| Box::new(Lars::new(p, lars)) as Box<dyn Optimizer>), 3),
        ("lars without momentum", Box::new(move |p| Box::new(Lars::new(p, lars0)) as Box<dyn Optimizer>), 4),
    ]
}

#[test]
fn installed_steps_equal_the_tensor_optimizers_on_the_cpu() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    for (name, make, expected) in rules() {
        let calls = compare(Device::Cpu, Backend::Torch, 1e-6, &make);
        assert_eq!(calls, expected, "{name}: steps through the installed implementation");
    }
    // The fused kernels take CUDA tensors only: CPU parameters step tensor by tensor.
    let calls = compare(Device::Cpu, Backend::Fused, 0.0, &rules().remove(0).1);
    assert_eq!(calls, 0, "CPU tensors are not handed to the fused kernels");
}

/// Where the fused side runs: CUDA, else the CPU emulator, switched off again when the test
/// ends (the switch is process-wide, and the CPU test asserts that CPU tensors are refused).
struct Fused(Device);

impl Fused {
    fn device(test: &str) -> Fused {
        Fused(suite_tests::cuda_or_emulator(test, kernels::emulator::enable))
    }
}

impl Drop for Fused {
    fn drop(&mut self) {
        kernels::emulator::disable();
    }
}

#[test]
fn fused_steps_equal_the_tensor_optimizers_on_cuda_or_the_emulator() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let fused = Fused::device("fused_steps_equal_the_tensor_optimizers_on_cuda_or_the_emulator");
    for (name, make, expected) in rules() {
        // As the kernels' parity tests: f32 norms summed by atomics in any order.
        let calls = compare(fused.0, Backend::Fused, 1e-5, &make);
        assert_eq!(calls, expected, "{name}: steps through the fused kernels");
    }
}

/// Gemini's flat optimizer for device homes: AdamW over segments of a flat buffer (padding
/// between them left alone) through the installed steps equals its tensor operations.
fn device_optimizer_matches(dev: Device, backend: Backend, tol: f64) -> usize {
    let segments = vec![
        Segment { name: "w".into(), offset: 0, len: 35, adapt: true },
        Segment { name: "b".into(), offset: 40, len: 5, adapt: false },
        Segment { name: "big".into(), offset: 48, len: 16384 + 3, adapt: true },
    ];
    let len = 48 + 16384 + 3;
    tch::manual_seed(12);
    let start = Tensor::randn([len], (Kind::Float, dev));
    let grads: Vec<Tensor> = (0..3).map(|_| Tensor::randn([len], (Kind::Float, dev))).collect();
    let rule = CpuRule::AdamW(AdamWConfig { lr: 0.05, weight_decay: 0.1, ..Default::default() });
    let run = |steps: Option<Arc<dyn MultiTensorSteps>>| {
        fused::install(steps);
        let w = start.copy();
        let mut opt = DeviceOptimizer::new(rule, segments.clone(), &w).unwrap();
        for g in &grads {
            let g = g.copy();
            let sums = opt.prepare(&w, &g).unwrap();
            let sums: Vec<[f64; 2]> =
                Vec::<Vec<f64>>::try_from(sums).unwrap().into_iter().map(|r| [r[0], r[1]]).collect();
            let before = g.copy();
            opt.finish(&w, &g, &sums).unwrap();
            // Gemini overwrites a spent gradient with the next, so the step leaves it.
            assert!(g.equal(&before), "the gradient is left as it is");
        }
        fused::install(None);
        w
    };
    let plain = run(None);
    let counting = Arc::new(Counting(MultiTensor(backend), AtomicUsize::new(0)));
    let multi = run(Some(counting.clone()));
    let d = (&multi - &plain).abs().max().double_value(&[]);
    assert!(d <= tol * plain.abs().max().double_value(&[]), "differs by {d:e}");
    assert_eq!(multi.narrow(0, 35, 5), start.narrow(0, 35, 5), "padding untouched");
    counting.1.load(Ordering::SeqCst)
}

#[test]
fn device_homes_step_through_the_installed_steps() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    assert_eq!(device_optimizer_matches(Device::Cpu, Backend::Torch, 1e-6), 3, "every step");
    let fused = Fused::device("device_homes_step_through_the_installed_steps (fused part)");
    assert_eq!(device_optimizer_matches(fused.0, Backend::Fused, 1e-5), 3, "every step, fused");
}
