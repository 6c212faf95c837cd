#!/usr/bin/env bash
# Serving sweep (issue 9): `moeserve serve` on mixtral-bench-1b, `moeserve bench serve` over the
# concurrency levels, then `moeserve plan` for a 100 ms TPOT target. Writes
# bench/results/serve_sweep_bench1b.json and .svg (the latency-versus-throughput plot).
#   bench/serve_sweep.sh [PROMPT_LEN=128] [OUTPUT_LEN=32] [NUM_PROMPTS=2x] [LEVELS=1,2,4,8,16,32,64]
# NUM_PROMPTS is per level: a count, or Nx = N × the level's concurrency. --stream-logprobs:
# the random model's tokens mostly decode to no text, so tokens are seen by their logprobs.
# Environment: PORT (default 18123), ARRIVAL_RATE for the plan (default 1 request/s).
set -euo pipefail
cd "$(dirname "$0")/.."
prompt_len=${1:-128}; output_len=${2:-32}; num_prompts=${3:-2x}; levels=${4:-1,2,4,8,16,32,64}
port=${PORT:-18123}; rate=${ARRIVAL_RATE:-1}
kv_cache=4GiB
source bench/common.sh
"$bin" serve --model "$model" --host 127.0.0.1 --port "$port" --max-num-seqs 64 \
  --kv-cache-memory "$kv_cache" > "$work/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2> /dev/null || true; wait "$server" 2> /dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$server" 2> /dev/null || { cat "$work/serve.log" >&2; exit 1; }
  sleep 0.5
done
mkdir -p bench/results
out=bench/results/serve_sweep_bench1b
"$bin" bench serve --url "http://127.0.0.1:$port" --model "$(basename "$model")" \
  --concurrency "$levels" --num-prompts "$num_prompts" --prompt-len "$prompt_len" \
  --output-len "$output_len" --stream-logprobs --out "$out.json" --plot "$out.svg"
echo
"$bin" plan --from "$out.json" --target-tpot 100ms --arrival-rate "$rate" --model "$model" \
  --kv-cache-memory "$kv_cache"
