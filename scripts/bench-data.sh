#!/usr/bin/env bash
# The input pipeline alone: our loader against torchvision's DataLoader with the same worker
# count, JPEG folder and HDF5, in one run (data/benches/loader.rs). Extra arguments go to the
# benchmark (--workers, --images, --seconds, --batch, --source-size).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# torchvision and h5py are the baseline's only extra needs (never the product's).
.venv/bin/python -c 'import torchvision, h5py' 2>/dev/null || .venv/bin/pip install --quiet -r scripts/bench-requirements.txt
cargo bench --locked -p data --bench loader -- "$@"
