// Seeded uniform fill on the device, for synthetic benchmark weights: a 93 GB Mixtral-8x7B is
// generated where it runs instead of crossing PCIe. out[i] = scale * u(seed, i), u in [-1, 1),
// from splitmix64 of (seed, i), so any launch shape gives the same values.

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

template <typename T>
__device__ void fill_uniform(T* out, i64 n, unsigned long long seed, float scale) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const unsigned long long bits = splitmix64(seed * 0x100000001B3ull + (unsigned long long)i);
        const float u = (float)(bits >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        out[i] = from_f32<T>(u * scale);
    }
}

#define DEFINE_FILL_UNIFORM(SUFFIX, T)                                                         \
    extern "C" __global__ void fill_uniform_##SUFFIX(T* out, i64 n, unsigned long long seed,  \
                                                     float scale) {                            \
        fill_uniform<T>(out, n, seed, scale);                                                  \
    }
MOESERVE_FOR_EACH_DTYPE(DEFINE_FILL_UNIFORM)
