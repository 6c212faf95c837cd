// The emulator's stand-in for CUDA's cuda_bf16.h: the upper 16 bits of an f32, rounded to
// nearest even like __float2bfloat16_rn.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t x = (uint32_t)h.bits << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((x >> 16) | 0x40u)};  // NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return {(uint16_t)(x >> 16)};
}
