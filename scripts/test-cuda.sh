#!/usr/bin/env bash
# The CUDA backend's checks on a machine without a GPU (CI): fetches NVRTC 13.0 from PyPI
# (scripts/fetch-nvrtc.sh), builds `moeserve` with `--features cuda`, compiles every kernel of
# cuda/ for sm_80 and sm_90 (a kernel that does not compile fails here), runs the kernels this
# project changed without a GPU on the CPU emulator (scripts/emulate-kernels.sh), runs `--device`
# selection against the CUDA-enabled binary, then the dry run of bench/gpu_check.sh. The kernel
# parity tests (tests/cuda_kernels) and the GPU forward's fixture tests (moeserve-model's
# tests/cuda_forward.rs) compile and, with no GPU, return early; bench/gpu_check.sh runs them on
# a GPU.
#
# Builds share target/release with the CPU build: the feature-on crates get their own hashes
# there, so the two coexist; the plain binary is re-linked at the end so target/release/moeserve
# stays the default build that the end-to-end tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
nvrtc_dir=$(scripts/fetch-nvrtc.sh)
export LD_LIBRARY_PATH="$nvrtc_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOESERVE_CUDA_INCLUDE="$nvrtc_dir/include"
export MOESERVE_REQUIRE_NVRTC=1
echo "== cuda: build (--features cuda)"
cargo build --release --bin moeserve --features cuda
echo "== cuda: kernels through NVRTC 13.0, kernel tests (compiled; run on a GPU only)"
cargo test --release -p moeserve-backend --features cuda "$@"
echo "== cuda: the changed kernels on the CPU emulator (cuda/emulator, g++)"
scripts/emulate-kernels.sh
echo "== cuda: the forward on CUDA (host-side unit tests; fixture tests run on a GPU only)"
cargo test --release -p moeserve-model --features cuda --lib models::cuda "$@"
cargo test --release -p moeserve-model --features cuda --test cuda_forward "$@"
echo "== cuda: --device selection with the CUDA-enabled binary"
cargo test --release -p moeserve-server --features cuda --test device_selection "$@"
echo "== cuda: bench/gpu_check.sh --build, then --dry-run (every step up to the first GPU call)"
bench/gpu_check.sh --build > /dev/null
bench/gpu_check.sh --dry-run
cargo build --release --bin moeserve
