#!/usr/bin/env bash
# Fuzzing in CI (cargo-fuzz, libFuzzer with AddressSanitizer): builds the targets in fuzz/,
# replays each target's checked-in seed corpus fuzz/corpus/<target>/ (every input must pass),
# then fuzzes each target for FUZZ_SECONDS (default 20) from those seeds. Inputs found on the way
# go to target/fuzz-corpus/<target>/, not into the repository; a crash fails the run and leaves
# its input in fuzz/artifacts/<target>/.
#
# cargo-fuzz passes nightly -Z flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them.
# Installs the pinned cargo-fuzz when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_VERSION="0.13.2"
FUZZ_SECONDS="${FUZZ_SECONDS:-20}"
if ! cargo fuzz --version 2> /dev/null | grep -qx "cargo-fuzz $FUZZ_VERSION"; then
    echo "== installing cargo-fuzz $FUZZ_VERSION"
    cargo install cargo-fuzz --locked --version "$FUZZ_VERSION"
fi
export RUSTC_BOOTSTRAP=1
found="$PWD/target/fuzz-corpus"
cd fuzz
cargo fuzz build -O
for target in $(cargo fuzz list); do
    echo "== fuzz $target: replay fuzz/corpus/$target"
    cargo fuzz run -O "$target" "corpus/$target" -- -runs=0
    echo "== fuzz $target: ${FUZZ_SECONDS} s"
    mkdir -p "$found/$target"
    log="$found/$target.log"
    if ! cargo fuzz run -O "$target" "$found/$target" "corpus/$target" -- \
        -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 > "$log" 2>&1; then
        tail -n 80 "$log"
        echo "error: fuzz target $target failed; its input is in fuzz/artifacts/$target/" >&2
        exit 1
    fi
    grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
done
