#!/usr/bin/env bash
# TPOT of unconstrained requests with and without JSON-schema-constrained neighbours, on the
# demo model (issue 25). Usage: bench/structured_outputs.sh  (env N=4 OUTPUT_LEN=64 ROUNDS=3,
# PORT=18125). Prints a table for bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin moeserve
models/smolmoe-8x135m.sh > /dev/null
port=${PORT:-18125}
log=$(mktemp)
target/release/moeserve serve --model models/smolmoe-8x135m --host 127.0.0.1 --port "$port" \
    2> "$log" &
server=$!
trap 'kill $server 2> /dev/null; wait $server 2> /dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do
    grep -q "ready: serving" "$log" && break
    kill -0 $server 2> /dev/null || { cat "$log"; exit 1; }
    sleep 0.1
done
grep -E "kernels:" "$log" | sed 's/^.*INFO [^ ]* //'
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
python3 bench/structured_outputs.py "http://127.0.0.1:$port" smolmoe-8x135m
