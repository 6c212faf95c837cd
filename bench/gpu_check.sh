#!/usr/bin/env bash
# The CUDA backend on a real GPU (issues 7 and 22), in under 8 minutes.
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
#   It first prints what the machine has (GPU and driver, and where NVRTC, cuBLAS and NCCL were
#   found), then runs the checks cheapest first, each under its own time limit, so a short
#   window still yields a complete report: a table (check, result, time) in
#   target/gpu-check/results.md (or $OUT/results.md when $OUT is set), ending with one summary
#   line. Large files (the engine bench's model) go to a scratch folder outside $OUT, removed on
#   every exit path.
#
#   bench/gpu_check.sh --dry-run (no GPU needed; CI runs it after --build): every step up to the
#   first GPU call — binaries, libraries looked up, the kernels through NVRTC when it is there,
#   the engine bench's model written and removed — and the same report and summary line, the
#   GPU checks marked "not run (dry run)"; exits 0 unless a step it can run fails.
#
# Environment on the GPU machine: CUDA_HOME (default /usr/local/cuda) for libnvrtc.so.13 and the
# headers; GPU_CHECK_LAYERS (default 32) for the full model; GPU_CHECK_BATCHES (default 1,16,64);
# GPU_CHECK_BUDGET (default 450 s) for all the checks together.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=target/gpu-check/bin
export BIN

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

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
elif [[ -n "${1:-}" ]]; then
    echo "usage: bench/gpu_check.sh [--build | --dry-run]" >&2
    exit 2
fi

START=$SECONDS
OUT_DIR=${OUT:-target/gpu-check}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
RESULTS="$OUT_DIR/results.md"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LAYERS=${GPU_CHECK_LAYERS:-32}
BATCHES=${GPU_CHECK_BATCHES:-1,16,64}
BUDGET=${GPU_CHECK_BUDGET:-450}
# Scratch outside $OUT (whatever is under $OUT is copied back): the engine bench's model
# (~6.3 GB) and the NCCL name shim; removed however the script ends.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moeserve-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
passed=0 failed=0 not_run=0
ROWS=()

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

row() {
    ROWS+=("| $1 | $2 | $3 |")
    echo "   -> $2 ($3)" | tee -a "$LOG"
}
# Runs one check under a time limit, recording PASS / FAIL and keeping its output in the log.
# `check gpu ...` needs a GPU (not run in a dry run); `check host ...` runs either way.
check() {
    local needs=$1 name=$2 limit=$3
    shift 3
    echo "== $name" | tee -a "$LOG"
    if ((DRY_RUN)) && [[ $needs == gpu ]]; then
        echo "   (dry run) would run: $*" | tee -a "$LOG"
        row "$name" "not run (dry run)" "-"
        not_run=$((not_run + 1))
        return 0
    fi
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 10)); then
        row "$name" "not run (the ${BUDGET} s budget is spent)" "-"
        not_run=$((not_run + 1))
        return 0
    fi
    ((limit > left)) && limit=$left
    local t0=$SECONDS status=0
    timeout "$limit" "$@" >> "$LOG" 2>&1 || status=$?
    if ((status == 0)); then
        row "$name" "PASS" "$((SECONDS - t0)) s"
        passed=$((passed + 1))
    else
        local why="exit $status"
        ((status == 124)) && why="timed out after $limit s"
        row "$name" "FAIL ($why; see gpu_check.log)" "$((SECONDS - t0)) s"
        failed=$((failed + 1))
    fi
}

# The first of `names` found under `dirs` or by the dynamic loader's cache, as a path.
find_lib() {
    local dirs=$1 name dir
    shift
    for name in "$@"; do
        for dir in $dirs; do
            [[ -e "$dir/$name" ]] && { readlink -f "$dir/$name"; return 0; }
        done
        local cached
        cached=$(ldconfig -p 2> /dev/null | awk -v n="$name" '$1 == n { print $NF; exit }')
        [[ -n "$cached" ]] && { readlink -f "$cached"; return 0; }
    done
    return 1
}
# Where NVIDIA's wheels put their libraries (nvidia-*-cu13: nvidia/cu13/lib; older ones a folder
# per library), for every Python on the machine, and this checkout's fetched NVRTC.
wheel_dirs() {
    local py
    for py in python3 python; do
        command -v "$py" > /dev/null || continue
        "$py" - << 'PY' 2> /dev/null
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    for pattern in ("nvidia/cu13/lib", "nvidia/*/lib"):
        for d in sorted(glob.glob(f"{root}/{pattern}")):
            print(d)
PY
    done
    echo "$PWD/target/cuda-nvrtc/lib"
}
LIB_DIRS="$CUDA_HOME/lib64 $CUDA_HOME/lib $(wheel_dirs | tr '\n' ' ')"

