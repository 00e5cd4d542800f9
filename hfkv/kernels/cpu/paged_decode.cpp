// Paged decode attention on CPU: the contract of hfkv.kernels.decode_attention.paged_attention, in C++.
//
// The torch backend reads a quantized tier in a dozen tensor passes (copy the codes out of the records,
// shift, mask, convert, scale, matmul, softmax, gather the mask, scatter the scores), each a trip through
// memory. Here one (row, KV head) is one loop over its slots in blocks of eight: each record is read where
// it lies in the page, unpacked into a buffer that stays in L1 (integer codes shifted and masked eight at a
// time in a 64-bit word, widened and scaled in registers), and the block meets every query row at once, so
// a step reads every record's key field once and its value field once. Two passes over the slots (logits,
// then values) instead of an online softmax, because the probabilities are needed anyway: they are the
// decode-time significance scores, added in place to the records' score fields in the second pass.
//
// The (row, KV head) pairs, and for a step with fewer pairs than threads ranges of their slots (split-K,
// combined through each range's max and sum), run on torch's own OpenMP threads, as many as
// torch.get_num_threads() says at the call. A prefill chunk's queries go through in tiles of rows, one call per
// chunk, the tiles themselves spread over the threads (chunk_tiles_parallel).
//
// Built at first use by hfkv/kernels/cpu/build.py (plain C ABI, no Python or torch headers, so the build
// takes a second) and called through ctypes; hfkv/kernels/cpu/paged_decode.py is the Python side.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

enum Family : int32_t { MODEL = 0, INT = 1, FP8 = 2 };
enum DType : int32_t { F32 = 0, F16 = 1, BF16 = 2 };
enum Reduction : int32_t { RED_MAX = 0, RED_MEAN = 1, RED_L2 = 2 };

}  // namespace

extern "C" {

// One field (keys or values) of a record: hfkv.quant.formats.QuantFormat.
struct HfkvField {
    int32_t family;  // MODEL, INT, FP8
    int32_t bits;    // INT: 8, 4, 2
    int32_t group;   // INT: elements per scale / zero
    int32_t dtype;   // MODEL: F32, F16, BF16
    int32_t offset;  // byte offset inside the record
};

// One part of a layer's slots: the window ring / a chunk's exits (dense) or one paged tier.
// Mirrored field by field by the ctypes Structure in paged_decode.py.
struct HfkvPart {
    const void* k;           // dense: [B, H, S, D] in `dense_dtype`
    const void* v;
    const int64_t* pos;      // dense: [S] logical positions, -1 = empty
    float* score;            // dense: [B, H, S] score sums added to in place, or null
    uint8_t* pool;           // paged: the byte pool
    const int32_t* table;    // paged: [B, H, table_w] page ids
    int64_t page_bytes;
    int32_t paged;
    int32_t slots;           // per (row, head): S (dense) or table_w * tpp (paged)
    int32_t dense_dtype;
    int32_t table_w;
    int32_t tpp;
    int32_t record;          // bytes per record body in a page (keys, values, pad)
    int32_t tag_offset;      // the page's tag region: int32 position + 1 (0 = empty slot), 4 bytes a slot
    int32_t score_offset;    // the page's score region: fp32 score sum, 4 bytes a slot
    int32_t add_scores;      // add each slot's probability to its score sum (dense: needs `score`)
    HfkvField key;
    HfkvField value;
};

}  // extern "C"

namespace {

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
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

alignas(64) const float kZeros[512] = {};

struct Fp8Table {
    float value[256];
    Fp8Table() {
        for (int b = 0; b < 256; ++b) {  // e4m3fn: bias 7, no infinities, 0x7f / 0xff are NaN
            const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
            float v;
            if (exp == 15 && man == 7) v = NAN;
            else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);
            else v = std::ldexp(1.0f + man / 8.0f, exp - 7);
            value[b] = sign ? -v : v;
        }
    }
};
const Fp8Table kFp8;

// 8 byte codes -> 8 floats: two widenings and one conversion with SSE4.1 + AVX, one of each with AVX2.
inline Vec8 bytes8_to_floats(uint64_t codes) {
#if defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(codes))));
#elif defined(__AVX__)
    const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>(codes));
    const __m256i w = _mm256_insertf128_si256(_mm256_castsi128_si256(_mm_cvtepu8_epi32(b)),
                                              _mm_cvtepu8_epi32(_mm_srli_si128(b, 4)), 1);
    const __m256 f = _mm256_cvtepi32_ps(w);
#endif
#if defined(__AVX__)
    Vec8 out;
    std::memcpy(&out, &f, sizeof out);
    return out;
#else
    typedef uint8_t Bytes8 __attribute__((vector_size(8)));
    Bytes8 b;
    std::memcpy(&b, &codes, sizeof b);
    return __builtin_convertvector(b, Vec8);
#endif
}

