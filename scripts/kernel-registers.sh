#!/usr/bin/env bash
# Registers, spills and shared memory of every fused kernel for one GPU architecture, as ptxas
# reports them (ptxas -v), without a GPU: NVRTC compiles the sources to PTX (kernels/examples/
# ptx.rs) and the ptxas that comes with the virtual environment's Triton assembles them.
#
#   bash scripts/kernel-registers.sh [arch, default 90]
#
# Triton's ptxas (CUDA 12.8) reads PTX up to ISA 8.7; NVRTC 13 writes 9.0 though the kernels use
# nothing newer, so the version line is lowered for it. A kernel that spills registers or keeps
# a stack frame fails the script (CI runs it), and one whose static shared memory passes 48 KiB
# fails ptxas itself: both show here before any GPU runs the kernel.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
arch="${1:-90}"
ptxas="$(ls "$root"/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin/ptxas 2>/dev/null | head -n 1)"
[ -x "$ptxas" ] || { echo "no ptxas under .venv (Triton's): run scripts/setup.sh" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cargo run --locked -q -p kernels --example ptx -- "$out" "$arch"
for ptx in "$out"/*.ptx; do
  sed -i 's/^\.version 9\.[0-9]*/.version 8.7/' "$ptx"
  echo "== $(basename "$ptx" .ptx)"
  "$ptxas" -arch="sm_$arch" -v "$ptx" -o "$out/x.cubin" 2>"$out/report" || { cat "$out/report" >&2; exit 1; }
  sed -n "s/.*Compiling entry function '\([^']*\)'.*/\1/p; s/^ *\([0-9]* bytes stack frame.*\)/  \1/p; s/.*: *\(Used .*\)/  \1/p" \
    "$out/report" | tee -a "$out/all"
done
if grep -E '[1-9][0-9]* bytes (stack frame|spill)' "$out/all" >/dev/null; then
  echo "kernel-registers: a kernel spills or keeps a stack frame (above)" >&2
  exit 1
fi
echo "kernel-registers: $(grep -c 'Used' "$out/all") kernels for sm_$arch, none spills"
