// The MoE router in one kernel, for every family's scoring, as the CPU router (`moe/router.rs`)
// computes it: logits (+ the router's bias) → scores → groups → top-k → weights → capacity
// slots.
// - Scores: softmax over all experts in f32 (Mixtral, Qwen, OLMoE, DeepSeek-V2; HF's
//   `MixtralSparseMoeBlock`), or `sigmoid(logit)` (DeepSeek-V3, GLM-4.5), ranked by the score
//   plus `e_score_correction_bias` where the layer has one, weighted by the score alone.
// - Groups (`n_group`, `topk_group`): only the experts of the `keep_groups` best of `groups`
//   equal groups are ranked; a group scores the sum of its two best ranking values (sigmoid:
//   `noaux_tc`) or its best (softmax: `group_limited_greedy`); ties go to the lower group.
// - Top-k by the ranking values, ties to the lower expert index (as the CPU's sort); the kept
//   pairs' weights renormalised to sum to 1 (`renormalize`: Mixtral, `norm_topk_prob`) in rank
//   order, then multiplied by `scale` (`routed_scaling_factor`).
//
// Slots: each kept (token, expert) pair takes `slot = atomicAdd(&expert_counts[e], 1)`, its row
// inside expert e's segment of the permuted activations (moe_permute.cu). With a capacity C > 0
// a pair whose slot is >= C is dropped (slot -1) and the token's remaining weights are
// renormalised, as the CPU `drop` policy does.
// NOTE: atomics hand out slots in arrival order, not token order. Dropless routing (the
// default) does not care: every pair is computed wherever its row lands. With a capacity, which
// pairs overflow can differ from the CPU's token-order choice, so the model routes steps with
// a capacity on the host (FIXME: token-order ranks, a scan over the step's pairs).

#define MAX_EXPERTS_PER_LANE 8  // up to 256 experts
#define MAX_TOP_K 8
#define MAX_GROUPS 32

// Of the warp's (value, expert, weight) candidates, the highest value, then the lowest expert;
// every lane ends with the winner.
__device__ __forceinline__ void warp_best(float& value, int& expert, float& weight) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        const int other_e = __shfl_xor_sync(0xffffffffu, expert, offset);
        const float other_w = __shfl_xor_sync(0xffffffffu, weight, offset);
        if (other > value || (other == value && other_e < expert)) {
            value = other, expert = other_e, weight = other_w;
        }
    }
}

// Sets the ranking values of the experts outside the `keep_groups` best groups to -inf. Every
// lane computes the same group scores (warp reductions: the sum of a group's two best with
// `top_two`, else its best) and the same choice of groups.
__device__ void mask_groups(float* choice, int lane, int num_experts, int groups,
                            int keep_groups, int top_two) {
    const int size = num_experts / groups;
    float score[MAX_GROUPS];
    for (int g = 0; g < groups; ++g) {
        // This lane's two best of the group, then the warp's (the top two of the union).
        float best = NEG_INF, second = NEG_INF;
        for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
            const int e = lane + 32 * r;
            if (e < num_experts && e / size == g) {
                const float v = choice[r];
                if (v > best) second = best, best = v;
                else if (v > second) second = v;
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, offset);
            const float other_second = __shfl_xor_sync(0xffffffffu, second, offset);
            second = fmaxf(fminf(best, other), fmaxf(second, other_second));
            best = fmaxf(best, other);
        }
        score[g] = top_two && size > 1 ? best + second : best;
    }
    unsigned kept = 0;
    for (int j = 0; j < keep_groups; ++j) {
        int pick = -1;
        for (int g = 0; g < groups; ++g) {
            if (!((kept >> g) & 1u) && (pick < 0 || score[g] > score[pick])) pick = g;
        }
        kept |= 1u << pick;
    }
    for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
        const int e = lane + 32 * r;
        if (e < num_experts && !((kept >> (e / size)) & 1u)) choice[r] = NEG_INF;
    }
}