// Integer codes in planes: byte j holds elements j, j + P, ... (bits p*b .. p*b + b of byte j), then
// fp16 scales and zeros, one per group. Eight codes of a plane are one 64-bit shift and mask, widened to
// floats and scaled in registers, so a record is decoded without a trip through memory.
template <int D, int BITS, int GROUP = 0>
__attribute__((always_inline)) inline void unpack_int(const uint8_t* src, int group_, int dim, float* out) {
    const int d = D ? D : dim;
    const int group = GROUP ? GROUP : group_;  // a constant where it can be: e / group is a division otherwise
    constexpr int kPer = 8 / BITS;
    constexpr uint64_t kMask = 0x0101010101010101ull * ((1u << BITS) - 1u);
    const int plane = d / kPer, groups = d / group;
    const uint8_t* meta = src + plane;
    float scale[64], zero[64];
    const bool fused = plane % 8 == 0 && group % 8 == 0 && groups <= 64;
    for (int g = 0; g < (fused ? groups : 0); ++g) {
        uint16_t sz[2];
        std::memcpy(&sz[0], meta + 2 * g, 2);
        std::memcpy(&sz[1], meta + 2 * (groups + g), 2);
        scale[g] = half_to_float(sz[0]);
        zero[g] = half_to_float(sz[1]);
    }
    if (fused) {
#if defined(__AVX2__)
        // Eight bytes widened once to eight 32-bit lanes, each plane then a shift and a mask in the vector
        // registers (a shift, a mask, a move from a general register and a widening per plane otherwise: 3-5%
        // of the kernel's time at 8k, K4V2). The fused multiply-add equals torch's code * scale + zero (two
        // roundings): a code of at most 8 bits times an fp16 scale is exact in fp32, so the first rounds nothing.
        const __m256i low = _mm256_set1_epi32((1 << BITS) - 1);
        for (int j = 0; j < plane; j += 8) {
            const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j)));
            for (int p = 0; p < kPer; ++p) {
                const int e = p * plane + j, g = e / group;
                __m256i c = _mm256_srli_epi32(codes, p * BITS);
                if (p + 1 < kPer) c = _mm256_and_si256(c, low);
                const __m256 x = _mm256_cvtepi32_ps(c);
                _mm256_storeu_ps(out + e, _mm256_fmadd_ps(x, _mm256_set1_ps(scale[g]), _mm256_set1_ps(zero[g])));
            }
        }
#else
        for (int j = 0; j < plane; j += 8) {
            uint64_t bytes;
            std::memcpy(&bytes, src + j, 8);
            for (int p = 0; p < kPer; ++p) {
                const int e = p * plane + j, g = e / group;
                store_vec(out + e, bytes8_to_floats((bytes >> (p * BITS)) & kMask) * scale[g] + zero[g]);
            }
        }
#endif
        return;
    }
    for (int j = 0; j < plane; ++j)
        for (int p = 0; p < kPer; ++p)
            out[p * plane + j] = static_cast<float>((static_cast<uint32_t>(src[j]) >> (p * BITS)) & ((1u << BITS) - 1u));
    for (int g = 0; g < groups; ++g) {
        uint16_t sz[2];
        std::memcpy(&sz[0], meta + 2 * g, 2);
        std::memcpy(&sz[1], meta + 2 * (groups + g), 2);
        const float sc = half_to_float(sz[0]), zr = half_to_float(sz[1]);
        for (int e = g * group; e < (g + 1) * group; ++e) out[e] = out[e] * sc + zr;
    }
}

// bf16 -> fp32 is a 16-bit shift: each half becomes the high half of a 32-bit lane (interleaved with zeros),
// eight at a time, then the tail.
inline void bf16_row(const uint16_t* h, int d, float* out) {
    int e = 0;
#if defined(__AVX__)
    const __m128i zero = _mm_setzero_si128();
    for (; e + 8 <= d; e += 8) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + e));
        const __m256i w = _mm256_insertf128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(zero, x)),
                                                  _mm_unpackhi_epi16(zero, x), 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), w);
    }
#else
    typedef uint16_t Halves8 __attribute__((vector_size(16)));
    typedef uint32_t Words8 __attribute__((vector_size(32)));
    for (; e + 8 <= d; e += 8) {
        Halves8 x;
        std::memcpy(&x, h + e, sizeof x);
        const Words8 w = __builtin_convertvector(x, Words8) << 16;
        std::memcpy(out + e, &w, sizeof w);
    }
#endif
    for (; e < d; ++e) out[e] = bf16_to_float(h[e]);
}

// A field's format as one number, so that a block of records picks its decoder once (a switch per record, and a
// call the compiler would not inline, were a third of the quantized loop's time at 8k, perf).
enum Kind : int { K_F32, K_F16, K_BF16, K_FP8, K_INT8, K_INT4, K_INT2, K_INT8_G32, K_INT4_G32, K_INT2_G32 };

inline int kind_of(const HfkvField& f) {
    if (f.family == MODEL) return f.dtype == F32 ? K_F32 : (f.dtype == BF16 ? K_BF16 : K_F16);
    if (f.family == FP8) return K_FP8;
    const int k = f.bits == 8 ? K_INT8 : (f.bits == 4 ? K_INT4 : K_INT2);
    return f.group == 32 ? k + (K_INT8_G32 - K_INT8) : k;  // 32: every shipped integer format's group
}

