//! The small transformer the Gemini tests train, its plain and Gemini training loops, and the
//! assertions they share (`tests/tests/gemini.rs`): one definition, so every test compares
//! Gemini against the same plain run.
use engine::dist::ProcessGroup;
use std::collections::HashMap;

use engine::gemini::{ChunkConfig, CpuRule, Event, Gemini, GeminiConfig, Placement, Replication};
use engine::optim::{clip_grad_norm, AdamW, AdamWConfig, Lamb, LambConfig, Lars, LarsConfig, Optimizer, Param};
use tch::{Device, Kind, Tensor};

pub const F: (Kind, Device) = (Kind::Float, Device::Cpu);
pub const D: i64 = 8;
pub const T: i64 = 6;
pub const HEADS: i64 = 2;
pub const BATCH: i64 = 4;
pub const STEPS: i64 = 10;
/// 1 KiB chunks of 256 fp32 elements (a block spans three or four; six chunks).
pub const CHUNK: usize = 256;

/// Tests run in parallel threads that share torch's generator: seeding and drawing happen
/// under this lock.
pub static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn seeded<T>(seed: i64, draw: impl FnOnce() -> T) -> T {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    draw()
}

/// Parameters in execution order: two pre-norm blocks (attention, MLP), then a head.
pub fn parameters() -> Vec<Param> {
    seeded(7, draw_parameters)
}

pub fn draw_parameters() -> Vec<Param> {
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

pub fn block(x: &Tensor, w: &[Tensor]) -> Tensor {
    mlp(&attention(x, w), w)
}

/// A block's first half: `x` plus self-attention of its norm.
pub fn attention(x: &Tensor, w: &[Tensor]) -> Tensor {
    let (b, _, _) = x.size3().unwrap();
    let h = x.layer_norm([D], Some(&w[0]), Some(&w[1]), 1e-6, false);
    // The key bias cannot change attention (softmax ignores a shift shared by all keys): its
    // gradient is rounding noise, which Adam's normalisation would amplify into differences
    // between equally accurate runs. Zeroing it makes that gradient exactly zero.
    let key_bias_off = Tensor::cat(&[Tensor::ones([D], F), Tensor::zeros([D], F), Tensor::ones([D], F)], 0)
        .to_dtype_layout((w[3].kind(), w[3].device()), false, false);
    let qkv =
        h.linear(&w[2], Some(&(&w[3] * key_bias_off))).reshape([b, T, 3, HEADS, D / HEADS]).permute([2, 0, 3, 1, 4]);
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
    x + a.transpose(1, 2).reshape([b, T, D]).linear(&w[4], Some(&w[5]))
}

/// A block's second half: `x` plus the MLP of its norm.
pub fn mlp(x: &Tensor, w: &[Tensor]) -> Tensor {
    let h = x.layer_norm([D], Some(&w[6]), Some(&w[7]), 1e-6, false);
    x + h.linear(&w[8], Some(&w[9])).gelu("none").linear(&w[10], Some(&w[11]))
}

pub fn head(x: &Tensor, w: &[Tensor]) -> Tensor {
    x.mean_dim(1, false, x.kind()).linear(&w[0], Some(&w[1]))
}

/// A module: its input and its parameters to its output.
pub type Module = dyn Fn(&Tensor, &[Tensor]) -> Tensor;
/// Runs a module whose parameters are the given range of the parameter list.
pub type Runner<'a> = &'a dyn Fn(std::ops::Range<usize>, &Tensor, &Module) -> Tensor;

/// The mean loss of examples `rows` of step `step`'s batch, each module run through `run`.
pub fn loss(step: i64, rows: std::ops::Range<i64>, run: Runner) -> Tensor {
    loss_in(Kind::Float, step, rows, run)
}

/// [`loss`] where the second block runs only when `second` (a branch taken by the data, as a
/// mixture of experts or a dropped layer takes it).
pub fn branch_loss(step: i64, rows: std::ops::Range<i64>, second: bool, run: Runner) -> Tensor {
    let (x, y) = seeded(100 + step, || {
        (
            Tensor::randn([BATCH, T, D], (Kind::Float, Device::Cpu)),
            Tensor::randint(4, [BATCH], (Kind::Int64, Device::Cpu)),
        )
    });
    let (x, y) = (x.narrow(0, rows.start, rows.end - rows.start), y.narrow(0, rows.start, rows.end - rows.start));
    let mut h = run(0..12, &x, &block);
    if second {
        h = run(12..24, &h, &block);
    }
    run(24..26, &h, &head).cross_entropy_for_logits(&y)
}

/// [`loss`] with the model computing in `kind` (the loss itself in fp32).
pub fn loss_in(kind: Kind, step: i64, rows: std::ops::Range<i64>, run: Runner) -> Tensor {
    let (x, y) = seeded(100 + step, || {
        (
            Tensor::randn([BATCH, T, D], (Kind::Float, Device::Cpu)),
            Tensor::randint(4, [BATCH], (Kind::Int64, Device::Cpu)),
        )
    });
    let (x, y) = (x.narrow(0, rows.start, rows.end - rows.start), y.narrow(0, rows.start, rows.end - rows.start));
    let h = run(0..12, &x.to_kind(kind), &block);
    let h = run(12..24, &h, &block);
    run(24..26, &h, &head).to_kind(Kind::Float).to_device(Device::Cpu).cross_entropy_for_logits(&y)
}

/// [`loss_in`] with each module run under Gemini (`tensors` the parameters, computing in
/// `kind`), the whole batch.
pub fn gemini_loss(g: &Gemini, tensors: &[Tensor], kind: Kind, step: i64) -> Tensor {
    loss_in(kind, step, 0..BATCH, &|range, x, f| {
        let params: Vec<usize> = range.clone().collect();
        g.run(&params, x, |x| f(x, &tensors[range])).unwrap()
    })
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    AdamW,
    Lamb,
    Lars,
}

pub const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-2, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.1 };

