#!/usr/bin/env bash
# Capacity-factor tuner (issue 9) on the demo model (smolmoe-8x135m): runs 16 English prompts
# greedily dropless, recording the routing trace, then per α × policy (drop rate, step time,
# TPOT, quality against dropless), then replays the recorded trace alone. Prints both tables;
# keeps the trace and the JSON reports in bench/results/.
#   bench/tune_capacity_factor.sh [MAX_TOKENS=32] [ALPHAS=1.0,1.25,1.5,2.0]
set -euo pipefail
cd "$(dirname "$0")/.."
max_tokens=${1:-32}; alphas=${2:-1.0,1.25,1.5,2.0}
cargo build --release --quiet --bin moeserve
bin=target/release/moeserve
models/smolmoe-8x135m.sh
model=models/smolmoe-8x135m
mkdir -p bench/results
prompts=bench/results/tune_prompts.jsonl
python3 - > "$prompts" <<'PY'
import json
topics = ["the water cycle", "how a compiler works", "the history of the printing press",
          "why the sky is blue", "how vaccines train the immune system", "the rules of chess",
          "what a mixture-of-experts model is", "how to bake bread", "the causes of the seasons",
          "how a bicycle stays upright", "what TCP does", "the life of a star",
          "how bees make honey", "why we sleep", "how a refrigerator works", "the French Revolution"]
for t in topics:
    print(json.dumps({"prompt": f"Explain {t} in a few sentences.\n\nAnswer:"}))
PY
trace=bench/results/tune_trace_smolmoe.jsonl
echo "== prompts run through the engine (dropless routing recorded to $trace)"
"$bin" tune capacity-factor --model "$model" --prompts "$prompts" --alphas "$alphas" \
  --policies drop,reroute --max-tokens "$max_tokens" --record-routing "$trace" \
  --json bench/results/tune_prompts_smolmoe.json
echo
echo "== the recorded trace replayed"
"$bin" tune capacity-factor --model "$model" --trace "$trace" --alphas "$alphas" \
  --policies drop,spill --json bench/results/tune_trace_smolmoe.json
