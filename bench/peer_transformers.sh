#!/usr/bin/env bash
# moeserve against transformers (PyTorch CPU, bf16 weights: the seed's baseline) on the same
# machine, same checkpoint, same run: batch-1 prefill and decode, and B concurrent requests
# (output tokens/s over the whole run, prefill included) for each B in BATCHES, on
# mixtral-bench-1b; the two engines alternated ROUNDS times, medians. A greedy continuation
# from both checks that they run the same model.
#   bench/peer_transformers.sh [PROMPT_LEN] [OUTPUT_LEN] [ROUNDS] [BATCHES]
# Environment: PEER_PYTHON — a python with torch and transformers (default: a venv made under
# target/peer-venv-hf with the versions of tests/reference/requirements.txt; torch's PyPI wheel
# is large, ~1 GB with its CUDA libraries); THREADS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
prompt_len=${1:-128}; output_len=${2:-64}; rounds=${3:-3}; batches=${4:-8,32}
threads=${THREADS:-$(nproc)}
export TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
source bench/common.sh
py=${PEER_PYTHON:-target/peer-venv-hf/bin/python}
if ! "$py" -c "import torch, transformers" 2> /dev/null; then
    python3 -m venv target/peer-venv-hf
    target/peer-venv-hf/bin/pip install --quiet "torch==2.15.0" "transformers==5.24.0"
    py=target/peer-venv-hf/bin/python
fi
largest=$(tr ',' '\n' <<< "$batches" | sort -n | tail -1)
python3 - "$prompt_len" "$largest" > "$work/prompts.json" <<'PY'
import json, random, sys
rng = random.Random(0)
plen, n = int(sys.argv[1]), max(1, int(sys.argv[2]))
print(json.dumps([[rng.randrange(5, 49152) for _ in range(plen)] for _ in range(n)]))
PY
# moeserve's requests: the same prompts, exactly OUTPUT_LEN tokens each.
jsonl() { # $1 = number of requests
    python3 - "$work/prompts.json" "$1" "$output_len" <<'PY'
import json, sys
prompts, n, olen = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
for p in prompts[:n]:
    print(json.dumps({"prompt_ids": p, "max_tokens": olen, "ignore_eos": True}))
PY
}
for r in $(seq "$rounds"); do
    "$py" bench/peers/transformers_bench.py "$model" "$work/prompts.json" "$output_len" \
        "$threads" 1 "$batches" > "$work/hf-$r.json"
    "$bin" bench offline --model "$model" --batch 1 --prompt-len "$prompt_len" \
        --output-len "$output_len" --threads "$threads" --json --no-probe \
        > "$work/moeserve-$r.json" 2> /dev/null
    for b in ${batches//,/ }; do
        jsonl "$b" > "$work/b$b.jsonl"
        "$bin" generate --model "$model" --prompts-file "$work/b$b.jsonl" --json \
            --threads "$threads" --max-num-seqs "$b" > "$work/out-b$b-$r.jsonl" 2> "$work/log-b$b-$r.txt"
        grep -o '[0-9.]* tokens/s' "$work/log-b$b-$r.txt" | tail -1 | cut -d' ' -f1 > "$work/moeserve-b$b-$r.txt"
    done
done
jsonl 1 | python3 -c "import json,sys; r=json.loads(sys.stdin.readline()); r['max_tokens']=16; print(json.dumps(r))" \
    > "$work/greedy-in.jsonl"
"$bin" generate --model "$model" --prompts-file "$work/greedy-in.jsonl" --json --threads "$threads" \
    > "$work/greedy.jsonl" 2> /dev/null
python3 - "$work" "$rounds" "$prompt_len" "$output_len" "$threads" "$batches" <<'PY'
import json, statistics, sys
work, rounds, plen, olen, threads, batches = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
rs = range(1, rounds + 1)
hf = [json.load(open(f"{work}/hf-{r}.json")) for r in rs]
ours = [json.load(open(f"{work}/moeserve-{r}.json")) for r in rs]
med = lambda xs: statistics.median(xs)
print(f"mixtral-bench-1b bf16, prompt {plen}, output {olen}, {threads} threads, "
      f"medians of {rounds} alternating rounds")
print(f"{'':22} {'transformers':>13} {'moeserve':>10} {'ratio':>7}")
def row(name, a, b):
    print(f"{name:22} {a:13.1f} {b:10.1f} {b / a:6.2f}x")
for key, name in [("prefill_tokens_per_s", "batch-1 prefill tok/s"),
                  ("decode_tokens_per_s", "batch-1 decode tok/s")]:
    row(name, med(h[key] for h in hf), med(o[key] for o in ours))
for b in batches.split(","):
    ours_b = [float(open(f"{work}/moeserve-b{b}-{r}.txt").read()) for r in rs]
    row(f"{b} requests, out tok/s", med(h["batched_output_tokens_per_s"][b] for h in hf), med(ours_b))
ours_ids = json.loads(open(f"{work}/greedy.jsonl").readline())["token_ids"]
same = next((i for i, (a, c) in enumerate(zip(ours_ids, hf[0]["token_ids"])) if a != c), 16)
print(f"greedy continuation: the first {same} of 16 tokens agree")
PY
