#!/usr/bin/env bash
# Expert parallelism on 2 CPU device workers under a skewed load: 16 requests whose prompts
# repeat one of two tokens (so most pairs go to a few experts), mixtral-bench-1b, with
# re-placement allowed every 16 steps. Prints the routing summary: windowed imbalance and
# each rebalance's imbalance before, predicted and realised.
#   bench/rebalance_skew.sh [OUTPUT_LEN=160]
set -euo pipefail
cd "$(dirname "$0")/.."
output_len=${1:-160}
source bench/common.sh
python3 - "$output_len" > "$work/prompts.jsonl" <<'PY'
import json, sys
for i in range(16):
    print(json.dumps({"prompt_ids": [1234 + i % 2] * 32, "max_tokens": int(sys.argv[1]), "ignore_eos": True}))
PY
run() { "$bin" generate --model "$model" --prompts-file "$work/prompts.jsonl" --json --max-num-seqs 16 \
  --expert-parallel-size 2 --num-redundant-experts 2 --load-window 16 "$@" 2>&1 > "$work/out-$#.jsonl" | grep '^moe:'; }
echo "without re-placement: $(run --rebalance-interval 0)"
echo "with re-placement:    $(run --rebalance-interval 16 --rebalance-threshold 1.05)"
python3 - "$work/out-2.jsonl" "$work/out-4.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["token_ids"] for l in open(f)] for f in sys.argv[1:])
print("identical tokens:", "yes" if a == b else "NO")
PY
