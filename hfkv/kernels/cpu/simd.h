// Vector helpers shared by the CPU kernels (paged_decode.cpp, observation.cpp): the machine's widest fp32 vector,
// its loads and stores, a lane sum and a vectorised exp. Included by each source; build.py hashes it with them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

// The machine's widest fp32 vector through GCC / Clang vector extensions (16 lanes with AVX-512, else 8), so the
// reductions below run in parallel lanes without -ffast-math, which would break the -inf masking. Wider than the
// machine's registers, GCC 12 turned its compares, selects and conversions into one scalar op per lane, with
// spills: half of split_logits' time at 8k on an AVX2 CPU (perf), in the softmax passes over the logits.
#if defined(__AVX512F__)
typedef float Vec __attribute__((vector_size(64)));
constexpr int kLanes = 16;
#else
typedef float Vec __attribute__((vector_size(32)));
constexpr int kLanes = 8;
#endif

typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

// Unaligned loads and stores of any of the vector types (Vec, or the blocked loops' Vec8: one AVX register).
template <class V = Vec>
inline V load_vec(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <class V>
inline void store_vec(float* p, V v) {
    std::memcpy(p, &v, sizeof v);
}

// A pairwise tree: a chain of dependent adds would cost more than the dot product itself.
inline float lane_sum(Vec v) {
#if defined(__AVX512F__)
    __m512 x;
    std::memcpy(&x, &v, sizeof x);
    return _mm512_reduce_add_ps(x);
#else
    Vec4 c, d;
    std::memcpy(&c, &v, sizeof c);
    std::memcpy(&d, reinterpret_cast<const char*>(&v) + sizeof c, sizeof d);
    const Vec4 e = c + d;
    return (e[0] + e[2]) + (e[1] + e[3]);
#endif
}

typedef int32_t Ints __attribute__((vector_size(sizeof(Vec))));

// exp(x) for kLanes x <= 0 (logits minus the row max), Cephes' polynomial after range reduction (within 2 ulp),
// in vector operations only; a lane holding -inf (a masked slot) gives exactly 0.
inline Vec exp_nonpositive(Vec x) {
    const Vec zero = {};
    const Ints masked = x == -INFINITY;
    x = x < -87.0f ? zero - 87.0f : x;
    const Vec t = x * 1.44269504088896341f;
    const Ints n = __builtin_convertvector(t + (t >= 0.0f ? zero + 0.5f : zero - 0.5f), Ints);
    const Vec nf = __builtin_convertvector(n, Vec);
    Vec r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    Vec p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const Ints bits = (n + 127) << 23;
    Vec scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return masked ? zero : p * scale;
}

}  // namespace