// Values of one field of one record, in natural order, fp32: the twin of QuantFormat.decode_at. Returns where
// they are: the record itself for fp32 fields (nothing to convert), else `out`.
template <int D, int K>
__attribute__((always_inline)) inline const float* decode_kind(const uint8_t* rec, const HfkvField& f, int dim,
                                                               float* out) {
    const int d = D ? D : dim;
    const uint8_t* src = rec + f.offset;
    if constexpr (K == K_F32) {
        return reinterpret_cast<const float*>(src);  // records are 4-byte aligned
    } else if constexpr (K == K_F16 || K == K_BF16) {
        uint16_t h[D ? D : 512];
        std::memcpy(h, src, 2 * d);
        if constexpr (K == K_BF16) {
            bf16_row(h, d, out);
        } else {
            for (int e = 0; e < d; ++e) out[e] = half_to_float(h[e]);
        }
    } else if constexpr (K == K_FP8) {
        float scale;
        std::memcpy(&scale, src + d, 4);
        for (int e = 0; e < d; ++e) out[e] = kFp8.value[src[e]] * scale;
    } else {
        constexpr bool g32 = K >= K_INT8_G32;
        constexpr int base = g32 ? K - (K_INT8_G32 - K_INT8) : K;
        constexpr int bits = base == K_INT8 ? 8 : (base == K_INT4 ? 4 : 2);
        unpack_int<D, bits, g32 ? 32 : 0>(src, f.group, dim, out);
    }
    return out;
}

// fn(decoder) with the decoder of kind k: a generic lambda called with decode_kind<D, K> for the K that k names.
template <int D, class Fn>
inline void with_kind(int k, Fn&& fn) {
    switch (k) {
        case K_F32: fn([](auto... a) { return decode_kind<D, K_F32>(a...); }); break;
        case K_F16: fn([](auto... a) { return decode_kind<D, K_F16>(a...); }); break;
        case K_BF16: fn([](auto... a) { return decode_kind<D, K_BF16>(a...); }); break;
        case K_FP8: fn([](auto... a) { return decode_kind<D, K_FP8>(a...); }); break;
        case K_INT8: fn([](auto... a) { return decode_kind<D, K_INT8>(a...); }); break;
        case K_INT4: fn([](auto... a) { return decode_kind<D, K_INT4>(a...); }); break;
        case K_INT2: fn([](auto... a) { return decode_kind<D, K_INT2>(a...); }); break;
        case K_INT8_G32: fn([](auto... a) { return decode_kind<D, K_INT8_G32>(a...); }); break;
        case K_INT4_G32: fn([](auto... a) { return decode_kind<D, K_INT4_G32>(a...); }); break;
        default: fn([](auto... a) { return decode_kind<D, K_INT2_G32>(a...); });
    }
}

template <int D>
inline const float* decode_field(const uint8_t* rec, const HfkvField& f, int dim, float* out) {
    const float* x = nullptr;
    with_kind<D>(kind_of(f), [&](auto decode) { x = decode(rec, f, dim, out); });
    return x;
}

// The field of each record of a block that `recs` names (null: leave x[i] as it is), the format's decoder chosen once.
template <int D>
inline void decode_block(const HfkvField& f, const uint8_t* const* recs, int n, int dim, float (*buf)[D ? D : 512],
                         const float** x) {
    with_kind<D>(kind_of(f), [&](auto decode) {
        for (int i = 0; i < n; ++i)
            if (recs[i]) x[i] = decode(recs[i], f, dim, buf[i]);
    });
}

template <int D>
inline const float* decode_dense(const void* base, int32_t dtype, int64_t index, int dim, float* out) {
    const int d = D ? D : dim;
    if (dtype == F32) return static_cast<const float*>(base) + index * d;
    const uint16_t* h = static_cast<const uint16_t*>(base) + index * d;
    if (dtype == BF16) {
        bf16_row(h, d, out);
    } else {
        for (int e = 0; e < d; ++e) out[e] = half_to_float(h[e]);
    }
    return out;
}

// Where a slot lives, and its tag (position + 1, 0 = empty).
struct SlotRef {
    const uint8_t* record;  // paged only
    const uint8_t* tag_at;  // paged only: the slot's tag in its page's tag region
    int64_t dense_index;    // dense only: (row * H + head) * S + s
    int32_t tag;
};

// Adds v to the score sum of a live slot where it lies: its page's score region, or the dense part's array.
inline void add_score(const HfkvPart& part, const SlotRef& ref, float v) {
    if (!part.add_scores) return;
    if (part.paged) {
        *reinterpret_cast<float*>(const_cast<uint8_t*>(ref.tag_at) + part.score_offset - part.tag_offset) += v;
    } else if (part.score) {
        part.score[ref.dense_index] += v;
    }
}

// Walks the slots of one part for one (row, head) in order, page by page and record by record (no division
// per slot).
struct Cursor {
    const HfkvPart& part;
    int64_t bh;
    int s, page, in_page;
    const uint8_t* rec;
    const uint8_t* tag;

