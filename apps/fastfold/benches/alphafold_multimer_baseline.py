"""AlphaFold's side of `benches/versus_alphafold_multimer.rs`: DeepMind's AlphaFold-Multimer
(`alphafold/model/modules_multimer.py` of alphafold-colabfold, JAX on the CPU, or on a GPU with
the benchmark's `--device cuda`) predicting one
complex from the features in --features (our pipeline's `features.npz`, AlphaFold's names and
dtypes) with `model_1_multimer_v3`'s full sizes (--blocks Evoformer blocks, 48 in the release;
--extra-blocks extra-MSA blocks, 4) and random parameters from haiku's own initialisers, fp32
(`global_config.bfloat16` off) and v2.3's recycling with every one of --recycles recycles run
(no early stop).

v2.3's loop (`modules_multimer.AlphaFold`) is written out here, one `AlphaFoldIteration` per
jit-compiled call, since the fork's `RunModel.predict` runs ColabFold's loop (its own key
splits, the recycled state in float16): the network's key is haiku's first `next_rng_key` of
`PRNGKey(seed)`, as `RunModel.predict` applies the model; each recycle takes the second half of
the loop key's split, the first half the next loop key; the last pass the loop key as it stands.

Writes into --out: `params_model_1_multimer_v3.npz` (the parameters under AlphaFold's file keys,
`scope//name`, as the release holds them) and `positions.npz` (`final_atom_positions`,
`final_atom_mask`). Prints one JSON line: the seconds of the first prediction (jit compilation
included), of the second (compiled), and the peak memory (`card_memory.py`: the resident set on
the CPU, the card's use on a GPU). With --once the
pass is compiled ahead (`lower(...).compile()`) and one prediction runs: its seconds, and
those plus the compilation's as the first prediction's.

Benchmark-only; never on the product's path. Its environment: scripts/bench-fastfold-multimer.sh.
"""
import argparse
import json
import os
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from alphafold.common import residue_constants as rc
from alphafold.model import config, modules_multimer, prng
from card_memory import PeakMemory


class OnePass(hk.Module):
    """One `AlphaFoldIteration` under the release's scope (`alphafold/alphafold_iteration`), on
    the batch with the previous pass's outputs, from the key `key`."""

    def __init__(self, cfg):
        super().__init__(name='alphafold')
        self.cfg = cfg

    def __call__(self, batch, key):
        iteration = modules_multimer.AlphaFoldIteration(self.cfg, self.cfg.global_config)
        ret = iteration(batch, is_training=False, safe_key=prng.SafeKey(key))
        return {'prev_pos': ret['structure_module']['final_atom_positions'],
                'prev_msa_first_row': ret['representations']['msa_first_row'],
                'prev_pair': ret['representations']['pair'],
                'final_atom_mask': ret['structure_module']['final_atom_mask']}


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--features', required=True)
    p.add_argument('--blocks', type=int, default=48)
    p.add_argument('--extra-blocks', type=int, default=4)
    p.add_argument('--recycles', type=int, default=3)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--once', action='store_true')
    p.add_argument('--out', required=True)
    args = p.parse_args()
    memory = PeakMemory(jax.default_backend() == 'gpu')

    cfg = config.model_config('model_1_multimer_v3')
    m = cfg.model
    m.global_config.bfloat16 = False
    # Random output layers instead of zeros, so that no pass computes on all-zero updates.
    m.global_config.zero_init = False
    m.embeddings_and_evoformer.evoformer_num_block = args.blocks
    m.embeddings_and_evoformer.extra_msa_stack_num_block = args.extra_blocks

    feats = {k: v for k, v in np.load(args.features).items()}
    n = feats['aatype'].shape[0]
    e = m.embeddings_and_evoformer
    batch = {k: jnp.asarray(v) for k, v in feats.items()}
    # AlphaFoldIteration runs its structure module on this path; only a loss reads the positions.
    batch['all_atom_positions'] = jnp.zeros((n, rc.atom_type_num, 3), jnp.float32)
    zeros = {'prev_pos': jnp.zeros((n, rc.atom_type_num, 3)),
             'prev_msa_first_row': jnp.zeros((n, e.msa_channel)),
             'prev_pair': jnp.zeros((n, n, e.pair_channel))}

    fn = hk.transform(lambda b, k: OnePass(m)(b, k))
    params = fn.init(jax.random.PRNGKey(0), {**batch, **zeros}, jax.random.PRNGKey(1))
    os.makedirs(args.out, exist_ok=True)
    flat = {f'{scope}//{name}': np.asarray(v, np.float32) for scope, d in params.items() for name, v in d.items()}
    np.savez(os.path.join(args.out, 'params_model_1_multimer_v3.npz'), **flat)
    del flat

    step = jax.jit(fn.apply)
    compile_seconds = 0.0
    if args.once:
        start = time.perf_counter()
        # Every pass takes arrays of these shapes and dtypes, so one compilation serves all.
        step = step.lower(params, jax.random.PRNGKey(0), {**batch, **zeros}, jax.random.PRNGKey(0)).compile()
        compile_seconds = time.perf_counter() - start
    first_key = hk.transform(lambda: hk.next_rng_key()).apply({}, jax.random.PRNGKey(args.seed))

    # The modules given no key (the shape-only embedding, dropout-free heads) draw haiku's.
    apply_key = jax.random.PRNGKey(args.seed)

    def predict():
        prev, key = zeros, first_key
        for _ in range(args.recycles):
            key, this = jax.random.split(key)
            out = step(params, apply_key, {**batch, **prev}, this)
            prev = {k: out[k] for k in zeros}
        out = step(params, apply_key, {**batch, **prev}, key)
        return jax.block_until_ready(out)

    seconds = []
    for _ in range(1 if args.once else 2):
        start = time.perf_counter()
        out = predict()
        seconds.append(time.perf_counter() - start)
    if args.once:
        seconds = [compile_seconds + seconds[0], seconds[0]]
    positions = np.asarray(out['prev_pos'], np.float32)
    assert np.isfinite(positions).all(), 'non-finite positions'
    np.savez(os.path.join(args.out, 'positions.npz'), final_atom_positions=positions,
             final_atom_mask=np.asarray(out['final_atom_mask'], np.float32))
    print(json.dumps({'first_seconds': seconds[0], 'seconds': seconds[1], 'peak_bytes': memory.finish(),
                      'residues': int(n), 'msa_rows': int(feats['msa'].shape[0])}))


if __name__ == '__main__':
    main()
