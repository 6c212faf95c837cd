// Row gathers: the token embedding (into the f32 residual stream) and the selection of rows
// (the last token of every sequence before the final norm and lm_head).

// out[t] = table[ids[t]] widened to f32; table: [vocab, hidden]. Grid: one block per token.
template <typename T>
__device__ void embedding(const T* table, const u32* ids, float* out, int hidden) {
    const T* row = table + (i64)ids[blockIdx.x] * hidden;
    float* o = out + (i64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = to_f32(row[i]);
}

#define DEFINE_EMBEDDING(SUFFIX, T)                                                            \
    extern "C" __global__ void embedding_##SUFFIX(const T* table, const u32* ids, float* out,  \
                                                  int hidden) {                                \
        embedding<T>(table, ids, out, hidden);                                                 \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_EMBEDDING)

// dst[r] = src[rows[r]] for f32 rows of `hidden` values. Grid: one block per selected row.
extern "C" __global__ void gather_rows_f32(const float* src, const int* rows, float* dst,
                                           int hidden) {
    const float* s = src + (i64)rows[blockIdx.x] * hidden;
    float* d = dst + (i64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) d[i] = s[i];
}
