#!/usr/bin/env bash
# fastfold's model against DeepMind's AlphaFold (JAX, CPU) on the same processed features and
# random full-size model_1_ptm parameters, side by side (apps/fastfold/benches/versus_alphafold.rs).
# AlphaFold runs in an environment of its own, .venv-alphafold (made here on first use, never
# needed by the product or the tests). Extra arguments go to the benchmark, e.g.
# `--residues 40,128,256 --recycles 3`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if ! .venv-alphafold/bin/python -c 'import alphafold.model.modules_multimer, jax, haiku' 2>/dev/null; then
  python3 -m venv .venv-alphafold
  .venv-alphafold/bin/pip install --quiet -r apps/fastfold/benches/alphafold-requirements.txt
fi
ALPHAFOLD_PYTHON=.venv-alphafold/bin/python cargo bench --locked -p fastfold --bench versus_alphafold -- "$@"
