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

// Slots are read in blocks of kBlock: a block's fields are decoded into L1 once, then every query row meets
// the whole block. Logits: per row, kBlock accumulators over the head dimension, reduced to one vector of
// kBlock logits by a tree of horizontal adds (one reduction per row and block, not one per slot, which would
// cost as much as the dot products). Values: per row, the block's kBlock probabilities broadcast once and an
// 8-wide chunk of the output kept in a register while every slot of the block is added into it.
constexpr int kBlock = 8;

// {sum(a[0]), ..., sum(a[7])}.
inline Vec8 reduce8(const Vec8* a) {
#if defined(__AVX__)
    __m256 x[8];
    std::memcpy(x, a, sizeof x);
    const __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
    const __m256 t2 = _mm256_hadd_ps(x[4], x[5]), t3 = _mm256_hadd_ps(x[6], x[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    Vec8 out;
    std::memcpy(&out, &r, sizeof out);
    return out;
#else
    Vec8 out;
    for (int s = 0; s < 8; ++s) {
        const Vec8 v = a[s];
        out[s] = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    }
    return out;
#endif
}

// out[j] = {x[0][e + j], ..., x[7][e + j]} for j < 8: an 8 x 8 transpose of the block's columns e .. e + 7.
inline void transpose8(const float* const* x, int e, Vec8* out) {
#if defined(__AVX__)
    __m256 r[8], t[8];
    for (int s = 0; s < 8; ++s) r[s] = _mm256_loadu_ps(x[s] + e);
    for (int s = 0; s < 8; s += 2) {
        t[s] = _mm256_unpacklo_ps(r[s], r[s + 1]);
        t[s + 1] = _mm256_unpackhi_ps(r[s], r[s + 1]);
    }
    for (int s = 0; s < 8; s += 4) {
        r[s] = _mm256_shuffle_ps(t[s], t[s + 2], 0x44);
        r[s + 1] = _mm256_shuffle_ps(t[s], t[s + 2], 0xee);
        r[s + 2] = _mm256_shuffle_ps(t[s + 1], t[s + 3], 0x44);
        r[s + 3] = _mm256_shuffle_ps(t[s + 1], t[s + 3], 0xee);
    }
    for (int j = 0; j < 4; ++j) {  // r[j]: columns j and j + 4 of rows 0-3, r[j + 4]: of rows 4-7
        const __m256 lo = _mm256_permute2f128_ps(r[j], r[j + 4], 0x20);
        const __m256 hi = _mm256_permute2f128_ps(r[j], r[j + 4], 0x31);
        std::memcpy(out + j, &lo, sizeof lo);
        std::memcpy(out + j + 4, &hi, sizeof hi);
    }
#else
    for (int j = 0; j < 8; ++j)
        for (int s = 0; s < 8; ++s) out[j][s] = x[s][e + j];
#endif
}

// lg[r * stride + s] = q_r . x[s] for every row r and the first n slots of a block (x[s] of the others: zeros).
//
// From 8 rows on (a prefill chunk's tile), the block is transposed first (kt[e] = element e of the 8 slots), so that
// 8 rows at a time accumulate their 8 logits in one register each over the head dim, with no horizontal sum: the
// reduction per row and block cost a fifth of the logits phase of a chunk tile (perf), and its price, one
// transpose per block, is paid once for all the rows.
template <int D>
inline void dot_block(const float* q, int rows, int dim, const float* const* x, int n, float* lg, int64_t stride) {
    const int d = D ? D : dim;
    const int whole = d / 8 * 8;
    int r0 = 0;
    if constexpr (D != 0 && D % 8 == 0) {
        if (rows >= 8) {
            alignas(32) Vec8 kt[D];
            for (int e = 0; e < D; e += 8) transpose8(x, e, kt + e);
            for (; r0 + 8 <= rows; r0 += 8) {
                Vec8 acc[8] = {};
                const float* q0 = q + static_cast<int64_t>(r0) * D;
                for (int e = 0; e < D; ++e)
                    for (int i = 0; i < 8; ++i) acc[i] += q0[i * D + e] * kt[e];
                for (int i = 0; i < 8; ++i) {
                    float* out = lg + (r0 + i) * stride;
                    if (n == kBlock) {
                        store_vec(out, acc[i]);
                    } else {
                        for (int s = 0; s < n; ++s) out[s] = acc[i][s];
                    }
                }
            }
        }
    }
    for (int r = r0; r < rows; ++r) {
        const float* qr = q + static_cast<int64_t>(r) * d;
        Vec8 acc[kBlock] = {};
        for (int e = 0; e < whole; e += 8) {
            const Vec8 qv = load_vec<Vec8>(qr + e);
            for (int s = 0; s < kBlock; ++s) acc[s] += qv * load_vec<Vec8>(x[s] + e);
        }
        Vec8 sums = reduce8(acc);
        for (int e = whole; e < d; ++e)
            for (int s = 0; s < kBlock; ++s) sums[s] += qr[e] * x[s][e];
        float* out = lg + r * stride;
        if (n == kBlock) {
            store_vec(out, sums);
        } else {
            for (int s = 0; s < n; ++s) out[s] = sums[s];
        }
    }
}

// o[r] += sum over the first n slots of p[r * stride + s] * f[2 * r] * x[s], for every row r.
//
// With the head dim a constant, R rows' outputs stay in 16 vector registers for the whole block: each 8-wide
// chunk of a slot's values is loaded once for R rows, and the adds into one register are spread over R * D / 8
// independent chains (one row at a time, each chunk was a chain of kBlock dependent adds between a load and a
// store of the output: latency-bound, a quarter of split_values' time in a chunked prefill, perf).
// Rows r .. r + R - 1 of axpy_block, their outputs held in R * D / 8 registers over the block.
template <int D, int R>
__attribute__((always_inline)) inline void axpy_rows(float* o, int r, const float* p, int64_t stride, const float* f,
                                                     const float* const* x, int n) {
    constexpr int C = D / 8;
    float* o0 = o + static_cast<int64_t>(r) * D;
    Vec8 acc[R][C];
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) acc[i][c] = load_vec<Vec8>(o0 + i * D + 8 * c);
    for (int s = 0; s < n; ++s) {
        float wv[R];
        for (int i = 0; i < R; ++i) wv[i] = p[(r + i) * stride + s] * f[2 * (r + i)];
        for (int c = 0; c < C; ++c) {
            const Vec8 xv = load_vec<Vec8>(x[s] + 8 * c);
            for (int i = 0; i < R; ++i) acc[i][c] += wv[i] * xv;
        }
    }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) store_vec(o0 + i * D + 8 * c, acc[i][c]);
}

