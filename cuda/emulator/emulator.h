// A CPU emulator of the CUDA subset moeserve's kernels use, to run them before a GPU is lent
// (`scripts/emulate-kernels.sh`, part of `scripts/test-cuda.sh`): every thread of a block is an
// OS thread, blocks run one after another (so a kernel's `static` locals play its `__shared__`
// arrays), `__syncthreads` is a barrier of the block, and warp shuffles exchange through a
// per-warp slot between two barriers of the warp's 32 threads. Slow, and blind to races that
// only real concurrency between blocks shows, but it runs the kernels' own indexing, masking,
// reductions and softmax recurrences on real inputs.
#pragma once
#include <atomic>
#include <barrier>
#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct uint4 {
    unsigned x, y, z, w;
};

inline dim3 blockIdx, blockDim, gridDim;
inline thread_local dim3 threadIdx;

// The dynamic shared memory of `extern __shared__ float smem[]` (the sources' one name for it).
inline float smem[1 << 16];

namespace emu {

struct Warp {
    std::barrier<> barrier{32};
    float f[32];
    int i[32];
};

struct Block {
    explicit Block(unsigned threads) : barrier(threads) {
        for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(new Warp);
    }
    std::barrier<> barrier;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local Block* block = nullptr;

// Lane `lane ^ offset`'s value: every lane writes its own, the warp meets, every lane reads.
template <typename V>
V shuffle_xor(V v, int offset, V* slots, std::barrier<>& warp) {
    const int lane = threadIdx.x % 32;
    slots[lane] = v;
    warp.arrive_and_wait();
    const V r = slots[lane ^ offset];
    warp.arrive_and_wait();
    return r;
}

// Runs `kernel` over `grid` × `block_dim`, blocks in order.
template <typename F>
void launch(dim3 grid, dim3 block_dim, F kernel) {
    gridDim = grid;
    blockDim = block_dim;
    const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                Block b(threads);
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; ++t)
                    pool.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        block = &b;
                        kernel();
                    });
                for (auto& th : pool) th.join();
            }
}

}  // namespace emu

inline void __syncthreads() { emu::block->barrier.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    emu::Warp& w = *emu::block->warps[threadIdx.x / 32];
    return emu::shuffle_xor(v, offset, w.f, w.barrier);
}
inline int __shfl_xor_sync(unsigned, int v, int offset) {
    emu::Warp& w = *emu::block->warps[threadIdx.x / 32];
    return emu::shuffle_xor(v, offset, w.i, w.barrier);
}

inline float __int_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}

inline int atomicAdd(int* at, int v) { return std::atomic_ref<int>(*at).fetch_add(v); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
// expf, logf, fmaxf: <cmath>'s (global in glibc).
