#!/usr/bin/env bash
# One idempotent setup for a fresh Debian machine: a check of the Rust toolchain, system packages, the project's Python
# environment with the pinned torch wheel (libtorch for tch and the C++ bridge), and the cargo
# configuration that points the build at it. Safe to run again: each step checks first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv="${SUITE_VENV:-$root/.venv}"
say() { printf '[setup] %s\n' "$*" >&2; }

# 0. The Rust toolchain (this script does not install it): cargo and rustc, at least the
#    workspace's rust-version.
need="$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
if ! command -v cargo >/dev/null 2>&1 || ! command -v rustc >/dev/null 2>&1; then
  say "no Rust toolchain (cargo, rustc) on PATH; install Rust $need or newer with rustup:"
  say "  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\""
  exit 1
fi
have="$(rustc --version | awk '{print $2}')"
if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n 1)" != "$need" ]; then
  say "rustc $have is older than $need, the workspace's rust-version; update it: rustup update stable"
  exit 1
fi

# 1. Debian packages: Gloo headers for the c10d bridge (the Gloo code itself is inside
#    libtorch), HDF5 for the data crate, a C++ compiler for the bridge, and OpenMPI's mpirun
#    and Slurm (slurm-wlm, with munge for its authentication), launchers the tests start jobs
#    with (the Slurm test runs a one-node cluster of its own); the homology-search tools
#    AlphaFold and ColabFold run (`fastfold predict --data-dir`; its tests fail without them).
debs=(libgloo-dev libhdf5-dev pkg-config g++ python3-venv openmpi-bin slurm-wlm munge hmmer hhsuite kalign mmseqs2)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Python environment with pinned wheels (scripts/requirements.txt).
stamp="$venv/.requirements.sha256"
want="$(sha256sum scripts/requirements.txt | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "creating Python environment in $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r scripts/requirements.txt
  echo "$want" >"$stamp"
fi

# 3. Cargo configuration: tch's torch-sys and the engine's bridge find libtorch (the wheel's
#    torch package) through LIBTORCH; every crate's build.rs gives its binaries an rpath (libtorch-build/).
torch_dir="$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
mkdir -p .cargo
cat >.cargo/config.toml <<CFG
# Written by scripts/setup.sh; do not edit by hand.
[env]
LIBTORCH = "$torch_dir"
LIBTORCH_CXX11_ABI = "1"
SUITE_PYTHON = "$venv/bin/python"
CFG
say "ready: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
