#!/usr/bin/env bash
# moeserve against llama.cpp on the same machine, same weights, same run: batch-1 prefill and
# decode of a preset (PRESET, default mixtral-bench-1b), the two engines alternated ROUNDS times,
# medians. llama.cpp runs through llama-cpp-python on a GGUF of the same checkpoint; a greedy
# continuation from both checks that they run the same model. Mixtral: the GGUF is written by
# bench/peers/export_gguf.py (bf16, or Q8_0 with QUANT=int8). GPT-OSS presets (gpt-oss-20b-2l,
# MXFP4 experts as released): by llama.cpp's own convert_hf_to_gguf.py
# (bench/peers/convert_gpt_oss.py; experts stay MXFP4, the rest bf16), from the llama.cpp that
# llama-cpp-python 0.3.36 vendors (LLAMA_CPP_SRC, default: its sdist unpacked under
# target/peers) and a python with torch and transformers (CONVERT_PYTHON, default
# .venv-ref/bin/python, tests/reference's venv).
#   bench/peer_llamacpp.sh [PROMPT_LEN] [OUTPUT_LEN] [ROUNDS]
# Environment: PEER_PYTHON — a python with llama_cpp, gguf and numpy (default: a venv made under
# target/peer-venv with llama-cpp-python==0.3.36, which compiles llama.cpp: needs cmake and a
# C++ compiler, about 10 minutes on 2 cores; without AMX where the CPU has it, see below); THREADS (default: all cores); QUANT=int8 compares
# moeserve's `--quantization int8` with llama.cpp's Q8_0 instead of bf16 with bf16; QUANT=q4
# compares a GPTQ int4 checkpoint that `moeserve quantize --bits 4 --group-size 128` makes of
# the preset (kept as models/PRESET-gptq-int4) with llama.cpp's Q4_K_M of the same bf16 weights
# (bench/peers/quantize_gguf.py: llama.cpp's own quantizer); with REST=int8 the layers the
# GPTQ checkpoint keeps in float (lm_head) run moeserve's int8.
set -euo pipefail
cd "$(dirname "$0")/.."
prompt_len=${1:-128}; output_len=${2:-64}; rounds=${3:-3}
threads=${THREADS:-$(nproc)}
source bench/common.sh
# llama.cpp builds with -march=native, which on a CPU with AMX compiles in its AMX matmul; in
# llama-cpp-python 0.3.36 that segfaults on Q8_0 on this project's Sapphire Rapids VMs (gdb:
# ggml_backend_amx_mul_mat, 2026-12-04), so there it is built without AMX (its AVX-512 VNNI
# paths remain), in a venv of its own.
venv=target/peer-venv
cmake_args=
if grep -qw amx_tile /proc/cpuinfo; then
    venv=target/peer-venv-noamx
    no_amx='-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16'
    cmake_args="-DCMAKE_C_FLAGS=$no_amx -DCMAKE_CXX_FLAGS=$no_amx"
fi
py=${PEER_PYTHON:-$venv/bin/python}
if ! "$py" -c "import llama_cpp, gguf, numpy" 2> /dev/null; then
    python3 -m venv "$venv"
    CMAKE_ARGS="$cmake_args" "$venv/bin/pip" install --no-cache-dir --quiet \
        "llama-cpp-python==0.3.36" "gguf==0.19.0" numpy
    py=$venv/bin/python
fi
case ${QUANT:-bf16} in
    bf16) gguf_type=bf16; ours=(--quantization none) ;;
    int8) gguf_type=q8_0; ours=(--quantization int8) ;;
    # REST=int8: the layers the GPTQ checkpoint left in float (lm_head, …) run int8, as
    # Q4_K_M stores its output matrix in 6 bits.
    q4) gguf_type=q4_k_m; ours=(--quantization "${REST:-none}") ;;
    *) echo "QUANT must be bf16, int8 or q4" >&2; exit 2 ;;
esac
mkdir -p target/peers
if [[ $preset = gpt-oss-* ]]; then
    [[ $gguf_type = bf16 ]] || { echo "GPT-OSS presets run as stored (no QUANT)" >&2; exit 2; }
    weights="MXFP4 experts as released, the rest bf16"
    gguf=target/peers/$preset.gguf
    src=${LLAMA_CPP_SRC:-}
    [[ -f $gguf || -n $src ]] || src=$(llama_cpp_source "$py")
    if [[ ! -f $gguf ]]; then
        "${CONVERT_PYTHON:-.venv-ref/bin/python}" bench/peers/convert_gpt_oss.py "$src" "$model" \
            "$gguf.tmp"
        mv "$gguf.tmp" "$gguf"
    fi