template <int D>
inline void axpy_block(float* o, int rows, int dim, const float* p, int64_t stride, const float* f,
                       const float* const* x_, int n) {
    const float* x[kBlock];  // a local copy: the stores into o could alias the caller's array of pointers
    for (int s = 0; s < kBlock; ++s) x[s] = x_[s];
    int r = 0;
    if constexpr (D != 0 && D % 8 == 0) {
        constexpr int C = D / 8, R = C >= 16 ? 1 : 16 / C;
#if defined(__AVX512VL__)
        // 32 vector registers: three rows of a 64-wide head (24 accumulators) at once, a 3-way GQA group's whole
        // decode step (SmolLM2's), where pairs left the third row to the generic loop below.
        if constexpr (C == 8) {
            if (rows == 3) {
                axpy_rows<D, 3>(o, 0, p, stride, f, x, n);
                return;
            }
        }
#endif
        for (; r + R <= rows; r += R) axpy_rows<D, R>(o, r, p, stride, f, x, n);
    }
    const int d = D ? D : dim;
    const int whole = d / 8 * 8;
    for (; r < rows; ++r) {
        float* orow = o + static_cast<int64_t>(r) * d;
        const float* pr = p + r * stride;
        float w[kBlock];
        for (int s = 0; s < kBlock; ++s) w[s] = s < n ? pr[s] * f[2 * r] : 0.0f;
        Vec8 wb[kBlock];
        for (int s = 0; s < kBlock; ++s) wb[s] = Vec8{} + w[s];
        for (int e = 0; e < whole; e += 8) {
            Vec8 acc = load_vec<Vec8>(orow + e);
            for (int s = 0; s < kBlock; ++s) acc += wb[s] * load_vec<Vec8>(x[s] + e);
            store_vec(orow + e, acc);
        }
        for (int e = whole; e < d; ++e) {
            float acc = orow[e];
            for (int s = 0; s < kBlock; ++s) acc += w[s] * x[s][e];
            orow[e] = acc;
        }
    }
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
