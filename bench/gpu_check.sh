#!/usr/bin/env bash
# The CUDA backend on a real GPU (issue 7), in under 8 minutes.
#
# The GPU machine has a driver, nvcc and NVRTC but no Rust toolchain and no network, so the
# binaries are built on the CPU machine and copied over (NVRTC is not: the one installed there
# is used, and must be 13.0.x, the version the kernels target).
#
#   On the CPU machine:  bench/gpu_check.sh --build
#       builds, strips and puts under target/gpu-check/bin/:
#         cuda_nvrtc          every kernel of cuda/ through the local NVRTC (sm_80, sm_90)
#         cuda_kernels        kernel parity against the scalar CPU reference, f32/f16/bf16
#         cuda_forward        every family's forward on the GPU (Mixtral, Qwen3-MoE per-expert
#                             and fused, Qwen2-MoE, OLMoE) against the transformers fixtures
#                             (f32 and bf16); batched vs alone, capacity factor and expert
#                             parallelism on Mixtral, Qwen3-MoE and Qwen2-MoE
#         cuda_mixtral_bench  synthetic Mixtral-8x7B through the CUDA forward (random bf16
#                             weights made on the device)
#         moeserve            the `--features cuda` binary (device probe on a real GPU)
#   Copy the repository's working tree with target/gpu-check/ to the GPU machine, then there:
#       bench/gpu_check.sh
#   (with the device tool: carry target/gpu-check, 14 MB; the binaries need glibc >= 2.34.)
#   It writes target/gpu-check/results.md (or $OUT/results.md when $OUT is set): the figures and
#   the pass / fail of each check, with the date, for bench/RESULTS.md.
#
# Environment on the GPU machine: CUDA_HOME (default /usr/local/cuda) for libnvrtc.so.13 and the
# headers; GPU_CHECK_LAYERS (default 32) for the full model; GPU_CHECK_BATCHES (default 1,16,64).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=target/gpu-check/bin

