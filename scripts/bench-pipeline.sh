#!/usr/bin/env bash
# ViT pipeline schedules (GPipe, 1F1B, interleaved, ZB-H1) against one process in the same run:
# step time, peak memory per stage, measured idle fraction beside the simulator's (fed with the
# measured costs) and the textbook bubble (apps/vit/benches/pipeline.rs). Extra arguments go to
# the benchmark, e.g. `--pp 4`, `--micro-batches 4,16` or `--device cuda` (NCCL, a GPU per rank).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo bench --locked -p vit --bench pipeline -- "$@"
