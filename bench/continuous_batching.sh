#!/usr/bin/env bash
# Continuous batching vs one request at a time, same engine, same requests:
# 32 requests (prompt 256 random token ids, 128 output tokens, ignore_eos, greedy) on
# mixtral-bench-1b. Prints output tokens/s of both runs, their ratio, and checks that both runs
# produced identical tokens.
#   bench/continuous_batching.sh [NUM_REQUESTS] [PROMPT_LEN] [OUTPUT_LEN]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-32}; prompt_len=${2:-256}; output_len=${3:-128}
source bench/common.sh
python3 - "$n" "$prompt_len" "$output_len" > "$work/prompts.jsonl" <<'PY'
import json, random, sys
n, plen, olen = map(int, sys.argv[1:])
rng = random.Random(0)
for _ in range(n):
    print(json.dumps({"prompt_ids": [rng.randrange(3, 49152) for _ in range(plen)],
                      "max_tokens": olen, "ignore_eos": True}))
PY
run() { # $1 = max-num-seqs
  "$bin" generate --model "$model" --prompts-file "$work/prompts.jsonl" --json \
    --max-num-seqs "$1" --max-num-batched-tokens 2048 --kv-cache-memory 4GiB \
    > "$work/out-$1.jsonl" 2> "$work/log-$1.txt"
  grep -o '[0-9.]* tokens/s' "$work/log-$1.txt" | tail -1 | cut -d' ' -f1
}
alone=$(run 1)
together=$(run "$n")
same=$(python3 - "$work/out-1.jsonl" "$work/out-$n.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["token_ids"] for l in open(f)] for f in sys.argv[1:])
print("yes" if a == b else "NO")
PY
)
python3 - "$alone" "$together" "$same" "$n" <<'PY'
import sys
alone, together, same, n = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f"one at a time (--max-num-seqs 1): {alone:.1f} output tokens/s")
print(f"together (--max-num-seqs {n}):     {together:.1f} output tokens/s")
print(f"speed-up: {together / alone:.2f}x; identical tokens: {same}")
PY
