#!/usr/bin/env bash
# Puts NVRTC 13.0 and the CUDA headers it does not bundle under target/cuda-nvrtc/ (lib/,
# include/), from NVIDIA's pinned PyPI wheels, so the kernels of cuda/ compile in CI on a machine
# with no GPU and no CUDA toolkit. Skips the download when that exact version is already there.
#   nvidia-cuda-nvrtc   -> libnvrtc.so.13, libnvrtc-builtins.so.13.0
#   nvidia-cuda-runtime -> cuda_bf16.h, cuda_fp16.h (and the rest of the runtime headers)
# Prints the directory. Use it as:
#   dir=$(scripts/fetch-nvrtc.sh)
#   LD_LIBRARY_PATH=$dir/lib MOESERVE_CUDA_INCLUDE=$dir/include cargo test --features cuda ...
set -euo pipefail
cd "$(dirname "$0")/.."
NVRTC_VERSION="13.0.88"
RUNTIME_VERSION="13.0.96"
DEST=target/cuda-nvrtc
STAMP="nvidia-cuda-nvrtc==$NVRTC_VERSION nvidia-cuda-runtime==$RUNTIME_VERSION"
if [[ "$(cat "$DEST/VERSION" 2> /dev/null)" != "$STAMP" ]]; then
    echo "== fetching $STAMP into $DEST" >&2
    rm -rf "$DEST"
    mkdir -p "$DEST/wheels" "$DEST/unpacked"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: -d "$DEST/wheels" \
        "nvidia-cuda-nvrtc==$NVRTC_VERSION" "nvidia-cuda-runtime==$RUNTIME_VERSION" >&2
    for wheel in "$DEST"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$DEST/unpacked"
    done
    ln -s unpacked/nvidia/cu13/lib "$DEST/lib"
    ln -s unpacked/nvidia/cu13/include "$DEST/include"
    rm -rf "$DEST/wheels"
    test -f "$DEST/lib/libnvrtc.so.13" && test -f "$DEST/include/cuda_bf16.h"
    echo "$STAMP" > "$DEST/VERSION"
fi
echo "$PWD/$DEST"
