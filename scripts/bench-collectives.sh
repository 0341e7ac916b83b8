#!/usr/bin/env bash
# Collective bus bandwidth of the engine against torch.distributed, side by side.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo bench --locked -p engine --bench collectives
