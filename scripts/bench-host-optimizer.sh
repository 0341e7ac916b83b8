#!/usr/bin/env bash
# Gemini's host AdamW beside torch.optim.AdamW(fused=True) on the CPU and a STREAM triad
# measuring this machine's memory bandwidth, in the same run (engine/benches/host_optimizer.rs).
# Extra arguments go to the benchmark (--params 860M, --steps 5, --rounds 3, --no-baseline).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo bench --locked -p engine --bench host_optimizer -- "$@"