pub fn lamb() -> LambConfig {
    LambConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() }
}

pub fn lars() -> LarsConfig {
    LarsConfig { lr: 0.1, weight_decay: 1e-3, ..Default::default() }
}

pub fn tensor_optimizer(rule: Rule, ps: Vec<Param>) -> Box<dyn Optimizer> {
    match rule {
        Rule::AdamW => Box::new(AdamW::new(ps, ADAMW)),
        Rule::Lamb => Box::new(Lamb::new(ps, lamb())),
        Rule::Lars => Box::new(Lars::new(ps, lars())),
    }
}

pub fn chunk_rule(rule: Rule) -> CpuRule {
    match rule {
        Rule::AdamW => CpuRule::AdamW(ADAMW),
        Rule::Lamb => CpuRule::Lamb(lamb()),
        Rule::Lars => CpuRule::Lars(lars()),
    }
}

/// Clipping and micro-batches of a run.
#[derive(Clone, Copy)]
pub struct Recipe {
    pub clip: Option<f64>,
    pub micro_batches: i64,
}

pub const PLAIN: Recipe = Recipe { clip: None, micro_batches: 1 };

/// The reference: one process, the whole batch, tensor optimizers.
pub fn train_plain(rule: Rule, recipe: Recipe) -> Vec<Tensor> {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let mut opt = tensor_optimizer(rule, ps);
    let per = BATCH / recipe.micro_batches;
    for step in 0..STEPS {
        for mb in 0..recipe.micro_batches {
            let l = loss(step, mb * per..(mb + 1) * per, &|range, x, f| f(x, &tensors[range]));
            (l / recipe.micro_batches as f64).backward();
        }
        if let Some(max) = recipe.clip {
            clip_grad_norm(opt.params(), max, None).unwrap();
        }
        opt.step().unwrap();
        opt.zero_grad();
    }
    opt.params().iter().map(|p| p.tensor.detach().copy()).collect()
}

/// Gemini's options for the tests: 1 KiB chunks, one chunk prefetched, one process.
pub fn config(device: Device, budget: usize, placement: Placement, rule: Rule, compute: Kind) -> GeminiConfig {
    GeminiConfig {
        chunks: ChunkConfig {
            device,
            budget,
            search: (CHUNK, CHUNK, 1),
            home_buffers: 0,
            compute,
            share_cpu_homes: true,
            trainable: true,
        },
        placement,
        prefetch: 1,
        rule: chunk_rule(rule),
        replication: None,
    }
}

