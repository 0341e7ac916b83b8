//! The Evoformer block traced symbolically for the planner's profiler: the ops
//! `model/evoformer.rs` runs on one rank without chunking, with libtorch's compositions (not
//! the fused kernels), on shapes alone: FLOPs, parameter bytes and the bytes autograd keeps for
//! the backward. `tests/profile.rs` checks the parameters and the kept bytes against a block
//! built and run on the CPU.
use engine::planner::{LayerProfile, Recorder, Shard, Sym};

use crate::model::triangle::Direction;
use crate::model::EvoformerConfig;

/// One Evoformer block on `seqs` x `residues` (MSA `[s, r, c_m]`, pair `[r, r, c_z]`), in
/// `elem_bytes`-wide activations (4 for f32).
pub fn block(cfg: &EvoformerConfig, name: &str, seqs: i64, residues: i64, elem_bytes: usize) -> LayerProfile {
    let (s, r) = (seqs, residues);
    let (mut rec, msa) = Recorder::new(name, &[s, r, cfg.c_m], elem_bytes);
    rec.checkpointable();
    let pair = rec.input(&[r, r, cfg.c_z]);

    // MSA row attention with the pair as bias.
    let normed_pair = rec.layer_norm(&pair);
    let bias = pair_bias(&mut rec, &normed_pair, cfg.msa_heads);
    let x = rec.layer_norm(&msa);
    attention(&mut rec, &x, Some(&bias), cfg.msa_heads, cfg.msa_head_dim);
    let msa = rec.add(&msa);
    // Column attention: the rows of the transposed MSA.
    let columns = rec.view(&msa, &[r, s, cfg.c_m]);
    let x = rec.layer_norm(&columns);
    attention(&mut rec, &x, None, cfg.msa_heads, cfg.msa_head_dim);
    let msa = rec.add(&msa);
    transition(&mut rec, &msa, cfg.transition_factor);
    let msa = rec.add(&msa);

    outer_product_mean(&mut rec, &msa, cfg.opm_channels, cfg.c_z);
    let mut pair = rec.add(&pair);
    // Each update adds to the pair: the next one normalises (and saves) a new pair.
    for direction in [Direction::Outgoing, Direction::Incoming] {
        triangle_multiplication(&mut rec, &pair, cfg.tri_mul_channels, direction);
        pair = rec.add(&pair);
    }
    // Triangle attention around the starting node, then the ending node (the transposed pair).
    for transposed in [false, true] {
        let input = match transposed {
            true => rec.view(&pair, &[r, r, cfg.c_z]),
            false => pair.clone(),
        };
        let x = rec.layer_norm(&input);
        let bias = pair_bias(&mut rec, &x, cfg.pair_heads);
        attention(&mut rec, &x, Some(&bias), cfg.pair_heads, cfg.pair_head_dim);
        pair = rec.add(&pair);
    }
    transition(&mut rec, &pair, cfg.transition_factor);
    let pair = rec.add(&pair);
    rec.finish_many(&[&msa, &pair])
}

/// The per-head bias `[heads, q, k]` from a normalised pair `[q, k, c]`.
fn pair_bias(rec: &mut Recorder, normed: &Sym, heads: i64) -> Sym {
    let w = rec.weight(&[normed.shape[2], heads]);
    rec.einsum("qkc,ch->hqk", normed, &w)
}

/// Gated multi-head attention over the rows of `x` `[b, q, c]` (`model/attention.rs`).
fn attention(rec: &mut Recorder, x: &Sym, bias: Option<&Sym>, heads: i64, head_dim: i64) -> Sym {
    let c = x.shape[2];
    let project = |rec: &mut Recorder| {
        let w = rec.weight(&[c, heads, head_dim]);
        rec.einsum("bqa,ahc->bqhc", x, &w)
    };
    let q = project(rec);
    let q = rec.add(&q);
    let k = project(rec);
    let v = project(rec);
    let logits = rec.einsum("bqhc,bkhc->bhqk", &q, &k);
    // The mask's bias, then the pair's, added; softmax keeps its output.
    let mut logits = rec.add(&logits);
    if bias.is_some() {
        logits = rec.add(&logits);
    }
    let weights = rec.saves_output(&logits);
    let averaged = rec.einsum("bhqk,bkhc->bqhc", &weights, &v);
    let gate = project(rec);
    rec.param(&[heads, head_dim], false);
    let gate = rec.add(&gate);
    let gate = rec.saves_output(&gate);
    let gated = rec.mul(&averaged, &gate);
    let w = rec.weight(&[heads, head_dim, c]);
    let out = rec.einsum("bqhc,hco->bqo", &gated, &w);
    rec.param(&[c], false);
    rec.add(&out)
}

/// LayerNorm, a `factor`-wide ReLU layer, back to the width.
fn transition(rec: &mut Recorder, x: &Sym, factor: i64) -> Sym {
    let c = x.shape[x.shape.len() - 1];
    let h = rec.layer_norm(x);
    let h = rec.linear(&h, factor * c, Shard::None);
    let h = rec.saves_output(&h);
    rec.linear(&h, c, Shard::None)
}

/// The outer product mean of the MSA `[s, r, c_m]` into the pair `[r, r, c_z]`.
fn outer_product_mean(rec: &mut Recorder, msa: &Sym, channels: i64, c_z: i64) -> Sym {
    let (s, r) = (msa.shape[0], msa.shape[1]);
    let x = rec.layer_norm(msa);
    let mask = rec.external(&[s, r, 1]);
    let masked_projection = |rec: &mut Recorder| {
        let p = rec.linear(&x, channels, Shard::None);
        rec.mul(&p, &mask)
    };
    let left = masked_projection(rec);
    let right = masked_projection(rec);
    // The product comes out of bmm laid out [i, c, j, e]; flattening (c, e) copies it.
    let outer = rec.einsum("sic,sje->ijce", &left, &right);
    let flat = rec.copy(&outer, &[r, r, channels * channels]);
    let y = rec.linear(&flat, c_z, Shard::None);
    // Divided by the number of sequences both residues have (from the masks, plus 1e-3).
    let counts = rec.external(&[r, r]);
    let divisor = rec.copy(&counts, &[r, r, 1]);
    rec.div(&y, &divisor)
}

/// A triangle multiplicative update of the pair `[r, r, c_z]` through `c` channels.
fn triangle_multiplication(rec: &mut Recorder, pair: &Sym, c: i64, direction: Direction) -> Sym {
    let (r, c_z) = (pair.shape[0], pair.shape[2]);
    let x = rec.layer_norm(pair);
    let mask = rec.external(&[r, r, 1]);
    let gated_projection = |rec: &mut Recorder| {
        let p = rec.linear(&x, c, Shard::None);
        let p = rec.mul(&p, &mask);
        let g = rec.linear(&x, c, Shard::None);
        let g = rec.saves_output(&g);
        rec.mul(&p, &g)
    };
    let left = gated_projection(rec);
    let right = gated_projection(rec);
    let product = match direction {
        Direction::Outgoing => rec.einsum("ikc,jkc->ijc", &left, &right),
        Direction::Incoming => rec.einsum("kjc,kic->ijc", &left, &right),
    };
    let normed = rec.layer_norm(&product);
    let y = rec.linear(&normed, c_z, Shard::None);
    let g = rec.linear(&x, c_z, Shard::None);
    let g = rec.saves_output(&g);
    rec.mul(&y, &g)
}
