#!/usr/bin/env bash
# The automatic planner against every manual ViT layout that fits on CPU ranks: predicted and
# measured step time and peak memory per layout, and the --parallel auto plan's measured step
# time over the best manual layout's (apps/vit/benches/auto.rs). Extra arguments go to the
# benchmark, e.g. `--nproc 4 --batch 32`, `--cluster cluster.json`, `--image-size 16
# --patch-size 4` or `--measured-steps 10`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo bench --locked -p vit --bench auto -- "$@"
