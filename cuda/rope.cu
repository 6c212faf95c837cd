// Rotary position embeddings on q and k in place, HF's `rotate_half` layout over the first
// `rotary_dim` elements of a head (all of it, or its leading part under a
// `partial_rotary_factor`; the rest passes through): element i pairs with i + rotary_dim/2.
// Angles are `position * inv_freq[i]` in f32 (as HF computes `freqs`), and their sine and cosine
// are taken in f64 so long contexts match the CPU reference, then multiplied by `scaling` (YaRN's
// attention factor; 1 for plain RoPE).

// q: [num_tokens, num_heads * head_dim], k: [num_tokens, num_kv_heads * head_dim].
// Grid: one block per token.
template <typename T>
__device__ void rope(T* q, T* k, const int* positions, const float* inv_freq, int num_heads,
                     int num_kv_heads, int head_dim, int rotary_dim, float scaling) {
    const int t = blockIdx.x, half_dim = rotary_dim / 2;
    const float pos = (float)positions[t];
    const int pairs_q = num_heads * half_dim, pairs = (num_heads + num_kv_heads) * half_dim;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const bool is_q = p < pairs_q;
        const int local = is_q ? p : p - pairs_q;
        const int head = local / half_dim, i = local % half_dim;
        T* base = is_q ? q + ((i64)t * num_heads + head) * head_dim
                       : k + ((i64)t * num_kv_heads + head) * head_dim;
        double s, c;
        sincos((double)(pos * inv_freq[i]), &s, &c);
        const float sin_a = (float)s * scaling, cos_a = (float)c * scaling;
        const float a = to_f32(base[i]), b = to_f32(base[i + half_dim]);
        base[i] = from_f32<T>(a * cos_a - b * sin_a);
        base[i + half_dim] = from_f32<T>(b * cos_a + a * sin_a);
    }
}

#define DEFINE_ROPE(SUFFIX, T)                                                                 \
    extern "C" __global__ void rope_##SUFFIX(T* q, T* k, const int* positions,               \
                                             const float* inv_freq, int num_heads,             \
                                             int num_kv_heads, int head_dim, int rotary_dim,   \
                                             float scaling) {                                  \
        rope<T>(q, k, positions, inv_freq, num_heads, num_kv_heads, head_dim, rotary_dim,      \
                scaling);                                                                      \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_ROPE)
