// Multi-head latent attention's (DeepSeek-V2/V3) row-wise kernels: RoPE on the rotary slices,
// the rotary part of each head's query copied into its latent query, and the latent rows into
// the paged cache. The attention itself is paged_attention.cu's kernel over the latent rows.
//
// A query head is `[qk_nope | qk_rope]` (`qk_head_dim` wide); a latent row, one per token, is
// `[kv_lora_rank latent | qk_rope shared rotary key]` (`latent_dim` wide); a latent query head is
// `[kv_lora_rank absorbed | qk_rope]`, the same width as a latent row.

// RoPE in place on every query head's rotary slice (q: [num_tokens, num_heads * qk_head_dim],
// after `nope`) and on each token's shared rotary key (latent: [num_tokens, latent_dim], after
// `kv_lora_rank`), at the token's position. Pairs are (i, i + rope_dim/2) as HF's `rotate_half`,
// or (2i, 2i + 1) with `interleave` (V2's complex product, V3's `rope_interleave`); pair i turns
// by positions[t] * inv_freq[i] (angle in f32, sine and cosine in f64, times `scaling`, as
// rope.cu). Grid: one block per token.
template <typename T>
__device__ void mla_rope(T* q, T* latent, const int* positions, const float* inv_freq,
                         int num_heads, int qk_head_dim, int nope, int rope_dim, int latent_dim,
                         int kv_lora_rank, int interleave, float scaling) {
    const int t = blockIdx.x, half_dim = rope_dim / 2;
    const float pos = (float)positions[t];
    const int pairs = (num_heads + 1) * half_dim;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int head = p / half_dim, i = p % half_dim;
        T* base = head < num_heads ? q + ((i64)t * num_heads + head) * qk_head_dim + nope
                                   : latent + (i64)t * latent_dim + kv_lora_rank;
        const int first = interleave ? 2 * i : i, second = interleave ? 2 * i + 1 : i + half_dim;
        double s, c;
        sincos((double)(pos * inv_freq[i]), &s, &c);
        const float sin_a = (float)s * scaling, cos_a = (float)c * scaling;
        const float a = to_f32(base[first]), b = to_f32(base[second]);
        base[first] = from_f32<T>(a * cos_a - b * sin_a);
        base[second] = from_f32<T>(b * cos_a + a * sin_a);
    }
}

// latent_q[t, h, kv_lora_rank..] = q[t, h, nope..]: each head's rotary query beside its
// absorbed one (latent_q: [num_tokens, num_heads * latent_dim]). Grid: one block per token.
template <typename T>
__device__ void mla_copy_rope(const T* q, T* latent_q, int num_heads, int qk_head_dim, int nope,
                              int rope_dim, int latent_dim, int kv_lora_rank) {
    const int t = blockIdx.x;
    for (int p = threadIdx.x; p < num_heads * rope_dim; p += blockDim.x) {
        const int head = p / rope_dim, i = p % rope_dim;
        const i64 row = (i64)t * num_heads + head;
        latent_q[row * latent_dim + kv_lora_rank + i] = q[row * qk_head_dim + nope + i];
    }
}

// The step's latent rows (latent: [num_tokens, latent_dim]) into one layer's cache
// ([num_slots, latent_dim]) at their slots; a negative slot (padding) is skipped.
// Grid: one block per token.
template <typename T>
__device__ void write_latent(const T* latent, T* cache, const i64* slot_mapping, int latent_dim) {
    const i64 slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const i64 src = (i64)blockIdx.x * latent_dim, dst = slot * latent_dim;
    for (int i = threadIdx.x; i < latent_dim; i += blockDim.x) cache[dst + i] = latent[src + i];
}

#define DEFINE_MLA(SUFFIX, T)                                                                  \
    extern "C" __global__ void mla_rope_##SUFFIX(                                              \
        T* q, T* latent, const int* positions, const float* inv_freq, int num_heads,           \
        int qk_head_dim, int nope, int rope_dim, int latent_dim, int kv_lora_rank,             \
        int interleave, float scaling) {                                                       \
        mla_rope<T>(q, latent, positions, inv_freq, num_heads, qk_head_dim, nope, rope_dim,    \
                    latent_dim, kv_lora_rank, interleave, scaling);                            \
    }                                                                                          \
    extern "C" __global__ void mla_copy_rope_##SUFFIX(const T* q, T* latent_q, int num_heads,  \
                                                      int qk_head_dim, int nope, int rope_dim, \
                                                      int latent_dim, int kv_lora_rank) {      \
        mla_copy_rope<T>(q, latent_q, num_heads, qk_head_dim, nope, rope_dim, latent_dim,      \
                         kv_lora_rank);                                                        \
    }                                                                                          \
    extern "C" __global__ void write_latent_##SUFFIX(const T* latent, T* cache,                \
                                                     const i64* slot_mapping, int latent_dim) { \
        write_latent<T>(latent, cache, slot_mapping, latent_dim);                              \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_MLA)
