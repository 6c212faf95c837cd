// SwiGLU's activation over the fused gate/up projection: Mixtral's `act_fn(w1(x)) * w3(x)`, and
// GPT-OSS's clamped variant: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
// `g · sigmoid(alpha · g) · (u + 1)` (transformers' GptOssExperts).
//
// The expert GEMM writes `gate_up: [rows, 2 * inter]` (w1's outputs, then w3's), so one kernel
// reads both halves of a row and writes `out: [rows, inter]`.

template <typename T>
__device__ void silu_mul(const T* gate_up, T* out, int rows, int inter) {
    const i64 n = (i64)rows * inter;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / inter, i = idx % inter;
        const float g = to_f32(gate_up[r * 2 * inter + i]);
        const float u = to_f32(gate_up[r * 2 * inter + inter + i]);
        out[idx] = from_f32<T>(g / (1.0f + expf(-g)) * u);
    }
}

template <typename T>
__device__ void clamped_swiglu(const T* gate_up, T* out, int rows, int inter, float alpha,
                               float limit) {
    const i64 n = (i64)rows * inter;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / inter, i = idx % inter;
        const float g = fminf(to_f32(gate_up[r * 2 * inter + i]), limit);
        const float u = fminf(fmaxf(to_f32(gate_up[r * 2 * inter + inter + i]), -limit), limit);
        out[idx] = from_f32<T>(g / (1.0f + expf(-alpha * g)) * (u + 1.0f));
    }
}

#define DEFINE_SILU_MUL(SUFFIX, T)                                                             \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* gate_up, T* out, int rows,         \
                                                 int inter) {                                  \
        silu_mul<T>(gate_up, out, rows, inter);                                                \
    }                                                                                          \
    extern "C" __global__ void clamped_swiglu_##SUFFIX(const T* gate_up, T* out, int rows,   \
                                                       int inter, float alpha, float limit) {  \
        clamped_swiglu<T>(gate_up, out, rows, inter, alpha, limit);                            \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_SILU_MUL)
