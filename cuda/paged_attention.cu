// Grouped-query attention of every step token over a paged KV cache, for prefill and decode
// alike: the step's keys and values are written to the cache first (kv_cache.cu), so a query at
// position p attends to its own sequence's slots first..=p, found through the block table.
// `first` is 0, or p + 1 - sliding_window with a window (HF admits keys j with p - j < window).
// GPT-OSS's sinks (one logit per head, or null) join the softmax's denominator and add no value.
// Multi-head latent attention (DeepSeek-V2/V3) runs on the same kernel: one "KV head" whose key is
// the whole cached latent row (`kv_lora_rank + qk_rope_head_dim`) and whose value is the row's
// first `kv_lora_rank` elements (k_cache and v_cache the same buffer, value_dim < head_dim).
//
// A block computes up to MAX_ROWS query rows that share their keys: the query heads of one KV
// group (`heads_per_block` of them) for each token of a tile of consecutive tokens of one
// sequence (`tiles`, made on the host: decode tokens alone, prefill tokens in runs). Each K/V row
// is read once per block, not once per query head and token (vLLM's GQA-aware decode and a
// query-tiled prefill in one kernel). Keys are visited in tiles of TILE with an online softmax
// (running max and sum per row, the FlashAttention recurrence), so any context fits in shared
// memory. Each warp scores keys of the tile against every row (lanes split the key's width,
// coalesced reads); each thread then accumulates its own output dimensions for every row.
//
// Long contexts are split (vLLM's paged-attention v2): grid.z partitions of `partition_len` keys
// each write their rows' running max, sum and unnormalised output to `partials`, and
// `paged_attention_reduce` combines them; with one partition the block writes `out` itself.

#define TILE 64
#define MAX_ROWS 8
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
    int heads_per_block; // query heads of one KV group per block (≤ MAX_ROWS)
    int num_partitions;  // 1: no split
    int partition_len;   // keys per partition (a multiple of TILE)
};

// One query row of a block: its token, head, and the keys it may see.
struct Row {
    int token, head, first, last;
};

__device__ __forceinline__ i64 slot_of(const int* table, int key, int block_size) {
    return (i64)table[key / block_size] * block_size + key % block_size;
}

