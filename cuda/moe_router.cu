// The MoE router in one kernel: logits → softmax → top-k → renormalise (`renormalize`: Mixtral,
// `norm_topk_prob`; else the kept pairs keep their softmax probabilities) → capacity slots.
// Follows HF `MixtralSparseMoeBlock` (softmax in f32, `torch.topk`, divide by the chosen sum);
// ties go to the lower expert index, as in the CPU router.
//
// Slots: each kept (token, expert) pair takes `slot = atomicAdd(&expert_counts[e], 1)`, its row
// inside expert e's segment of the permuted activations (moe_permute.cu). With a capacity C > 0
// a pair whose slot is >= C is dropped (slot -1) and the token's remaining weights are
// renormalised, as the CPU `drop` policy does.
// NOTE: atomics hand out slots in arrival order, not token order. Dropless routing (the
// default) does not care: every pair is computed wherever its row lands. With a capacity, which
// pairs overflow can differ from the CPU's token-order choice; FIXME: token-order ranks (a scan
// over the step's pairs) before the CUDA path serves `--capacity-factor`.

#define MAX_EXPERTS_PER_LANE 8  // up to 256 experts
#define MAX_TOP_K 8

// logits: [num_tokens, num_experts] (the gate GEMM's output); bias: [num_experts] or null.
// Out: topk_ids, topk_weights, slots: [num_tokens, top_k]; expert_counts: [num_experts], zeroed
// before the launch, ends as the number of pairs that asked for each expert.
// Grid: one warp per token (blockDim.x a multiple of 32).
template <typename T>
__device__ void route_top_k(const T* logits, const float* bias, int* topk_ids,
                            float* topk_weights, int* slots, int* expert_counts, int num_tokens,
                            int num_experts, int top_k, int capacity, int renormalize) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= num_tokens) return;
    float prob[MAX_EXPERTS_PER_LANE];
    float row_max = NEG_INF;
    for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
        const int e = lane + 32 * r;
        prob[r] = NEG_INF;
        if (e < num_experts) {
            prob[r] = to_f32(logits[(i64)t * num_experts + e]) + (bias ? bias[e] : 0.0f);
            row_max = fmaxf(row_max, prob[r]);
        }
    }
    row_max = warp_max(row_max);
    float sum = 0.0f;
    for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
        if (lane + 32 * r < num_experts) {
            prob[r] = expf(prob[r] - row_max);
            sum += prob[r];
        }
    }
    const float inv_sum = 1.0f / warp_sum(sum);
    for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) prob[r] *= inv_sum;  // -inf stays -inf
    int chosen[MAX_TOP_K];
    float chosen_prob[MAX_TOP_K];
    for (int j = 0; j < top_k; ++j) {
        // This lane's best (highest probability, then lowest index), then the warp's.
        float best = NEG_INF;
        int best_e = num_experts;
        for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
            const int e = lane + 32 * r;
            if (prob[r] > best) best = prob[r], best_e = e;
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, offset);
            const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
            if (other > best || (other == best && other_e < best_e)) best = other, best_e = other_e;
        }
        chosen[j] = best_e;
        chosen_prob[j] = best;
        if ((best_e & 31) == lane) prob[best_e >> 5] = NEG_INF;  // out of the running
    }
    if (lane != 0) return;
    float kept_sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        int slot = atomicAdd(&expert_counts[chosen[j]], 1);
        if (capacity > 0 && slot >= capacity) slot = -1;
        slots[(i64)t * top_k + j] = slot;
        topk_ids[(i64)t * top_k + j] = chosen[j];
        if (slot >= 0) kept_sum += chosen_prob[j];  // rank order, as the CPU sums
    }
    for (int j = 0; j < top_k; ++j) {
        const bool kept = slots[(i64)t * top_k + j] >= 0;
        const float w = renormalize ? chosen_prob[j] / kept_sum : chosen_prob[j];
        topk_weights[(i64)t * top_k + j] = kept ? w : 0.0f;
    }
}

#define DEFINE_ROUTE_TOP_K(SUFFIX, T)                                                          \
    extern "C" __global__ void route_top_k_##SUFFIX(                                           \
        const T* logits, const float* bias, int* topk_ids, float* topk_weights, int* slots,    \
        int* expert_counts, int num_tokens, int num_experts, int top_k, int capacity,          \
        int renormalize) {                                                                     \
        route_top_k<T>(logits, bias, topk_ids, topk_weights, slots, expert_counts, num_tokens, \
                       num_experts, top_k, capacity, renormalize);                             \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_ROUTE_TOP_K)
