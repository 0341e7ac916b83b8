#!/usr/bin/env bash
# Everything GPU in one command, for the rare machine with an NVIDIA GPU. That machine gets a
# copy of the working tree but no Rust toolchain, so the binaries are built here first:
#
#   bash scripts/gpu-check.sh pack                    # here: build, strip, compress into gpu-bin/
#   bash scripts/gpu-check.sh all     OUT [SECONDS]   # there: tests, then benchmarks, in SECONDS
#   bash scripts/gpu-check.sh tests   OUT [SECONDS]   # there: every CUDA and kernel test
#   bash scripts/gpu-check.sh bench   OUT [SECONDS]   # there: the benchmarks, each beside its baseline
#   bash scripts/gpu-check.sh alphafold OUT [SECONDS] # there: fastfold beside DeepMind's AlphaFold (JAX)
#
# A session is lent a GPU for 15 minutes in all, starts included, so the whole check is one
# call: `run` with `carry: ["gpu-bin"]`, `bash scripts/gpu-check.sh all $OUT 520`, timeout_s
# 580 (about 11 of the 15 minutes with the start). SECONDS (default 520) is a deadline for the
# whole stage: items are ordered by what they prove, each gets at most what is left, and what
# no longer fits is reported as not run. A later call (the machine stays warm 30 s after one)
# can run the rest: `GPU_CHECK_SKIP="c0 c2 ..." bash scripts/gpu-check.sh bench $OUT SECONDS`
# skips the items named.
# OUT/report.md (device, driver, versions, every command with its result and figures) grows
# as items finish, and is printed at the end; OUT/logs.tar.gz holds every item's whole output,
# OUT/traces.tar.gz the benchmarks' Chrome traces (Perfetto, chrome://tracing).
# libtorch there is the GPU machine's own torch install (TORCH_PYTHON, default
# /opt/torch/.venv/bin/python, the same 2.11.0+cu130 build as ours).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stage="${1:-}"
out="${2:-gpu-report}"
budget="${3:-520}"
pack_dir="$root/gpu-bin"
say() { printf '[gpu-check] %s\n' "$*" >&2; }

# Copies the test executables of package $1 that hold tests matching filter $2 ('' for all)
# into $3, stripped. A binary with no such test would only cost transfer. The list is read
# whole before it is searched: `--list | grep -q` under pipefail drops a binary whenever grep
# exits before the list is written (the harness then fails on the closed pipe), which is how
# the CUDA file's binary went missing from the first GPU run. Only the test harnesses (artifacts
# built with the test profile) are listed, not the package's programs built beside them.
test_binaries() {
  local exe listed
  cargo test --locked -p "$1" --no-run --message-format=json 2>/dev/null | grep '"test":true},"features"' |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | while read -r exe; do
      listed="$("$exe" --list $2 2>/dev/null)" || { say "$exe --list failed"; exit 1; }
      if grep -q ': test$' <<<"$listed"; then
        cp "$exe" "$3/" && strip "$3/$(basename "$exe")"
      fi
    done
}

