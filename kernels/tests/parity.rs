//! Every fused kernel equals its libtorch composition, forward and backward, on odd shapes,
//! masks and strides. In each dtype the fused result is at most twice as far from the f64
//! composition (on the same rounded inputs) as the composition in that dtype is, plus 1e-5
//! (f32), 4e-3 (bf16) or 5e-4 (f16) of the largest value: the kernels compute in f32 and round
//! once, the composition rounds after every operation, and where a result is ill-conditioned
//! (a LayerNorm over one column) the composition's own error sets the bar. The optimizers: within
//! 1e-6 (AdamW) or 1e-5 (LAMB, LARS) of the composition.
//!
//! Without a GPU they run on the CPU emulator (`kernels::emulator`): the same kernels, compiled
//! as C++, through the same wrappers and launch shapes, and once more under AddressSanitizer.
//! Under `SUITE_REQUIRE_CUDA=1` (scripts/gpu-check.sh sets it) a missing GPU fails them instead.
use engine::optim::{AdamWConfig, LambConfig, LarsConfig};
use kernels::{Backend, LarsTensors, OptimTensors};
use tch::{Device, Kind, Tensor};

/// libtorch's generators are global and the tests run on parallel threads: each test holds
/// this while it seeds and draws, so that a seed gives the same numbers every run.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rng() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|p| p.into_inner())
}

fn device(test: &str) -> Device {
    suite_tests::cuda_or_emulator(test, kernels::emulator::enable)
}

fn max_abs(t: &Tensor) -> f64 {
    t.to_kind(Kind::Double).abs().max().double_value(&[])
}

/// `a` equals `b` within `tol` of the largest value of `b` (at least 1).
fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let d = max_abs(&(a.to_kind(Kind::Double) - b.to_kind(Kind::Double)));
    let scale = max_abs(b).max(1.0);
    assert!(d <= tol * scale, "{what}: max difference {d:e} > {tol:e} x {scale}");
}

/// The tolerance rule for a dtype: `fused` against `torch`, both judged by `reference` (f64).
/// Over the whole tensor, not element by element: in bf16 and f16 a single rounding of the
/// largest value takes most of the floor, and an element where the composition happens to be
/// exact would leave nothing for the kernel's one rounding.
fn assert_matches(fused: &Tensor, torch: &Tensor, reference: &Tensor, kind: Kind, what: &str) {
    let floor = match kind {
        Kind::Float => 1e-5,
        Kind::BFloat16 => 4e-3,
        _ => 5e-4,
    };
    let err = |t: &Tensor| max_abs(&(t.to_kind(Kind::Double) - reference.to_kind(Kind::Double)));
    let scale = max_abs(reference).max(1.0);
    let (ours, theirs) = (err(fused), err(torch));
    assert!(
        ours <= 2.0 * theirs + floor * scale,
        "{what} ({kind:?}): fused error {ours:e}, torch's {theirs:e}, scale {scale}"
    );
}

/// Output and input gradients of `f` for one backend, given leaf inputs and an output gradient.
fn run(f: &dyn Fn(&[Tensor], Backend) -> Tensor, inputs: &[Tensor], dy: &Tensor, backend: Backend) -> Vec<Tensor> {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.detach().copy().set_requires_grad(t.requires_grad())).collect();
    let y = f(&leaves, backend);
    let wrt: Vec<&Tensor> = leaves.iter().filter(|t| t.requires_grad()).collect();
    let mut out = vec![y.detach()];
    out.extend(Tensor::run_backward(&[(&y * dy).sum(Kind::Float)], &wrt, false, false));
    out
}

/// Checks `f` in every dtype: fused against the composition, both judged by the f64
/// composition on the same (rounded) inputs.
fn check(test: &str, f: &dyn Fn(&[Tensor], Backend) -> Tensor, inputs: &[Tensor], out_shape: &[i64]) {
    let dy32 = Tensor::randn(out_shape, (Kind::Float, inputs[0].device()));
    let cast = |kind: Kind| -> Vec<Tensor> {
        let cast = |t: &Tensor| if t.is_floating_point() { t.detach().to_kind(kind) } else { t.detach() };
        inputs.iter().map(|t| cast(t).set_requires_grad(t.requires_grad())).collect()
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let (inputs, dy) = (cast(kind), dy32.to_kind(kind));
        let fused = run(f, &inputs, &dy, Backend::Fused);
        let torch = run(f, &inputs, &dy, Backend::Torch);
        let rounded: Vec<Tensor> = inputs
            .iter()
            .map(|t| {
                let up = if t.is_floating_point() { t.detach().to_kind(Kind::Double) } else { t.detach() };
                up.set_requires_grad(t.requires_grad())
            })
            .collect();
        let reference = run(f, &rounded, &dy.to_kind(Kind::Double), Backend::Torch);
        let names = ["output"].into_iter().chain(std::iter::repeat("gradient"));
        for (i, ((a, b), name)) in fused.iter().zip(&torch).zip(names).enumerate() {
            assert_eq!(a.kind(), kind, "{test}: {name} {i} dtype");
            assert_matches(a, b, &reference[i], kind, &format!("{test}: {name} {i}"));
        }
    }
}

