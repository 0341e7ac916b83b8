#!/usr/bin/env bash
# fastfold train's step against DeepMind's AlphaFold training step (JAX, CPU): the gradient of
# the whole training loss on the same example, full-width model_3_ptm parameters and
# configuration, side by side, and ours on 2 DAP ranks against 1
# (apps/fastfold/benches/versus_alphafold_train.rs). AlphaFold runs in an environment of its
# own, .venv-alphafold (made here on first use, never needed by the product or the tests).
# Extra arguments go to the benchmark, e.g. `--residues 128,256 --blocks 48 --dap-residues 128`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if ! .venv-alphafold/bin/python -c 'import alphafold.model.modules_multimer, jax, haiku' 2>/dev/null; then
  python3 -m venv .venv-alphafold
  .venv-alphafold/bin/pip install --quiet -r apps/fastfold/benches/alphafold-requirements.txt
fi
ALPHAFOLD_PYTHON=.venv-alphafold/bin/python cargo bench --locked -p fastfold --bench versus_alphafold_train -- "$@"
