#!/usr/bin/env bash
# Fuzzes checkpoint loading and policy parsing with libFuzzer (cargo-fuzz, nightly) for a fixed budget,
# then keeps what it found as regression cases that a plain `cargo test` replays:
#   - inputs that reached new code are merged into tests/corpus/checkpoint/ and tests/corpus/policy/;
#   - inputs that crashed (panic, abort, an allocation over -malloc_limit_mb, a broken promise of
#     tests/corpus/checkpoint_case.rs) are copied there too, so the fix stays tested.
# Not part of CI (its time budget); run it before a release or after touching a loader:
#   scripts/fuzz.sh [seconds for the checkpoint target, default 600]
# The policy target gets a quarter of that. Prints executions, time and corpus sizes at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

budget="${1:-600}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-fuzz}"
status=0

# fuzz TARGET REGRESSION_DIR SECONDS EXTRA_LIBFUZZER_FLAGS...
fuzz() {
    local target="$1" keep="$2" seconds="$3"
    shift 3
    local work="fuzz/corpus/$target" log="fuzz/$target.log"
    mkdir -p "$work" "$keep" "fuzz/artifacts/$target"
    echo "==> $target: ${seconds}s (log: $log)"
    # -a: debug assertions and overflow checks on, as in the tests.
    if ! cargo +nightly fuzz run -a "$target" "$work" "$keep" -- \
        -max_total_time="$seconds" -print_final_stats=1 "$@" >"$log" 2>&1; then
        echo "!! $target found a failing input (see $log); it is copied into $keep"
        status=1
    fi
    cp -n fuzz/artifacts/"$target"/* "$keep"/ 2>/dev/null || true
    local before
    before=$(find "$keep" -type f | wc -l)
    cargo +nightly fuzz run -a "$target" "$keep" "$work" -- -merge=1 >>"$log" 2>&1
    local runs time
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | head -1)
    time=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | head -1)
    echo "$target: ${runs:-?} executions in ${time:-$seconds} s; regression corpus $keep: $before -> $(find "$keep" -type f | wc -l) cases"
}

fuzz checkpoint_load tests/corpus/checkpoint "$budget" -max_len=8192 -malloc_limit_mb=64 -rss_limit_mb=2048
fuzz policy_parse tests/corpus/policy "$((budget / 4))" -max_len=256 -malloc_limit_mb=64
exit "$status"
