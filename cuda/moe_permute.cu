// Dispatch and combine of the MoE block on one device: permute scatters each kept (token,
// expert) pair's activations into its expert's segment, so every expert runs one GEMM over a
// contiguous [count_e, hidden] block; unpermute gathers the expert outputs back into token order
// with the routing weights.
//
//   permuted rows:  | expert 0: slots 0..c0 | expert 1: slots 0..c1 | ... |
//                   ^offsets[0]             ^offsets[1]              ^offsets[E] = rows
//
// Slots come from the router (moe_router.cu); offsets from `moe_segment_offsets`.

// offsets[e] = Σ_{e' < e} min(counts[e'], capacity) (capacity 0 = none); offsets: [E + 1].
// One thread: E is small (8 for Mixtral), and this saves a host round trip.
extern "C" __global__ void moe_segment_offsets(const int* expert_counts, int* offsets,
                                               int num_experts, int capacity) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int total = 0;
    for (int e = 0; e < num_experts; ++e) {
        offsets[e] = total;
        const int c = expert_counts[e];
        total += capacity > 0 ? min(c, capacity) : c;
    }
    offsets[num_experts] = total;
}

// x: [num_tokens, hidden] → permuted: [offsets[E], hidden]; pair_of_row[row] = t * top_k + j.
// Grid: one block per pair (num_tokens * top_k); dropped pairs (slot -1) copy nothing.
template <typename T>
__device__ void moe_permute(const T* x, const int* topk_ids, const int* slots, const int* offsets,
                            T* permuted, int* pair_of_row, int top_k, int hidden) {
    const int pair = blockIdx.x, slot = slots[pair];
    if (slot < 0) return;
    const i64 row = offsets[topk_ids[pair]] + slot;
    const T* src = x + (i64)(pair / top_k) * hidden;
    T* dst = permuted + row * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
    if (threadIdx.x == 0) pair_of_row[row] = pair;
}

// out[t] = Σ_j topk_weights[t, j] · expert_out[row(t, j)] over kept pairs, in ascending expert
// order as the CPU's combine (and HF's per-expert `index_add_` loop) sums them. With
// `sort_by_id` the token's pairs are ordered here by `topk_ids` (the router's expert ids, best
// first); without, the host laid them out in that order already (its ids are then segments).
// expert_out: [offsets[E], hidden]; out: [num_tokens, hidden]. Grid: one block per token.
#define UNPERMUTE_MAX_TOP_K 16
template <typename T>
__device__ void moe_unpermute(const T* expert_out, const int* topk_ids, const float* topk_weights,
                              const int* slots, const int* offsets, T* out, int top_k,
                              int hidden, int sort_by_id) {
    const int t = blockIdx.x;
    int order[UNPERMUTE_MAX_TOP_K];
    for (int j = 0; j < top_k; ++j) order[j] = j;
    if (sort_by_id) {
        // Insertion sort, stable: equal ids keep rank order.
        for (int j = 1; j < top_k; ++j) {
            const int v = order[j], id = topk_ids[t * top_k + v];
            int i = j - 1;
            while (i >= 0 && topk_ids[t * top_k + order[i]] > id) {
                order[i + 1] = order[i];
                --i;
            }
            order[i + 1] = v;
        }
    }
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const int pair = t * top_k + order[j], slot = slots[pair];
            if (slot < 0) continue;
            const i64 row = offsets[topk_ids[pair]] + slot;
            acc += topk_weights[pair] * to_f32(expert_out[row * hidden + i]);
        }
        out[(i64)t * hidden + i] = from_f32<T>(acc);
    }
}

#define DEFINE_MOE_PERMUTE(SUFFIX, T)                                                          \
    extern "C" __global__ void moe_permute_##SUFFIX(const T* x, const int* topk_ids,           \
                                                    const int* slots, const int* offsets,      \
                                                    T* permuted, int* pair_of_row, int top_k,  \
                                                    int hidden) {                              \
        moe_permute<T>(x, topk_ids, slots, offsets, permuted, pair_of_row, top_k, hidden);     \
    }                                                                                          \
    extern "C" __global__ void moe_unpermute_##SUFFIX(                                         \
        const T* expert_out, const int* topk_ids, const float* topk_weights, const int* slots, \
        const int* offsets, T* out, int top_k, int hidden, int sort_by_id) {                   \
        moe_unpermute<T>(expert_out, topk_ids, topk_weights, slots, offsets, out, top_k,       \
                         hidden, sort_by_id);                                                  \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_MOE_PERMUTE)
