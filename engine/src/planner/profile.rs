//! Symbolic profiling: a model's layers traced on shapes alone. A layer describes its forward
//! to a [`Recorder`] op by op (linear, patch convolution, attention, norm, activation, add,
//! view); each op's FLOPs and what autograd keeps for its backward follow from the shapes by
//! the rules libtorch's CPU and CUDA kernels use, so nothing is allocated or computed.
//!
//! Why not libtorch's meta device: tch 0.24's `Device` has no `Meta`, and reaching it through
//! the C++ bridge would still need a second, tensor-free copy of each model's forward to run
//! there; the saved-for-backward bytes are therefore derived per op from the recorded forward
//! shapes (the rules below), and checked against measured allocations of a real ViT block in
//! `apps/vit/tests/profile.rs` and of an Evoformer block in `apps/fastfold/tests/profile.rs`.
//!
//! Tensors are tracked by storage, so views (reshapes, permutes, selects) cost nothing and a
//! storage saved by two ops counts once. Each tensor also says whether 1D tensor parallelism
//! splits it (a column-parallel output and what is computed from it) or replicates it: the cost
//! model divides only the split share by the tensor-parallel degree.
use std::collections::BTreeSet;

/// A tensor as the recorder knows it: its storage, shape, whether 1D tensor parallelism
/// splits it and whether it needs a gradient (autograd saves an operand of a product only
/// for the other operand's gradient).
#[derive(Clone, Debug)]
pub struct Sym {
    storage: usize,
    /// The shape.
    pub shape: Vec<i64>,
    split: bool,
    grad: bool,
}

impl Sym {
    /// Elements.
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
    fn rows(&self) -> i64 {
        self.numel() / self.shape.last().copied().unwrap_or(1)
    }
}

/// How a linear layer is sharded under 1D (Megatron) tensor parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// Replicated on every rank.
    None,
    /// Output features split; the input is replicated (its gradient is all-reduced backward).
    Column,
    /// Input features split; the output is all-reduced forward.
    Row,
}

/// What one layer costs, per sample batch it was traced with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerProfile {
    /// The layer's name (`blocks.3`).
    pub name: String,
    /// Forward FLOPs of its matmuls, convolutions and attention.
    pub forward_flops: f64,
    /// The share of `forward_flops` that 1D tensor parallelism splits.
    pub split_flops: f64,
    /// Parameter bytes.
    pub param_bytes: f64,
    /// The share of `param_bytes` that 1D tensor parallelism splits.
    pub split_param_bytes: f64,
    /// Parameter tensors (ZeRO broadcasts each from its owner: one collective apiece).
    pub param_tensors: f64,
    /// Bytes of the layer's inputs (kept by their first ops for backward, or by a checkpoint).
    pub input_bytes: f64,
    /// Bytes the layer creates and autograd keeps until its backward (its inputs and outputs
    /// not counted: an output that is also saved counts once, in `output_bytes`).
    pub saved_bytes: f64,
    /// The share of `saved_bytes` that 1D tensor parallelism splits.
    pub split_saved_bytes: f64,
    /// Bytes of the layer's outputs.
    pub output_bytes: f64,
    /// The largest short-lived buffer of the forward (a temporary freed inside the layer).
    pub workspace_bytes: f64,
    /// Bytes all-reduced forward by row-parallel outputs under 1D tensor parallelism (the same
    /// again backward for the column-parallel inputs' gradients).
    pub tp_allreduce_bytes: f64,
    /// All-reduces of those forward (row-parallel layers; as many backward).
    pub tp_allreduces: f64,
    /// Bytes of the matmul operands (inputs and weights) that 2D/2.5D/3D layouts move.
    pub matmul_operand_bytes: f64,
    /// Those matmuls (linear layers, the patch embedding): 2D/2.5D/3D run a few collectives
    /// for each.
    pub matmuls: f64,
    /// LayerNorms: on 2D/2.5D/3D layouts each reduces its statistics across the width.
    pub norms: f64,
    /// Bytes of the queries, keys and values sequence parallelism exchanges.
    pub attention_qkv_bytes: f64,
    /// Whether this is a repeated block the planner may checkpoint.
    pub checkpointable: bool,
    /// Tensor operations the forward runs (views aside): each costs the device's
    /// per-operation overhead whatever its size, forward and (twice) backward.
    pub ops: f64,
    /// The layer's forward and backward timed on the device, where it was: the cost model then
    /// prices it from the measurement rather than from its FLOPs and operations.
    pub measured: Option<LayerTime>,
}

