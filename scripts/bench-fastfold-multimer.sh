#!/usr/bin/env bash
# fastfold's AlphaFold-Multimer against DeepMind's (JAX, CPU) on the same complex features and
# random full-size model_1_multimer_v3 parameters, side by side
# (apps/fastfold/benches/versus_alphafold_multimer.rs). AlphaFold runs in an environment of its
# own, .venv-alphafold (made here on first use, never needed by the product or the tests), or
# the one ALPHAFOLD_PYTHON names. Extra arguments go to the benchmark, e.g.
# `--residues 300,300 --blocks 48 --recycles 3`, or a reduced `--residues 64,64 --blocks 2`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if [ -z "${ALPHAFOLD_PYTHON:-}" ]; then
  if ! .venv-alphafold/bin/python -c 'import alphafold.model.modules_multimer, jax, haiku' 2>/dev/null; then
    python3 -m venv .venv-alphafold
    .venv-alphafold/bin/pip install --quiet -r apps/fastfold/benches/alphafold-requirements.txt
  fi
  export ALPHAFOLD_PYTHON=.venv-alphafold/bin/python
fi
cargo bench --locked -p fastfold --bench versus_alphafold_multimer -- "$@"
