// Greedy sampling on the device: the argmax of each logits row (ties to the lower token id, as
// the CPU sampler) and its log-probability under the full softmax, so a greedy decode step
// copies back two numbers per sequence instead of a vocabulary of logits. Other sampling
// (temperature, top-p, top-k, penalties) copies the last-token logits back to the host sampler.

// logits: [num_rows, vocab]. Grid: one block per row; blockDim.x a multiple of 32. A row the
// CPU sampler would refuse (a NaN or +inf logit, or every logit -inf) gets token -1, so the
// engine fails that request alone as it does on the CPU.
template <typename T>
__device__ void argmax_logprob(const T* logits, int* token_ids, float* logprobs, int vocab) {
    __shared__ float scratch[32];
    __shared__ float best_vals[32];
    __shared__ int best_ids[32];
    const T* row = logits + (i64)blockIdx.x * vocab;
    float best = NEG_INF;
    int best_id = vocab;
    float bad = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = to_f32(row[i]);
        if (v != v || v == -NEG_INF) bad = 1.0f;
        if (v > best) best = v, best_id = i;  // i grows, so ties keep the lower id
    }
    bad = block_max(bad, scratch);
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
        if (other > best || (other == best && other_id < best_id)) best = other, best_id = other_id;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    if (lane == 0) best_vals[warp] = best, best_ids[warp] = best_id;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < num_warps; ++w) {
            if (best_vals[w] > best || (best_vals[w] == best && best_ids[w] < best_id))
                best = best_vals[w], best_id = best_ids[w];
        }
        best_vals[0] = best, best_ids[0] = best_id;
    }
    __syncthreads();
    const float row_max = best_vals[0];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(to_f32(row[i]) - row_max);
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        const bool refused = bad > 0.0f || best_ids[0] >= vocab;
        token_ids[blockIdx.x] = refused ? -1 : best_ids[0];
        logprobs[blockIdx.x] = -logf(sum);  // log softmax at the max: (max - max) - log Σ
    }
}

#define DEFINE_ARGMAX_LOGPROB(SUFFIX, T)                                                       \
    extern "C" __global__ void argmax_logprob_##SUFFIX(const T* logits, int* token_ids,        \
                                                       float* logprobs, int vocab) {           \
        argmax_logprob<T>(logits, token_ids, logprobs, vocab);                                 \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_ARGMAX_LOGPROB)