/// A layer's forward and backward measured on a device in one process: `fixed_s +
/// per_sample_s * n` seconds for a micro-batch of `n` samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerTime {
    /// Seconds whatever the batch (the operations' overheads).
    pub fixed_s: f64,
    /// Seconds per sample.
    pub per_sample_s: f64,
}

impl LayerTime {
    /// The line through the times `t1` of `n1` samples and `t2` of `n2 > n1` samples, neither
    /// part below zero (timer noise can tilt a line through two points).
    pub fn fit(n1: f64, t1: f64, n2: f64, t2: f64) -> LayerTime {
        let per_sample_s = ((t2 - t1) / (n2 - n1)).max(0.0);
        LayerTime { fixed_s: (t1 - per_sample_s * n1).max(0.0), per_sample_s }
    }
}

impl LayerProfile {
    /// Backward FLOPs: each matmul's input and weight gradients cost as much as its forward.
    pub fn backward_flops(&self) -> f64 {
        2.0 * self.forward_flops
    }
}

/// Records one layer's forward, op by op.
#[derive(Debug)]
pub struct Recorder {
    elem: f64,
    next_storage: usize,
    storage_bytes: Vec<f64>,
    storage_split: Vec<bool>,
    saved: BTreeSet<usize>,
    inputs: BTreeSet<usize>,
    profile: LayerProfile,
}

impl Recorder {
    /// Starts layer `name` whose input has `shape`; activations are `elem_bytes` wide (4 for
    /// f32). Returns the recorder and the input.
    pub fn new(name: &str, shape: &[i64], elem_bytes: usize) -> (Recorder, Sym) {
        let mut r = Recorder {
            elem: elem_bytes as f64,
            next_storage: 0,
            storage_bytes: Vec::new(),
            storage_split: Vec::new(),
            saved: BTreeSet::new(),
            inputs: BTreeSet::new(),
            profile: LayerProfile { name: name.to_string(), ..Default::default() },
        };
        let x = r.input(shape);
        (r, x)
    }

    /// Another input of the layer, of `shape` (the Evoformer block's pair beside its MSA).
    pub fn input(&mut self, shape: &[i64]) -> Sym {
        let x = self.fresh(shape.to_vec(), false);
        self.inputs.insert(x.storage);
        self.profile.input_bytes += self.bytes(&x);
        x
    }

    /// A weight of `shape` used as an operand ([`Recorder::einsum`]): its bytes count as
    /// parameters, and saving it costs no activation memory.
    pub fn weight(&mut self, shape: &[i64]) -> Sym {
        self.param(shape, false);
        Sym { grad: true, ..self.external(shape) }
    }

    /// A tensor made outside the layer that needs no gradient (a mask): saving it costs
    /// nothing.
    pub fn external(&mut self, shape: &[i64]) -> Sym {
        let s = Sym { storage: self.next_storage, shape: shape.to_vec(), split: false, grad: false };
        self.next_storage += 1;
        self.storage_bytes.push(0.0);
        self.storage_split.push(false);
        s
    }

    /// Marks the layer as a repeated block the planner may checkpoint.
    pub fn checkpointable(&mut self) {
        self.profile.checkpointable = true;
    }

    fn bytes(&self, x: &Sym) -> f64 {
        x.numel() as f64 * self.elem
    }

    fn fresh(&mut self, shape: Vec<i64>, split: bool) -> Sym {
        let s = Sym { storage: self.next_storage, shape, split, grad: true };
        self.next_storage += 1;
        self.storage_bytes.push(self.bytes(&s));
        self.storage_split.push(split);
        // A freshly made tensor is a temporary until something saves it or it leaves the layer.
        self.profile.workspace_bytes = self.profile.workspace_bytes.max(self.bytes(&s));
        s
    }

    fn fresh_f32(&mut self, shape: Vec<i64>, split: bool) -> Sym {
        let s = Sym { storage: self.next_storage, shape, split, grad: true };
        self.next_storage += 1;
        self.storage_bytes.push(s.numel() as f64 * 4.0);
        self.storage_split.push(split);
        s
    }