fn randn(shape: &[i64], dev: Device, grad: bool) -> Tensor {
    Tensor::randn(shape, (Kind::Float, dev)).set_requires_grad(grad)
}

#[test]
fn require_cuda_turns_a_missing_gpu_into_a_failure() {
    let _rng = rng();
    if engine::cuda::is_available() {
        return; // Nothing to check: the GPU tests run for real here.
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["layer_norm_matches", "--exact", "--test-threads=1"])
        .env(suite_tests::REQUIRE_CUDA_ENV, "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "a GPU test passed without a GPU under SUITE_REQUIRE_CUDA=1:\n{text}");
    assert!(text.contains("needs 1 CUDA device(s), found 0"), "{text}");
}

/// Without a GPU: the emulated tests again, in a child process under AddressSanitizer (the
/// kernels compiled with `-fsanitize=address`, its runtime preloaded so that libtorch's CPU
/// tensors get red zones). A kernel that reads or writes past its tensors fails here, rather
/// than with an illegal address on a GPU, which ends the process there.
#[test]
fn kernels_stay_within_their_tensors() {
    if engine::cuda::device_count() > 0 || suite_tests::cuda_required() {
        return; // On a GPU the tests above run there.
    }
    let compiler = kernels::emulator::compiler();
    let runtime = std::process::Command::new(&compiler).arg("-print-file-name=libasan.so").output().unwrap();
    let runtime = String::from_utf8_lossy(&runtime.stdout).trim().to_string();
    assert!(
        std::path::Path::new(&runtime).is_absolute() && std::path::Path::new(&runtime).exists(),
        "{compiler} names no AddressSanitizer runtime (-print-file-name=libasan.so gave {runtime:?}); install g++"
    );
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["_matches", "--test-threads=2"])
        .env("LD_PRELOAD", &runtime)
        .env(
            kernels::emulator::FLAGS_ENV,
            "-fsanitize=address -fno-omit-frame-pointer -fno-sanitize-address-use-after-scope",
        )
        // The fibers' stacks are switched by hand: no fake stacks for returns.
        .env("ASAN_OPTIONS", "detect_leaks=0:detect_stack_use_after_return=0:halt_on_error=1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the emulated kernels under AddressSanitizer:\n{text}");
    assert!(text.contains("test result: ok. 11 passed"), "all eleven emulated tests ran:\n{text}");
}

#[test]
fn attention_softmax_matches() {
    let _rng = rng();
    let dev = device("attention_softmax_matches");
    tch::manual_seed(0);
    let softmax = |scale: f64, with_mask: bool, with_bias: bool| {
        move |t: &[Tensor], backend| {
            let mut it = t[1..].iter();
            let mask = with_mask.then(|| it.next().unwrap());
            let bias = with_bias.then(|| it.next().unwrap());
            kernels::attention_softmax(&t[0], scale, mask, bias, backend).unwrap()
        }
    };
    // Odd sizes; rows shorter than a warp, of one key, of a multiple of 4 keys (vector accesses),
    // one of each count of quads per lane a warp kernel is compiled for (1, 2, 3, 4, 6, 8: 97,
    // 250, 300, 500, 700, 1024 keys), as long as a warp takes (1024) and longer (a block per row).
    for (b, h, q, k) in [
        (3, 5, 37, 97),
        (2, 3, 4, 1),
        (1, 2, 3, 1500),
        (2, 1, 5, 31),
        (2, 3, 5, 64),
        (1, 2, 3, 250),
        (1, 2, 3, 300),
        (1, 1, 3, 500),
        (1, 1, 2, 700),
        (1, 2, 3, 1024),
        (1, 1, 2, 1028),
    ] {
        let x = randn(&[b, h, q, k], dev, true) * 3.0;
        let x = x.detach().set_requires_grad(true);
        let mask = Tensor::rand([b, k], (Kind::Float, dev)).gt(0.3).to_kind(Kind::Float);
        let _ = mask.narrow(1, 0, 1).fill_(1.0); // every row keeps a key
        let shared = randn(&[h, q, k], dev, true);
        let per_row = randn(&[b, h, q, k], dev, true);
        let name = format!("attention_softmax {b}x{h}x{q}x{k}");
        check(&name, &softmax(0.125, true, true), &[x.shallow_clone(), mask.shallow_clone(), shared], &[b, h, q, k]);
        check(&name, &softmax(1.0, true, true), &[x.shallow_clone(), mask, per_row], &[b, h, q, k]);
        check(&name, &softmax(0.5, false, false), &[x.shallow_clone()], &[b, h, q, k]);
    }
    // Strided logits: a transposed view is made contiguous first, with gradients flowing back.
    let x = randn(&[2, 3, 11, 9], dev, false).transpose(2, 3).set_requires_grad(true);
    check("attention_softmax strided", &softmax(0.3, false, false), &[x], &[2, 3, 9, 11]);
}

