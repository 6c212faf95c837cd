// Grouped-query attention of every step token over a paged KV cache, for prefill and decode
// alike: the step's keys and values are written to the cache first (kv_cache.cu), so a query at
// position p attends to its own sequence's slots first..=p, found through the block table.
// `first` is 0, or p + 1 - sliding_window with a window (HF admits keys j with p - j < window).
// GPT-OSS's sinks (one logit per head, or null) join the softmax's denominator and add no value.
// Multi-head latent attention (DeepSeek-V2/V3) runs on the same kernel: one "KV head" whose key is
// the whole cached latent row (`kv_lora_rank + qk_rope_head_dim`) and whose value is the row's
// first `kv_lora_rank` elements (k_cache and v_cache the same buffer, value_dim < head_dim).
//
// One block per (token, head); keys are visited in tiles of TILE with an online softmax
// (running max and sum, the FlashAttention recurrence), so any context length fits in shared
// memory. Each warp scores keys of the tile (lanes split head_dim, coalesced reads), then each
// thread accumulates its own output dimensions over the tile's values.
//
// NOTE: a prefill of n tokens re-reads each key up to n times; a tiled varlen prefill kernel
// (queries of a sequence sharing key tiles) is the next step for long prompts.

#define TILE 128
#define MAX_DIMS_PER_THREAD 4

struct PagedAttentionParams {
    int num_heads;
    int num_kv_heads;
    int head_dim;        // a key's width (and the query's)
    int value_dim;       // a value's width (and the output's); head_dim for grouped-query attention
    int k_row;           // elements between consecutive slots of k_cache
    int v_row;           // of v_cache
    int block_size;
    int max_blocks_per_seq;
    int sliding_window;  // 0 = none
    float scale;         // head_dim^-0.5, or MLA's softmax scale
};

// q: [num_tokens, num_heads * head_dim]; out: [num_tokens, num_heads * value_dim]; k_cache,
// v_cache: one layer, [num_blocks * block_size, k_row] and [.., v_row], kv head g's key at
// g * head_dim of a row and its value at g * value_dim; block_tables: [num_seqs,
// max_blocks_per_seq]; token_seq, positions: [num_tokens].
// Grid (num_tokens, num_heads); blockDim.x a multiple of 32 with value_dim <= 4 * blockDim.x;
// dynamic shared memory (head_dim + TILE + 32) floats.
template <typename T>
__device__ void paged_attention(T* out, const T* q, const T* k_cache, const T* v_cache,
                                const int* block_tables, const int* token_seq,
                                const int* positions, const float* sinks,
                                PagedAttentionParams p) {
    extern __shared__ float smem[];
    float* q_s = smem;
    float* scores = smem + p.head_dim;
    const int t = blockIdx.x, h = blockIdx.y, d = p.head_dim, dv = p.value_dim;
    const int kv_head = h / (p.num_heads / p.num_kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    const T* qh = q + ((i64)t * p.num_heads + h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) q_s[i] = to_f32(qh[i]);
    const int pos = positions[t];
    const int first = p.sliding_window > 0 ? max(0, pos + 1 - p.sliding_window) : 0;
    const int* table = block_tables + (i64)token_seq[t] * p.max_blocks_per_seq;
    float acc[MAX_DIMS_PER_THREAD] = {0.0f, 0.0f, 0.0f, 0.0f};
    float running_max = NEG_INF, running_sum = 0.0f;
    __syncthreads();
    for (int tile_start = first; tile_start <= pos; tile_start += TILE) {
        const int n = min(TILE, pos + 1 - tile_start);
        for (int j = warp; j < n; j += num_warps) {
            const int key = tile_start + j;
            const i64 slot = (i64)table[key / p.block_size] * p.block_size + key % p.block_size;
            const T* kr = k_cache + slot * p.k_row + (i64)kv_head * d;
            float s = 0.0f;
            for (int i = lane; i < d; i += 32) s += q_s[i] * to_f32(kr[i]);
            s = warp_sum(s);
            if (lane == 0) scores[j] = s * p.scale;
        }
        __syncthreads();
        float tile_max = NEG_INF;
        for (int j = 0; j < n; ++j) tile_max = fmaxf(tile_max, scores[j]);
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = expf(running_max - new_max);
        running_sum *= correction;
        for (int r = 0; r < MAX_DIMS_PER_THREAD; ++r) acc[r] *= correction;
        for (int j = 0; j < n; ++j) {
            const int key = tile_start + j;
            const i64 slot = (i64)table[key / p.block_size] * p.block_size + key % p.block_size;
            const T* vr = v_cache + slot * p.v_row + (i64)kv_head * dv;
            const float weight = expf(scores[j] - new_max);
            running_sum += weight;
            for (int r = 0; r < MAX_DIMS_PER_THREAD; ++r) {
                const int i = threadIdx.x + r * blockDim.x;
                if (i < dv) acc[r] += weight * to_f32(vr[i]);
            }
        }
        running_max = new_max;
        __syncthreads();  // the next tile overwrites `scores`
    }
    if (sinks) {
        const float sink = sinks[h];
        const float new_max = fmaxf(running_max, sink);
        const float correction = expf(running_max - new_max);
        running_sum = running_sum * correction + expf(sink - new_max);
        for (int r = 0; r < MAX_DIMS_PER_THREAD; ++r) acc[r] *= correction;
    }
    T* oh = out + ((i64)t * p.num_heads + h) * dv;
    const float inv_sum = 1.0f / running_sum;
    for (int r = 0; r < MAX_DIMS_PER_THREAD; ++r) {
        const int i = threadIdx.x + r * blockDim.x;
        if (i < dv) oh[i] = from_f32<T>(acc[r] * inv_sum);
    }
}

#define DEFINE_PAGED_ATTENTION(SUFFIX, T)                                                      \
    extern "C" __global__ void paged_attention_##SUFFIX(                                       \
        T* out, const T* q, const T* k_cache, const T* v_cache, const int* block_tables,       \
        const int* token_seq, const int* positions, const float* sinks,                        \
        PagedAttentionParams p) {                                                              \
        paged_attention<T>(out, q, k_cache, v_cache, block_tables, token_seq, positions, sinks, \
                           p);                                                                 \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_PAGED_ATTENTION)
