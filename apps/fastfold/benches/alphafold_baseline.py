"""AlphaFold's side of `benches/versus_alphafold.rs`: DeepMind's monomer model (the `alphafold`
package of alphafold-colabfold, JAX on the CPU, or on a GPU with the benchmark's `--device
cuda`) predicting one single-sequence query with `model_1_ptm`'s full sizes and random
parameters, fp32 (`global_config.bfloat16` off, so both sides run the same arithmetic) and
every recycling pass run (no early stop).

Writes into --out: `params.npz` (the parameters under AlphaFold's own file keys, `scope//name`,
as `params_model_1_ptm.npz` holds them), `positions.npz` (the second prediction's
`final_atom_positions` and `final_atom_mask`) and `features.npz` (the features as AlphaFold's
`process_features` gives them to the model: MSA padded to 512 clusters less the templates,
extra MSA to 5,120 rows, one placeholder template as ColabFold makes when there is none), for
our side to run on. Prints one JSON line: the seconds of the first `predict` (jit compilation
included), of the second (compiled), and the peak memory (`card_memory.py`: the resident set on
the CPU, the card's use on a GPU).

Benchmark-only; never on the product's path. Its environment: scripts/bench-fastfold-alphafold.sh.
"""
import argparse
import json
import os
import time

import jax
import numpy as np
from alphafold.common import residue_constants as rc
from alphafold.data import parsers, pipeline
from alphafold.model import config, model
from card_memory import PeakMemory


def query(n):
    """The same query as the Rust side's: residues cycling through the 20 amino acids."""
    letters = "ARNDCQEGHILKMFPSTWYV"
    return "".join(letters[(i * 7 + i // 3) % 20] for i in range(n))


def placeholder_template(n):
    """One empty template (all gaps, no atoms), as ColabFold builds when no template is used."""
    gaps = rc.sequence_to_onehot("-" * n, rc.HHBLITS_AA_TO_ID)
    return {
        "template_all_atom_positions": np.zeros((1, n, rc.atom_type_num, 3), np.float32),
        "template_all_atom_masks": np.zeros((1, n, rc.atom_type_num), np.float32),
        "template_sequence": np.array([b"none"]),
        "template_aatype": gaps[None].astype(np.float32),
        "template_domain_names": np.array([b"none"]),
        "template_sum_probs": np.zeros((1, 1), np.float32),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--residues", type=int, required=True)
    p.add_argument("--recycles", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    memory = PeakMemory(jax.default_backend() == "gpu")
    seq = query(args.residues)

    cfg = config.model_config("model_1_ptm")
    cfg.data.eval.num_ensemble = 1
    cfg.data.common.num_recycle = args.recycles
    cfg.model.num_recycle = args.recycles
    cfg.model.recycle_early_stop_tolerance = -1.0
    cfg.model.stop_at_score = 101.0
    gc = cfg.model.global_config
    gc.bfloat16 = False
    # Random output layers instead of zeros, so that no pass computes on all-zero updates.
    gc.zero_init = False
    # The released monomer parameter files hold separate left/right triangle projections.
    e = cfg.model.embeddings_and_evoformer
    for stack in (e.evoformer, e.template.template_pair_stack):
        for k in ("triangle_multiplication_outgoing", "triangle_multiplication_incoming"):
            stack[k].fuse_projection_weights = False

    raw = {
        **pipeline.make_sequence_features(seq, "query", len(seq)),
        **pipeline.make_msa_features([parsers.Msa([seq], [[0] * len(seq)], ["query"])]),
        **placeholder_template(len(seq)),
    }
    runner = model.RunModel(cfg)
    feats = runner.process_features(raw, random_seed=0)
    runner.init_params(feats, random_seed=0)

    os.makedirs(args.out, exist_ok=True)
    flat = {f"{scope}//{name}": np.asarray(v) for scope, d in runner.params.items() for name, v in d.items()}
    np.savez(os.path.join(args.out, "params.npz"), **flat)
    np.savez(os.path.join(args.out, "features.npz"), **{k: np.asarray(v) for k, v in feats.items()})

    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        result, last = runner.predict(feats, random_seed=0)
        np.asarray(result["structure_module"]["final_atom_positions"])
        seconds.append(time.perf_counter() - start)
    assert last == args.recycles, f"stopped after pass {last + 1}"
    positions = np.asarray(result["structure_module"]["final_atom_positions"], np.float32)
    assert np.isfinite(positions).all(), "non-finite positions"
    np.savez(os.path.join(args.out, "positions.npz"), final_atom_positions=positions,
             final_atom_mask=np.asarray(result["structure_module"]["final_atom_mask"], np.float32))
    print(json.dumps({"first_seconds": seconds[0], "seconds": seconds[1], "peak_bytes": memory.finish(),
                      "msa_rows": int(feats["msa_feat"].shape[1]),
                      "extra_msa_rows": int(feats["extra_msa"].shape[1])}))


if __name__ == "__main__":
    main()
