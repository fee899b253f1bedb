#!/usr/bin/env bash
# The GPU check, in two halves because the GPU machine has no Rust toolchain and no network:
#
#   scripts/gpu-check.sh build [--kernels-only]   # here (no GPU, no system CUDA)
#   scripts/gpu-check.sh run [--budget-s 420]     # on the GPU machine, from the repo root
#
# `build` puts into .gpu-check/ (git-ignored; carry it to the GPU machine, e.g. with the device tool:
# run(command="scripts/gpu-check.sh run --budget-s 420", carry=[".gpu-check"])):
#   - gpu_check: amp-kernels' kernel check (every kernel against the CPU reference, fused AdamW and
#     unscale bandwidth against device copy). CUDA is loaded at run time: builds in about a minute.
#   - cuda_training and gpu_bench, unless --kernels-only: the `cuda` build of amp (candle's CUDA backend,
#     linked against the CUDA libraries; built with scripts/cuda-toolchain.sh full, 20+ minutes the
#     first time on 2 cores): the training tests on the device, GEMM per precision, and a BERT-base-like
#     step under O2 fp16 against fp32 and TF32. Stripped and xz-compressed to fit the carry limit.
#   - nccl, unless --kernels-only: the `nccl` build's NCCL tests (tests/nccl.rs: every collective on a
#     world of one GPU, device tensors, the data-parallel step). It links libnccl.so.2, which is not
#     carried (250 MB): it runs where the GPU machine has it (the CUDA toolkit's, or the wheel
#     `nvidia-nccl-cu13` in any Python, as PyTorch installs it) and is skipped with a note elsewhere.
#
# `run` finds the CUDA libraries (the toolkit's, or NVIDIA's wheels in any Python on the machine), prints
# the GPU, then runs the four in that order, printing one table as it goes (tee'd to $OUT/gpu-check.md
# when $OUT is set). The budget is shared: the kernel check takes well under a minute; the long
# benchmark items are skipped first when time runs short.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${repo}/.gpu-check"
target="${CARGO_TARGET_DIR:-${repo}/target}"

log() { printf 'gpu-check: %s\n' "$*" >&2; }

build() {
  cd "${repo}"
  mkdir -p "${bundle}"
  cargo build --release --locked -p amp-kernels --features cuda-dynamic-loading --example gpu_check
  strip -o "${bundle}/gpu_check" "${target}/release/examples/gpu_check"
  if [[ "${1:-}" != "--kernels-only" ]]; then
    (
      eval "$(scripts/cuda-toolchain.sh full)"
      cargo build --release --locked -p amp --features cuda --example gpu_bench
      cargo test --release --locked -p amp --features cuda --test cuda_training --no-run
      cargo test --release --locked -p amp --features nccl --test nccl --no-run
    )
    local name test_binary
    for name in cuda_training nccl; do
      test_binary="$(find "${target}/release/deps" -maxdepth 1 -type f -executable -name "${name}-*" -printf '%T@ %p\n' |
        sort -n | tail -n 1 | cut -d' ' -f2)"
      [[ -n "${test_binary}" ]] || { log "no ${name} test binary under ${target}/release/deps"; exit 1; }
      strip -o "${bundle}/${name}" "${test_binary}"
    done
    strip -o "${bundle}/gpu_bench" "${target}/release/examples/gpu_bench"
    xz -f -T0 -6 "${bundle}/cuda_training" "${bundle}/nccl" "${bundle}/gpu_bench"
  fi
  log "ready: $(du -ch "${bundle}"/* | tail -n 1 | cut -f1) in ${bundle}; carry .gpu-check to the GPU machine"
}

# Prints the folders holding CUDA libraries (libnvrtc, libcublas, ...): the system toolkit's, then any
# Python's NVIDIA wheels.
cuda_lib_dirs() {
  local dir py
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    compgen -G "${dir}/libnvrtc.so*" >/dev/null && printf '%s\n' "${dir}"
  done
  for py in python3 /usr/bin/python3 /usr/local/bin/python3; do
    command -v "${py}" >/dev/null 2>&1 || continue
    "${py}" - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
for root in sorted(r for r in roots if os.path.isdir(os.path.join(r, "nvidia"))):
    for pattern in ("libnvrtc.so*", "libcublas.so*", "libcurand.so*", "libcudart.so*", "libnccl.so*"):
        for lib in sorted(glob.glob(os.path.join(root, "nvidia", "**", pattern), recursive=True)):
            print(os.path.dirname(lib))
PY
  done
}

run() {
  [[ -x "${bundle}/gpu_check" ]] || { log "no ${bundle}/gpu_check: run 'scripts/gpu-check.sh build' first and carry .gpu-check"; exit 2; }
  local budget=420 start dirs status=0 report
  if [[ "${1:-}" == "--budget-s" && -n "${2:-}" ]]; then budget="$2"; fi
  start="${SECONDS}"
  dirs="$(cuda_lib_dirs | awk '!seen[$0]++' | paste -sd: -)"
  if [[ -n "${dirs}" ]]; then
    export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    log "CUDA libraries from: ${dirs}"
  else
    log "no CUDA libraries found on this machine: the checks will say so and skip"
  fi
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
  report=/dev/null
  [[ -n "${OUT:-}" ]] && report="${OUT}/gpu-check.md"
  set +e
  (
    "${bundle}/gpu_check" --budget-s "${budget}" || status=1
    # The `cuda` build of amp, decompressed outside the bundle (which must stay small enough to carry). It
    # links the driver library: without it the binaries cannot even start, so they are skipped.
    local work name missing
    work="$(mktemp -d)"
    for name in cuda_training nccl gpu_bench; do
      [[ -f "${bundle}/${name}.xz" ]] || continue
      xz -dc "${bundle}/${name}.xz" >"${work}/${name}" && chmod +x "${work}/${name}"
      missing="$(ldd "${work}/${name}" 2>/dev/null | awk '/not found/ {print $1}' | paste -sd' ' -)"
      if [[ -n "${missing}" ]]; then
        echo
        echo "skipped ${name}: ${missing} not found on this machine (no CUDA driver / libraries)"
        rm -f "${work}/${name}"
      fi
    done
    if [[ -x "${work}/cuda_training" ]]; then
      echo
      echo "## training tests on the device (tests/cuda_training.rs)"
      "${work}/cuda_training" --test-threads 1 || status=1
    fi
    if [[ -x "${work}/nccl" ]]; then
      echo
      echo "## NCCL on one GPU (tests/nccl.rs)"
      "${work}/nccl" --test-threads 1 || status=1
    fi
    if [[ -x "${work}/gpu_bench" ]]; then
      local left=$((budget - (SECONDS - start)))
      echo
      "${work}/gpu_bench" --budget-s "$((left > 0 ? left : 0))" || status=1
    fi
    rm -rf "${work}"
    exit "${status}"
  ) 2>&1 | tee "${report}"
  local rc=$?
  set -e
  return "${rc}"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) shift; run "$@" ;;
  *) printf 'usage: %s build [--kernels-only] | run [--budget-s SECONDS]\n' "$0" >&2; exit 2 ;;
esac