    Cursor(const HfkvPart& p, int64_t bh_, int s0)
        : part(p), bh(bh_), s(s0), page(0), in_page(0), rec(nullptr), tag(nullptr) {
        if (part.paged) {
            page = s0 / part.tpp;
            in_page = s0 % part.tpp;
            if (page < part.table_w) {
                const uint8_t* base = page_base(page);
                rec = base + static_cast<int64_t>(in_page) * part.record;
                tag = base + part.tag_offset + 4 * static_cast<int64_t>(in_page);
            }
        }
    }
    const uint8_t* page_base(int pg) const {
        return part.pool + static_cast<int64_t>(part.table[bh * part.table_w + pg]) * part.page_bytes;
    }
    void next() {
        ++s;
        if (!part.paged) return;
        if (++in_page == part.tpp) {
            in_page = 0;
            ++page;
            rec = page < part.table_w ? page_base(page) : nullptr;
            tag = rec ? rec + part.tag_offset : nullptr;
        } else {
            rec += part.record;
            tag += 4;
        }
    }
    // Field by field into the block's entry: a whole SlotRef built on the stack and copied in 8-byte words
    // made every tag load wait for a failed store-to-load forward.
    void fill(SlotRef& r) const {
        r.record = rec;
        r.tag_at = tag;
        if (part.paged) {
            std::memcpy(&r.tag, tag, 4);
        } else {
            r.dense_index = bh * part.slots + s;
            r.tag = static_cast<int32_t>(part.pos[s] + 1);
        }
    }
    // The cache lines of [offset, offset + bytes) of the current record, and of its tag.
    void prefetch(int32_t offset, int32_t bytes) const {
        const uint8_t* a = rec + offset;
        for (int32_t i = 0; i < bytes; i += 64) __builtin_prefetch(a + i);
        __builtin_prefetch(a + bytes - 1);
        __builtin_prefetch(tag);
    }
};

// Records asked for ahead of the one being read, so that a pass's loads overlap instead of each record's tag
// waiting for its own cache miss.
constexpr int kAhead = 6;

// One call's work: B * H (row, KV head) pairs, each cut into `nsplit` column ranges of whole vectors (split-K),
// so that a step with fewer (row, head) pairs than threads still keeps every thread busy.
struct Work {
    const float* q;
    int G, qlen, dim, H, nparts, reduction, nsplit;
    int64_t q_start, s_total, stride, split_len;
    const int64_t* pad_end;
    const HfkvPart* parts;
    const int64_t* part_start;  // first column of each part
    float* out;                 // [BH, rows, D], zeroed
    float* delta;               // [BH, s_total] or null
    float* logits;              // [BH, rows, stride]
    float* stats;               // [BH, nsplit, rows, 2]: local max and sum, then the normalising factor
    float* partial;             // [BH, nsplit, rows, D] when nsplit > 1
    // 1, or 0 where one thread's buffers (q, logits, stats, out) hold the one (row, head) it works on (a chunk's
    // tiles in parallel: chunk_tiles_parallel).
    int64_t own = 1;
    // Whether phase 2 adds significances to the score sums where they lie (else only into `delta`).
    bool scores_in_place = true;

    int rows() const { return G * qlen; }
    int64_t begin(int sp) const { return sp * split_len; }
    int64_t end(int sp) const { return sp + 1 == nsplit ? stride : (sp + 1) * split_len; }
};

// Calls fn(part, refs, n, col0) for the slots of columns [c0, min(c1, s_total)) of one (row, head), in
// column order, in blocks of up to kBlock consecutive slots of one part (refs[i] is column col0 + i),
// prefetching the tag and the keys (or, with `values`, the values) of the records kAhead slots on.
template <class F>
inline void for_blocks(const Work& w, int64_t bh, int64_t c0, int64_t c1, bool values, F&& fn) {
    c1 = c1 < w.s_total ? c1 : w.s_total;
    SlotRef blk[kBlock];
    for (int pi = 0; pi < w.nparts; ++pi) {
        const HfkvPart& part = w.parts[pi];
        const int64_t first = w.part_start[pi], last = first + part.slots;
        const int64_t lo = c0 > first ? c0 : first, hi = c1 < last ? c1 : last;
        if (lo >= hi) continue;
        const int end = static_cast<int>(hi - first);
        const HfkvField& f = values ? part.value : part.key;
        const int32_t bytes = (values ? part.record : part.value.offset) - f.offset;
        Cursor cur(part, bh, static_cast<int>(lo - first)), ahead = cur;
        // Records of a cache line or less are left to the hardware prefetcher, which follows a page's records
        // better than the prefetch instructions' cost repays (interleaved A/B, 8k, 1 thread: K4V2 records of
        // 64 bytes, smollm2's shape, 0.94x the time without them; of 112 bytes, Llama-3.1-8B's, 1.06x; bf16
        // records of 256 bytes 1.54x).
        const bool prefetch = part.paged && part.record > 64;
        if (prefetch) {
            for (int i = 0; i < kAhead && ahead.s < end; ++i, ahead.next()) ahead.prefetch(f.offset, bytes);
        }
        int n = 0;
        int64_t col0 = lo;
        for (int64_t col = lo; col < hi; ++col, cur.next()) {
            if (prefetch && ahead.s < end) {
                ahead.prefetch(f.offset, bytes);
                ahead.next();
            }
            cur.fill(blk[n++]);
            if (n == kBlock) {
                fn(part, blk, n, col0);
                col0 += n;
                n = 0;
            }
        }
        if (n) fn(part, blk, n, col0);
    }
}