// logits: [num_tokens, num_experts] (the gate GEMM's output); bias: [num_experts] or null,
// added to the logits; correction: [num_experts] or null (sigmoid scoring), added to the
// scores for ranking only. groups <= 1: no group limit.
// Out: topk_ids, topk_weights, slots: [num_tokens, top_k]; expert_counts: [num_experts], zeroed
// before the launch, ends as the number of pairs that asked for each expert.
// Grid: one warp per token (blockDim.x a multiple of 32).
template <typename T>
__device__ void route_top_k(const T* logits, const float* bias, const float* correction,
                            int* topk_ids, float* topk_weights, int* slots, int* expert_counts,
                            int num_tokens, int num_experts, int top_k, int capacity,
                            int renormalize, int sigmoid, int groups, int keep_groups,
                            float scale) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= num_tokens) return;
    float weight[MAX_EXPERTS_PER_LANE];  // what a chosen expert weighs
    float choice[MAX_EXPERTS_PER_LANE];  // what ranks it
    float row_max = NEG_INF;
    for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
        const int e = lane + 32 * r;
        weight[r] = NEG_INF;
        if (e < num_experts) {
            weight[r] = to_f32(logits[(i64)t * num_experts + e]) + (bias ? bias[e] : 0.0f);
            row_max = fmaxf(row_max, weight[r]);
        }
    }
    if (sigmoid) {
        for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
            const int e = lane + 32 * r;
            choice[r] = NEG_INF;
            if (e < num_experts) {
                weight[r] = 1.0f / (1.0f + expf(-weight[r]));
                choice[r] = weight[r] + (correction ? correction[e] : 0.0f);
            }
        }
    } else {
        row_max = warp_max(row_max);
        float sum = 0.0f;
        for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
            if (lane + 32 * r < num_experts) {
                weight[r] = expf(weight[r] - row_max);
                sum += weight[r];
            }
        }
        const float inv_sum = 1.0f / warp_sum(sum);
        for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
            weight[r] *= inv_sum;  // -inf stays -inf
            choice[r] = weight[r];
        }
    }
    if (groups > 1) mask_groups(choice, lane, num_experts, groups, keep_groups, sigmoid);
    int chosen[MAX_TOP_K];
    float chosen_weight[MAX_TOP_K];
    for (int j = 0; j < top_k; ++j) {
        // This lane's best (highest ranking value, then lowest index), then the warp's.
        float best = NEG_INF, best_w = 0.0f;
        int best_e = num_experts;
        for (int r = 0; r < MAX_EXPERTS_PER_LANE; ++r) {
            const int e = lane + 32 * r;
            if (choice[r] > best) best = choice[r], best_e = e, best_w = weight[r];
        }
        warp_best(best, best_e, best_w);
        chosen[j] = best_e;
        chosen_weight[j] = best_w;
        if ((best_e & 31) == lane) choice[best_e >> 5] = NEG_INF;  // out of the running
    }
    if (lane != 0) return;
    float kept_sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        int slot = atomicAdd(&expert_counts[chosen[j]], 1);
        if (capacity > 0 && slot >= capacity) slot = -1;
        slots[(i64)t * top_k + j] = slot;
        topk_ids[(i64)t * top_k + j] = chosen[j];
        if (slot >= 0) kept_sum += chosen_weight[j];  // rank order, as the CPU sums
    }
    for (int j = 0; j < top_k; ++j) {
        const bool kept = slots[(i64)t * top_k + j] >= 0;
        const float w = renormalize ? chosen_weight[j] / kept_sum : chosen_weight[j];
        topk_weights[(i64)t * top_k + j] = kept ? w * scale : 0.0f;
    }
}

#define DEFINE_ROUTE_TOP_K(SUFFIX, T)                                                          \
    extern "C" __global__ void route_top_k_##SUFFIX(                                           \
        const T* logits, const float* bias, const float* correction, int* topk_ids,            \
        float* topk_weights, int* slots, int* expert_counts, int num_tokens, int num_experts,   \
        int top_k, int capacity, int renormalize, int sigmoid, int groups, int keep_groups,    \
        float scale) {                                                                         \
        route_top_k<T>(logits, bias, correction, topk_ids, topk_weights, slots, expert_counts, \
                       num_tokens, num_experts, top_k, capacity, renormalize, sigmoid, groups, \
                       keep_groups, scale);                                                    \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_ROUTE_TOP_K)
