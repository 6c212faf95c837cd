// The experts' GEMM of a decode step with the segment offsets read on the device, so no layer
// waits for the host (cuBLAS needs each segment's size on the host): vLLM's fused-MoE idea in
// its simplest form, for steps with few rows per expert, where the weights' bytes dominate.
//
//   y[row, j] = Σ_i x[row, i] · W_e[j, i]   for offsets[e] ≤ row < offsets[e + 1]
//
// x: [rows, k] (permuted, grouped by expert); y: [rows, n]; weights: [E] device pointers, each
// to an expert's [n, k] row-major matrix (its `w1 | w3` or `w2`).
//
// Grid: (ceil(n / (warps · COLS)), E); block: `warps` warps. A warp owns COLS output columns
// of one expert and walks its segment ROWS rows at a time: each pass reads the COLS weight rows
// once (16-byte loads, lanes striding k) and multiplies them into every row of the pass, so a
// segment of up to ROWS rows reads its expert's weights exactly once. Accumulation is f32; the
// lanes' partial sums are reduced with shuffles.

#define MOE_GEMM_COLS 2
#define MOE_GEMM_ROWS 16

// Elements of T in one 16-byte load.
template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
};

template <typename T>
__device__ __forceinline__ void load16(const T* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec16<T>::N; ++i) out[i] = to_f32(v[i]);
}

template <typename T>
__device__ void moe_grouped_gemm(const T* x, const unsigned long long* weights, T* y,
                                 const int* offsets, int n, int k) {
    constexpr int COLS = MOE_GEMM_COLS, ROWS = MOE_GEMM_ROWS, V = Vec16<T>::N;
    const int e = blockIdx.y;
    const int start = offsets[e], end = offsets[e + 1];
    if (start >= end) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int col0 = (blockIdx.x * warps + warp) * COLS;
    if (col0 >= n) return;
    const T* w = reinterpret_cast<const T*>(weights[e]);
    // 16-byte loads need every row to start on a 16-byte boundary.
    const bool vectorized = (k % V) == 0;
    for (int r0 = start; r0 < end; r0 += ROWS) {
        const int rows = min(ROWS, end - r0);
        float acc[COLS][ROWS];
#pragma unroll
        for (int c = 0; c < COLS; ++c)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[c][r] = 0.0f;
        if (vectorized) {
            for (int i = lane * V; i < k; i += 32 * V) {
                float wv[COLS][V];
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    if (col0 + c < n) {
                        load16(w + (i64)(col0 + c) * k + i, wv[c]);
                    } else {
#pragma unroll
                        for (int v = 0; v < V; ++v) wv[c][v] = 0.0f;
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r < rows) {
                        float xv[V];
                        load16(x + (i64)(r0 + r) * k + i, xv);
#pragma unroll
                        for (int c = 0; c < COLS; ++c)
#pragma unroll
                            for (int v = 0; v < V; ++v) acc[c][r] += wv[c][v] * xv[v];
                    }
                }
            }
        } else {
            for (int i = lane; i < k; i += 32) {
                float wv[COLS];
#pragma unroll
                for (int c = 0; c < COLS; ++c)
                    wv[c] = col0 + c < n ? to_f32(w[(i64)(col0 + c) * k + i]) : 0.0f;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r < rows) {
                        const float xv = to_f32(x[(i64)(r0 + r) * k + i]);
#pragma unroll
                        for (int c = 0; c < COLS; ++c) acc[c][r] += wv[c] * xv;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < rows) {
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    const float s = warp_sum(acc[c][r]);
                    if (lane == 0 && col0 + c < n) y[(i64)(r0 + r) * n + col0 + c] = from_f32<T>(s);
                }
            }
        }
    }
}

#define DEFINE_MOE_GEMM(SUFFIX, T)                                                            \
    extern "C" __global__ void moe_grouped_gemm_##SUFFIX(const T* x,                          \
                                                         const unsigned long long* weights,   \
                                                         T* y, const int* offsets, int n,     \
                                                         int k) {                             \
        moe_grouped_gemm<T>(x, weights, y, offsets, n, k);                                    \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_MOE_GEMM)