if [[ "${1:-}" == "--build" ]]; then
    set -e
    # Executables by cargo's JSON messages (test binaries carry a hash in their names).
    artifacts() {
        cargo "$@" --release --features cuda --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
    }
    # Built into a fresh folder that replaces $BIN only when everything is there.
    NEW="$BIN.new"
    rm -rf "$NEW" && mkdir -p "$NEW"
    {
        artifacts build --bin moeserve
        artifacts build -p moeserve-model --example cuda_mixtral_bench
        artifacts test -p moeserve-backend --no-run
        artifacts test -p moeserve-model --test cuda_forward --no-run
    } | while read -r name path; do
        case $name in
            moeserve | cuda_mixtral_bench | cuda_nvrtc | cuda_kernels | cuda_forward)
                cp "$path" "$NEW/$name"
                ;;
        esac
    done
    # Another build in this tree may re-link target/release/moeserve without the feature between
    # our build and the copy: check that the copy has CUDA in it.
    for b in moeserve cuda_mixtral_bench cuda_nvrtc cuda_kernels cuda_forward; do
        [[ -x "$NEW/$b" ]] || { echo "error: $b was not built" >&2; exit 1; }
    done
    if "$NEW/moeserve" generate --model /nonexistent --prompt-ids 1 --device cuda 2>&1 \
        | grep -q "without CUDA support"; then
        echo "error: moeserve lacks the cuda feature (raced with another build); rerun" >&2
        exit 1
    fi
    # Debug info makes them large; the GPU run needs none of it.
    strip "$NEW"/*
    rm -rf "$BIN" && mv "$NEW" "$BIN"
    # Leave the default (CPU) binary in target/release for the CPU-side tests.
    cargo build --release --bin moeserve
    ls -la "$BIN"
    exit 0
fi

START=$SECONDS
OUT_DIR=${OUT:-target/gpu-check}
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/results.md"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LAYERS=${GPU_CHECK_LAYERS:-32}
BATCHES=${GPU_CHECK_BATCHES:-1,16,64}
failures=0

# Markdown rows from the bench's JSON lines.
read -r -d '' TABLE_PY << 'PY'
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if "batch" in r:
        print("| {layers} | {batch} | {prefill_tokens_per_s:.0f} | {decode_tokens_per_s:.1f} | "
              "{decode_step_ms:.2f} | {decode_bytes_per_step_gb:.2f} | {decode_hbm_gbs:.0f} | "
              "{d2d_copy_gbs:.0f} |".format(**r))
PY

say() { echo "$*" | tee -a "$RESULTS"; }
# Runs one check with a time limit; records PASS / FAIL and keeps its output in the log.
check() {
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$LOG"
    local t0=$SECONDS
    if timeout "$limit" "$@" >> "$LOG" 2>&1; then
        say "- PASS $name ($((SECONDS - t0)) s)"
    else
        say "- FAIL $name (exit $?, $((SECONDS - t0)) s; see $LOG)"
        failures=$((failures + 1))
    fi
}

for b in cuda_nvrtc cuda_kernels cuda_forward cuda_mixtral_bench moeserve; do
    if [[ ! -x "$BIN/$b" ]]; then
        echo "error: $BIN/$b is missing: run bench/gpu_check.sh --build on the CPU machine" >&2
        exit 2
    fi
done
nvrtc_lib=$(ls "$CUDA_HOME"/lib64/libnvrtc.so.13* "$CUDA_HOME"/lib/libnvrtc.so.13* 2> /dev/null | head -1)
if [[ -z "$nvrtc_lib" ]]; then
    echo "error: no libnvrtc.so.13 under $CUDA_HOME (set CUDA_HOME)" >&2
    exit 2
fi
export LD_LIBRARY_PATH="$(dirname "$nvrtc_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOESERVE_CUDA_INCLUDE="$CUDA_HOME/include"
export MOESERVE_REQUIRE_NVRTC=1 MOESERVE_REQUIRE_GPU=1
# The test binaries were built elsewhere: point them at this checkout's fixtures.
export MOESERVE_FIXTURES="$PWD/tests/fixtures"

{
    echo "## CUDA backend on $(nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader 2> /dev/null | head -1) — $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "NVRTC: $(readlink -f "$nvrtc_lib"); nvcc: $("$CUDA_HOME"/bin/nvcc --version 2> /dev/null \
        | grep -o 'release [0-9.]*' || echo 'not found')"
    echo
} > "$RESULTS"
cat "$RESULTS"

# 1. NVRTC there is 13.0.x (the test asserts it) and compiles every kernel.
check "NVRTC 13.0 compiles every kernel (sm_80, sm_90)" 60 "$BIN/cuda_nvrtc"
# 2. Every kernel against the scalar CPU reference on this GPU (fails, not skips, without one).
check "kernel parity vs the CPU reference (f32, f16, bf16)" 120 "$BIN/cuda_kernels" --test-threads 1
# 3. The Mixtral forward on the GPU: transformers fixtures in f32 (layer outputs, greedy tokens,
#    logprobs) and bf16 (teacher-forced logprobs), batched steps vs each sequence alone.
check "Mixtral forward on the GPU vs transformers fixtures; batched vs alone" 150 \
    "$BIN/cuda_forward" --test-threads 1 --nocapture
# 4. The engine end to end on the GPU: `--device cuda` picks it, generates, and gives the
#    fixture's greedy tokens (mixtral-gqa, first reference prompt).
gen_check() {
    local dir=tests/fixtures/mixtral-gqa want ids got
    ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('$dir/reference.json'))['prompts'][0]['prompt_ids'])))")
    want=$(python3 -c "import json; print(json.load(open('$dir/reference.json'))['prompts'][0]['greedy_ids'][:8])")
    got=$("$BIN/moeserve" generate --model "$dir" --prompt-ids "$ids" --max-tokens 8 --ignore-eos \
        --json --device cuda | python3 -c "import json, sys; print(json.load(sys.stdin)['token_ids'])")
    echo "engine on the GPU: $got, transformers: $want"
    [[ "$got" == "$want" ]]
}
export -f gen_check
export BIN
check "engine on the GPU (moeserve generate --device cuda) gives the fixture's greedy tokens" 60 \
    bash -c gen_check
# 5. Timings: the 2-layer Mixtral-8x7B shape (synthetic), the same shape through the engine
#    (mixtral-8x7b-2l, random preset weights, `moeserve bench offline --device cuda`), then the
#    full 32 layers (synthetic, ~93 GB).
engine_bench() {
    local dir="$OUT_DIR/mixtral-8x7b-2l"
    [[ -f "$dir/config.json" ]] || "$BIN/moeserve" make-model --preset mixtral-8x7b-2l --out "$dir"
    "$BIN/moeserve" bench offline --model "$dir" --device cuda --batch 16 --prompt-len 256 \
        --output-len 32 --json --no-probe > "$OUT_DIR/engine_8x7b_2l.json"
    cat "$OUT_DIR/engine_8x7b_2l.json"
    rm -rf "$dir"
}
export -f engine_bench
export OUT_DIR
for layers in 2 engine "$LAYERS"; do
    if [[ $layers == engine ]]; then
        if ((450 - (SECONDS - START) < 300)); then
            say "- NOT RUN engine bench on mixtral-8x7b-2l: kept the budget for the 32-layer bench"
        else
            check "engine bench, mixtral-8x7b-2l, batch 16 (engine_8x7b_2l.json)" 150 \
                bash -c engine_bench
        fi
        continue
    fi
    budget=$((450 - (SECONDS - START)))
    if ((budget < 60)); then
        say "- NOT RUN bench with $layers layers: the 8-minute budget is spent"
        continue
    fi
    echo "== bench $layers layers" | tee -a "$LOG"
    if timeout "$budget" "$BIN/cuda_mixtral_bench" --layers "$layers" --batch "$BATCHES" \
        --prompt-len 256 --decode-steps 32 > "$OUT_DIR/bench_${layers}l.jsonl" 2>> "$LOG"; then
        say "- PASS bench $layers layers (bench_${layers}l.jsonl)"
    else
        say "- FAIL bench $layers layers (see $LOG)"
        failures=$((failures + 1))
    fi
done
{
    echo
    echo "| layers | batch | prefill tok/s | decode tok/s | decode step ms | bytes/step GB | decode HBM GB/s | D2D copy GB/s |"
    echo "|---|---|---|---|---|---|---|---|"
    cat "$OUT_DIR"/bench_*l.jsonl 2> /dev/null | python3 -c "$TABLE_PY"
    echo
    if [[ -s "$OUT_DIR/engine_8x7b_2l.json" ]]; then
        python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("Engine (moeserve bench offline --device cuda), mixtral-8x7b-2l, batch 16: prefill {:.0f} tok/s, decode {:.1f} tok/s, {:.0f} GB/s of weights in decode".format(r["prefill_tokens_per_s"], r["decode_tokens_per_s"], r["decode_gbps"]))' "$OUT_DIR/engine_8x7b_2l.json"
        echo
    fi
    echo "Total $((SECONDS - START)) s; $failures failure(s)."
} | tee -a "$RESULTS"
exit $((failures > 0))
