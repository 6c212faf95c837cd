#!/usr/bin/env bash
# Two moeserve binaries alternated on one model and shape, `moeserve bench offline` each round
# (old, new, old, new, …), so both see the same machine state; prints every round and the
# medians of prefill and decode tokens/s and of the per-round new/old decode ratio.
#   bench/ab_offline.sh OLD_BIN NEW_BIN MODEL_DIR BATCH PROMPT_LEN OUTPUT_LEN [ROUNDS=5]
set -euo pipefail
old=$1 new=$2 model=$3 batch=$4 prompt=$5 output=$6 rounds=${7:-5}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for round in $(seq "$rounds"); do
  for which in old new; do
    bin=$old; [ "$which" = new ] && bin=$new
    "$bin" bench offline --model "$model" --batch "$batch" --prompt-len "$prompt" \
      --output-len "$output" --max-num-batched-tokens 4096 --kv-cache-memory 2GiB --no-probe \
      --json 2>/dev/null | python3 -c "import json,sys; r=json.load(sys.stdin); \
print('$which', $round, r['prefill_tokens_per_s'], r['decode_tokens_per_s'])" >> "$out"
  done
done
python3 - "$out" "$model" "$batch" "$prompt" "$output" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {w: [(float(p), float(d)) for n, _, p, d in rows if n == w] for w in ("old", "new")}
ratios = [n[1] / o[1] for o, n in zip(by["old"], by["new"])]
print(f"{sys.argv[2]} batch {sys.argv[3]} prompt {sys.argv[4]} output {sys.argv[5]}, "
      f"{len(ratios)} rounds")
for w in ("old", "new"):
    pre = [p for p, _ in by[w]]
    dec = [d for _, d in by[w]]
    print(f"  {w}: prefill median {statistics.median(pre):.1f} tok/s, decode median "
          f"{statistics.median(dec):.2f} tok/s (rounds: {', '.join(f'{d:.2f}' for d in dec)})")
print(f"  decode new/old per round: {', '.join(f'{r:.3f}' for r in ratios)}; "
      f"median {statistics.median(ratios):.3f}")
PY
