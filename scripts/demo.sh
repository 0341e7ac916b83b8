#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job: `vit pretrain` on the embedded
# 8x8 digits (LAMB, 60 epochs), writing checkpoints, metrics and the model to runs/vit-digits.
# Extra arguments go to `vit pretrain` (e.g. --nproc 2, --zero 1, --precision bf16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo run --release --locked -p vit -- pretrain --out runs/vit-digits "$@"