// Phase 1 of a (row-head, split): masked logits of the split's slots (keys are read here and never again),
// then per query row the split's max and the sum of exp(logit - max), the logits becoming those exps.
template <int D>
void split_logits(const Work& w, int64_t bh, int sp) {
    const int d = D ? D : w.dim;
    const int rows = w.rows();
    const int64_t c0 = w.begin(sp), c1 = w.end(sp), pad_end = w.pad_end[bh / w.H];
    const float* q = w.q + bh * w.own * rows * d;
    float* lg = w.logits + bh * w.own * rows * w.stride;
    alignas(64) float buf[kBlock][D ? D : 512];
    for_blocks(w, bh, c0, c1, false, [&](const HfkvPart& part, const SlotRef* blk, int n, int64_t col0) {
        if (rows > 8 && (col0 & 15) < kBlock && col0 + 32 < c1) {  // a chunk tile: each row's next lines
            for (int r = 0; r < rows; ++r) __builtin_prefetch(lg + r * w.stride + ((col0 + 32) & ~int64_t{15}), 1);
        }
        const float* x[kBlock];
        const uint8_t* recs[kBlock] = {};
        bool masked = false;  // some slot of the block is hidden from some query row
        for (int i = 0; i < kBlock; ++i) {
            x[i] = kZeros;
            if (i >= n) continue;
            const int64_t pos = static_cast<int64_t>(blk[i].tag) - 1;
            if (blk[i].tag <= 0 || pos < pad_end) {
                masked = true;
                continue;
            }
            masked |= pos > w.q_start;  // a chunk's causal mask (never when decoding)
            if (part.paged) {
                recs[i] = blk[i].record;
            } else {
                x[i] = decode_dense<D>(part.k, part.dense_dtype, blk[i].dense_index, d, buf[i]);
            }
        }
        if (part.paged) decode_block<D>(part.key, recs, n, d, buf, x);
        dot_block<D>(q, rows, d, x, n, lg + col0, w.stride);
        if (!masked) return;
        for (int i = 0; i < n; ++i) {
            const int64_t pos = static_cast<int64_t>(blk[i].tag) - 1;
            const bool live = blk[i].tag > 0 && pos >= pad_end;
            if (live && pos <= w.q_start) continue;
            for (int r = 0; r < rows; ++r)  // row r is query r % qlen
                if (!live || pos > w.q_start + r % w.qlen) lg[r * w.stride + col0 + i] = -INFINITY;
        }
    });
    float* st = w.stats + (bh * w.own * w.nsplit + sp) * rows * 2;
    for (int r = 0; r < rows; ++r) {
        float* lr = lg + r * w.stride;
        for (int64_t c = (c0 > w.s_total ? c0 : w.s_total); c < c1; ++c) lr[c] = -INFINITY;  // vector padding
        Vec mv = {};
        mv -= INFINITY;
        for (int64_t c = c0; c < c1; c += kLanes) {
            const Vec x = load_vec(lr + c);
            mv = x > mv ? x : mv;
        }
        float m = -INFINITY;
        for (int i = 0; i < kLanes; ++i) m = mv[i] > m ? mv[i] : m;
        const float shift = m == -INFINITY ? 0.0f : m;
        Vec sv = {};
        for (int64_t c = c0; c < c1; c += kLanes) {
            const Vec p = exp_nonpositive(load_vec(lr + c) - shift);
            store_vec(lr + c, p);
            sv += p;
        }
        st[2 * r] = m;
        st[2 * r + 1] = lane_sum(sv);
    }
}

// Between the phases, per (row-head, query row): the factor turning a split's exps into probabilities,
// exp(m_split - m) / sum over splits (0 for a split that saw nothing, and for a row that sees nothing).
inline void combine_row(const Work& w, int64_t bh, int r) {
    const int rows = w.rows();
    float* st = w.stats + bh * w.own * w.nsplit * rows * 2 + 2 * r;
    float m = -INFINITY;
    for (int sp = 0; sp < w.nsplit; ++sp) m = st[sp * rows * 2] > m ? st[sp * rows * 2] : m;
    float sum = 0.0f;
    for (int sp = 0; sp < w.nsplit; ++sp) {
        const float ms = st[sp * rows * 2];
        const float f = ms == -INFINITY ? 0.0f : (w.nsplit == 1 ? 1.0f : std::exp(ms - m));
        st[sp * rows * 2] = f;
        sum += f * st[sp * rows * 2 + 1];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int sp = 0; sp < w.nsplit; ++sp) st[sp * rows * 2] *= inv;
}

// The significance of the n slots of a block at columns col0..: each query row's probability (exp times the row's
// factor f[2r]), reduced over the GQA group, summed over the queries.
inline void block_significance(const Work& w, const float* lg, const float* f, int64_t col0, int n, float* red_out) {
    Vec8 total = {};
    for (int qi = 0; qi < w.qlen; ++qi) {
        Vec8 red = {};
        for (int gi = 0; gi < w.G; ++gi) {
            const int r = gi * w.qlen + qi;
            Vec8 e;
            if (n == kBlock) {
                e = load_vec<Vec8>(lg + r * w.stride + col0);
            } else {
                e = Vec8{};
                for (int i = 0; i < n; ++i) e[i] = lg[r * w.stride + col0 + i];
            }
            const Vec8 p = e * f[2 * r];
            if (w.reduction == RED_MAX) red = p > red ? p : red;
            else red += w.reduction == RED_MEAN ? p : p * p;
        }
        if (w.reduction == RED_MEAN) {
            red = red / static_cast<float>(w.G);
        } else if (w.reduction == RED_L2) {
            red = red / static_cast<float>(w.G);
            for (int i = 0; i < kBlock; ++i) red[i] = std::sqrt(red[i]);
        }
        total += red;
    }
    store_vec(red_out, total);
}

