// The emulator's stand-in for CUDA's cuda_fp16.h: __half as IEEE binary16 bits, converted with
// round-to-nearest-even like __float2half_rn.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
    uint32_t exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu, out;
    if (exp == 0) {
        if (mant == 0) {
            out = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) mant <<= 1, --exp;
            out = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        out = sign | 0x7f800000u | (mant << 13);
    } else {
        out = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &out, 4);
    return f;
}

inline __half __float2half_rn(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000u;
    const uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) return {(uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0))};
    if (abs >= 0x477ff000u) return {(uint16_t)(sign | 0x7c00u)};  // rounds to infinity
    if (abs < 0x38800000u) {  // a subnormal half: multiples of 2^-24, ties to even
        float a;
        std::memcpy(&a, &abs, 4);
        return {(uint16_t)(sign | (uint16_t)std::nearbyint(a * 16777216.0f))};
    }
    uint32_t r = ((abs - 0x38000000u) >> 13);
    const uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
    return {(uint16_t)(sign | r)};
}
