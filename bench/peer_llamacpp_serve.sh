#!/usr/bin/env bash
# moeserve's server against llama.cpp's (llama-server) on the same machine, same weights, same
# run, under concurrent requests: at each level of LEVELS, the two servers are started in turn
# and loaded by the same client (`moeserve bench serve`: that many streaming completions in
# flight, random prompts of PROMPT_LEN token ids, OUTPUT_LEN tokens each with ignore_eos, NUM
# requests per level), ROUNDS alternating rounds, medians of output tokens/s, TPOT and TTFT.
#   bench/peer_llamacpp_serve.sh [PROMPT_LEN] [OUTPUT_LEN] [ROUNDS] [LEVELS] [NUM]
# Defaults: 128, 64, 3, 8,32, 2x (twice the level).
# llama-server is built (once, under target/peers) from the llama.cpp that llama-cpp-python
# 0.3.36 vendors, its sdist fetched with pip, cmake from pip, without AMX where the CPU has it
# (see bench/peer_llamacpp.sh), about 10 minutes on 2 cores; LLAMA_SERVER names another build.
# It serves with a slot and an HTTP thread per request of the largest level (`--parallel`,
# `--threads-http`; with its default HTTP threads a connection at 32 was refused), continuous
# batching, and each slot a context of PROMPT_LEN + OUTPUT_LEN (+ 16).
# The GGUF is bench/peers/export_gguf.py's, as in bench/peer_llamacpp.sh (target/peers, shared).
# Environment: PRESET (default mixtral-bench-1b), THREADS (default: all cores), QUANT=int8
# (moeserve `--quantization int8` against llama.cpp's Q8_0; default bf16 against bf16), QUANT=q4
# (the GPTQ int4 checkpoint `moeserve quantize --bits 4 --group-size 128` makes of the preset,
# models/PRESET-gptq-int4, against llama.cpp's Q4_K_M of the bf16 export, made by the
# llama-quantize of the same build; both shared with bench/peer_llamacpp.sh; REST=int8 runs the
# layers the checkpoint keeps in float as int8, as there), PORT (default 18131).
set -euo pipefail
cd "$(dirname "$0")/.."
prompt_len=${1:-128}; output_len=${2:-64}; rounds=${3:-3}; levels=${4:-8,32}; num=${5:-2x}
threads=${THREADS:-$(nproc)}
port=${PORT:-18131}
source bench/common.sh
case ${QUANT:-bf16} in
    bf16) gguf_type=bf16; ours=(--quantization none) ;;
    int8) gguf_type=q8_0; ours=(--quantization int8) ;;
    q4) gguf_type=q4_k_m; ours=(--quantization "${REST:-none}") ;;
    *) echo "QUANT must be bf16, int8 or q4" >&2; exit 2 ;;
esac

