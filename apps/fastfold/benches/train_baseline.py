"""AlphaFold's side of `benches/versus_alphafold_train.rs`: one training step of DeepMind's
monomer model (the `alphafold` package of alphafold-colabfold, JAX on CPU), the gradient of
its whole training loss, jit-compiled, on one example of --residues residues.

The model: `model_3_ptm` (no templates) at full widths with --blocks Evoformer blocks (48 in
AlphaFold), fp32, random parameters (`global_config.zero_init` off), rematerialised blocks
(`use_remat`, as AlphaFold trains), every dropout rate 0 (ours with dropout off too: the same computation)
and `is_training=True` otherwise. One recycling pass from zero recycled inputs: the pass that
AlphaFold trains, `AlphaFoldIteration(..., compute_loss=True)`, whose total is each head's
`loss` times its weight, under the initial-training weights (structural violations,
experimentally resolved and aligned error 0; OpenFold's `initial_training`), backbone FAPE
clamped, resolution 2 A (inside the confidence heads' filter).

The example: a query of --residues residues (`alphafold_baseline.query`) with a synthetic
MSA of 1,200 sequences (the query with 30% substitutions and 5% gaps), processed by
AlphaFold's `process_features` into 128 MSA clusters and --extra-msa extra rows (AlphaFold's
training sizes: 1,024), so that no row is padding; its true structure a random chain (C-alpha
3.8 A apart, the other atoms scattered about it) and the ground truth that AlphaFold's
losses read computed from it by AlphaFold's functions (`make_alphafold_loss.ground_truth`).

Writes into --out, before the step, `params.npz` (AlphaFold's keys), `features.npz` (the processed features)
and `truth.npz` (`aatype`, `all_atom_positions`, `all_atom_mask`) for our side. Prints one
JSON line: the compile seconds (`jit(...).lower(...).compile()`), the seconds of the last
of --calls compiled calls of `value_and_grad` (parameters' gradients), the loss, and the
process's peak resident memory.

Benchmark-only; never on the product's path. Its environment:
scripts/bench-fastfold-train.sh.
"""
import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests', 'fixtures'))

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from alphafold.common import residue_constants as rc  # noqa: E402
from alphafold.data import parsers, pipeline  # noqa: E402
from alphafold.model import config, modules  # noqa: E402

from alphafold_baseline import query  # noqa: E402
from make_alphafold_loss import ground_truth  # noqa: E402

MSA_CLUSTERS, SEQUENCES = 128, 1200


def synthetic_msa(seq, rng):
    letters = 'ARNDCQEGHILKMFPSTWYV'
    rows = [seq]
    for _ in range(SEQUENCES - 1):
        row = [letters[rng.integers(20)] if rng.random() < 0.3 else c for c in seq]
        row = ['-' if rng.random() < 0.05 else c for c in row]
        rows.append(''.join(row))
    deletions = [[0] * len(seq) for _ in rows]
    return parsers.Msa(rows, deletions, [f's{i}' for i in range(len(rows))])


def true_structure(aatype, rng):
    """A random chain: C-alpha 3.8 A apart, each other atom within about 1.5 A of its C-alpha."""
    n = len(aatype)
    steps = rng.normal(size=(n, 3))
    steps *= 3.8 / np.linalg.norm(steps, axis=-1, keepdims=True)
    ca = np.cumsum(steps, axis=0)
    pos = ca[:, None, :] + rng.normal(scale=1.5, size=(n, rc.atom_type_num, 3))
    pos[:, rc.atom_order['CA']] = ca
    mask = np.stack([rc.STANDARD_ATOM_MASK[a] for a in aatype]).astype(np.float32)
    return (pos * mask[..., None]).astype(np.float32), mask


def model_config(blocks, extra_msa):
    cfg = config.model_config('model_3_ptm')
    cfg.data.eval.num_ensemble = 1
    cfg.data.eval.max_msa_clusters = MSA_CLUSTERS
    cfg.data.common.max_extra_msa = extra_msa
    cfg.data.common.num_recycle = 0
    cfg.model.num_recycle = 0
    gc = cfg.model.global_config
    gc.bfloat16 = False
    gc.zero_init = False
    gc.use_remat = True
    e = cfg.model.embeddings_and_evoformer
    e.evoformer_num_block = blocks
    for stack in (e.evoformer, e.template.template_pair_stack):
        for k in ('triangle_multiplication_outgoing', 'triangle_multiplication_incoming'):
            stack[k].fuse_projection_weights = False

    def no_dropout(node):
        for k in list(node.keys()):
            if k in ('dropout_rate', 'dropout'):  # the structure module's is `dropout`
                node[k] = 0.0
            elif hasattr(node[k], 'keys'):
                no_dropout(node[k])
    no_dropout(cfg.model)
    return cfg