// Phase 2 of a (row-head, split): each slot's significance (its probabilities reduced over the GQA group, summed
// over the queries) added to its score sum where it lies, and the values weighted by the probabilities. Block by
// block: a block's exps are read once from the logits for both, and normalised in registers (the factor of each
// row), not in a pass that stores them (that store was an eighth of a chunk tile's time, perf).
template <int D>
void split_values(const Work& w, int64_t bh, int sp) {
    const int d = D ? D : w.dim;
    const int rows = w.rows();
    const int64_t c0 = w.begin(sp), c1 = w.end(sp), pad_end = w.pad_end[bh / w.H];
    const float* lg = w.logits + bh * w.own * rows * w.stride;
    const float* st = w.stats + (bh * w.own * w.nsplit + sp) * rows * 2;
    float* out = w.nsplit == 1 ? w.out + bh * w.own * rows * d : w.partial + (bh * w.nsplit + sp) * rows * d;
    float* delta = w.delta ? w.delta + bh * w.s_total : nullptr;
    alignas(64) float buf[kBlock][D ? D : 512];
    // Masked and empty slots received exact zeros: nothing is decoded for them and their scores are untouched.
    for_blocks(w, bh, c0, c1, true, [&](const HfkvPart& part, const SlotRef* blk, int n, int64_t col0) {
        alignas(32) float red[kBlock];
        if (rows > 8 && (col0 & 15) < kBlock && col0 + 32 < c1) {  // a chunk tile: each row's next lines
            for (int r = 0; r < rows; ++r) __builtin_prefetch(lg + r * w.stride + ((col0 + 32) & ~int64_t{15}));
        }
        block_significance(w, lg, st, col0, n, red);
        if (delta) {  // summed over the tiles of a chunk's queries (zeroed by the entry point)
            for (int i = 0; i < n; ++i) delta[col0 + i] += red[i];
        }
        const float* x[kBlock];
        const uint8_t* recs[kBlock] = {};
        for (int i = 0; i < kBlock; ++i) {
            x[i] = kZeros;
            if (i >= n || blk[i].tag <= 0 || static_cast<int64_t>(blk[i].tag) - 1 < pad_end) continue;
            if (w.scores_in_place) add_score(part, blk[i], red[i]);
            if (part.paged) {
                recs[i] = blk[i].record;
            } else {
                x[i] = decode_dense<D>(part.v, part.dense_dtype, blk[i].dense_index, d, buf[i]);
            }
        }
        if (part.paged) decode_block<D>(part.value, recs, n, d, buf, x);
        axpy_block<D>(out, rows, d, lg + col0, w.stride, st, x, n);
    });
}

inline void sum_splits(const Work& w, int64_t bh) {
    const int64_t n = static_cast<int64_t>(w.rows()) * w.dim;
    float* out = w.out + bh * n;
    for (int sp = 0; sp < w.nsplit; ++sp) {
        const float* src = w.partial + (bh * w.nsplit + sp) * n;
        for (int64_t i = 0; i < n; ++i) out[i] += src[i];
    }
}

// The phases run on `threads` threads of the OpenMP runtime torch itself uses (the library links the libgomp
// torch loaded), so the kernel's threads are torch's warm threads, not a second pool competing for cores.
template <int D>
void attend_all(Work& w, int64_t BH, int threads) {
    const int64_t items = BH * w.nsplit;
    const int64_t rows_all = BH * w.rows();
    const bool parallel = threads > 1 && items > 1;
    (void)parallel;
    if (w.nsplit == 1) {
        // Without split-K a (row, head) is one thread's from its logits to its output, so the phases need no
        // barrier between threads: each of the three below cost a step on two threads a wait for the slower
        // thread, which the OpenBLAS and OpenMP threads left spinning by the model's other operations often
        // delay (the random model at 8k, 2 threads: the kernel 3.9 ms a step with the barriers, 2.4 with
        // OMP_WAIT_POLICY=active, which keeps the threads from sleeping).
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
        for (int64_t bh = 0; bh < BH; ++bh) {
            split_logits<D>(w, bh, 0);
            for (int r = 0; r < w.rows(); ++r) combine_row(w, bh, r);
            split_values<D>(w, bh, 0);
        }
        return;
    }
#pragma omp parallel num_threads(threads) if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) split_logits<D>(w, it / w.nsplit, static_cast<int>(it % w.nsplit));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows_all; ++i) combine_row(w, i / w.rows(), static_cast<int>(i % w.rows()));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) split_values<D>(w, it / w.nsplit, static_cast<int>(it % w.nsplit));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < BH; ++bh) sum_splits(w, bh);  // split-K only here: nsplit > 1
    }
}

// A tile's query rows (gi, t0 .. t0 + tq) of row-head bh, scaled, packed as (gi, ti) into dst: the rows one pass
// over the slots takes. And back: the tile's output rows into their places in out.
inline void take_tile_rows(const float* query, int G, int qlen, int dim, int64_t bh, int t0, int tq, float scaling,
                           float* dst) {
    for (int gi = 0; gi < G; ++gi) {
        const float* src = query + ((bh * G + gi) * qlen + t0) * dim;
        float* row = dst + static_cast<int64_t>(gi) * tq * dim;
        for (int64_t i = 0; i < static_cast<int64_t>(tq) * dim; ++i) row[i] = src[i] * scaling;
    }
}

