#!/usr/bin/env bash
# Engine-only throughput (issue 6): `moeserve bench offline` on mixtral-bench-1b and
# mixtral-8x7b-2l, bf16 and int8 weights — prefill of one 512-token prompt, decode at batch 1,
# 8 and 32 (prompt 128). Each run also measures the machine's read bandwidth and f32 FMA peak,
# so decode GB/s and prefill GFLOP/s are reported as fractions of ceilings measured in the
# same run. Prints a markdown table; JSON lines go to bench/results/offline.jsonl.
#   bench/offline.sh [OUTPUT_LEN=32] [MODELS="mixtral-bench-1b mixtral-8x7b-2l"]
set -euo pipefail
cd "$(dirname "$0")/.."
output_len=${1:-32}
models=${2:-"mixtral-bench-1b mixtral-8x7b-2l"}
source bench/common.sh
for preset in $models; do
  [ -f "models/$preset/config.json" ] || "$bin" make-model --preset "$preset" --out "models/$preset"
done
mkdir -p bench/results
out=bench/results/offline.jsonl
: > "$out"
for preset in $models; do
  for q in none int8; do
    for shape in "1 512" "1 128" "8 128" "32 128"; do
      set -- $shape
      "$bin" bench offline --model "models/$preset" --quantization "$q" --batch "$1" \
        --prompt-len "$2" --output-len "$output_len" --max-num-batched-tokens 4096 \
        --kv-cache-memory 4GiB --json 2>/dev/null >> "$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| model | weights | batch | prompt | prefill tok/s | prefill GFLOP/s (% of FMA peak) "
      "| decode tok/s | ms/step | GB/step | decode GB/s (% of read BW) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    q = "bf16" if r["quantization"] == "none" else r["quantization"]
    print(f"| {r['model'].split('/')[-1]} | {q} | {r['batch']} | {r['prompt_len']} "
          f"| {r['prefill_tokens_per_s']:.0f} "
          f"| {r['prefill_gflops']:.0f} ({100 * r['prefill_peak_fraction']:.0f} % of {r['fma_peak_gflops']:.0f}) "
          f"| {r['decode_tokens_per_s']:.1f} | {r['decode_step_ms']:.0f} "
          f"| {r['decode_weight_bytes_per_step'] / 1e9:.2f} "
          f"| {r['decode_gbps']:.1f} ({100 * r['decode_bandwidth_fraction']:.0f} % of {r['stream_gbps']:.1f}) |")
PY