def initial_training(cfg):
    """The initial-training weights (as `make_alphafold_violations.weights`)."""
    h = cfg.model.heads
    h.structure_module.structural_violation_loss_weight = 0.0
    h.experimentally_resolved.weight = 0.0
    h.predicted_aligned_error.weight = 0.0
    return cfg


class Pass(hk.Module):
    """One recycling pass under AlphaFold's module path from zero recycled inputs."""

    def __init__(self, cfg, is_training, compute_loss):
        super().__init__(name='alphafold')
        self.cfg, self.is_training, self.compute_loss = cfg, is_training, compute_loss

    def __call__(self, batch):
        n = batch['aatype'].shape[1]
        c = self.cfg.embeddings_and_evoformer
        prev = {'prev_msa_first_row': jnp.zeros((n, c.msa_channel)),
                'prev_pair': jnp.zeros((n, n, c.pair_channel)),
                'prev_pos': jnp.zeros((n, 37, 3))}
        impl = modules.AlphaFoldIteration(self.cfg, self.cfg.global_config)
        return impl(ensembled_batch=batch, non_ensembled_batch=prev, is_training=self.is_training,
                    compute_loss=self.compute_loss, ensemble_representations=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--residues', type=int, required=True)
    p.add_argument('--blocks', type=int, default=48)
    p.add_argument('--calls', type=int, default=2)
    p.add_argument('--extra-msa', type=int, default=1024)
    p.add_argument('--out', required=True)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    seq = query(args.residues)

    cfg = model_config(args.blocks, args.extra_msa)
    raw = {**pipeline.make_sequence_features(seq, 'query', len(seq)),
           **pipeline.make_msa_features([synthetic_msa(seq, rng)])}
    from alphafold.model import model
    feats = model.RunModel(cfg).process_features(raw, random_seed=0)
    batch = {k: jnp.asarray(v) for k, v in feats.items()}

    # Every head's parameters (our side builds them all); the loss leaves out weight-0 heads.
    init = hk.transform(lambda b: Pass(cfg.model, False, False)(b))
    params = jax.jit(init.init)(jax.random.PRNGKey(0), batch)

    aatype = np.asarray(feats['aatype'][0])
    pos, mask = true_structure(aatype, rng)
    loss_batch = dict(batch)
    for k, v in ground_truth(aatype, pos, mask).items():
        loss_batch[k] = jnp.asarray(v)[None]
    loss_batch['resolution'] = jnp.asarray([2.0])
    loss_batch['use_clamped_fape'] = jnp.asarray([1.0])

    # Written before the step, so that our side has its inputs even if this one fails.
    os.makedirs(args.out, exist_ok=True)
    flat = {f'{scope}//{name}': np.asarray(v) for scope, d in params.items() for name, v in d.items()}
    np.savez(os.path.join(args.out, 'params.npz'), **flat)
    np.savez(os.path.join(args.out, 'features.npz'), **{k: np.asarray(v) for k, v in feats.items()})
    np.savez(os.path.join(args.out, 'truth.npz'), aatype=aatype.astype(np.int64),
             all_atom_positions=pos, all_atom_mask=mask)

    train_cfg = initial_training(model_config(args.blocks, args.extra_msa))
    fn = hk.transform(lambda b: Pass(train_cfg.model, True, True)(b))

    def loss(p, b):
        _, total = fn.apply(p, jax.random.PRNGKey(1), b)
        return total

    start = time.perf_counter()
    step = jax.jit(jax.value_and_grad(loss)).lower(params, loss_batch).compile()
    compile_seconds = time.perf_counter() - start
    seconds = []
    for _ in range(args.calls):
        start = time.perf_counter()
        value, grad = step(params, loss_batch)
        jax.block_until_ready(grad)
        seconds.append(time.perf_counter() - start)
    value = float(value)
    assert np.isfinite(value), f'loss {value}'
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    print(json.dumps({'compile_seconds': compile_seconds, 'seconds': seconds[-1], 'loss': value,
                      'peak_bytes': peak, 'msa_rows': int(feats['msa_feat'].shape[1]),
                      'extra_msa_rows': int(feats['extra_msa'].shape[1])}))


if __name__ == '__main__':
    main()