/// Over the logits, each backend gives what it gives out of place, bit for bit: the same
/// arithmetic, row by row, warp and block kernels, shared and per-row biases, every dtype.
#[test]
fn attention_softmax_in_place_equals_it_out_of_place() {
    let _rng = rng();
    let dev = device("attention_softmax_in_place_equals_it_out_of_place");
    tch::manual_seed(1);
    for (b, h, q, k) in [(3, 5, 37, 97), (2, 3, 4, 1), (1, 2, 3, 300), (2, 3, 5, 64), (1, 1, 2, 1028), (1, 2, 3, 1500)]
    {
        let mask = Tensor::rand([b, k], (Kind::Float, dev)).gt(0.3).to_kind(Kind::Float);
        let _ = mask.narrow(1, 0, 1).fill_(1.0);
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let x = (randn(&[b, h, q, k], dev, false) * 3.0).to_kind(kind);
            let biases = [randn(&[h, q, k], dev, false).to_kind(kind), randn(&[b, h, q, k], dev, false).to_kind(kind)];
            for backend in [Backend::Fused, Backend::Torch] {
                for (scale, mask, bias) in
                    [(0.125, Some(&mask), Some(&biases[0])), (1.0, Some(&mask), Some(&biases[1])), (0.5, None, None)]
                {
                    let want = kernels::attention_softmax(&x, scale, mask, bias, backend).unwrap();
                    let logits = x.copy();
                    kernels::attention_softmax_in_place(&logits, scale, mask, bias, backend).unwrap();
                    let what = format!("{b}x{h}x{q}x{k} {kind:?} {backend:?} scale {scale}");
                    assert!(logits.equal(&want), "{what}: in place differs by {}", max_abs(&(&logits - &want)));
                }
            }
        }
    }
    // Refused: a strided view (it would write where the rows do not lie) and logits in autograd.
    let x = randn(&[2, 3, 11, 9], dev, false).transpose(2, 3);
    let err = kernels::attention_softmax_in_place(&x, 1.0, None, None, Backend::Fused).unwrap_err().to_string();
    assert!(err.contains("in place needs contiguous logits"), "{err}");
    let x = randn(&[2, 3, 11, 9], dev, true);
    let err = kernels::attention_softmax_in_place(&x, 1.0, None, None, Backend::Torch).unwrap_err().to_string();
    assert!(err.contains("in place is for inference"), "{err}");
}

#[test]
fn layer_norm_matches() {
    let _rng = rng();
    let dev = device("layer_norm_matches");
    tch::manual_seed(1);
    let ln = |t: &[Tensor], backend| kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5, backend).unwrap();
    // A warp per row up to 1024 columns (with vector accesses where a multiple of 4; each count
    // of quads per lane: 1, 129, 300, 500, 768, 1024 columns), a block per row past it.
    for shape in [
        vec![7, 13, 129],
        vec![4, 6, 768],
        vec![300, 1024],
        vec![5, 1],
        vec![6, 300],
        vec![3, 501],
        vec![1, 2500],
        vec![3, 1028],
    ] {
        let c = *shape.last().unwrap();
        let inputs = [randn(&shape, dev, true) * 2.0 + 0.5, randn(&[c], dev, true), randn(&[c], dev, true)];
        let inputs = inputs.map(|t| t.detach().set_requires_grad(true));
        check(&format!("layer_norm {shape:?}"), &ln, &inputs, &shape);
    }
    let x = randn(&[33, 17], dev, false).t_().set_requires_grad(true);
    check("layer_norm strided", &ln, &[x, randn(&[33], dev, true), randn(&[33], dev, true)], &[17, 33]);
    // Without autograd the forward reads rows where they lie: transposed leading dimensions (an
    // MSA's columns), a chunk of columns transposed (row strides not a multiple of 4: element
    // accesses), one row, and three levels that do not merge into two (copied first).
    type View = fn(Tensor) -> Tensor;
    let views: [(&str, i64, View); 7] = [
        ("transposed", 768, |t| t.transpose(0, 1)),
        ("transposed", 129, |t| t.transpose(0, 1)),
        ("transposed", 1028, |t| t.transpose(0, 1)),
        ("a chunk transposed", 64, |t| t.narrow(1, 2, 5).transpose(0, 1)),
        ("a chunk transposed", 67, |t| t.narrow(1, 2, 5).transpose(0, 1)),
        ("one row", 256, |t| t.narrow(0, 2, 1).narrow(1, 4, 1)),
        ("three levels", 32, |t| t.view([3, 2, 7, -1]).permute([2, 1, 0, 3])),
    ];
    for (what, c, view) in views {
        // With autograd too: the backward reads the view's rows where they lie as well, and
        // the gradient reaches the tensor under the view.
        let base = (randn(&[6, 7, c], dev, false) * 2.0 + 0.5).set_requires_grad(true);
        let through_view = move |t: &[Tensor], backend| {
            ln(&[view(t[0].shallow_clone()), t[1].shallow_clone(), t[2].shallow_clone()], backend)
        };
        let out_shape = view(base.detach()).size();
        check(
            &format!("layer_norm {what} [.., {c}]"),
            &through_view,
            &[base, randn(&[c], dev, true), randn(&[c], dev, true)],
            &out_shape,
        );
        let (x, w, b) =
            (view(randn(&[6, 7, c], dev, false) * 2.0 + 0.5), randn(&[c], dev, false), randn(&[c], dev, false));
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let [x, w, b] = [&x, &w, &b].map(|t| t.to_kind(kind));
            let (fused, torch) = (
                ln(&[x.shallow_clone(), w.shallow_clone(), b.shallow_clone()], Backend::Fused),
                ln(&[x.shallow_clone(), w.shallow_clone(), b.shallow_clone()], Backend::Torch),
            );
            let reference = ln(&[x, w, b].map(|t| t.to_kind(Kind::Double)), Backend::Torch);
            assert!(fused.is_contiguous(), "layer_norm {what}: output contiguous");
            assert_matches(&fused, &torch, &reference, kind, &format!("layer_norm {what} [.., {c}] without autograd"));
        }
    }
}

