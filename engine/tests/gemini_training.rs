//! Training a small transformer under Gemini gives the same parameters as training it plainly
//! (fp32, relative 1e-5 after 10 steps), with chunk homes in host memory under a budget that
//! forces evictions in every step, and with homes on the device; with AdamW and LAMB.
use engine::gemini::{ChunkConfig, Event, Gemini, Tier};
use engine::optim::{AdamW, AdamWConfig, Lamb, LambConfig, Optimizer, Param};
use tch::{Device, Kind, Tensor};

const D: i64 = 8;
const T: i64 = 6;
const HEADS: i64 = 2;

/// Parameters in execution order: two pre-norm blocks (attention, MLP), then a head.
fn parameters() -> Vec<Param> {
    tch::manual_seed(7);
    let mut ps = vec![];
    let mut add = |name: String, shape: &[i64], ones: bool| {
        let t = if ones {
            Tensor::ones(shape, (Kind::Float, Device::Cpu))
        } else {
            Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.3
        };
        ps.push(Param::new(name, &t.set_requires_grad(true)));
    };
    for b in 0..2 {
        let p = |n: &str| format!("blocks.{b}.{n}");
        add(p("norm1.weight"), &[D], true);
        add(p("norm1.bias"), &[D], false);
        add(p("attn.qkv.weight"), &[3 * D, D], false);
        add(p("attn.qkv.bias"), &[3 * D], false);
        add(p("attn.proj.weight"), &[D, D], false);
        add(p("attn.proj.bias"), &[D], false);
        add(p("norm2.weight"), &[D], true);
        add(p("norm2.bias"), &[D], false);
        add(p("mlp.fc1.weight"), &[2 * D, D], false);
        add(p("mlp.fc1.bias"), &[2 * D], false);
        add(p("mlp.fc2.weight"), &[D, 2 * D], false);
        add(p("mlp.fc2.bias"), &[D], false);
    }
    add("head.weight".into(), &[4, D], false);
    add("head.bias".into(), &[4], false);
    ps
}

fn block(x: &Tensor, w: &[Tensor]) -> Tensor {
    let (b, _, _) = x.size3().unwrap();
    let h = x.layer_norm([D], Some(&w[0]), Some(&w[1]), 1e-6, false);
    let qkv = h.linear(&w[2], Some(&w[3])).reshape([b, T, 3, HEADS, D / HEADS]).permute([2, 0, 3, 1, 4]);
    let a = Tensor::scaled_dot_product_attention(
        &qkv.get(0),
        &qkv.get(1),
        &qkv.get(2),
        None::<Tensor>,
        0.0,
        false,
        None,
        false,
    );
    let x = x + a.transpose(1, 2).reshape([b, T, D]).linear(&w[4], Some(&w[5]));
    let h = x.layer_norm([D], Some(&w[6]), Some(&w[7]), 1e-6, false);
    &x + h.linear(&w[8], Some(&w[9])).gelu("none").linear(&w[10], Some(&w[11]))
}

fn head(x: &Tensor, w: &[Tensor]) -> Tensor {
    x.mean_dim(1, false, Kind::Float).linear(&w[0], Some(&w[1]))
}

/// A module: its input and its parameters to its output.
type Module = dyn Fn(&Tensor, &[Tensor]) -> Tensor;
/// Runs a module whose parameters are the given range of the parameter list.
type Runner<'a> = &'a dyn Fn(std::ops::Range<usize>, &Tensor, &Module) -> Tensor;

/// The loss of one step, each module run through `run` (plainly or under Gemini).
fn loss(step: i64, run: Runner) -> Tensor {
    tch::manual_seed(100 + step);
    let x = Tensor::randn([4, T, D], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(4, [4], (Kind::Int64, Device::Cpu));
    let h = run(0..12, &x, &block);
    let h = run(12..24, &h, &block);
    run(24..26, &h, &head).cross_entropy_for_logits(&y)
}

fn make(kind: &str, ps: Vec<Param>) -> Box<dyn Optimizer> {
    match kind {
        "adamw" => Box::new(AdamW::new(ps, AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() })),
        _ => Box::new(Lamb::new(ps, LambConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() })),
    }
}

fn train_plain(kind: &str) -> Vec<Tensor> {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let mut opt = make(kind, ps);
    for step in 0..10 {
        let l = loss(step, &|range, x, f| f(x, &tensors[range]));
        l.backward();
        opt.step().unwrap();
        opt.zero_grad();
    }
    opt.params().iter().map(|p| p.tensor.detach().copy()).collect()
}

fn train_gemini(kind: &str, tier: Tier, budget: usize) -> (Vec<Tensor>, Vec<Event>, usize) {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let cfg = ChunkConfig { device: Device::Cpu, budget, search: (256, 256, 1) };
    let g = Gemini::new(&ps, cfg, tier, 1).unwrap();
    let mut opt = make(kind, g.optimizer_params().unwrap());
    for step in 0..10 {
        let l = loss(step, &|range, x, f| {
            let params: Vec<usize> = range.clone().collect();
            g.run(&params, x, |x| f(x, &tensors[range])).unwrap()
        });
        l.backward();
        g.finish_backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        g.after_step().unwrap();
    }
    let m = g.manager().unwrap();
    let (_, peak) = m.device_bytes();
    (opt.params().iter().map(|p| p.tensor.detach().copy()).collect(), m.events().to_vec(), peak)
}

fn assert_same(a: &[Tensor], b: &[Tensor], what: &str) {
    let names: Vec<String> = parameters().into_iter().map(|p| p.name).collect();
    for ((x, y), name) in a.iter().zip(b).zip(names) {
        let diff = (x - y).abs().max().double_value(&[]);
        let scale = y.abs().max().double_value(&[]);
        assert!(diff <= 1e-5 * scale, "{what}: {name} differs by {diff:.2e} (max |w| {scale:.2e})");
    }
}

#[test]
fn gemini_training_matches_plain_training() {
    for kind in ["adamw", "lamb"] {
        let plain = train_plain(kind);
        // 1 KiB chunks (a block spans three); homes in host memory, room for four resident
        // chunks of the seven.
        let (params, events, peak) = train_gemini(kind, Tier::Host, 4096);
        assert!(events.iter().filter(|e| matches!(e, Event::Evict(_))).count() >= 10, "evictions every step");
        assert!(events.iter().any(|e| matches!(e, Event::Prefetch(_))), "prefetches along the trace: {events:?}");
        assert!(peak <= 4096, "accounted device bytes {peak} within the budget");
        assert_same(&params, &plain, &format!("{kind}, host homes"));
        // Homes and gradients on the device (2 KiB per chunk) plus four resident chunks.
        let (params, _, peak) = train_gemini(kind, Tier::Device, 7 * 2048 + 4096);
        assert!(peak <= 7 * 2048 + 4096);
        assert_same(&params, &plain, &format!("{kind}, device homes"));
    }
}
