// Shared helpers of every moeserve kernel: element conversions and block reductions.
//
// The Rust side prepends this file to each `.cu` source before NVRTC compiles it (a deployed
// binary carries the sources, not this folder), so kernels need no include path of their own;
// only cuda_bf16.h / cuda_fp16.h come from the toolkit's include directory.
//
// Element types: `float`, `__half` (f16) and `__nv_bfloat16` (bf16). Every kernel reads its
// inputs as T, computes in f32 and writes T, as the CPU backend computes in f32 over weights
// stored in their own dtype. Kernels are templates instantiated under `extern "C"` names that
// end in `_f32`, `_f16` or `_bf16`.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef long long i64;

// -inf without <math.h> (NVRTC does not bundle it).
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the block must not reuse it until all have read.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Maximum over the block; same contract as `block_sum`.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// Instantiates `extern "C"` entry points NAME_f32 / NAME_f16 / NAME_bf16 of a kernel template:
// DEFINE(SUFFIX, T) must expand to one `extern "C" __global__` definition.
#define MOESERVE_FOR_EACH_DTYPE(DEFINE) \
    DEFINE(f32, float)                  \
    DEFINE(f16, __half)                 \
    DEFINE(bf16, __nv_bfloat16)
