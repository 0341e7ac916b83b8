#!/usr/bin/env bash
# Everything GPU in one command, for the rare machine with an NVIDIA GPU. That machine gets a
# copy of the working tree but no Rust toolchain, so the binaries are built here first:
#
#   bash scripts/gpu-check.sh pack            # here: build, strip and list into gpu-bin/ (~55 MiB)
#   bash scripts/gpu-check.sh tests   OUT     # there: every CUDA test, SUITE_REQUIRE_CUDA=1
#   bash scripts/gpu-check.sh kernels OUT     # there: the fused kernels' parity tests
#   bash scripts/gpu-check.sh bench   OUT     # there: the GPU benchmarks, each beside its baseline
#   bash scripts/gpu-check.sh all     OUT     # there: the three stages
#
# Each stage stays under 9 minutes and appends to OUT/report.md (device, driver, versions, every
# command with its result and figures). On the GPU machine libtorch comes from its own
# torch install (TORCH_PYTHON, default /opt/torch/.venv/bin/python, the same 2.11.0+cu130 build
# as ours); gpu-bin/ travels with the tree (`carry: ["gpu-bin"]`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stage="${1:-}"
out="${2:-gpu-report}"
bin="$root/gpu-bin"
say() { printf '[gpu-check] %s\n' "$*" >&2; }

# Copies the test executables of package $1 whose paths match $2 into $3, stripped.
test_binaries() {
  cargo test --locked -p "$1" --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | grep -E "$2" | while read -r exe; do
      cp "$exe" "$3/" && strip "$3/$(basename "$exe")"
    done
}

pack() {
  bash scripts/setup.sh
  rm -rf "$bin" && mkdir -p "$bin/tests" "$bin/kernels"
  # Test executables (debug, as CI builds them) of the engine's integration tests, the
  # Evoformer's, and the kernels' PTX and parity tests (~5 MiB each; the kernel sources travel
  # inside the binaries and are compiled there by NVRTC; their CPU-only tests run in CI).
  test_binaries suite-tests '.' "$bin/tests"
  # The apps' fused-kernel tests (the Evoformer's other tests are CPU ones CI runs).
  test_binaries fastfold '/(evoformer|profile)-[0-9a-f]+$' "$bin/tests"
  test_binaries vit '/(kernels|profile)-[0-9a-f]+$' "$bin/tests"
  test_binaries kernels '/(ptx|parity|engine_optimizers)-[0-9a-f]+$' "$bin/kernels"
  # The apps and benchmarks in release, as users run them.
  cargo build --locked --release -p vit -p fastfold -p diffusion
  for app in vit fastfold diffusion; do cp "target/release/$app" "$bin/" && strip "$bin/$app"; done
  for spec in "engine gemini" "fastfold evoformer" "diffusion finetune" "kernels kernels" "vit pipeline"; do
    set -- $spec
    exe="$(cargo bench --locked -p "$1" --bench "$2" --no-run --message-format=json 2>/dev/null |
      sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
    cp "$exe" "$bin/bench-$2" && strip "$bin/bench-$2"
  done
  # The benchmarks find their PyTorch baselines by this tree's path when they were built.
  echo "$root" >"$bin/built-at"
  du -sh "$bin" >&2
}