{
    echo "## CUDA backend check — $(date -u +%Y-%m-%dT%H:%MZ)$( ((DRY_RUN)) && echo ' (dry run)')"
    echo
} > "$RESULTS"
# What the machine has, before anything runs.
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null \
    | head -1)
libcuda=$(find_lib "" libcuda.so.1) || libcuda="not found"
nvrtc_lib=$(find_lib "$LIB_DIRS" libnvrtc.so.13) || nvrtc_lib=""
cublas_lib=$(find_lib "$LIB_DIRS" libcublas.so.13) || cublas_lib=""
# cudarc looks for libnccl.so (and .so.1, .so.10–.so.13), never NCCL's soname libnccl.so.2,
# which the nvidia-nccl-cu13 wheel and most images ship: a libnccl.so beside it in the
# scratch folder makes it loadable.
nccl_lib=$(find_lib "$LIB_DIRS" libnccl.so libnccl.so.2) || nccl_lib=""
headers=""
for d in "$CUDA_HOME/include" "$PWD/target/cuda-nvrtc/include"; do
    [[ -f "$d/cuda_bf16.h" ]] && { headers=$d; break; }
done
{
    echo "| what | found |"
    echo "|---|---|"
    echo "| GPU, driver, memory | ${gpu:-none (nvidia-smi found no GPU)} |"
    echo "| libcuda.so.1 (driver) | $libcuda |"
    echo "| NVRTC (libnvrtc.so.13) | ${nvrtc_lib:-not found} |"
    echo "| CUDA headers | ${headers:-not found} |"
    echo "| cuBLAS (libcublas.so.13) | ${cublas_lib:-not found} |"
    echo "| NCCL (libnccl.so.2) | ${nccl_lib:-not found (expert parallelism over GPUs needs it)} |"
    echo "| CPU, memory | $(nproc) cores, $(free -g 2> /dev/null | awk '/Mem:/ {print $2}') GiB |"
    echo
} | tee -a "$RESULTS"

mkdir -p "$WORK/lib"
for lib in "$nvrtc_lib" "$cublas_lib"; do
    [[ -n "$lib" ]] && ln -sf "$lib" "$WORK/lib/$(basename "$lib" | sed -E 's/(\.so\.[0-9]+).*/\1/')"
done
[[ -n "$nccl_lib" ]] && ln -sf "$nccl_lib" "$WORK/lib/libnccl.so"
# The shims first, then the folders they point into (NVRTC loads its builtins from beside it).
lib_path="$WORK/lib"
for lib in "$nvrtc_lib" "$cublas_lib" "$nccl_lib"; do
    [[ -n "$lib" ]] && lib_path="$lib_path:$(dirname "$lib")"
done
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[[ -n "$headers" ]] && export MOESERVE_CUDA_INCLUDE="$headers"
export MOESERVE_REQUIRE_NVRTC=1
((DRY_RUN)) || export MOESERVE_REQUIRE_GPU=1
# The test binaries were built elsewhere: point them at this checkout's fixtures and kernels.
export MOESERVE_FIXTURES="$PWD/tests/fixtures"
export MOESERVE_CUDA_SOURCES="$PWD/cuda"

binaries_present() {
    local b missing=0
    for b in cuda_nvrtc cuda_kernels cuda_forward cuda_mixtral_bench moeserve; do
        [[ -x "$BIN/$b" ]] || { echo "missing $BIN/$b: run bench/gpu_check.sh --build on the CPU machine"; missing=1; }
    done
    return $missing
}
export -f binaries_present
check host "binaries built by --build are here" 5 bash -c binaries_present
# The kernels through NVRTC need no GPU: a dry run compiles them too where NVRTC is found.
if [[ -n "$nvrtc_lib" && -n "$headers" ]]; then
    check host "NVRTC 13.0 compiles every kernel (sm_80, sm_90)" 60 "$BIN/cuda_nvrtc"