    fn save(&mut self, x: &Sym) {
        self.saved.insert(x.storage);
    }

    /// A parameter of `shape` (bytes in the activation width), split by 1D tensor parallelism
    /// or not.
    pub fn param(&mut self, shape: &[i64], split: bool) {
        let b = shape.iter().product::<i64>() as f64 * self.elem;
        self.profile.param_bytes += b;
        self.profile.param_tensors += 1.0;
        if split {
            self.profile.split_param_bytes += b;
        }
    }

    fn flops(&mut self, f: f64, split: bool) {
        self.profile.forward_flops += f;
        if split {
            self.profile.split_flops += f;
        }
    }

    /// `x @ W^T + b` over the last dimension (`nn.Linear`): saves its input.
    pub fn linear(&mut self, x: &Sym, out_features: i64, shard: Shard) -> Sym {
        self.profile.ops += 1.0;
        let inputs = *x.shape.last().expect("linear input has a feature dimension");
        self.param(&[out_features, inputs], shard != Shard::None);
        self.param(&[out_features], shard == Shard::Column);
        let split = shard != Shard::None;
        self.flops(2.0 * x.rows() as f64 * inputs as f64 * out_features as f64, split);
        self.profile.matmul_operand_bytes += self.bytes(x) + (inputs * out_features) as f64 * self.elem;
        self.profile.matmuls += 1.0;
        self.save(x);
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("checked") = out_features;
        let out = self.fresh(shape, shard == Shard::Column);
        if shard == Shard::Row {
            self.profile.tp_allreduce_bytes += self.bytes(&out);
            self.profile.tp_allreduces += 1.0;
        }
        out
    }

