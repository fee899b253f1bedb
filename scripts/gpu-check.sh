#!/usr/bin/env bash
# The GPU check, in two halves because the GPU machine has no Rust toolchain and no network:
#
#   scripts/gpu-check.sh build                  # here (no GPU, no CUDA needed): ~1 min
#   scripts/gpu-check.sh run [--budget-s 420]   # on the GPU machine, from the repo root
#
# `build` compiles the check binary (amp-kernels' `gpu_check` example, CUDA libraries loaded at run time)
# in release mode and puts it in .gpu-check/ (git-ignored): carry that folder to the GPU machine, e.g.
# with the device tool: run(command="scripts/gpu-check.sh run --budget-s 420", carry=[".gpu-check"]).
#
# `run` finds libnvrtc (the CUDA toolkit's, or the nvidia-cuda-nvrtc wheel's in any Python on the
# machine), prints the GPU, and runs every kernel against the CPU reference, then the bandwidth
# benchmarks, printing one table as it goes (tee'd to $OUT/gpu-check.md when $OUT is set). The whole
# check takes well under the budget; benchmarks are skipped first when time runs short.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${repo}/.gpu-check"

log() { printf 'gpu-check: %s\n' "$*" >&2; }

build() {
  cd "${repo}"
  cargo build --release --locked -p amp-kernels --features cuda-dynamic-loading --example gpu_check
  mkdir -p "${bundle}"
  cp "${CARGO_TARGET_DIR:-${repo}/target}/release/examples/gpu_check" "${bundle}/gpu_check"
  log "ready: ${bundle}/gpu_check ($(du -h "${bundle}/gpu_check" | cut -f1)); carry .gpu-check to the GPU machine"
}

# Prints the folders holding libnvrtc.so.*: the system toolkit's, then any Python's NVIDIA wheels.
nvrtc_dirs() {
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
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libnvrtc.so*"), recursive=True)):
        print(os.path.dirname(lib))
PY
  done
}

run() {
  [[ -x "${bundle}/gpu_check" ]] || { log "no ${bundle}/gpu_check: run 'scripts/gpu-check.sh build' first and carry .gpu-check"; exit 2; }
  local dirs
  dirs="$(nvrtc_dirs | awk '!seen[$0]++' | paste -sd: -)"
  if [[ -n "${dirs}" ]]; then
    export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    log "libnvrtc from: ${dirs}"
  else
    log "libnvrtc not found on this machine: the binary will say so and skip"
  fi
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
  if [[ -n "${OUT:-}" ]]; then
    "${bundle}/gpu_check" "$@" | tee "${OUT}/gpu-check.md"
  else
    "${bundle}/gpu_check" "$@"
  fi
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) shift; run "$@" ;;
  *) printf 'usage: %s build | run [--budget-s SECONDS]\n' "$0" >&2; exit 2 ;;
esac