else
    check gpu "NVRTC 13.0 compiles every kernel (sm_80, sm_90): NVRTC or headers missing" 60 false
fi
check gpu "kernel parity vs the CPU reference (f32, f16, bf16)" 120 \
    "$BIN/cuda_kernels" --test-threads 1
# The engine end to end on the GPU: `--device cuda` picks it, generates, and gives the
# fixture's greedy tokens (mixtral-gqa, first reference prompt).
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
check gpu "engine on the GPU (generate --device cuda) gives the fixture's greedy tokens" 60 \
    bash -c gen_check
# Every family's forward on the GPU: transformers fixtures in f32 (layer outputs, greedy tokens,
# logprobs) and bf16 (teacher-forced logprobs), batched vs alone, capacity factor, EP.
check gpu "every family's forward on the GPU vs transformers fixtures" 180 \
    "$BIN/cuda_forward" --test-threads 1 --nocapture
# The engine bench's model: written to the scratch folder (a dry run writes and removes it too).
MODEL="$WORK/mixtral-8x7b-2l"
write_model() {
    "$BIN/moeserve" make-model --preset mixtral-8x7b-2l --out "$MODEL" && du -sh "$MODEL"
}
export -f write_model
export WORK MODEL
free_gb=$(df -Pk "$WORK" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
if ((free_gb < 8)); then
    # Not moeserve's failure: the machine lacks the room (the model is ~6.3 GB).
    row "mixtral-8x7b-2l written to the scratch folder" "not run (only $free_gb GB free under $WORK)" "-"
    not_run=$((not_run + 1))
else
    check host "mixtral-8x7b-2l written to the scratch folder ($WORK)" 120 bash -c write_model
fi
engine_bench() {
    "$BIN/moeserve" bench offline --model "$MODEL" --device cuda --batch 16 --prompt-len 256 \
        --output-len 32 --json --no-probe > "$OUT_DIR/engine_8x7b_2l.json"
    cat "$OUT_DIR/engine_8x7b_2l.json"
}
export -f engine_bench
export OUT_DIR
if [[ -f "$MODEL/config.json" ]]; then
    check gpu "engine bench, mixtral-8x7b-2l, batch 16 (engine_8x7b_2l.json)" 150 \
        bash -c engine_bench
fi
check host "the scratch model removed" 30 rm -rf "$MODEL"
# Timings of the synthetic Mixtral-8x7B (weights made on the device): 2 layers, then the full
# model with what is left of the budget.
for layers in 2 "$LAYERS"; do
    bench="\"$BIN/cuda_mixtral_bench\" --layers $layers --batch $BATCHES --prompt-len 256"
    bench="$bench --decode-steps 32 > \"$OUT_DIR/bench_${layers}l.jsonl\""
    check gpu "synthetic Mixtral-8x7B, $layers layers (bench_${layers}l.jsonl)" 300 bash -c "$bench"
done

total=$((SECONDS - START))
{
    echo "| check | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    if ls "$OUT_DIR"/bench_*l.jsonl > /dev/null 2>&1; then
        echo "| layers | batch | prefill tok/s | decode tok/s | decode step ms | bytes/step GB | decode HBM GB/s | D2D copy GB/s |"
        echo "|---|---|---|---|---|---|---|---|"
        cat "$OUT_DIR"/bench_*l.jsonl | python3 -c "$TABLE_PY"
        echo
    fi
    if [[ -s "$OUT_DIR/engine_8x7b_2l.json" ]]; then
        python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("Engine (moeserve bench offline --device cuda), mixtral-8x7b-2l, batch 16: prefill {:.0f} tok/s, decode {:.1f} tok/s, {:.0f} GB/s of weights in decode".format(r["prefill_tokens_per_s"], r["decode_tokens_per_s"], r["decode_gbps"]))' "$OUT_DIR/engine_8x7b_2l.json"
        echo
    fi
    echo "gpu_check: $passed passed, $failed failed, $not_run not run, $total s$( ((DRY_RUN)) && echo ' (dry run)')"
} | tee -a "$RESULTS"
exit $((failed > 0))
