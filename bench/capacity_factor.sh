#!/usr/bin/env bash
# Capacity factor × overflow policy on mixtral-bench-1b at 32 concurrent requests: dropped-pair
# rate, TPOT, throughput, and quality against dropless (greedy agreement; mean |Δlogprob| of the
# dropless tokens while the contexts agree — see bench/README.md). Prints a Markdown table.
#   bench/capacity_factor.sh [NUM_REQUESTS=32] [PROMPT_LEN=64] [OUTPUT_LEN=64]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-32}; prompt_len=${2:-64}; output_len=${3:-64}
source bench/common.sh
python3 - "$n" "$prompt_len" "$output_len" > "$work/prompts.jsonl" <<'PY'
import json, random, sys
n, plen, olen = map(int, sys.argv[1:])
rng = random.Random(1)
for _ in range(n):
    print(json.dumps({"prompt_ids": [rng.randrange(3, 49152) for _ in range(plen)],
                      "max_tokens": olen, "ignore_eos": True}))
PY
run() { # $1 = name, rest = extra flags
  local name=$1; shift
  "$bin" generate --model "$model" --prompts-file "$work/prompts.jsonl" --json --logprobs 20 \
    --max-num-seqs "$n" --kv-cache-memory 2GiB "$@" > "$work/$name.jsonl" 2> "$work/$name.log"
  grep -o '[0-9.]* tokens/s' "$work/$name.log" | tail -1 | cut -d' ' -f1 > "$work/$name.tps"
}
run dropless
for alpha in 1.0 1.25 1.5 2.0; do
  for policy in drop reroute spill; do
    run "a$alpha-$policy" --capacity-factor "$alpha" --moe-overflow "$policy"
  done
done
python3 - "$work" <<'PY'
import json, os, statistics, sys
work = sys.argv[1]
def load(name):
    with open(os.path.join(work, name + ".jsonl")) as f:
        outs = [json.loads(l) for l in f]
    with open(os.path.join(work, name + ".tps")) as f:
        tps = float(f.read().strip() or "nan")
    return outs, tps
base, base_tps = load("dropless")
def tpot(outs):
    return statistics.mean(o["timings"]["decode_seconds"] / max(1, len(o["token_ids"]) - 1) for o in outs)
def quality(outs):
    agree, deltas = [], []
    for b, o in zip(base, outs):
        same = 0
        for i, (tb, to) in enumerate(zip(b["token_ids"], o["token_ids"])):
            if tb == to:
                same += 1
                deltas.append(abs(b["logprobs"][i] - o["logprobs"][i]))
                continue
            # First divergence: the dropless token's logprob under this run, if in its top-20.
            alts = dict((t, lp) for t, lp in o["top_logprobs"][i])
            if tb in alts:
                deltas.append(abs(b["logprobs"][i] - alts[tb]))
            break
        agree.append(same / len(b["token_ids"]))
    return statistics.mean(agree), statistics.mean(deltas) if deltas else float("nan")
print("| α | policy | dropped pairs | rerouted pairs | TPOT (ms) | output tokens/s | greedy agreement | mean abs Δlogprob |")
print("|---|---|---|---|---|---|---|---|")
print(f"| dropless | – | 0 % | 0 % | {tpot(base)*1e3:.0f} | {base_tps:.1f} | 100 % | 0 |")
for alpha in ["1.0", "1.25", "1.5", "2.0"]:
    for policy in ["drop", "reroute", "spill"]:
        outs, tps = load(f"a{alpha}-{policy}")
        pairs = sum(o["moe"]["pairs"] for o in outs)
        dropped = sum(o["moe"]["dropped"] for o in outs)
        rerouted = sum(o["moe"]["rerouted"] for o in outs)
        agree, delta = quality(outs)
        print(f"| {alpha} | {policy} | {100*dropped/pairs:.2f} % | {100*rerouted/pairs:.2f} % | {tpot(outs)*1e3:.0f} | {tps:.1f} | {100*agree:.1f} % | {delta:.4f} |")
PY
