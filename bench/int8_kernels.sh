#!/usr/bin/env bash
# The integer weight kernels against bf16 on one model, in one run: `moeserve bench offline`
# at batch BATCH for each configuration below, alternated ROUNDS times so all see the same
# machine state; medians of decode and prefill tokens/s and of decode's share of the read
# bandwidth that each run probes itself. WEIGHTS=int8 (default): `--quantization int8` of the
# preset; WEIGHTS=int4: its GPTQ int4 copy models/PRESET-gptq-int4 (`moeserve quantize --bits 4
# --group-size 128`, ~15–25 min on 2 cores; made here if missing). Configurations: bf16; the
# integer weights with the CPU's widest dot product (AVX-512 VNNI on AVX-512 machines); forced
# onto AVX-VNNI and onto AVX2's vpmaddwd (`MOESERVE_INT8_DOT`, where the CPU has them); and bf16
# and the integer weights with the AVX2 kernels (`MOESERVE_ISA=avx2`, what a Zen 2/3 or
# pre-AVX-512 Intel runs) when the machine has AVX-512.
#   [WEIGHTS=int8|int4] bench/int8_kernels.sh [BATCH=1] [ROUNDS=3] [PROMPT_LEN=128] [OUTPUT_LEN=64]
# Environment: PRESET (default mixtral-bench-1b).
set -euo pipefail
cd "$(dirname "$0")/.."
batch=${1:-1}; rounds=${2:-3}; prompt_len=${3:-128}; output_len=${4:-64}
source bench/common.sh
has() { grep -qw "$1" /proc/cpuinfo; }
weights=${WEIGHTS:-int8}
case $weights in
    int8) q="int8|$model" ;;
    int4)
        [ -f "$model-gptq-int4/config.json" ] || "$bin" quantize --model "$model" \
            --out "$model-gptq-int4" --bits 4 --group-size 128
        q="none|$model-gptq-int4" ;;
    *) echo "WEIGHTS must be int8 or int4" >&2; exit 2 ;;
esac
# label | environment | quantization | model
configs=("bf16||none|$model" "$weights||$q")
if has avx512f; then
    has avx512_vnni && configs[1]="$weights avx512-vnni||$q"
    has avx_vnni && configs+=("$weights avx-vnni|MOESERVE_INT8_DOT=avx-vnni|$q")
    configs+=("$weights avx2-madd|MOESERVE_INT8_DOT=avx2-madd|$q")
    configs+=("bf16, AVX2 kernels|MOESERVE_ISA=avx2|none|$model")
    configs+=("$weights, AVX2 kernels|MOESERVE_ISA=avx2|$q")
elif has avx_vnni; then
    configs[1]="$weights avx-vnni||$q"
    configs+=("$weights avx2-madd|MOESERVE_INT8_DOT=avx2-madd|$q")
fi
out="$work/rounds.jsonl"
for round in $(seq "$rounds"); do
    for c in "${configs[@]}"; do
        IFS='|' read -r label envs quant dir <<< "$c"
        env $envs "$bin" bench offline --model "$dir" --quantization "$quant" \
            --batch "$batch" --prompt-len "$prompt_len" --output-len "$output_len" \
            --max-num-batched-tokens 4096 --kv-cache-memory 2GiB --json 2> /dev/null \
            | python3 -c "import json, sys; r = json.load(sys.stdin); r['label'] = sys.argv[1]; \
print(json.dumps(r))" "$label" >> "$out"
    done
done
python3 - "$out" "$preset" "$batch" "$prompt_len" "$output_len" "$rounds" <<'PY'
import json, statistics, sys
path, preset, batch, prompt, output, rounds = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"{preset}, batch {batch}, prompt {prompt}, output {output}, {rounds} rounds alternated; CPU: {cpu}")
print("| weights, kernels | decode tok/s | decode, of bandwidth | prefill tok/s | kernels |")
print("|---|---|---|---|---|")
labels = list(dict.fromkeys(r["label"] for r in rows))
base = None
for label in labels:
    rs = [r for r in rows if r["label"] == label]
    dec = [r["decode_tokens_per_s"] for r in rs]
    pre = [r["prefill_tokens_per_s"] for r in rs]
    frac = [r["decode_bandwidth_fraction"] for r in rs if r.get("decode_bandwidth_fraction")]
    med = statistics.median(dec)
    base = base or med
    fr = f"{100 * statistics.median(frac):.0f} %" if frac and int(batch) == 1 else "—"
    print(f"| {label} | **{med:.1f}** ({', '.join(f'{d:.1f}' for d in dec)}) = {med / base:.2f}× bf16 "
          f"| {fr} | {statistics.median(pre):.0f} | {rs[0]['kernels']} |")
PY
