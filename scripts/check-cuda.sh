#!/usr/bin/env bash
# Type-checks and lints the whole workspace with the `cuda` feature (candle's CUDA backend + amp's CUDA
# code), using the wheel toolchain of scripts/cuda-toolchain.sh. Needs no GPU and no system CUDA.
#
# Too slow for CI: the first run compiles candle-kernels' .cu files with nvcc, about 10-15 minutes on 2
# cores (cargo check and clippy share that build-script output; later runs take about a minute). Uses
# CARGO_TARGET_DIR when set, e.g. `CARGO_TARGET_DIR=/work/target-cuda scripts/check-cuda.sh`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo}"

exports="$(scripts/cuda-toolchain.sh full)"
eval "${exports}"

echo "check-cuda: cargo check" >&2
cargo check --locked --workspace --all-targets --features cuda
echo "check-cuda: cargo clippy" >&2
cargo clippy --locked --workspace --all-targets --features cuda -- -D warnings