    /// A convolution over `[b, c, h, w]` with a square kernel equal to its stride (a patch
    /// embedding): saves its input.
    pub fn patch_conv(&mut self, x: &Sym, out_channels: i64, kernel: i64) -> Sym {
        self.profile.ops += 1.0;
        let (b, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
        let (oh, ow) = (h / kernel, w / kernel);
        self.param(&[out_channels, c, kernel, kernel], false);
        self.param(&[out_channels], false);
        self.flops(2.0 * (b * oh * ow) as f64 * (c * kernel * kernel) as f64 * out_channels as f64, false);
        self.profile.matmuls += 1.0;
        self.save(x);
        self.fresh(vec![b, out_channels, oh, ow], false)
    }

    /// LayerNorm over the last dimension with weight and bias: saves its input and the f32
    /// mean and reciprocal deviation per row.
    pub fn layer_norm(&mut self, x: &Sym) -> Sym {
        self.profile.ops += 1.0;
        self.profile.norms += 1.0;
        let width = *x.shape.last().expect("norm input has a feature dimension");
        self.param(&[width], false);
        self.param(&[width], false);
        self.save(x);
        let rows = x.rows();
        let mean = self.fresh_f32(vec![rows], false);
        let rstd = self.fresh_f32(vec![rows], false);
        self.save(&mean);
        self.save(&rstd);
        self.fresh(x.shape.clone(), x.split)
    }

    /// An elementwise activation that saves its input (GELU).
    pub fn activation(&mut self, x: &Sym) -> Sym {
        self.profile.ops += 1.0;
        self.save(x);
        self.fresh(x.shape.clone(), x.split)
    }

    /// An element-wise op whose backward reads its output (sigmoid, ReLU, softmax): saves
    /// the output.
    pub fn saves_output(&mut self, x: &Sym) -> Sym {
        self.profile.ops += 1.0;
        let out = self.fresh(x.shape.clone(), x.split);
        self.save(&out);
        out
    }

    /// `a * b` element-wise (`b` broadcast to `a`'s shape): saves each operand the other's
    /// gradient needs (times a mask: only the mask, which costs nothing).
    pub fn mul(&mut self, a: &Sym, b: &Sym) -> Sym {
        self.profile.ops += 1.0;
        if b.grad {
            self.save(a);
        }
        if a.grad {
            self.save(b);
        }
        self.fresh(a.shape.clone(), a.split || b.split)
    }

    /// `x / d` element-wise (`d` broadcast, needing no gradient): saves the divisor.
    pub fn div(&mut self, x: &Sym, d: &Sym) -> Sym {
        self.profile.ops += 1.0;
        self.save(d);
        self.fresh(x.shape.clone(), x.split)
    }

    /// Two-operand `einsum` as libtorch runs it (`sumproduct_pair`): both operands viewed in
    /// the output's dimension order then the summed ones, each permuted to (dims both keep,
    /// dims it alone keeps, summed dims) and reshaped to three dimensions for one `bmm`, which
    /// saves both. Where a group of two or more dimensions is not adjacent and in order in
    /// the operand's memory the reshape copies it, and the copy is what is saved. Operands
    /// are taken as laid out in their subscripts' order (contiguous). Returns the output in
    /// its subscripts' order (a view of the `bmm` result).
    pub fn einsum(&mut self, equation: &str, a: &Sym, b: &Sym) -> Sym {
        // The operands' permutes and reshapes, the bmm and the output's view: about three.
        self.profile.ops += 3.0;
        let (inputs, output) = equation.split_once("->").expect("an explicit einsum output");
        let (left, right) = inputs.split_once(',').expect("two einsum operands");
        let (left, right, output): (Vec<char>, Vec<char>, Vec<char>) =
            (left.chars().collect(), right.chars().collect(), output.chars().collect());
        let size = |c: char| {
            left.iter()
                .position(|&x| x == c)
                .map(|i| a.shape[i])
                .or_else(|| right.iter().position(|&x| x == c).map(|i| b.shape[i]))
        };
        // The output's dimensions, then the summed ones in order of appearance.
        let mut order: Vec<char> = output.clone();
        for &c in left.iter().chain(&right) {
            if !order.contains(&c) {
                order.push(c);
            }
        }
        let flops = 2.0 * order.iter().map(|&c| size(c).expect("every subscript has a size") as f64).product::<f64>();
        self.flops(flops, false);
        let kept = |c: &char| output.contains(c);
        let (both, sum): (Vec<char>, Vec<char>) =
            order.iter().filter(|c| left.contains(c) && right.contains(c)).partition(|c| kept(c));
        let only = |mine: &[char], other: &[char]| -> Vec<char> {
            order.iter().copied().filter(|c| mine.contains(c) && !other.contains(c) && kept(c)).collect()
        };
        let (left_only, right_only) = (only(&left, &right), only(&right, &left));
        // Each operand's groups in the order bmm wants them.
        let left_groups = [both.clone(), left_only.clone(), sum.clone()];
        let right_groups = [both, sum, right_only];
        for (x, other, subscripts, groups) in [(a, b, &left, &left_groups), (b, a, &right, &right_groups)] {
            if !other.grad {
                continue;
            }
            let copied = groups.iter().any(|g| {
                let dims: Vec<usize> = g
                    .iter()
                    .filter_map(|c| subscripts.iter().position(|s| s == c))
                    .filter(|&i| x.shape[i] != 1)
                    .collect();
                dims.windows(2).any(|w| w[1] != w[0] + 1)
            });
            match copied {
                true => {
                    let copy = self.fresh(x.shape.clone(), x.split);
                    self.save(&copy);
                }
                false => self.save(x),
            }
        }
        let shape: Vec<i64> =
            output.iter().map(|&c| size(c).expect("output subscripts appear in an operand")).collect();
        self.fresh(shape, a.split || b.split)
    }

    /// `a + b` (residual, position embedding): saves nothing.
    pub fn add(&mut self, a: &Sym) -> Sym {
        self.profile.ops += 1.0;
        self.fresh(a.shape.clone(), a.split)
    }

    /// A new tensor of `shape` from `x` that saves nothing (concatenation).
    pub fn copy(&mut self, x: &Sym, shape: &[i64]) -> Sym {
        self.profile.ops += 1.0;
        self.fresh(shape.to_vec(), x.split)
    }

    /// A view of `x` as `shape` (same storage).
    pub fn view(&mut self, x: &Sym, shape: &[i64]) -> Sym {
        Sym { shape: shape.to_vec(), ..x.clone() }
    }

    /// Fused attention over `qkv` (one storage holding queries, keys and values of
    /// `[batch, heads, tokens, head_dim]` each) as PyTorch's flash kernels run it: saves the
    /// queries, keys and values, its output and the f32 log-sum-exp per query; the score tiles
    /// stay in a per-thread workspace. Returns the output `[batch, tokens, heads * head_dim]`.
    pub fn attention(&mut self, qkv: &Sym, batch: i64, heads: i64, tokens: i64, head_dim: i64) -> Sym {
        self.profile.ops += 1.0;
        let split = qkv.split;
        self.flops(4.0 * (batch * heads) as f64 * (tokens * tokens) as f64 * head_dim as f64, split);
        self.profile.attention_qkv_bytes += self.bytes(qkv);
        self.save(qkv);
        let out = self.fresh(vec![batch, tokens, heads * head_dim], split);
        self.save(&out);
        let lse = self.fresh_f32(vec![batch, heads, tokens], split);
        self.save(&lse);
        out
    }

    /// Ends the layer with `output`.
    pub fn finish(self, output: &Sym) -> LayerProfile {
        self.finish_many(&[output])
    }

    /// Ends the layer with several outputs (the Evoformer block's MSA and pair).
    pub fn finish_many(mut self, outputs: &[&Sym]) -> LayerProfile {
        let p = &mut self.profile;
        p.output_bytes = outputs.iter().map(|o| o.numel() as f64 * self.elem).sum();
        let outs: BTreeSet<usize> = outputs.iter().map(|o| o.storage).collect();
        for &s in self.saved.iter().filter(|s| !self.inputs.contains(s) && !outs.contains(s)) {
            p.saved_bytes += self.storage_bytes[s];
            if self.storage_split[s] {
                p.split_saved_bytes += self.storage_bytes[s];
            }
        }
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn einsum_saves_its_operands_or_the_copies_its_reshapes_make() {
        let (mut r, x) = Recorder::new("l", &[2, 3, 8], 4);
        let w = r.weight(&[8, 2, 4]);
        // x viewed as [6, 8] and w as [8, 8]: saved as they are (the input and a weight).
        let q = r.einsum("bqa,ahc->bqhc", &x, &w);
        let k = r.einsum("bka,ahc->bkhc", &x, &w);
        // bmm wants (b, h) merged, which are not adjacent in q or k: both are copied.
        let logits = r.einsum("bqhc,bkhc->bhqk", &q, &k);
        // Times a mask: only the mask is saved, and it costs nothing.
        let mask = r.external(&[2, 2, 3, 3]);
        let y = r.mul(&logits, &mask);
        let p = r.finish(&y);
        assert_eq!(p.saved_bytes, 4.0 * 2.0 * (2 * 3 * 2 * 4) as f64);
        assert_eq!(p.param_bytes, 4.0 * 64.0);
        let projections = 2.0 * (2 * 3 * 2 * 4 * 8) as f64;
        assert_eq!(p.forward_flops, 2.0 * projections + 2.0 * (2 * 2 * 3 * 3 * 4) as f64);
        assert_eq!(p.input_bytes, 4.0 * 48.0);
        assert_eq!(p.output_bytes, 4.0 * 36.0);
    }

    #[test]
    fn views_share_storage_and_saved_storage_counts_once() {
        let (mut r, x) = Recorder::new("l", &[2, 3, 8], 4);
        let h = r.linear(&x, 24, Shard::Column);
        let v = r.view(&h, &[2, 3, 3, 8]);
        let o = r.attention(&v, 2, 1, 3, 8);
        let y = r.linear(&o, 8, Shard::Row);
        let p = r.finish(&y);
        // Saved: h (2*3*24), attention output (2*3*8) and its f32 lse (2*1*3); x is the input.
        assert_eq!(p.saved_bytes, 4.0 * (144.0 + 48.0 + 6.0));
        assert_eq!(p.split_saved_bytes, p.saved_bytes);
        assert_eq!(p.input_bytes, 4.0 * 48.0);
        assert_eq!(p.param_bytes, 4.0 * (24.0 * 8.0 + 24.0 + 8.0 * 8.0 + 8.0));
        assert_eq!(p.split_param_bytes, 4.0 * (24.0 * 8.0 + 24.0 + 8.0 * 8.0));
        assert_eq!(p.forward_flops, 2.0 * 6.0 * 8.0 * 24.0 + 4.0 * 2.0 * 9.0 * 8.0 + 2.0 * 6.0 * 8.0 * 8.0);
        assert_eq!(p.tp_allreduce_bytes, 4.0 * 48.0);
    }
}
