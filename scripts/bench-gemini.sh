#!/usr/bin/env bash
# Gemini under a GPU memory cap against plain training, side by side (needs a CUDA device).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo bench --locked -p engine --bench gemini -- "$@"
