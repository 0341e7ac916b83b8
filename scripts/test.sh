#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs every check and test (what CI runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# Space for the build (a full debug build of the workspace takes about 8 GB), for the log.
df -h . | awk 'NR == 2 {print "[test] disk: " $4 " free of " $2}'
# The GPU script runs only on GPU machines: here it must at least parse.
bash -n scripts/gpu-check.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Doc comments render as written: no broken, private or ambiguous links, no stray HTML (a
# tensor shape such as [N] reads as a link unless it is code).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
# Every fused kernel assembles for the H100's sm_90 without spilling (no GPU needed).
bash scripts/kernel-registers.sh 90 >/dev/null
# setup.sh installed Slurm; as root (CI) its test can start a cluster, so it must not skip.
[ "$(id -u)" -ne 0 ] || export SUITE_REQUIRE_SLURM=1
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --locked 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line for the whole run: cargo prints one summary per test binary, and the last
# of them is often a crate's empty doc-test run.
sum() { grep -oE "[0-9]+ $1" "$log" | awk '{s += $1} END {print s + 0}'; }
echo "all test binaries: $(grep '^test result:' "$log" | sum passed) passed, $(grep '^test result:' "$log" | sum failed) failed"
exit "$status"
