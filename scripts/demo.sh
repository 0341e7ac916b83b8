#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job: data-parallel training on two
# local ranks, checked step by step against one process. Extra arguments go to the job
# (e.g. --nproc 4 --steps 100).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo run --release --locked -p engine --example data_parallel -- "$@"