inline void put_tile_rows(const float* src, int G, int qlen, int dim, int64_t bh, int t0, int tq, float* out) {
    for (int gi = 0; gi < G; ++gi)
        std::memcpy(out + ((bh * G + gi) * qlen + t0) * dim, src + static_cast<int64_t>(gi) * tq * dim,
                    sizeof(float) * static_cast<size_t>(tq) * dim);
}

// Adds delta [BH, s_total] to the score sums of the live slots where they lie (the significances of a chunk whose
// tiles ran in parallel: two tiles adding into one record at once would race).
inline void add_deltas(const Work& w, int64_t BH, const float* delta, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && BH > 1)
    for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t pad_end = w.pad_end[bh / w.H];
        const float* d = delta + bh * w.s_total;
        for_blocks(w, bh, 0, w.s_total, false, [&](const HfkvPart& part, const SlotRef* blk, int n, int64_t col0) {
            for (int i = 0; i < n; ++i) {
                const bool live = blk[i].tag > 0 && static_cast<int64_t>(blk[i].tag) - 1 >= pad_end;
                if (live) add_score(part, blk[i], d[col0 + i]);
            }
        });
    }
}

// A chunk's query tiles on several threads, each thread one (tile, row-head) at a time with buffers of its own and
// every slot of the head (no split-K): a tile's phases need no barrier between threads, where splitting each tile's
// slots over the threads waited at three barriers a tile (perf: a tenth of a 2-thread chunked prefill in libgomp's
// waits). Significances gather in per-thread sums, added to the score sums once at the end.
template <int D>
void chunk_tiles_parallel(Work base, const float* query, float scaling, int64_t BH, int T, float* out, float* delta,
                          int threads) {
    const int G = base.G, qlen = base.qlen, d = D ? D : base.dim;
    const int ntiles = (qlen + T - 1) / T;
    const int64_t items = ntiles * BH, st_size = static_cast<int64_t>(BH) * base.s_total;
    std::vector<float> sums(static_cast<size_t>(threads) * st_size, 0.0f);
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        std::vector<float> scaled(static_cast<size_t>(G) * T * d), tout(static_cast<size_t>(G) * T * d);
        std::vector<float> lg(static_cast<size_t>(G) * T * base.stride), stats(static_cast<size_t>(G) * T * 2);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t bh = it % BH;
            const int t0 = static_cast<int>(it / BH) * T, tq = qlen - t0 < T ? qlen - t0 : T;
            take_tile_rows(query, G, qlen, d, bh, t0, tq, scaling, scaled.data());
            std::fill(tout.begin(), tout.begin() + static_cast<int64_t>(G) * tq * d, 0.0f);
            Work w = base;
            w.q = scaled.data();
            w.qlen = tq;
            w.q_start = base.q_start + t0;
            w.nsplit = 1;
            w.split_len = base.stride;
            w.out = tout.data();
            w.delta = sums.data() + static_cast<int64_t>(tid) * st_size;
            w.logits = lg.data();
            w.stats = stats.data();
            w.own = 0;
            w.scores_in_place = false;
            split_logits<D>(w, bh, 0);
            for (int r = 0; r < G * tq; ++r) combine_row(w, bh, r);
            split_values<D>(w, bh, 0);
            put_tile_rows(tout.data(), G, qlen, d, bh, t0, tq, out);
        }
    }
    for (int t = 1; t < threads; ++t)
        for (int64_t i = 0; i < st_size; ++i) sums[i] += sums[t * st_size + i];
    add_deltas(base, BH, sums.data(), threads);
    if (delta) std::memcpy(delta, sums.data(), sizeof(float) * static_cast<size_t>(st_size));
}

}  // namespace

