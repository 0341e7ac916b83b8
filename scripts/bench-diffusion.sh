#!/usr/bin/env bash
# SD UNet fine-tuning steps: ours under Gemini with a memory cap, ours uncapped, and diffusers in
# PyTorch eager, side by side (apps/diffusion/benches/finetune.rs). On a GPU the issue's
# measurement (SD 1.x UNet, 512 px, batch 1, fp16, 4 GiB cap); on the CPU a narrower UNet at
# 256 px under a 1 GiB budget (below its 0.9 GB of fp32 weights plus their homes) to check the
# program. Then the same for an SDXL-shaped UNet (`--arch sdxl`): on a GPU SDXL's own UNet at
# 1024 px under a 24 GiB cap; on the CPU half its widths with transformer layers 1,1,2 (232M
# parameters). Extra arguments go to both runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# diffusers is the baseline's only extra need (never the product's).
.venv/bin/python -c 'import diffusers' 2>/dev/null || .venv/bin/pip install --quiet -r scripts/bench-requirements.txt
if .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  cargo bench --locked -p diffusion --bench finetune -- --device cuda --cap 4G --resolution 512 --batch 1 \
    --precision fp16 --gradient-checkpointing "$@"
  cargo bench --locked -p diffusion --bench finetune -- --arch sdxl --device cuda --cap 24G --resolution 1024 \
    --batch 1 --precision fp16 --gradient-checkpointing "$@"
else
  cargo bench --locked -p diffusion --bench finetune -- --resolution 256 --block-out-channels 160,320,640,640 --cap 1G \
    --steps 2 "$@"
  cargo bench --locked -p diffusion --bench finetune -- --arch sdxl --resolution 256 --block-out-channels 160,320,640 \
    --transformer-depth 1,1,2 --cap 1G --steps 2 "$@"
fi
