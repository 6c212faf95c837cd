// Element-wise kernels the decoder's family options need: a linear layer's bias, an expert's
// bias over its segment of the permuted rows (GPT-OSS), OLMoE's `clip_qkv` clamp, and the
// shared expert's output added to the routed experts' (scaled by
// `sigmoid(shared_expert_gate(x))` where the family has that gate, as Qwen2-MoE does).
// Every value is computed in f32 and rounded to T once.

// x[r, i] += bias[i] over x: [rows, width].
template <typename T>
__device__ void add_bias(T* x, const T* bias, int rows, int width) {
    const i64 n = (i64)rows * width;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (i64)gridDim.x * blockDim.x) {
        x[idx] = from_f32<T>(to_f32(x[idx]) + to_f32(bias[idx % width]));
    }
}

// x[r, i] += bias[e, i] for the rows r of expert e's segment, offsets[e] <= r < offsets[e + 1]
// (x: [offsets[num_segments], width], the permuted rows of moe_permute.cu; bias f32
// [num_segments, width]). A row's segment is found by binary search over the offsets.
template <typename T>
__device__ void add_segment_bias(T* x, const float* bias, const int* offsets, int num_segments,
                                 int width) {
    const i64 n = (i64)offsets[num_segments] * width;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(idx / width);
        int lo = 0, hi = num_segments;  // offsets[lo] <= r < offsets[hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (offsets[mid] <= r) lo = mid; else hi = mid;
        }
        x[idx] = from_f32<T>(to_f32(x[idx]) + bias[(i64)lo * width + idx % width]);
    }
}

// x = clamp(x, -limit, limit) (torch.clamp: NaN stays NaN).
template <typename T>
__device__ void clamp_values(T* x, i64 n, float limit) {
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (i64)gridDim.x * blockDim.x) {
        const float v = to_f32(x[idx]);
        x[idx] = from_f32<T>(v != v ? v : fminf(fmaxf(v, -limit), limit));
    }
}

// delta[r, i] += g[r] * src[r, i], g[r] = sigmoid(gate_logit[r]) or 1 when gate_logit is null.
template <typename T>
__device__ void add_gated(T* delta, const T* src, const T* gate_logit, int rows, int width) {
    const i64 n = (i64)rows * width;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (i64)gridDim.x * blockDim.x) {
        const float g = gate_logit ? 1.0f / (1.0f + expf(-to_f32(gate_logit[idx / width]))) : 1.0f;
        delta[idx] = from_f32<T>(to_f32(delta[idx]) + g * to_f32(src[idx]));
    }
}

#define DEFINE_ELEMENTWISE(SUFFIX, T)                                                          \
    extern "C" __global__ void add_bias_##SUFFIX(T* x, const T* bias, int rows, int width) {   \
        add_bias<T>(x, bias, rows, width);                                                     \
    }                                                                                          \
    extern "C" __global__ void add_segment_bias_##SUFFIX(T* x, const float* bias,              \
                                                         const int* offsets, int num_segments, \
                                                         int width) {                          \
        add_segment_bias<T>(x, bias, offsets, num_segments, width);                            \
    }                                                                                          \
    extern "C" __global__ void clamp_##SUFFIX(T* x, i64 n, float limit) {                      \
        clamp_values<T>(x, n, limit);                                                          \
    }                                                                                          \
    extern "C" __global__ void add_gated_##SUFFIX(T* delta, const T* src, const T* gate_logit, \
                                                  int rows, int width) {                       \
        add_gated<T>(delta, src, gate_logit, rows, width);                                     \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_ELEMENTWISE)