extern "C" {

// query [B, H, G * qlen, D] fp32, rows ordered (gi, qi), scaled here by `scaling`; out [B, H, G * qlen, D] fp32,
// zeroed here (scaling and zeroing in the caller cost a decode step two tensor ops per layer); delta [B, H, sum
// slots] fp32 or null. tile: the most queries one pass takes (0 = all): a prefill chunk's queries go through in
// tiles, each reading every slot, with one call per chunk (one per tile cost a quarter of a millisecond of Python
// each, a tenth of a chunk's attention). logits: scratch of B * H * G * min(qlen, tile) * round_up(sum slots, 16)
// floats. threads: how many threads to use (torch.get_num_threads() at the call); min_split: the fewest slots a
// split-K range holds.
// Returns 0, or -1 for a head dim beyond 512.
int hfkv_paged_decode(const float* query, int32_t B, int32_t H, int32_t G, int32_t qlen, int32_t dim,
                      int64_t q_start, const int64_t* pad_end, int32_t nparts, const HfkvPart* parts,
                      int32_t reduction, float* out, float* delta, float* logits, int32_t threads,
                      int32_t min_split, float scaling, int32_t tile) {
    if (dim > 512) return -1;  // the staging buffers of decode_field
    std::vector<int64_t> part_start(nparts + 1, 0);
    for (int pi = 0; pi < nparts; ++pi) part_start[pi + 1] = part_start[pi] + parts[pi].slots;
    const int64_t s_total = part_start[nparts], BH = static_cast<int64_t>(B) * H;
    const int64_t stride = (s_total + kLanes - 1) / kLanes * kLanes;
    const int rows = G * qlen, T = tile > 0 && tile < qlen ? tile : qlen;
    std::memset(out, 0, sizeof(float) * static_cast<size_t>(BH * rows * dim));
    if (delta) std::memset(delta, 0, sizeof(float) * static_cast<size_t>(BH * s_total));
    // Split-K only where (row, head) pairs are fewer than twice the threads and do not divide evenly among them
    // (a whole pair a thread needs no barrier: attend_all), never below min_split slots.
    int64_t nsplit = 1;
    if (threads > 1 && BH < 2 * threads && BH % threads != 0) nsplit = (2 * threads + BH - 1) / BH;
    const int64_t most = stride / (min_split > kLanes ? min_split : kLanes);
    if (nsplit > most) nsplit = most > 1 ? most : 1;
    const int64_t split_len = ((stride + nsplit - 1) / nsplit + kLanes - 1) / kLanes * kLanes;
    nsplit = stride ? (stride + split_len - 1) / split_len : 1;
    if (T < qlen && threads > 1) {
        Work base{query, G, qlen, dim, H, nparts, reduction, 1, q_start, s_total, stride, stride, pad_end, parts,
                  part_start.data(), out, delta, logits, nullptr, nullptr};
        switch (dim) {
            case 64: chunk_tiles_parallel<64>(base, query, scaling, BH, T, out, delta, threads); break;
            case 128: chunk_tiles_parallel<128>(base, query, scaling, BH, T, out, delta, threads); break;
            default: chunk_tiles_parallel<0>(base, query, scaling, BH, T, out, delta, threads);
        }
        return 0;
    }
    const int64_t tile_numel = BH * G * T * dim;
    std::vector<float> scaled(static_cast<size_t>(tile_numel));
    std::vector<float> tile_out(T < qlen ? tile_numel : 0);
    std::vector<float> stats(BH * nsplit * G * T * 2);
    std::vector<float> partial(nsplit > 1 ? BH * nsplit * G * T * dim : 0);
    for (int t0 = 0; t0 < qlen; t0 += T) {
        const int tq = qlen - t0 < T ? qlen - t0 : T;
        for (int64_t bh = 0; bh < BH; ++bh)
            take_tile_rows(query, G, qlen, dim, bh, t0, tq, scaling, scaled.data() + bh * G * tq * dim);
        float* o = T == qlen ? out : tile_out.data();
        if (T < qlen) std::memset(o, 0, sizeof(float) * static_cast<size_t>(BH * G * tq * dim));
        if (nsplit > 1) std::fill(partial.begin(), partial.end(), 0.0f);
        Work w{scaled.data(), G, tq, dim, H, nparts, reduction, static_cast<int>(nsplit), q_start + t0, s_total, stride,
               split_len ? split_len : kLanes, pad_end, parts, part_start.data(), o, delta, logits, stats.data(),
               partial.data()};
        switch (dim) {
            case 64: attend_all<64>(w, BH, threads); break;
            case 128: attend_all<128>(w, BH, threads); break;
            default: attend_all<0>(w, BH, threads);
        }
        if (T < qlen) {
            for (int64_t bh = 0; bh < BH; ++bh) put_tile_rows(o + bh * G * tq * dim, G, qlen, dim, bh, t0, tq, out);
        }
    }
    return 0;
}

int hfkv_part_size(void) { return static_cast<int>(sizeof(HfkvPart)); }

// The records of slots (b[j], h[j], s[j]) of one paged part, decoded: k, v [n, dim] fp32, pos [n] int64, score [n]
// fp32: what a policy run reads of the tokens it demotes (PagedTiers.gather_decoded's contract). The torch path
// is a page lookup, a gather and a score of tensor operations per integer field; here each record is decoded
// where it lies by decode_field, whose operations are torch's (code * scale, then + zero: two roundings, no
// contraction under -std=c++17), so the values are equal bit for bit. Returns 0, or -1 for a head dim past 512.
int hfkv_gather_decode(const HfkvPart* part, int32_t heads, int64_t n, const int64_t* b, const int64_t* h,
                       const int64_t* s, int32_t dim, float* k, float* v, int64_t* pos, float* score) {
    if (dim > 512) return -1;
#pragma omp parallel for schedule(static) if (n > 256)
    for (int64_t j = 0; j < n; ++j) {
        const int64_t bh = b[j] * heads + h[j];
        const int64_t page = part->table[bh * part->table_w + s[j] / part->tpp];
        const uint8_t* base = part->pool + page * part->page_bytes;
        const uint8_t* rec = base + (s[j] % part->tpp) * part->record;
        alignas(64) float buf[512];
        const float* x = decode_field<0>(rec, part->key, dim, buf);
        std::memcpy(k + j * dim, x, sizeof(float) * dim);
        x = decode_field<0>(rec, part->value, dim, buf);
        std::memcpy(v + j * dim, x, sizeof(float) * dim);
        int32_t tag;
        std::memcpy(&tag, base + part->tag_offset + (s[j] % part->tpp) * 4, 4);
        pos[j] = static_cast<int64_t>(tag) - 1;
        std::memcpy(score + j, base + part->score_offset + (s[j] % part->tpp) * 4, 4);
    }
    return 0;
}

}  // extern "C"
