#!/usr/bin/env bash
# Runs the kernels of cuda/ that changed without a GPU on the CPU emulator (cuda/emulator/):
# copies the sources with `extern __shared__` arrays made the emulator's global, builds
# cuda/emulator/kernels_test.cpp with g++ (C++20) and runs it. Needs g++ only; part of
# scripts/test-cuda.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for f in cuda/*.cu cuda/*.cuh; do
    sed 's/^\( *\)extern __shared__ float smem\[\];/\1\/\/ smem: the emulator'"'"'s global/' "$f" > "$work/$(basename "$f")"
done
cp cuda/emulator/*.h cuda/emulator/kernels_test.cpp "$work/"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -Wno-unknown-pragmas -I "$work" "$work/kernels_test.cpp" -o "$work/kernels_test"
"$work/kernels_test" "$@"
