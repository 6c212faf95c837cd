// Writes the step's keys and values into one layer's paged KV cache by slot mapping (vLLM's
// `reshape_and_cache`). The cache of a layer is `[num_blocks * block_size, kv_dim]`, slot-major,
// the layout of the CPU backend's `PagedKvCache`; slot = block_id * block_size + offset.
// A negative slot marks a padding token and is skipped.

// k, v: [num_tokens, kv_dim]. Grid: one block per token.
template <typename T>
__device__ void write_kv(const T* k, const T* v, T* k_cache, T* v_cache, const i64* slot_mapping,
                         int kv_dim) {
    const i64 slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const i64 src = (i64)blockIdx.x * kv_dim, dst = slot * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        k_cache[dst + i] = k[src + i];
        v_cache[dst + i] = v[src + i];
    }
}

#define DEFINE_WRITE_KV(SUFFIX, T)                                                             \
    extern "C" __global__ void write_kv_##SUFFIX(const T* k, const T* v, T* k_cache,           \
                                                 T* v_cache, const i64* slot_mapping,          \
                                                 int kv_dim) {                                 \
        write_kv<T>(k, v, k_cache, v_cache, slot_mapping, kv_dim);                             \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_WRITE_KV)