#[test]
fn bias_gelu_matches() {
    let _rng = rng();
    let dev = device("bias_gelu_matches");
    tch::manual_seed(2);
    let f = |t: &[Tensor], backend| kernels::bias_gelu(&t[0], &t[1], backend).unwrap();
    // Rows of a multiple of 8 (16-byte accesses in every dtype), of 4 but not 8 (16 bytes of
    // f32, 8 of bf16 and f16), of 2 (8 bytes of f32, elements of bf16 and f16) and odd (element
    // by element), short and long: ViT-B/16's 3072 and 3075 beside it; 40 and 3080 wrap the
    // columns of a thread's successive vectors round the row (the emulator's 768 threads of
    // vectors do not span whole rows).
    for shape in [
        vec![37, 513],
        vec![37, 512],
        vec![3, 5, 7],
        vec![3, 5, 8],
        vec![1, 1],
        vec![5, 3072],
        vec![3, 3075],
        vec![7, 3, 12],
        vec![11, 6],
        vec![9, 40],
        vec![2, 3080],
    ] {
        let c = *shape.last().unwrap();
        check(&format!("bias_gelu {shape:?}"), &f, &[randn(&shape, dev, true), randn(&[c], dev, true)], &shape);
    }
}

#[test]
fn memory_efficient_attention_matches() {
    let _rng = rng();
    let dev = device("memory_efficient_attention_matches");
    tch::manual_seed(10);
    // Odd sizes around the blocks' 32 rows and the 32- and 64-wide tiles (several of each, and
    // partial ones); AlphaFold's head widths 32, 16 and 8, ViT's 64; a bias shared across the
    // batch (pair bias) and one per row; masks with dropped keys.
    for (b, h, nq, nk, d, shared) in [
        (3, 4, 37, 45, 32, true),
        (2, 2, 33, 31, 8, false),
        (1, 3, 5, 70, 64, true),
        (2, 1, 70, 135, 16, false),
        (1, 1, 1, 1, 1, true),
    ] {
        let mask = randn(&[b, nk], dev, false).ge(-1.0).to_kind(Kind::Float);
        let bias_shape = if shared { vec![h, nq, nk] } else { vec![b, h, nq, nk] };
        let f = |t: &[Tensor], backend| {
            let m = t[4].to_kind(t[0].kind());
            kernels::memory_efficient_attention(&t[0], &t[1], &t[2], 0.3, Some(&m), Some(&t[3]), backend).unwrap()
        };
        let inputs = [
            randn(&[b, h, nq, d], dev, true),
            randn(&[b, h, nk, d], dev, true),
            randn(&[b, h, nk, d], dev, true),
            randn(&bias_shape, dev, true),
            mask,
        ];
        check(&format!("memory_efficient_attention {b}x{h}x{nq}x{nk}x{d}"), &f, &inputs, &[b, h, nq, d]);
    }
}