pack() {
  bash scripts/setup.sh
  local stage_dir="$root/target/gpu-bin"
  rm -rf "$stage_dir" "$pack_dir" && mkdir -p "$stage_dir/tests" "$stage_dir/kernels" "$stage_dir/wheels" "$pack_dir"
  # Test executables (debug, as CI builds them; their CPU tests run in CI). `tests/` runs the
  # tests named *cuda* (the CUDA file and the kernels' binaries whole); `kernels/` the fused
  # kernels' PTX, parity and optimizer tests (the sources travel inside the binaries and NVRTC
  # compiles them there).
  test_binaries suite-tests cuda "$stage_dir/tests"
  test_binaries fastfold cuda "$stage_dir/tests"
  test_binaries vit cuda "$stage_dir/tests"
  test_binaries kernels '' "$stage_dir/kernels"
  compgen -G "$stage_dir/tests/cuda-*" >/dev/null || { say "the CUDA file's test binary was not packed"; exit 1; }
  rm -f "$stage_dir"/kernels/{kernels,fallback}-* # the crate's unit tests and the fallbacks': CPU only
  # The README's main job, `diffusion` (run as a user types it) and the benchmarks in release,
  # as users run them.
  cargo build --locked --release -p vit -p diffusion
  local app
  for app in vit diffusion; do cp "target/release/$app" "$stage_dir/" && strip "$stage_dir/$app"; done
  local spec exe
  for spec in "engine gemini" "fastfold evoformer" "fastfold predict" "diffusion finetune" "kernels kernels" \
    "fastfold versus_alphafold" "fastfold versus_alphafold_multimer" "vit auto" "data loader"; do
    set -- $spec
    exe="$(cargo bench --locked -p "$1" --bench "$2" --no-run --message-format=json 2>/dev/null |
      sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
    cp "$exe" "$stage_dir/bench-$2" && strip "$stage_dir/bench-$2"
  done
  # The shared libraries vit needs beyond glibc, libstdc++ and torch (HDF5 and what it links:
  # the GPU machine may have none of them); there only the missing ones are used.
  mkdir -p "$stage_dir/lib"
  ldd "$stage_dir/vit" | awk '/=> \//{print $3}' |
    grep -vE 'torch|\.venv|/(libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s)\.so|ld-linux' |
    while read -r lib; do cp -L "$lib" "$stage_dir/lib/"; done
  # diffusers for the fine-tuning baseline (that machine has torch and transformers, not
  # diffusers, and no internet); its other requirements are there.
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$stage_dir/wheels" diffusers==0.42.1 importlib_metadata==10.2.0
  # DeepMind's AlphaFold for the baselines beside fastfold (that machine has JAX with CUDA,
  # NumPy, SciPy and PyYAML, not AlphaFold's own packages). colabfold-kernels' CUDA builds stay
  # behind: 2.3.27 imports the package, but its fused kernels are off in every model config.
  # This set ran DeepMind's Multimer under Python 3.12 and JAX 0.11 (on the CPU) here.
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$stage_dir/alphafold-wheels" alphafold-colabfold==2.3.27 colabfold-kernels==0.9.0 dm-haiku==0.0.17 \
    jmp==0.0.4 tabulate==0.10.0 dm-tree==0.1.10 ml-collections==1.1.0 absl-py==2.5.1 chex==0.1.92 toolz==1.2.0 \
    immutabledict==4.3.1 biopython==1.88
  # The benchmarks find their PyTorch baselines by this tree's path when they were built.
  echo "$root" >"$stage_dir/built-at"
  # One solid xz archive: the binaries share most of their code (80 MiB -> ~17 MiB), and the
  # working tree plus what it carries must stay under 64 MiB.
  tar -C "$stage_dir" -cf - . | xz -9 -T2 >"$pack_dir/gpu-bin.tar.xz"
  local tree packed
  tree="$(git ls-files -z | du -cb --files0-from=- | tail -n 1 | cut -f1)"
  packed="$(stat -c %s "$pack_dir/gpu-bin.tar.xz")"
  say "gpu-bin/gpu-bin.tar.xz: $((packed >> 20)) MiB; with the tracked tree $(((tree + packed) >> 20)) MiB of the 64 MiB that travel"
  [ $((tree + packed)) -lt $((60 << 20)) ] || { say "too large to travel"; exit 1; }
}

