// RMSNorm fused with the residual add (one pass over the row for the add and the sum of squares,
// one for the scaling), as vLLM's `fused_add_rms_norm`. The residual stream stays f32, as on the
// CPU backend; the normed output is T, the input of the next GEMM.
//
// HF: `hidden_states * torch.rsqrt(variance + eps)` then `self.weight * hidden_states`.

// residual[t] += delta[t] (when `delta` is not null); out[t] = rmsnorm(residual[t]) * weight.
// Grid: one block per token; any multiple of 32 threads up to 1024.
template <typename T>
__device__ void rms_norm_residual(float* residual, const T* delta, const T* weight, T* out,
                                  int hidden, float eps) {
    __shared__ float scratch[32];
    float* row = residual + (i64)blockIdx.x * hidden;
    const T* d = delta ? delta + (i64)blockIdx.x * hidden : nullptr;
    T* o = out + (i64)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = row[i];
        if (d) {
            v += to_f32(d[i]);
            row[i] = v;
        }
        sum_sq += v * v;
    }
    const float inv = rsqrtf(block_sum(sum_sq, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        o[i] = from_f32<T>(to_f32(weight[i]) * (row[i] * inv));
    }
}

#define DEFINE_RMS_NORM(SUFFIX, T)                                                              \
    extern "C" __global__ void rms_norm_residual_##SUFFIX(float* residual, const T* delta,      \
                                                          const T* weight, T* out, int hidden,  \
                                                          float eps) {                          \
        rms_norm_residual<T>(residual, delta, weight, out, hidden, eps);                        \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_RMS_NORM)

// RMSNorm in place over rows of `width` (Qwen3-MoE's q/k norm per head: width = head_dim, the
// rows are every token's heads; OLMoE's over the whole projection: width = q_dim or kv_dim).
// Rows start `stride` apart (width, or more: MLA's `kv_a_layernorm` norms the first
// kv_lora_rank elements of each latent row and leaves the rotary key after them).
// Grid: one block per row; any multiple of 32 threads up to 1024.
template <typename T>
__device__ void rms_norm_rows(T* x, const T* weight, int width, int stride, float eps) {
    __shared__ float scratch[32];
    T* row = x + (i64)blockIdx.x * stride;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = to_f32(row[i]);
        sum_sq += v * v;
    }
    const float inv = rsqrtf(block_sum(sum_sq, scratch) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        row[i] = from_f32<T>(to_f32(weight[i]) * (to_f32(row[i]) * inv));
    }
}

#define DEFINE_RMS_NORM_ROWS(SUFFIX, T)                                                         \
    extern "C" __global__ void rms_norm_rows_##SUFFIX(T* x, const T* weight, int width,         \
                                                      int stride, float eps) {                  \
        rms_norm_rows<T>(x, weight, width, stride, eps);                                        \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_RMS_NORM_ROWS)