# The GPU machine's libtorch, and the paths the packed binaries expect.
environment() {
  [ -d "$bin" ] || { say "no gpu-bin/: run 'bash scripts/gpu-check.sh pack' where cargo is, and carry gpu-bin"; exit 1; }
  py="${TORCH_PYTHON:-/opt/torch/.venv/bin/python}"
  site="$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
  export LD_LIBRARY_PATH="$site/torch/lib:$site/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}"
  # NVRTC for the fused kernels: the GPU machine's torch wheel's copy (nvidia-cuda-nvrtc), if
  # it has one (else the system loader's); compiled kernels are cached outside the report.
  if [ -e "$site/nvidia/cu13/lib/libnvrtc.so.13" ]; then export SUITE_NVRTC="$site/nvidia/cu13/lib"; fi
  export SUITE_KERNEL_CACHE="${TMPDIR:-/tmp}/suite-kernel-cache"
  export SUITE_PYTHON="$py" SUITE_REQUIRE_CUDA=1
  built="$(cat "$bin/built-at")"
  if [ "$built" != "$root" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -s "$root" "$built" || say "cannot link $built: baselines may not be found"
  fi
  mkdir -p "$out"
  report="$out/report.md"
  if [ ! -s "$report" ]; then
    {
      echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
      echo
      echo '```'
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not found"
      "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
      "$bin/vit" env 2>&1 || true
      echo '```'
    } >"$report"
  fi
}

# Runs a command under a time limit, appending it, its status and its output's tail to the report.
record() {
  local title="$1" limit="$2"
  shift 2
  local log status
  log="$(mktemp)"
  set +e
  timeout "$limit" "$@" >"$log" 2>&1
  status=$?
  set -e
  {
    echo
    echo "## $title: $([ "$status" -eq 0 ] && echo passed || echo "FAILED (exit $status)")"
    echo
    echo '```'
    echo "\$ $*"
    grep -E '^test result|panicked|FAILED|skipped|ours|PyTorch|ratio|peak|img/s|ms|s/step|^\||NCCL|No table' "$log" | tail -n 40
    echo '```'
  } >>"$report"
  rm -f "$log"
  return 0
}

tests() {
  environment
  for exe in "$bin"/tests/*; do
    name="$(basename "$exe")"
    case "$name" in
      # Every test of the CUDA file; elsewhere the CUDA variants (NCCL) and the Gemini GPU test.
      cuda-*) record "tests: $name" 300 "$exe" --test-threads=1 ;;
      # The profiler's checks print measured against predicted bytes for the report.
      profile-*) record "tests: $name (cuda)" 300 "$exe" --test-threads=1 --nocapture cuda ;;
      *) record "tests: $name (cuda)" 300 "$exe" --test-threads=1 cuda ;;
    esac
  done
}

# The kernels' tests: PTX compilation, the compositions, and parity of every fused kernel with
# its composition (forward and backward, f32/bf16/f16) on this GPU.
kernels() {
  environment
  for exe in "$bin"/kernels/*; do
    record "kernels: $(basename "$exe")" 240 "$exe" --test-threads=1
  done
}

bench() {
  environment
  record "vit bench, ViT-B/16 bf16" 300 "$bin/vit" bench --device cuda --precision bf16 \
    --model vit_base_patch16_224 --batch 64 --seconds 20
  record "Evoformer block 256 x 128" 300 "$bin/bench-evoformer" --device cuda --residues 256 \
    --sequences 128 --warmup 3 --iters 10
  record "Gemini under a 4 GiB cap" 300 "$bin/bench-gemini" --device cuda --cap 4G
  record "fused kernels against their libtorch compositions, bf16" 120 "$bin/bench-kernels" --iters 20
  # Two NCCL ranks want two GPUs; on one, NCCL's refusal is what the report shows.
  record "ViT pipeline schedules on 2 ranks (NCCL) beside one process" 300 "$bin/bench-pipeline" --device cuda \
    --pp 2 --batch 64 --micro-batches 2,8
  record "SD 1.x UNet fine-tuning under a 4 GiB cap (diffusers needs internet: ours only)" 400 \
    "$bin/bench-finetune" --device cuda --cap 4G --resolution 512 --batch 1 --precision fp16 \
    --gradient-checkpointing --no-baseline
}

case "$stage" in
  pack) pack ;;
  tests | kernels | bench)
    "$stage"
    say "report: $out/report.md"
    ;;
  all)
    tests
    kernels
    bench
    say "report: $out/report.md"
    ;;
  *)
    sed -n '2,13p' "${BASH_SOURCE[0]}" >&2
    exit 2
    ;;
esac
