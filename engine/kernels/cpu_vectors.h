// What the CPU kernels share: bfloat16 loads and stores that round as torch does, and GCC/Clang
// vectors of one register: 16 floats where the target has AVX-512, else 8 (AVX2 and FMA). A
// 16-float vector on AVX2 is two registers, which doubles every kernel's register pressure:
// the GEMM's 24 sums alone then spill from AVX2's 16 registers.
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenflow {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {  // bfloat16: the high half of a float
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

inline void store(float* p, int64_t i, float value) { p[i] = value; }

inline void store(uint16_t* p, int64_t i, float value) {  // round to nearest even, as torch
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN, tested on the bits (-ffast-math)
        p[i] = 0x7fc0;
        return;
    }
    bits += 0x7fff + ((bits >> 16) & 1);
    p[i] = static_cast<uint16_t>(bits >> 16);
}

// A float as the element type holds it: bfloat16 rounds, float is unchanged.
template <typename T>
inline float round_to(float value) {
    T held;
    store(&held, 0, value);
    return load(&held, 0);
}

#ifdef __AVX512F__
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vec vload(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline vec splat(float x) { return vec{} + x; }

// Runs run(element) with a float or a uint16_t (bfloat16) element, as `bf16` says.
template <typename Run>
void by_dtype(int bf16, Run run) {
    if (bf16) run(uint16_t{});
    else run(float{});
}

}  // namespace tokenflow