/// The tensor-core forward against the composition on the layouts fastfold hands it (each
/// head's `[dim, len]` contiguous, the output laid out so too) and plain ones; odd sizes around
/// the blocks' 64 queries and the 32-key tiles; AlphaFold's head widths 8, 16 and 32, ViT's 64,
/// and widths the kernel pads (1, 20); shared and per-row biases; masks with dropped keys. In
/// bf16 and f16 by the rule of [`check`]. In f32 the products are
/// TF32 (10-bit mantissas: each operand within 2^-11 of itself), so the bar is the f64
/// composition within 2e-3 of the largest output; the composition's own f32 error is ~1e-7,
/// and a wrong fragment layout, mask or bias row moves outputs by their whole size.
#[test]
fn flash_attention_matches() {
    let _rng = rng();
    let dev = device("flash_attention_matches");
    tch::manual_seed(13);
    for (b, h, nq, nk, d, bias, transposed) in [
        (3, 4, 37, 45, 32, Some(true), true),
        (2, 2, 70, 33, 8, Some(false), false),
        (1, 3, 5, 70, 64, Some(true), true),
        (2, 1, 130, 67, 16, Some(false), true),
        (1, 2, 64, 64, 20, None, false),
        (1, 1, 1, 1, 1, Some(true), false),
    ] {
        // Every batch element keeps its first key (a fully masked one: the next test).
        let mask = Tensor::rand([b, nk], (Kind::Float, dev)).gt(0.2).to_kind(Kind::Float);
        let _ = mask.narrow(1, 0, 1).fill_(1.0);
        // [b, h, n, d], or the transpose of [b, h, d, n] contiguous (fastfold's projections).
        let make = |n: i64| match transposed {
            true => randn(&[b, h, d, n], dev, false).transpose(2, 3),
            false => randn(&[b, h, n, d], dev, false),
        };
        let (q, k, v) = (make(nq), make(nk), make(nk));
        let bias = bias.map(|shared| randn(&if shared { vec![h, nq, nk] } else { vec![b, h, nq, nk] }, dev, false));
        let what = format!("flash_attention {b}x{h}x{nq}x{nk}x{d} transposed {transposed}");
        let f = |q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>, mask: &Tensor, backend| {
            let mask = mask.to_kind(q.kind());
            kernels::flash_attention(q, k, v, 0.3, Some(&mask), bias, backend).unwrap()
        };
        let f64_ = |t: &Tensor| t.to_kind(Kind::Double);
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let c = |t: &Tensor| t.to_kind(kind);
            // Casting keeps the layout (a dense view's strides), as the model's tensors have it.
            let (qc, kc, vc, bc) = (c(&q), c(&k), c(&v), bias.as_ref().map(c));
            assert_eq!(qc.stride(), q.stride(), "{what}: the cast keeps q's layout");
            let fused = f(&qc, &kc, &vc, bc.as_ref(), &mask, Backend::Fused);
            assert_eq!(fused.kind(), kind, "{what}: dtype");
            assert_eq!(fused.stride(), qc.stride(), "{what}: the output is laid out as q");
            let torch = f(&qc, &kc, &vc, bc.as_ref(), &mask, Backend::Torch);
            let reference =
                f(&f64_(&qc), &f64_(&kc), &f64_(&vc), bc.as_ref().map(f64_).as_ref(), &mask, Backend::Torch);
            match kind {
                Kind::Float => assert_close(&fused, &reference, 2e-3, &format!("{what} (TF32)")),
                _ => assert_matches(&fused, &torch, &reference, kind, &what),
            }
        }
    }
    // Refused: inputs that require grad (no backward), heads wider than 64.
    let q = randn(&[1, 1, 4, 8], dev, true);
    let err = kernels::flash_attention(&q, &q, &q, 1.0, None, None, Backend::Fused).unwrap_err().to_string();
    assert!(err.contains("is for inference"), "{err}");
    let q = randn(&[1, 1, 4, 65], dev, false);
    let err = kernels::flash_attention(&q, &q, &q, 1.0, None, None, Backend::Fused).unwrap_err().to_string();
    assert!(err.contains("at most 64"), "{err}");
}

/// A batch element whose keys are all masked: as the f32 composition, uniform weights (the -1e9
/// swamps the scores; see the next test for why only f32 sets the bar), within TF32's 2e-3.
#[test]
fn flash_attention_gives_fully_masked_queries_uniform_weights() {
    let _rng = rng();
    let dev = device("flash_attention_gives_fully_masked_queries_uniform_weights");
    tch::manual_seed(14);
    let (b, h, nq, nk, d) = (2, 2, 37, 45, 16);
    let mask = Tensor::ones([b, nk], (Kind::Float, dev));
    let _ = mask.get(1).fill_(0.0);
    let (q, k, v) =
        (randn(&[b, h, nq, d], dev, false), randn(&[b, h, nk, d], dev, false), randn(&[b, h, nk, d], dev, false));
    let bias = randn(&[h, nq, nk], dev, false);
    let f = |backend| kernels::flash_attention(&q, &k, &v, 0.3, Some(&mask), Some(&bias), backend).unwrap();
    let (fused, torch) = (f(Backend::Fused), f(Backend::Torch));
    assert_close(&fused, &torch, 2e-3, "flash_attention, fully masked");
    let mean = v.get(1).mean_dim(1, true, Kind::Float).expand([h, nq, d], false);
    assert_close(&fused.get(1), &mean, 2e-3, "flash_attention, fully masked: the values' mean");
}