// q: [num_tokens, num_heads * head_dim]; out: [num_tokens, num_heads * value_dim]; k_cache,
// v_cache: one layer, [num_blocks * block_size, k_row] and [.., v_row], kv head g's key at
// g * head_dim of a row and its value at g * value_dim; block_tables: [num_seqs,
// max_blocks_per_seq]; token_seq, positions: [num_tokens]; tiles: [num_tiles, 2] (first token,
// token count; the tokens of a tile belong to one sequence, count * heads_per_block ≤ MAX_ROWS);
// partials: [num_tokens, num_heads, num_partitions, value_dim + 2] when split (else unused).
// Grid (num_tiles, num_kv_heads * ceil(group / heads_per_block), num_partitions); blockDim.x a
// multiple of 32 with value_dim ≤ MAX_DIMS_PER_THREAD * blockDim.x; dynamic shared memory
// (MAX_ROWS * (head_dim + TILE) + 3 * MAX_ROWS) floats.
template <typename T>
__device__ void paged_attention(T* out, float* partials, const T* q, const T* k_cache,
                                const T* v_cache, const int* block_tables, const int* token_seq,
                                const int* positions, const int* tiles, const float* sinks,
                                PagedAttentionParams p) {
    extern __shared__ float smem[];
    const int d = p.head_dim, dv = p.value_dim;
    float* q_s = smem;                             // [MAX_ROWS][d]
    float* w_s = q_s + MAX_ROWS * d;               // [MAX_ROWS][TILE]: scores, then weights
    float* run_max = w_s + MAX_ROWS * TILE;        // [MAX_ROWS]
    float* run_sum = run_max + MAX_ROWS;           // [MAX_ROWS]
    float* correction = run_sum + MAX_ROWS;        // [MAX_ROWS]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;

    const int t0 = tiles[2 * blockIdx.x], num_tokens = tiles[2 * blockIdx.x + 1];
    const int group = p.num_heads / p.num_kv_heads;
    const int chunks = (group + p.heads_per_block - 1) / p.heads_per_block;
    const int kv_head = blockIdx.y / chunks;
    const int h0 = kv_head * group + (blockIdx.y % chunks) * p.heads_per_block;
    const int nh = min(p.heads_per_block, kv_head * group + group - h0);
    const int rows = num_tokens * nh;  // row r: token t0 + r / nh, head h0 + r % nh
    const int* table = block_tables + (i64)token_seq[t0] * p.max_blocks_per_seq;

    Row row[MAX_ROWS];
    int lo = 1 << 30, hi = -1;
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r < rows) {
            row[r].token = t0 + r / nh;
            row[r].head = h0 + r % nh;
            const int pos = positions[row[r].token];
            row[r].first = p.sliding_window > 0 ? max(0, pos + 1 - p.sliding_window) : 0;
            row[r].last = pos;
            lo = min(lo, row[r].first);
            hi = max(hi, row[r].last);
        }
    }
    // This block's partition of the keys.
    const int part = blockIdx.z;
    lo = max(lo, part * p.partition_len);
    hi = min(hi, (part + 1) * p.partition_len - 1);

    for (int i = threadIdx.x; i < rows * d; i += blockDim.x) {
        const int r = i / d;
        const int token = t0 + r / nh, head = h0 + r % nh;
        q_s[i] = to_f32(q[((i64)token * p.num_heads + head) * d + i % d]);
    }
    if (threadIdx.x < MAX_ROWS) run_max[threadIdx.x] = NEG_INF, run_sum[threadIdx.x] = 0.0f;
    float acc[MAX_ROWS][MAX_DIMS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < MAX_DIMS_PER_THREAD; ++c) acc[r][c] = 0.0f;
    __syncthreads();

    for (int tile_start = lo; tile_start <= hi; tile_start += TILE) {
        const int n = min(TILE, hi + 1 - tile_start);
        // Scores: a warp per key, the key read once for every row.
        for (int j = warp; j < n; j += num_warps) {
            const int key = tile_start + j;
            const T* kr = k_cache + slot_of(table, key, p.block_size) * p.k_row + (i64)kv_head * d;
            float s[MAX_ROWS];
#pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) s[r] = 0.0f;
            for (int i = lane; i < d; i += 32) {
                const float k = to_f32(kr[i]);
#pragma unroll
                for (int r = 0; r < MAX_ROWS; ++r)
                    if (r < rows) s[r] += q_s[r * d + i] * k;
            }
#pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r < rows) {
                    const float v = warp_sum(s[r]);
                    const bool seen = key >= row[r].first && key <= row[r].last;
                    if (lane == 0) w_s[r * TILE + j] = seen ? v * p.scale : NEG_INF;
                }
            }
        }
        __syncthreads();
        // The online softmax: a warp per row turns its scores into weights.
        for (int r = warp; r < rows; r += num_warps) {
            float m = NEG_INF;
            for (int j = lane; j < n; j += 32) m = fmaxf(m, w_s[r * TILE + j]);
            m = warp_max(m);
            const float old = run_max[r], next = fmaxf(old, m);
            float sum = 0.0f;
            for (int j = lane; j < n; j += 32) {
                const float e = next == NEG_INF ? 0.0f : expf(w_s[r * TILE + j] - next);
                w_s[r * TILE + j] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float c = old == NEG_INF ? 0.0f : expf(old - next);
                correction[r] = c;
                run_sum[r] = run_sum[r] * c + sum;
                run_max[r] = next;
            }
        }
        __syncthreads();
        // Values: each thread its own dimensions, every row, the value read once.
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
            if (r < rows) {
                const float c = correction[r];
#pragma unroll
                for (int x = 0; x < MAX_DIMS_PER_THREAD; ++x) acc[r][x] *= c;
            }
        }
        for (int j = 0; j < n; ++j) {
            const int key = tile_start + j;
            const T* vr = v_cache + slot_of(table, key, p.block_size) * p.v_row + (i64)kv_head * dv;
#pragma unroll
            for (int x = 0; x < MAX_DIMS_PER_THREAD; ++x) {
                const int i = threadIdx.x + x * blockDim.x;
                if (i < dv) {
                    const float v = to_f32(vr[i]);
#pragma unroll
                    for (int r = 0; r < MAX_ROWS; ++r)
                        if (r < rows) acc[r][x] += w_s[r * TILE + j] * v;
                }
            }
        }
        __syncthreads();  // the next tile overwrites the weights
    }