elif [[ $gguf_type = q4_k_m ]]; then
    weights="moeserve GPTQ int4 (group 128, float layers ${REST:-none}) / llama.cpp Q4_K_M"
    gguf=target/peers/$preset-q4_k_m.gguf
    if [[ ! -f $gguf ]]; then
        bf16=target/peers/$preset-bf16.gguf
        [[ -f $bf16 ]] || { "$py" bench/peers/export_gguf.py "$model" "$bf16.tmp" && mv "$bf16.tmp" "$bf16"; }
        "$py" bench/peers/quantize_gguf.py "$bf16" "$gguf.tmp" q4_k_m "$threads"
        mv "$gguf.tmp" "$gguf"
    fi
    use_gptq_int4
else
    weights=$([[ $gguf_type = bf16 ]] && echo bf16 || echo "moeserve int8 / llama.cpp Q8_0")
    gguf=target/peers/$preset-$gguf_type.gguf
    if [[ ! -f $gguf ]]; then
        "$py" bench/peers/export_gguf.py "$model" "$gguf.tmp" $([[ $gguf_type = q8_0 ]] && echo q8_0)
        mv "$gguf.tmp" "$gguf"
    fi
fi
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")
python3 - "$prompt_len" "$vocab" > "$work/prompt.json" <<'PY'
import json, random, sys
rng = random.Random(0)
print(json.dumps([rng.randrange(5, int(sys.argv[2])) for _ in range(int(sys.argv[1]))]))
PY
for r in $(seq "$rounds"); do
    "$py" bench/peers/llama_cpp_bench.py "$gguf" "$work/prompt.json" "$output_len" "$threads" 1 \
        > "$work/llama-$r.json"
    "$bin" bench offline --model "$model" --batch 1 --prompt-len "$prompt_len" \
        --output-len "$output_len" --threads "$threads" "${ours[@]}" --json --no-probe \
        > "$work/moeserve-$r.json" 2> /dev/null
done
python3 -c "import json,sys; print(json.dumps({'prompt_ids': json.load(open(sys.argv[1])), 'max_tokens': 16, 'ignore_eos': True}))" \
    "$work/prompt.json" > "$work/prompt.jsonl"
"$bin" generate --model "$model" --prompts-file "$work/prompt.jsonl" --json --threads "$threads" "${ours[@]}" \
    > "$work/greedy.jsonl" 2> /dev/null
python3 - "$work" "$rounds" "$prompt_len" "$output_len" "$threads" "$preset" "$weights" <<'PY'
import json, statistics, sys
work, rounds, plen, olen, threads, preset, weights = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
load = lambda name: [json.load(open(f"{work}/{name}-{r}.json")) for r in range(1, rounds + 1)]
llama, ours = load("llama"), load("moeserve")
med = lambda runs, key: statistics.median(run[key] for run in runs)
ours_ids = json.loads(open(f"{work}/greedy.jsonl").readline())["token_ids"]
same = next((i for i, (a, b) in enumerate(zip(ours_ids, llama[0]["token_ids"])) if a != b), 16)
print(f"{preset} {weights}, batch 1, prompt {plen}, output {olen}, {threads} threads, "
      f"medians of {rounds} alternating rounds")
print(f"{'':10} {'prefill tok/s':>14} {'decode tok/s':>13}")
for name, runs in [("llama.cpp", llama), ("moeserve", ours)]:
    print(f"{name:10} {med(runs, 'prefill_tokens_per_s'):14.1f} {med(runs, 'decode_tokens_per_s'):13.1f}")
for name, runs in [("llama.cpp", llama), ("moeserve", ours)]:
    rounds_decode = ", ".join("%.1f" % run["decode_tokens_per_s"] for run in runs)
    print(f"{name} decode per round: {rounds_decode}")
print(f"moeserve / llama.cpp: prefill {med(ours, 'prefill_tokens_per_s') / med(llama, 'prefill_tokens_per_s'):.2f}x, "
      f"decode {med(ours, 'decode_tokens_per_s') / med(llama, 'decode_tokens_per_s'):.2f}x")
print(f"greedy continuation: the first {same} of 16 tokens agree")
PY
