#!/usr/bin/env bash
# One Evoformer block, ours against PyTorch eager (apps/fastfold/benches/evoformer_baseline.py),
# side by side. On a GPU the shape OpenFold and FastFold report (256 residues x 128 sequences);
# on the CPU a smaller one. Extra arguments go to the benchmark, e.g. `--bf16` or `--chunk-size 64`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  cargo bench --locked -p fastfold --bench evoformer -- --device cuda --residues 256 --sequences 128 --warmup 3 --iters 10 "$@"
else
  cargo bench --locked -p fastfold --bench evoformer -- --residues 64 --sequences 32 "$@"
fi