# Tools: cmake (to build llama-server) and gguf + numpy (to export the GGUF), in a venv.
venv=target/peer-server-venv
if ! "$venv/bin/python" -c "import gguf, numpy" 2> /dev/null || [[ ! -x $venv/bin/cmake ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --no-cache-dir --quiet cmake "gguf==0.19.0" numpy
fi
llama_server=${LLAMA_SERVER:-target/peers/llama-server-build/bin/llama-server}
if [[ ! -x $llama_server ]]; then
    src=$(llama_cpp_source "$venv/bin/python")
    flags=()
    if grep -qw amx_tile /proc/cpuinfo; then
        no_amx='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
        flags=("-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
    fi
    # No web UI (it would be fetched from the network), no curl (models are local files).
    "$venv/bin/cmake" -S "$src" -B target/peers/llama-server-build -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON "${flags[@]}" \
        > "$work/cmake.log"
    "$venv/bin/cmake" --build target/peers/llama-server-build --target llama-server \
        llama-quantize -j "$(nproc)" > "$work/build.log"
    llama_server=target/peers/llama-server-build/bin/llama-server
fi
export_gguf() { # $1: the GGUF to write, $2: q8_0 or nothing (bf16)
    mkdir -p target/peers
    "$venv/bin/python" bench/peers/export_gguf.py "$model" "$1.tmp" ${2:-}
    mv "$1.tmp" "$1"
}
gguf=target/peers/$preset-$gguf_type.gguf
if [[ $gguf_type = q4_k_m ]]; then
    if [[ ! -f $gguf ]]; then
        bf16=target/peers/$preset-bf16.gguf
        [[ -f $bf16 ]] || export_gguf "$bf16"
        quantize=$(dirname "$llama_server")/llama-quantize
        [[ -x $quantize ]] || "$venv/bin/cmake" --build target/peers/llama-server-build \
            --target llama-quantize -j "$(nproc)" > "$work/build.log"
        "$quantize" "$bf16" "$gguf.tmp" Q4_K_M "$threads" > "$work/quantize.log" 2>&1
        mv "$gguf.tmp" "$gguf"
    fi
    use_gptq_int4
elif [[ ! -f $gguf ]]; then
    export_gguf "$gguf" "$([[ $gguf_type = q8_0 ]] && echo q8_0)"
fi
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")
largest=$(tr ',' '\n' <<< "$levels" | sort -n | tail -1)

server=
stop_server() {
    if [[ -n $server ]]; then
        kill "$server" 2> /dev/null || true
        wait "$server" 2> /dev/null || true
        server=
    fi
}
trap 'stop_server; rm -rf "$work"' EXIT
# Starts an engine's server (`moeserve` or `llama.cpp`) and waits until it answers.
start_server() {
    case $1 in
        moeserve)
            "$bin" serve --model "$model" --served-model-name "$preset" --host 127.0.0.1 \
                --port "$port" --threads "$threads" \
                --max-num-seqs "$largest" --kv-cache-memory 4GiB "${ours[@]}" \
                > "$work/server.log" 2>&1 &
            ;;
        llama.cpp)
            "$llama_server" -m "$gguf" --host 127.0.0.1 --port "$port" -t "$threads" \
                -tb "$threads" --parallel "$largest" --threads-http $((largest + 4)) --cont-batching \
                -c $((largest * (prompt_len + output_len + 16))) --no-webui \
                > "$work/server.log" 2>&1 &
            ;;
    esac
    server=$!
    for _ in $(seq 1200); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && return
        kill -0 "$server" 2> /dev/null || { cat "$work/server.log" >&2; exit 1; }
        sleep 0.5
    done
    echo "$1's server did not come up" >&2
    exit 1
}
for r in $(seq "$rounds"); do
    for engine in llama.cpp moeserve; do
        start_server "$engine"
        # --stream-logprobs: a random model's tokens mostly decode to no text; with a logprob
        # each token arrives as its own chunk, from both servers.
        "$bin" bench serve --url "http://127.0.0.1:$port" --model "$preset" \
            --concurrency "$levels" --num-prompts "$num" --prompt-len "$prompt_len" \
            --output-len "$output_len" --vocab-size "$vocab" --stream-logprobs \
            --out "$work/$engine-$r.json" > /dev/null \
            || [[ -f $work/$engine-$r.json ]] # failed requests: counted in the table, not fatal
        stop_server
    done
done
python3 - "$work" "$rounds" "$prompt_len" "$output_len" "$threads" "$preset" "$gguf_type" <<'PY'
import json, statistics, sys
work, rounds, plen, olen, threads, preset, weights = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
runs = {e: [json.load(open(f"{work}/{e}-{r}.json")) for r in range(1, rounds + 1)]
        for e in ("llama.cpp", "moeserve")}
print(f"{preset} {weights}, prompt {plen}, output {olen}, {threads} threads, "
      f"medians of {rounds} alternating rounds")
print(f"{'concurrency':>11} {'engine':10} {'output tok/s':>13} {'TPOT p50 ms':>12} "
      f"{'TTFT p50 ms':>12} {'failed':>7}")
for i, level in enumerate(runs["moeserve"][0]["levels"]):
    c = level["concurrency"]
    tput = {}
    for engine, rs in runs.items():
        ls = [run["levels"][i] for run in rs]
        assert all(l["concurrency"] == c for l in ls)
        med = lambda f: statistics.median(f(l) for l in ls)
        tput[engine] = med(lambda l: l["output_throughput"])
        print(f"{c:11} {engine:10} {tput[engine]:13.1f} {med(lambda l: l['tpot_ms']['p50']):12.1f} "
              f"{med(lambda l: l['ttft_ms']['p50']):12.1f} {sum(l['failed'] for l in ls):7}")
    print(f"{c:11} {'ratio':10} {tput['moeserve'] / tput['llama.cpp']:12.2f}x (moeserve / llama.cpp output tok/s)")
PY
