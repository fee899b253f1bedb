#!/usr/bin/env bash
# The GEMM bench with one more column: candle's f32 matmul built with its `gemm` dependency's `x86-v4`
# feature (AVX-512 f32 kernels; candle's default build leaves them out), timed in the same rounds from a
# child process (bench-peers/candle-x86-v4/: a workspace of its own, so that the feature does not reach
# the project's candle). On a CPU without AVX-512F that build runs the same AVX2 kernels as the default,
# and its first line says so. Builds the peer the first time (about 5 minutes on 2 cores). Never part of
# CI or the tests. Arguments go to the bench (e.g. --quick); with AMP_BENCH_TORCH set (see
# scripts/torch-bench.sh) PyTorch's columns join too.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo}"

peer="${repo}/bench-peers/candle-x86-v4"
cargo build --release --locked --manifest-path "${peer}/Cargo.toml"
export AMP_BENCH_CANDLE_X86_V4="${peer}/target/release/candle-x86-v4-peer"

cargo bench -p amp-kernels --bench gemm -- "$@"
