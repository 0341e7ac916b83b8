#!/usr/bin/env bash
# ViT training throughput (forward + backward + AdamW step, images/s) of ours against the same
# network in PyTorch eager (apps/vit/benches/vit_baseline.py), side by side. Extra arguments
# go to both runs, e.g. `--device cuda --precision bf16` or `--threads 4 --seconds 30`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# ViT-Ti/16 at 224 px (timm's vit_tiny_patch16_224).
cargo run --release --locked -p vit -- bench --model vit_tiny_patch16_224 --image-size 224 --batch 8 "$@"
# A small ViT for 32 px inputs (CIFAR-sized): width 192, 6 blocks, 3 heads, 4 px patches.
cargo run --release --locked -p vit -- bench --model custom --width 192 --depth 6 --heads 3 --patch-size 4 \
  --image-size 32 --classes 10 --batch 64 "$@"