# The GPU machine's libtorch, the unpacked binaries, and the paths they expect.
environment() {
  [ -s "$pack_dir/gpu-bin.tar.xz" ] ||
    { say "no gpu-bin/gpu-bin.tar.xz: run 'bash scripts/gpu-check.sh pack' where cargo is, and carry gpu-bin"; exit 1; }
  bin="${TMPDIR:-/tmp}/gpu-bin"
  if [ ! -x "$bin/vit" ]; then
    mkdir -p "$bin"
    if command -v xz >/dev/null; then
      tar -C "$bin" -xJf "$pack_dir/gpu-bin.tar.xz"
    else
      "${TORCH_PYTHON:-/opt/torch/.venv/bin/python}" -c \
        'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$pack_dir/gpu-bin.tar.xz" "$bin"
    fi
  fi
  py="${TORCH_PYTHON:-/opt/torch/.venv/bin/python}"
  site="$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
  export LD_LIBRARY_PATH="$site/torch/lib:$site/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}"
  provide_missing_libraries
  # NVRTC for the fused kernels: the torch wheel's copy (nvidia-cuda-nvrtc) if it has one, else
  # the system loader's; compiled kernels are cached outside the report.
  if [ -e "$site/nvidia/cu13/lib/libnvrtc.so.13" ]; then export SUITE_NVRTC="$site/nvidia/cu13/lib"; fi
  export SUITE_KERNEL_CACHE="${TMPDIR:-/tmp}/suite-kernel-cache"
  export SUITE_PYTHON="$py" SUITE_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1
  local wheels=("$bin"/wheels/*.whl)
  if [ -e "${wheels[0]}" ] && [ ! -d "$bin/site" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$bin/site" "${wheels[@]}" ||
      say "diffusers did not install: the fine-tuning baseline will fail"
  fi
  export PYTHONPATH="$bin/site${PYTHONPATH:+:$PYTHONPATH}"
  # AlphaFold's packages for its baselines only (through their own Python), so that the other
  # baselines import the machine's own.
  local af=("$bin"/alphafold-wheels/*.whl)
  if [ -e "${af[0]}" ] && [ ! -d "$bin/alphafold-site" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$bin/alphafold-site" "${af[@]}" ||
      say "AlphaFold's packages did not install: the AlphaFold baselines will fail"
  fi
  printf '#!/bin/sh\nPYTHONPATH="%s:$PYTHONPATH" exec "%s" "$@"\n' "$bin/alphafold-site" "$py" >"$bin/alphafold-python"
  chmod +x "$bin/alphafold-python"
  export ALPHAFOLD_PYTHON="$bin/alphafold-python"
  local built
  built="$(cat "$bin/built-at")"
  if [ "$built" != "$root" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -s "$root" "$built" || say "cannot link $built: baselines may not be found"
  fi
  mkdir -p "$out"
  report="$out/report.md"
  logs="$(mktemp -d)/logs"
  parts="$(dirname "$logs")/parts"
  # Benchmarks' Chrome traces (--trace): OUT/traces.tar.gz, apart from the logs, since a file
  # over 16 MiB does not come back; the predict pass's (tens of MB) stays behind, its table in
  # the report.
  traces="$(dirname "$logs")/traces"
  mkdir -p "$logs" "$parts" "$traces"
  deadline=$((SECONDS + budget))
  trap finish EXIT
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

# Links the packed copies of the shared libraries this machine lacks (and only those: the
# system's own stay first) into a folder at the end of the search path, until nothing is
# missing; what the pack lacks too is said.
provide_missing_libraries() {
  local dir="$bin/lib-missing" missing name round
  mkdir -p "$dir"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dir"
  for round in 1 2 3 4 5 6; do
    missing="$(for exe in "$bin"/vit "$bin"/diffusion "$bin"/bench-* "$bin"/tests/* "$bin"/kernels/*; do ldd "$exe"; done 2>/dev/null |
      awk '/not found/{print $1}' | sort -u)"
    [ -n "$missing" ] || return 0
    for name in $missing; do
      [ -e "$bin/lib/$name" ] || { say "$name: not on this machine and not packed"; return 0; }
      ln -sf "$bin/lib/$name" "$dir/$name"
    done
  done
}

# Keeps every item's whole output beside the report, and prints the report.
finish() {
  # Every trace's GPU time by kernel and launching operator (scripts/trace-by-op.py) into the
  # logs; the predict pass's and the fine-tuning step's, whose traces stay behind, also into
  # the report.
  local trace table
  for trace in "$traces"/*/*.json; do
    [ -e "$trace" ] || continue
    table="$logs/by-op-$(basename "$(dirname "$trace")")-$(basename "$trace" .json).md"
    timeout 60 "${py:-python3}" "$root/scripts/trace-by-op.py" "$trace" 30 >"$table" 2>&1 || true
    case "$trace" in
      "$traces"/predict/* | "$traces"/finetune/*)
        { echo; echo "## GPU time by kernel and launching operator: $(basename "$trace")"; echo; head -n 27 "$table"; } >>"$report" ;;
    esac
  done
  tar -C "$(dirname "$logs")" -czf "$out/logs.tar.gz" logs 2>/dev/null || true
  # The predict pass's and the fine-tuning step's traces run to tens of MB: their tables are in
  # the report, the files stay behind.
  rm -rf "$traces/predict" "$traces/finetune"
  tar -C "$(dirname "$traces")" -czf "$out/traces.tar.gz" traces 2>/dev/null || true
  local passed failed skipped
  passed="$(grep -c '^## .*: passed$' "$report" || true)"
  failed="$(grep -c '^## .*: FAILED' "$report" || true)"
  skipped="$(grep -c '^## .*: not run' "$report" || true)"
  printf '\n%s passed, %s failed, %s not run (of the %ss budget)\n' "$passed" "$failed" "$skipped" "$budget" >>"$report"
  cat "$report"
  [ "$failed" -eq 0 ] || exit 1
}

# Runs item $2 (title $3) with at most $4 seconds, or what is left before the deadline, and
# writes its section (status and the lines of its output that carry results) to parts/$1.
item() {
  local key="$1" name="$2" title="$3" limit="$4"
  shift 4
  local left=$((deadline - SECONDS - 5)) status log="$logs/$name.log"
  # GPU_CHECK_SKIP="c0 c2 ...": items a call before this one has run already.
  case " ${GPU_CHECK_SKIP:-} " in *" $key "*) return 0 ;; esac
  if [ "$left" -lt 20 ]; then
    printf '\n## %s: not run (the budget was spent)\n' "$title" >"$parts/$key"
    return 0
  fi
  [ "$limit" -le "$left" ] || limit="$left"
  set +e
  timeout "$limit" "$@" >"$log" 2>&1
  status=$?
  set -e
  {
    echo
    case "$status" in
      0) echo "## $title: passed" ;;
      124) echo "## $title: FAILED (stopped after ${limit}s)" ;;
      *) echo "## $title: FAILED (exit $status)" ;;
    esac
    echo
    echo '```'
    echo "\$ $*"
    grep -E '^device|^epoch|^test result|^test .* FAILED|panicked|FAILED|skipped|ms|GB/s|TFLOP|ratio|peak|img/s|s/step|^\||NCCL|bytes|^error|Error|kernels|GiB|width|largest|failed' "$log" | tail -n 120 || true
    echo '```'
  } >"$parts/$key"
}

# Appends the finished sections to the report in key order.
collect() {
  local part
  for part in "$parts"/*; do
    [ -e "$part" ] && cat "$part" >>"$report" && rm "$part"
  done
  return 0
}

# Every CUDA test and the kernels' tests, with SUITE_REQUIRE_CUDA=1. Correctness tests run four
# at a time (one GPU, each process its own allocator); the CUDA file, whose prefetch test times
# copy against compute, runs alone afterwards.
tests() {
  local exe name n=0
  for exe in "$bin"/kernels/* "$bin"/tests/*; do
    name="$(basename "$exe")"
    case "$name" in cuda-*) continue ;; esac
    while [ "$(jobs -rp | wc -l)" -ge 4 ]; do wait -n || true; done
    n=$((n + 1))
    case "$exe" in
      */kernels/*) OMP_NUM_THREADS=4 item "a$(printf %02d $n)" "$name" "kernels: $name" 300 "$exe" --test-threads=1 & ;;
      # The profiler's checks print measured against predicted bytes for the report.
      *) OMP_NUM_THREADS=4 item "a$(printf %02d $n)" "$name" "tests: $name" 300 "$exe" --test-threads=1 --nocapture cuda & ;;
    esac
  done
  wait
  for exe in "$bin"/tests/cuda-*; do
    item b "$(basename "$exe")" "tests: $(basename "$exe")" 120 "$exe" --test-threads=1 --nocapture
  done
  collect
}

# The benchmarks, one at a time, most telling first; each prints ours beside its baseline, and
# its section reaches the report as soon as it ends.
bench() {
  # --device auto must pick the GPU and say so first; the NCCL backend must end without
  # PyTorch's warning that it was never shut down (printed at exit before the engine aborted it).
  item c0 vit-pretrain "the README's main job (vit pretrain, --device auto)" 120 bash -c \
    'set -o pipefail; "$1" pretrain --out "$2" --epochs 10 2>&1 | tee "$2.log" && grep -m 1 "^device:" "$2.log" | grep -q -- "-> cuda" &&
     ! grep -q "destroy_process_group" "$2.log"' \
    _ "$bin/vit" "$(dirname "$logs")/vit-digits"
  collect
  item c2 bench-evoformer "Evoformer block 256 x 128 against PyTorch eager, fp32 (TF32 products, both sides)" 150 \
    "$bin/bench-evoformer" --device cuda --residues 256 --sequences 128 --warmup 3 --iters 10 --trace "$traces/evoformer-fp32"
  collect
  # bf16 with the forward's attentions on the tensor-core kernel (c2's fp32 row keeps whole logits).
  item c2b bench-evoformer-bf16 "Evoformer block 256 x 128 against PyTorch eager, bf16, the forward's attention on tensor cores" 150 "$bin/bench-evoformer" \
    --device cuda --residues 256 --sequences 128 --warmup 3 --iters 10 --bf16 --attention flash --trace "$traces/evoformer-bf16"
  collect
  item c4 bench-predict "fastfold predict, model_1_ptm sizes, 3 recycles, an MSA filling the clusters, planned for 70 GiB (issue 41's 304 and 914 residues)" 240 \
    "$bin/bench-predict" --device cuda --residues 304,914 --recycles 3 --msa-rows 5628 --gpu-mem 70G --trace "$traces/predict"
  collect
  # The tensor-core attention (--attention flash: no logits in memory, TF32 products) at c4's
  # lengths and plan, beside c4's whole logits.
  item c4d bench-predict-flash "fastfold predict as c4, the tensor-core attention (--attention flash)" 150 \
    "$bin/bench-predict" --device cuda --residues 304,914 --recycles 3 --msa-rows 5628 --gpu-mem 70G --attention flash
  collect
  item c4e bench-predict-flash-bf16 "fastfold predict as c4d in bf16 (the tensor-core attention's 16-bit products)" 120 \
    "$bin/bench-predict" --device cuda --residues 304,914 --recycles 3 --msa-rows 5628 --gpu-mem 70G --attention flash --bf16
  collect
  # Issue 41's two levers at 914 residues, each alone beside c4's fused fp32 row: libtorch's
  # scaled-dot-product attention with the biases as its additive mask (inference under
  # --kernels torch), and bf16.
  item c4b bench-predict-sdpa "fastfold predict at 914 residues as c4, attention by libtorch's SDPA (--kernels torch)" 90 \
    "$bin/bench-predict" --device cuda --residues 914 --recycles 3 --msa-rows 5628 --gpu-mem 70G --kernels torch
  collect
  item c4c bench-predict-bf16 "fastfold predict at 914 residues as c4, bf16" 90 \
    "$bin/bench-predict" --device cuda --residues 914 --recycles 3 --msa-rows 5628 --gpu-mem 70G --bf16
  collect
  item c7 bench-predict-lean "fastfold predict, 1,200 residues fp32, a 5,628-row MSA, the process capped at 3 GiB (issue 41's target; streams offloaded, per-row features moved as used): card peak beside the plan" 180 \
    "$bin/bench-predict" --device cuda --residues 1200 --msa-rows 5628 --gpu-mem 3G
  collect
  item c3 vit-bench "ViT-B/16 bf16 training at batch 256 (issue 43) against PyTorch eager and torch.compile" 240 "$bin/vit" bench \
    --device cuda --precision bf16 --model vit_base_patch16_224 --batch 256 --seconds 10 --compiled-baseline --trace "$traces/vit"
  collect
  # One 32,768-image step (two: the first warms up) from an HDF5 file of 224 px images, the
  # loader on 14 of the machine's 16 cores; each step's line of the metrics (seconds,
  # images_per_s, peak_bytes) into the report.
  item c3b vit-pretrain-32k "vit pretrain --batch 32k --micro-batch 256, ViT-B/16 bf16 from HDF5 (issue 43): step time and img/s" 180 bash -c \
    'set -e; "$2" "$3/apps/vit/benches/synthetic_h5.py" "$4/images.h5" --images 32768 --size 224
     "$1" pretrain --data "$4/images.h5" --val-fraction 0 --batch 32k --micro-batch 256 --model vit_base_patch16_224 \
       --precision bf16 --steps 2 --workers 14 --quiet --out "$4/run"
     cat "$4/run/metrics.jsonl"; rm -rf "$4"' \
    _ "$bin/vit" "$py" "$root" "$(dirname "$logs")/vit-32k"
  collect
  # Issue 43's loader row: the input pipeline alone on 16 cores beside torchvision's (what one
  # GPU at 4,000 img/s needs; the 32k step above read 14 workers' worth).
  item c8 bench-loader "the input pipeline alone, 16 workers, JPEG and HDF5, against torchvision (issue 43)" 120 \
    env SUITE_PYTHON="$py" "$bin/bench-loader" --workers 16 --images 2048 --seconds 8
  collect
  # Issue 40's GPU row: every one-device layout of ViT-B/16 bf16 that the planner says fits 16
  # GiB (micro-batches and checkpointed blocks its choice), predicted beside measured.
  item c3c bench-auto "vit --parallel auto against every layout, ViT-B/16 bf16 at batch 1024 on one GPU planned for 16 GiB (issue 40)" 180 bash -c \
    'set -e; "$2" "$3/apps/vit/benches/synthetic_h5.py" "$4/images.h5" --images 2048 --size 224
     "$1" --nproc 1 --device cuda --model vit_base_patch16_224 --precision bf16 --batch 1024 --memory-mib 16384 \
       --warmup-steps 2 --measured-steps 5 --data "$4/images.h5" --val-fraction 0 --workers 14
     rm -rf "$4"' \
    _ "$bin/bench-auto" "$py" "$root" "$(dirname "$logs")/vit-auto"
  collect
  item c5 bench-finetune "SD 1.5 UNet fine-tuning at 512 px, fp16, under a 4 GiB cap, uncapped and diffusers" 240 \
    "$bin/bench-finetune" --device cuda --cap 4G --resolution 512 --batch 1 --precision fp16 --gradient-checkpointing \
    --trace "$traces/finetune"
  collect
  # Issue 42 as a user types it: a full-size SD 1.5 folder with random weights (made by diffusers
  # here), default flags and then the README's (--precision bf16), each run's card use from
  # nvidia-smi every 100 ms beside the allocator's peaks in the step log.
  # As typed (fp32: its step ran out of the cap on the H200, 2026-11-30; the error must name the
  # flags that fit), bf16 alone, then the README's flags, whose failure alone fails the item.
  item c5b diffusion-finetune-4g "diffusion finetune --model sd15/ --data imgs/ --gpu-mem 4G as typed (the cap's defaults: fp16, recomputed blocks), then with --precision bf16 and --precision fp32 (issue 42): card and allocator peaks, s/step; fails if any run does" 240 bash -c \
    'set -e; "$2" "$3/apps/diffusion/benches/random_sd15.py" "$4/sd15" "$4/imgs"
     failed=0
     for flags in "" "--precision bf16" "--precision fp32"; do
       nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$4/card.csv" & watch=$!
       trap "kill $watch 2>/dev/null" EXIT
       status=0
       "$1" finetune --model "$4/sd15" --data "$4/imgs" --gpu-mem 4G $flags --steps 6 -o "$4/run" >"$4/run.log" 2>&1 || status=$?
       kill "$watch"; trap - EXIT
       grep -E "cap|final loss|rror" "$4/run.log" || true
       echo "flags [$flags]: exit $status, card memory.used MiB at start $(head -n 1 "$4/card.csv"), peak $(sort -n "$4/card.csv" | tail -n 1)"
       cat "$4/run/log.jsonl" 2>/dev/null || true; rm -rf "$4/run"
       [ "$status" -eq 0 ] || failed=1
     done
     rm -rf "$4"
     [ "$failed" -eq 0 ]' \
    _ "$bin/diffusion" "$py" "$root" "$(dirname "$logs")/diffusion-4g"
  collect
  item c1 bench-kernels "fused kernels against their libtorch compositions, bf16" 90 "$bin/bench-kernels" --iters 20
  collect
  item c1b bench-kernels-f32 "fused kernels against their libtorch compositions, f32 (the tensor-core attention in TF32)" 90 \
    "$bin/bench-kernels" --iters 20 --dtype f32
  collect
  item c6 bench-gemini "Gemini's largest GPT-style model under a 4 GiB cap against plain training" 180 \
    "$bin/bench-gemini" --device cuda --cap 4G --widths 1024,2048,3072,4096
  collect
}

# fastfold beside DeepMind's AlphaFold on the same GPU, each side in its own process, its peak
# the card's use (issues 41 and 39): a stage of its own, since AlphaFold's compilation alone
# takes minutes; run it in a call of its own when the device time allows.
alphafold() {
  # Multimer second: its row is all issue 39 still lacks.
  item d1 versus-alphafold-parity "fastfold predict beside DeepMind's AlphaFold, model_1_ptm sizes, one pass, both sides strict fp32 (parity)" 240 \
    "$bin/bench-versus_alphafold" --device cuda --residues 256 --recycles 0 --fp32-matmul ieee
  collect
  item d2 versus-alphafold-multimer "AlphaFold-Multimer 300 + 300 beside DeepMind's, full size, one pass, fp32" 300 \
    "$bin/bench-versus_alphafold_multimer" --device cuda --residues 300,300 --msa-rows 256 --recycles 0
  collect
  item d1b versus-alphafold "fastfold predict beside DeepMind's AlphaFold, model_1_ptm sizes, 4 passes, fp32 (TF32 products, each side's default), ours with whole logits and with the tensor-core attention" 360 \
    "$bin/bench-versus_alphafold" --device cuda --residues 256,1024 --recycles 3 --attention logits,flash
  collect
}

case "$stage" in
  pack) pack ;;
  tests | bench | alphafold)
    environment
    "$stage"
    ;;
  all)
    environment
    tests
    bench
    ;;
  *)
    sed -n '2,17p' "${BASH_SOURCE[0]}" >&2
    exit 2
    ;;
esac