/// How a Gemini run is set up.
pub struct Setup {
    pub placement: Placement,
    pub budget: usize,
    pub group: Option<(ProcessGroup, bool)>,
}

/// Trains steps `steps` under Gemini; this rank takes its share of each batch. `before` runs
/// after setup (to load a checkpoint), `after` at the end (to save one).
pub fn train_gemini(
    rule: Rule,
    recipe: Recipe,
    setup: &Setup,
    steps: std::ops::Range<i64>,
    before: impl FnOnce(&Gemini),
    after: impl FnOnce(&Gemini),
) -> (Vec<Tensor>, Vec<Event>, usize, Gemini) {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let cfg = GeminiConfig {
        replication: setup.group.as_ref().map(|(g, shard)| Replication { group: g.clone(), shard: *shard }),
        ..config(Device::Cpu, setup.budget, setup.placement, rule, Kind::Float)
    };
    let g = Gemini::new(&ps, cfg).unwrap();
    before(&g);
    let (rank, ranks) = setup.group.as_ref().map_or((0, 1), |(g, _)| (g.rank() as i64, g.size() as i64));
    let per = BATCH / ranks / recipe.micro_batches;
    for step in steps {
        for mb in 0..recipe.micro_batches {
            let first = rank * BATCH / ranks + mb * per;
            let l = loss(step, first..first + per, &|range, x, f| {
                let params: Vec<usize> = range.clone().collect();
                g.run(&params, x, |x| f(x, &tensors[range])).unwrap()
            });
            (l / recipe.micro_batches as f64).backward();
            g.finish_backward().unwrap();
        }
        if let Some(max) = recipe.clip {
            g.clip_grad_norm(max).unwrap();
        }
        g.step().unwrap();
    }
    after(&g);
    let state: HashMap<String, Tensor> = g.state_dict().unwrap().into_iter().collect();
    let trained = parameters().iter().map(|p| state[&p.name].shallow_clone()).collect();
    let (events, peak) = {
        let m = g.manager().unwrap();
        (m.events().to_vec(), m.device_bytes().1)
    };
    (trained, events, peak, g)
}

pub fn assert_same(a: &[Tensor], b: &[Tensor], what: &str) {
    let names: Vec<String> = parameters().into_iter().map(|p| p.name).collect();
    for ((x, y), name) in a.iter().zip(b).zip(names) {
        let diff = (x - y).abs().max().double_value(&[]);
        let scale = y.abs().max().double_value(&[]);
        assert!(diff <= 1e-5 * scale, "{what}: {name} differs by {diff:.2e} (max |w| {scale:.2e})");
    }
}

pub fn no_hooks(_: &Gemini) {}

/// Room for four resident chunks and nothing else.
pub const TIGHT: usize = 4 * 4 * CHUNK;

/// Runs a module of several inputs and outputs: the parameter range, the inputs, and the
/// module (inputs and parameters to outputs).
pub type Many<'a> =
    &'a dyn Fn(std::ops::Range<usize>, &[&Tensor], &dyn Fn(&[Tensor], &[Tensor]) -> Vec<Tensor>) -> Vec<Tensor>;

/// The loss of step `step` for a model with a skip connection, as a UNet's: block 0 returns
/// its output and its attention half's output (which its own MLP half also reads); block 1
/// reads block 0's output (its main path) and the half's (a side input); the head reads block
/// 1's output plus the half's. Backward enters block 0 through either output.
pub fn skip_loss(step: i64, run: Many) -> Tensor {
    let (x, y) = seeded(100 + step, || {
        (
            Tensor::randn([BATCH, T, D], (Kind::Float, Device::Cpu)),
            Tensor::randint(4, [BATCH], (Kind::Int64, Device::Cpu)),
        )
    });
    let first = run(0..12, &[&x], &|x, w| {
        let half = attention(&x[0], w);
        vec![mlp(&half, w), half]
    });
    let second = run(12..24, &[&first[0], &first[1]], &|x, w| vec![block(&x[0], w) + &x[1] * 0.5]);
    let logits = run(24..26, &[&(&second[0] + &first[1])], &|x, w| vec![head(&x[0], w)]);
    logits[0].cross_entropy_for_logits(&y)
}
