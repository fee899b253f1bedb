#!/usr/bin/env bash
# The GEMM bench with PyTorch's CPU matmul (bf16 and f32) as two more columns, timed in the same rounds.
#
# Installs PyTorch from PyPI into ./.venv-torch the first time (about 5 GB with the CUDA libraries its
# wheel depends on; it runs on the CPU here), unless AMP_BENCH_TORCH already names a Python that has it.
# Never part of CI or the tests. Arguments go to the bench (e.g. --quick). On a CPU where PyTorch has no
# fast bf16 kernel (AVX2 only: 0.3-24 GFLOP/s) the bench skips its bf16 column on the shapes it would
# take more than 2 s a product on, and says so.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo}"

if [[ -z "${AMP_BENCH_TORCH:-}" ]]; then
    venv="${repo}/.venv-torch"
    if ! "${venv}/bin/python" -c "import torch" 2>/dev/null; then
        echo "torch-bench: installing PyTorch into ${venv} (once; about 5 GB)" >&2
        python3 -m venv "${venv}"
        "${venv}/bin/pip" install --quiet torch
    fi
    export AMP_BENCH_TORCH="${venv}/bin/python"
fi

cargo bench -p amp-kernels --bench gemm -- "$@"