/// A query whose keys are all masked gets uniform weights, as the f32 composition gives it (the
/// -1e9 swamps the scores; in f16 the composition's -1e9 overflows to NaN instead, and in f64 it
/// keeps the scores, so only f32 sets the bar). Its backward once read a log-sum-exp whose
/// log-sum -1e9 had rounded away: weights of 1, gradients `keys` times too large.
#[test]
fn fully_masked_queries_get_the_compositions_uniform_weights() {
    let _rng = rng();
    let dev = device("fully_masked_queries_get_the_compositions_uniform_weights");
    tch::manual_seed(12);
    let (b, h, nq, nk, d) = (2, 2, 37, 45, 16);
    let mask = Tensor::ones([b, nk], (Kind::Float, dev));
    let _ = mask.get(1).fill_(0.0);
    let f = |t: &[Tensor], backend| {
        kernels::memory_efficient_attention(&t[0], &t[1], &t[2], 0.3, Some(&t[4]), Some(&t[3]), backend).unwrap()
    };
    let inputs = [
        randn(&[b, h, nq, d], dev, true),
        randn(&[b, h, nk, d], dev, true),
        randn(&[b, h, nk, d], dev, true),
        randn(&[h, nq, nk], dev, true),
        mask,
    ];
    let dy = Tensor::randn([b, h, nq, d], (Kind::Float, dev));
    let fused = run(&f, &inputs, &dy, Backend::Fused);
    let torch = run(&f, &inputs, &dy, Backend::Torch);
    for (i, (a, e)) in fused.iter().zip(&torch).enumerate() {
        assert_close(a, e, 1e-5, &format!("fully masked: output {i}"));
    }
    // A rounding tie near -1e9 (floats step by 64 there): score -40, bias 32 against score 0,
    // bias -64. Taken as (score + mask) + bias, as the composition does, the weights are 1 and
    // e^-64; a pass that added mask + bias first rounded the tie the other way and weighed the
    // first key e^64 against its forward (dv 3.1e27 where 1 is right).
    let t = |v: &[f32], shape: &[i64]| Tensor::from_slice(v).view(shape).to_device(dev).set_requires_grad(true);
    let inputs = [
        t(&[1.0], &[1, 1, 1, 1]),
        t(&[-40.0, 0.0], &[1, 1, 2, 1]),
        t(&[1.0, 2.0], &[1, 1, 2, 1]),
        t(&[32.0, -64.0], &[1, 1, 2]),
        Tensor::zeros([1, 2], (Kind::Float, dev)),
    ];
    let f = |t: &[Tensor], backend| {
        kernels::memory_efficient_attention(&t[0], &t[1], &t[2], 1.0, Some(&t[4]), Some(&t[3]), backend).unwrap()
    };
    let dy = Tensor::ones([1, 1, 1, 1], (Kind::Float, dev));
    let fused = run(&f, &inputs, &dy, Backend::Fused);
    let torch = run(&f, &inputs, &dy, Backend::Torch);
    for (i, (a, e)) in fused.iter().zip(&torch).enumerate() {
        assert_close(a, e, 1e-5, &format!("rounding tie: output {i}"));
    }
}

#[test]
fn sigmoid_gate_matches() {
    let _rng = rng();
    let dev = device("sigmoid_gate_matches");
    tch::manual_seed(8);
    // Odd sizes: a triangle update's pair [r, r, c] with its mask [r, r], and a flat case.
    for (shape, masked) in [(vec![37, 29, 33], true), (vec![37, 29, 33], false), (vec![5, 1], true)] {
        let c = *shape.last().unwrap();
        let rows = &shape[..shape.len() - 1];
        let mask = randn(rows, dev, false).ge(0.0).to_kind(Kind::Float);
        let f = move |t: &[Tensor], backend| {
            let m = masked.then(|| t[4].to_kind(t[0].kind()));
            kernels::sigmoid_gate(&t[0], &t[1], &t[2], &t[3], m.as_ref(), backend).unwrap()
        };
        let inputs =
            [randn(&shape, dev, true), randn(&[c], dev, true), randn(&shape, dev, true), randn(&[c], dev, true), mask];
        check(&format!("sigmoid_gate {shape:?} masked={masked}"), &f, &inputs, &shape);
    }
}

