#!/usr/bin/env bash
# Type-checks and lints the whole workspace with the `nccl` feature (which implies `cuda`: candle's CUDA
# backend, amp's CUDA code and its NCCL communicator), using the wheel toolchain of
# scripts/cuda-toolchain.sh. Needs no GPU and no system CUDA.
#
# Too slow for CI: the first run compiles candle-kernels' .cu files with nvcc (PTX kernels plus a ~37 MB
# static library of GGUF/MoE kernels), about 20-25 minutes on 2 cores, ~16 of them in that build script.
# check and clippy share its output; a later run with nothing changed takes under a minute. Another cargo
# invocation that unifies build-dependency features differently (e.g. `cargo test -p amp --features cuda`)
# reruns that build script once more. Uses CARGO_TARGET_DIR when set, e.g.
# `CARGO_TARGET_DIR=/work/target-cuda scripts/check-cuda.sh`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo}"

exports="$(scripts/cuda-toolchain.sh full)"
eval "${exports}"

echo "check-cuda: cargo check" >&2
cargo check --locked --workspace --all-targets --features nccl
echo "check-cuda: cargo clippy" >&2
cargo clippy --locked --workspace --all-targets --features nccl -- -D warnings