#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r >= rows) continue;
        const int token = row[r].token, head = row[r].head;
        float m = run_max[r], sum = run_sum[r], scale = 1.0f;
        if (p.num_partitions > 1) {
            // This partition's share; paged_attention_reduce normalises.
            float* part_row =
                partials + (((i64)token * p.num_heads + head) * p.num_partitions + part) * (dv + 2);
            if (threadIdx.x == 0) part_row[0] = m, part_row[1] = sum;
#pragma unroll
            for (int x = 0; x < MAX_DIMS_PER_THREAD; ++x) {
                const int i = threadIdx.x + x * blockDim.x;
                if (i < dv) part_row[2 + i] = acc[r][x];
            }
            continue;
        }
        if (sinks) {
            const float sink = sinks[head], next = fmaxf(m, sink);
            scale = m == NEG_INF ? 0.0f : expf(m - next);
            sum = sum * scale + expf(sink - next);
        }
        const float inv = sum > 0.0f ? scale / sum : 0.0f;
        T* oh = out + ((i64)token * p.num_heads + head) * dv;
#pragma unroll
        for (int x = 0; x < MAX_DIMS_PER_THREAD; ++x) {
            const int i = threadIdx.x + x * blockDim.x;
            if (i < dv) oh[i] = from_f32<T>(acc[r][x] * inv);
        }
    }
}

// Combines the partitions of a split attention: out = Σ_p e^{m_p - M} acc_p / Σ_p e^{m_p - M}
// sum_p (with the sink in the denominator). Grid (num_tokens, num_heads); blockDim.x threads.
template <typename T>
__device__ void paged_attention_reduce(T* out, const float* partials, const float* sinks,
                                       int num_heads, int num_partitions, int value_dim) {
    const int token = blockIdx.x, head = blockIdx.y;
    const float* rows = partials + ((i64)token * num_heads + head) * num_partitions * (value_dim + 2);
    float m = NEG_INF;
    for (int part = 0; part < num_partitions; ++part) m = fmaxf(m, rows[part * (value_dim + 2)]);
    float sum = 0.0f;
    for (int part = 0; part < num_partitions; ++part) {
        const float pm = rows[part * (value_dim + 2)];
        if (pm != NEG_INF) sum += expf(pm - m) * rows[part * (value_dim + 2) + 1];
    }
    float scale = 1.0f;
    if (sinks) {
        const float sink = sinks[head], next = fmaxf(m, sink);
        scale = m == NEG_INF ? 0.0f : expf(m - next);
        sum = sum * scale + expf(sink - next);
    }
    const float inv = sum > 0.0f ? scale / sum : 0.0f;
    T* oh = out + ((i64)token * num_heads + head) * value_dim;
    for (int i = threadIdx.x; i < value_dim; i += blockDim.x) {
        float acc = 0.0f;
        for (int part = 0; part < num_partitions; ++part) {
            const float pm = rows[part * (value_dim + 2)];
            if (pm != NEG_INF) acc += expf(pm - m) * rows[part * (value_dim + 2) + 2 + i];
        }
        oh[i] = from_f32<T>(acc * inv);
    }
}

#define DEFINE_PAGED_ATTENTION(SUFFIX, T)                                                       \
    extern "C" __global__ void paged_attention_##SUFFIX(                                        \
        T* out, float* partials, const T* q, const T* k_cache, const T* v_cache,                \
        const int* block_tables, const int* token_seq, const int* positions, const int* tiles,  \
        const float* sinks, PagedAttentionParams p) {                                           \
        paged_attention<T>(out, partials, q, k_cache, v_cache, block_tables, token_seq,         \
                           positions, tiles, sinks, p);                                         \
    }                                                                                           \
    extern "C" __global__ void paged_attention_reduce_##SUFFIX(                                 \
        T* out, const float* partials, const float* sinks, int num_heads, int num_partitions,   \
        int value_dim) {                                                                        \
        paged_attention_reduce<T>(out, partials, sinks, num_heads, num_partitions, value_dim);  \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_PAGED_ATTENTION)