#[test]
fn bias_dropout_residual_matches() {
    let _rng = rng();
    let dev = device("bias_dropout_residual_matches");
    for (p, train) in [(0.1, true), (0.5, true), (0.1, false)] {
        // The same seed before each call: both backends draw the same mask.
        let f = move |t: &[Tensor], backend| {
            tch::manual_seed(3);
            kernels::bias_dropout_residual(&t[0], &t[1], &t[2], p, train, backend).unwrap()
        };
        for shape in [[41, 3, 77], [41, 3, 76]] {
            let inputs = [randn(&shape, dev, true), randn(&[shape[2]], dev, true), randn(&shape, dev, true)];
            check(&format!("bias_dropout_residual {shape:?} p={p} train={train}"), &f, &inputs, &shape);
        }
    }
}

/// bias + GELU forward and backward on contiguous views starting inside their storage, in every
/// dtype: one element in (no vector access), two (8 bytes of bf16, f16), four (8 bytes of bf16
/// and f16, 16 of f32) and eight, x or the bias alone, beside an aligned one. Each takes the
/// widest access its pointers allow (the emulator fails a misaligned one) and must equal the
/// composition by the rule of `check`.
#[test]
fn bias_gelu_on_offset_views_matches() {
    let _rng = rng();
    let dev = device("bias_gelu_on_offset_views_matches");
    tch::manual_seed(13);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for (shape, x_at, b_at) in [
            ([6, 3072], 1, 0),
            ([6, 3072], 0, 1),
            ([6, 3072], 2, 2),
            ([6, 3072], 4, 0),
            ([6, 3072], 8, 4),
            ([5, 3075], 1, 1),
        ] {
            let view = |shape: &[i64], at: i64| {
                let n: i64 = shape.iter().product();
                Tensor::randn([n + at], (Kind::Float, dev)).to_kind(kind).narrow(0, at, n).view(shape)
            };
            let (x, b) = (view(&shape, x_at), view(&shape[1..], b_at));
            let offset = x_at as usize * x.kind().elt_size_in_bytes();
            assert!(x.is_contiguous() && (x.data_ptr() as usize) % 16 == offset % 16, "x {offset} bytes in");
            let dy = Tensor::randn(shape, (Kind::Float, dev)).to_kind(kind);
            let grads = |x: &Tensor, b: &Tensor, dy: &Tensor, backend| {
                let (x, b) = (x.detach().set_requires_grad(true), b.detach().set_requires_grad(true));
                let y = kernels::bias_gelu(&x, &b, backend).unwrap();
                let mut out = vec![y.detach()];
                out.extend(Tensor::run_backward(&[(&y * dy).sum(Kind::Float)], &[&x, &b], false, false));
                out
            };
            let fused = grads(&x, &b, &dy, Backend::Fused);
            let torch = grads(&x, &b, &dy, Backend::Torch);
            let up = |t: &Tensor| t.to_kind(Kind::Double);
            let reference = grads(&up(&x), &up(&b), &up(&dy), Backend::Torch);
            for (i, name) in ["output", "x's gradient", "the bias's gradient"].into_iter().enumerate() {
                let what = format!("bias_gelu {shape:?}, x at {x_at}, bias at {b_at}: {name}");
                assert_matches(&fused[i], &torch[i], &reference[i], kind, &what);
            }
        }
    }
}

/// A contiguous view starting one element into its storage: aligned to no vector access.
fn misaligned(shape: &[i64], dev: Device) -> Tensor {
    let n: i64 = shape.iter().product();
    Tensor::randn([n + 1], (Kind::Float, dev)).narrow(0, 1, n).view(shape)
}

#[test]
fn misaligned_inputs_take_the_element_path() {
    let _rng = rng();
    let dev = device("misaligned_inputs_take_the_element_path");
    tch::manual_seed(11);
    let (x, r) = (misaligned(&[9, 8], dev), misaligned(&[9, 8], dev));
    let b = misaligned(&[8], dev);
    assert!(x.is_contiguous() && !(x.data_ptr() as usize).is_multiple_of(16));
    let gelu = |backend| kernels::bias_gelu(&x, &b, backend).unwrap();
    assert_close(&gelu(Backend::Fused), &gelu(Backend::Torch), 1e-6, "bias_gelu misaligned");
    let add = |backend| kernels::bias_dropout_residual(&x, &b, &r, 0.0, false, backend).unwrap();
    assert_close(&add(Backend::Fused), &add(Backend::Torch), 1e-6, "bias_dropout_residual misaligned");
    let w = misaligned(&[8], dev);
    let ln = |backend| kernels::layer_norm(&x, &w, &b, 1e-5, backend).unwrap();
    assert_close(&ln(Backend::Fused), &ln(Backend::Torch), 1e-5, "layer_norm misaligned");
    let logits = misaligned(&[1, 3, 3, 8], dev);
    let (mask, bias) = (misaligned(&[1, 8], dev).ge(-1.0).to_kind(Kind::Float), misaligned(&[3, 3, 8], dev));
    let softmax = |backend| kernels::attention_softmax(&logits, 0.5, Some(&mask), Some(&bias), backend).unwrap();
    assert_close(&softmax(Backend::Fused), &softmax(Backend::Torch), 1e-6, "attention_softmax misaligned");
}

