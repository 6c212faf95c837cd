# Sourced by the bench scripts: builds the release binary and makes the preset `PRESET`
# (default mixtral-bench-1b) under models/ if missing.
# Sets `bin`, `preset`, `model` and a scratch directory `work` that is removed on exit.
cargo build --release --quiet --bin moeserve
bin=target/release/moeserve
preset=${PRESET:-mixtral-bench-1b}
model=models/$preset
[ -f "$model/config.json" ] || "$bin" make-model --preset "$preset" --out "$model"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The llama.cpp that llama-cpp-python 0.3.36 vendors, unpacked from its sdist (fetched with
# `$1 -m pip`) under target/peers once: prints its path.
llama_cpp_source() {
    local src=target/peers/llama-cpp-python-0.3.36/vendor/llama.cpp
    if [[ ! -f $src/CMakeLists.txt ]]; then
        mkdir -p target/peers
        "$1" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==0.3.36" -d target/peers >&2
        tar -xzf target/peers/llama_cpp_python-0.3.36.tar.gz -C target/peers
        mv target/peers/llama_cpp_python-0.3.36 target/peers/llama-cpp-python-0.3.36
    fi
    echo "$src"
}
# Points `model` at the GPTQ int4 checkpoint of the preset (models/PRESET-gptq-int4, groups of
# 128), made by `moeserve quantize` the first time (about 10 minutes on 2 cores).
use_gptq_int4() {
    local quantized=models/$preset-gptq-int4
    [[ -f $quantized/config.json ]] || "$bin" quantize --model "$model" --out "$quantized" \
        --bits 4 --group-size 128 --threads "${threads:-$(nproc)}"
    model=$quantized
}