/// Three steps of a fused optimizer against three of the composition on the same tensors.
fn optimizer_matches(step: impl Fn(&[OptimTensors], i32, Backend), tol: f64, what: &str, dev: Device) {
    tch::manual_seed(4);
    // Sizes around the kernels' chunk of 16384 elements, and a parameter that does not adapt.
    let shapes: [&[i64]; 5] = [&[1], &[7, 5], &[16384 * 2 + 3], &[300, 301], &[16384]];
    let make = || -> Vec<[Tensor; 4]> {
        tch::manual_seed(5);
        let opts = (Kind::Float, dev);
        shapes
            .iter()
            .map(|s| {
                [Tensor::randn(*s, opts), Tensor::randn(*s, opts), Tensor::zeros(*s, opts), Tensor::zeros(*s, opts)]
            })
            .collect()
    };
    let (fused, torch) = (make(), make());
    for (set, backend) in [(&fused, Backend::Fused), (&torch, Backend::Torch)] {
        for s in 1..=3 {
            let tensors: Vec<OptimTensors> = set
                .iter()
                .enumerate()
                .map(|(i, [w, g, m, v])| OptimTensors { param: w, grad: g, exp_avg: m, exp_avg_sq: v, adapt: i != 2 })
                .collect();
            step(&tensors, s, backend);
        }
    }
    for (i, (a, b)) in fused.iter().zip(&torch).enumerate() {
        for (j, name) in ["param", "grad", "exp_avg", "exp_avg_sq"].iter().enumerate() {
            assert_close(&a[j], &b[j], tol, &format!("{what}: tensor {i}'s {name}"));
        }
    }
}

#[test]
fn adamw_step_matches() {
    let _rng = rng();
    let dev = device("adamw_step_matches");
    let cfg = AdamWConfig { lr: 0.01, weight_decay: 0.05, ..Default::default() };
    optimizer_matches(|t, s, b| kernels::adamw_step(t, &cfg, s, b).unwrap(), 1e-6, "adamw", dev);
}

#[test]
fn lamb_step_matches() {
    let _rng = rng();
    let dev = device("lamb_step_matches");
    let cfg = LambConfig { lr: 0.01, weight_decay: 0.05, ..Default::default() };
    // The norms are summed in f32 by atomics in any order: the trust ratios differ in the last bits.
    optimizer_matches(|t, s, b| kernels::lamb_step(t, &cfg, s, b).unwrap(), 1e-5, "lamb", dev);
}

#[test]
fn lars_step_matches() {
    let _rng = rng();
    let dev = device("lars_step_matches");
    for momentum in [0.9, 0.0] {
        let cfg = LarsConfig { lr: 0.5, momentum, weight_decay: 1e-3, ..Default::default() };
        // The momentum buffer rides in the exp_avg slot; exp_avg_sq must stay zero.
        let step = |t: &[OptimTensors], s: i32, b: Backend| {
            let lars: Vec<LarsTensors> = t
                .iter()
                .map(|t| LarsTensors { param: t.param, grad: t.grad, momentum_buffer: Some(t.exp_avg), adapt: t.adapt })
                .collect();
            kernels::lars_step(&lars, &cfg, s, b).unwrap()
        };
        // As LAMB: norms summed in f32 by atomics in any order, and the ratio in f32 (f64 in
        // the composition).
        optimizer_matches(step, 1e-5, &format!("lars, momentum {momentum}"), dev);
    }
}

#[test]
fn kernels_run_on_the_current_stream() {
    let _rng = rng();
    if !suite_tests::cuda_devices(1, "kernels_run_on_the_current_stream") {
        return; // Streams are CUDA's: nothing to emulate.
    }
    let d = 0;
    let dev = Device::Cuda(d);
    let side = engine::cuda::Stream::from_pool(d, false).unwrap();
    let main = engine::cuda::Stream::current(d).unwrap();
    let a = Tensor::randn([4096, 4096], (Kind::Float, dev));
    let b = Tensor::randn([4096], (Kind::Float, dev));
    main.synchronize().unwrap();
    side.set_current().unwrap();
    // A slow producer queued on the side stream, then the fused kernel reading its output: on
    // any other stream the kernel would read the product before it is written.
    let x = a.matmul(&a).matmul(&a);
    let y = kernels::bias_gelu(&x, &b, Backend::Fused).unwrap();
    let want = kernels::bias_gelu(&x, &b, Backend::Torch).unwrap();
    side.synchronize().unwrap();
    main.set_current().unwrap();
    assert_close(&y, &want, 1e-5, "bias_gelu after a producer on the side stream");
}
