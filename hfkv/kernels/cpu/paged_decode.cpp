// Paged decode attention on CPU: the contract of hfkv.kernels.decode_attention.paged_attention, in C++.
//
// The torch backend reads a quantized tier in a dozen tensor passes (copy the codes out of the records,
// shift, mask, convert, scale, matmul, softmax, gather the mask, scatter the scores), each a trip through
// memory. Here one (row, KV head) is one loop over its slots: each record is read where it lies in the
// page, unpacked into a buffer that stays in L1, and used at once, so a step reads every record's key
// field once and its value field once. Two passes over the slots (logits, then values) instead of an
// online softmax, because the probabilities are needed anyway: they are the decode-time significance
// scores, added in place to the records' score fields in the second pass.
//
// Built at first use by hfkv/kernels/cpu/build.py (plain C ABI, no Python or torch headers, so the build
// takes a second) and called through ctypes; hfkv/kernels/cpu/paged_decode.py is the Python side.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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
    int32_t record;          // bytes per record
    int32_t tag_offset;      // int32 position + 1 (0 = empty slot)
    int32_t score_offset;    // fp32 score sum
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

// 16 fp32 lanes through GCC / Clang vector extensions: lowered to whatever SIMD the target has (one
// AVX-512 register, two AVX2 ones, four NEON ones), so the reductions below run in parallel lanes
// without -ffast-math, which would break the -inf masking.
typedef float Vec __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline Vec load_vec(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store_vec(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));
typedef uint8_t Bytes16 __attribute__((vector_size(16)));
typedef uint16_t Halves16 __attribute__((vector_size(32)));
typedef uint32_t Words16 __attribute__((vector_size(64)));

// 16 bytes zero-extended to 32-bit lanes: one instruction with AVX-512 or AVX2 (compilers lower the generic
// conversion to byte-by-byte inserts), the generic conversion elsewhere.
inline Words16 widen_bytes(const uint8_t* p) {
    Words16 w;
#if defined(__AVX512F__)
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&w, &x, sizeof w);
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    std::memcpy(&w, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&w) + sizeof lo, &hi, sizeof hi);
#else
    Bytes16 b;
    std::memcpy(&b, p, sizeof b);
    w = __builtin_convertvector(b, Words16);
#endif
    return w;
}

// A pairwise tree: a chain of 15 dependent adds would cost more than the dot product itself.
inline float lane_sum(Vec v) {
#if defined(__AVX512F__)
    __m512 x;
    std::memcpy(&x, &v, sizeof x);
    return _mm512_reduce_add_ps(x);
#else
    Vec8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    const Vec8 a = lo + hi;
    Vec4 c, d;
    std::memcpy(&c, &a, sizeof c);
    std::memcpy(&d, reinterpret_cast<const char*>(&a) + sizeof c, sizeof d);
    const Vec4 e = c + d;
    return (e[0] + e[2]) + (e[1] + e[3]);
#endif
}

// sum_e a[e] * b[e]: whole vectors, then the tail (head dims that are not a multiple of 16).
template <int D>
inline float dot(const float* a, const float* b, int dim) {
    const int d = D ? D : dim;
    const int whole = d / kLanes * kLanes;
    Vec acc = {};
    for (int e = 0; e < whole; e += kLanes) acc += load_vec(a + e) * load_vec(b + e);
    float s = lane_sum(acc);
    for (int e = whole; e < d; ++e) s += a[e] * b[e];
    return s;
}

// o[e] += w * x[e]
template <int D>
inline void axpy(float* o, float w, const float* x, int dim) {
    const int d = D ? D : dim;
    const int whole = d / kLanes * kLanes;
    for (int e = 0; e < whole; e += kLanes) store_vec(o + e, load_vec(o + e) + w * load_vec(x + e));
    for (int e = whole; e < d; ++e) o[e] += w * x[e];
}

// Four query rows at once: each vector of x is loaded once for four products (decode has g rows per KV head).
template <int D>
inline void dot4(const float* q, int dim, const float* x, float* lg, int64_t stride) {
    const int d = D ? D : dim;
    const int whole = d / kLanes * kLanes;
    Vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int e = 0; e < whole; e += kLanes) {
        const Vec v = load_vec(x + e);
        a0 += load_vec(q + e) * v;
        a1 += load_vec(q + d + e) * v;
        a2 += load_vec(q + 2 * d + e) * v;
        a3 += load_vec(q + 3 * d + e) * v;
    }
    float s[4] = {lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)};
    for (int e = whole; e < d; ++e)
        for (int r = 0; r < 4; ++r) s[r] += q[r * d + e] * x[e];
    for (int r = 0; r < 4; ++r) lg[r * stride] = s[r];
}

template <int D>
inline void axpy4(float* o, int dim, const float* w, int64_t stride, const float* x) {
    const int d = D ? D : dim;
    const int whole = d / kLanes * kLanes;
    const float w0 = w[0], w1 = w[stride], w2 = w[2 * stride], w3 = w[3 * stride];
    for (int e = 0; e < whole; e += kLanes) {
        const Vec v = load_vec(x + e);
        store_vec(o + e, load_vec(o + e) + w0 * v);
        store_vec(o + d + e, load_vec(o + d + e) + w1 * v);
        store_vec(o + 2 * d + e, load_vec(o + 2 * d + e) + w2 * v);
        store_vec(o + 3 * d + e, load_vec(o + 3 * d + e) + w3 * v);
    }
    for (int e = whole; e < d; ++e) {
        o[e] += w0 * x[e];
        o[d + e] += w1 * x[e];
        o[2 * d + e] += w2 * x[e];
        o[3 * d + e] += w3 * x[e];
    }
}

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

typedef int32_t Ints16 __attribute__((vector_size(64)));

// exp(x) for 16 x <= 0 (logits minus the row max), Cephes' polynomial after range reduction (within 2 ulp),
// in vector operations only; a lane holding -inf (a masked slot) gives exactly 0.
inline Vec exp_nonpositive(Vec x) {
    const Vec zero = {};
    const Ints16 masked = x == -INFINITY;
    x = x < -87.0f ? zero - 87.0f : x;
    const Vec t = x * 1.44269504088896341f;
    const Ints16 n = __builtin_convertvector(t + (t >= 0.0f ? zero + 0.5f : zero - 0.5f), Ints16);
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
    const Ints16 bits = (n + 127) << 23;
    Vec scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return masked ? zero : p * scale;
}

// Integer codes in planes: byte j holds elements j, j + P, ... (bits p*b .. p*b + b of byte j), then
// fp16 scales and zeros, one per group. Bit width and head dim are constants here, so the unpacking
// compiles to a few vector shifts and conversions per plane.
template <int D, int BITS>
inline void unpack_int(const uint8_t* src, int group, int dim, float* out) {
    const int d = D ? D : dim;
    constexpr int kPer = 8 / BITS;
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    const int plane = d / kPer, groups = d / group;
    const int whole = plane / kLanes * kLanes;
    for (int j = 0; j < whole; j += kLanes) {  // 16 bytes -> 16 codes of every plane
        const Words16 w = widen_bytes(src + j);
        for (int p = 0; p < kPer; ++p)
            store_vec(out + p * plane + j, __builtin_convertvector((w >> (p * BITS)) & kMask, Vec));
    }
    for (int j = whole; j < plane; ++j)
        for (int p = 0; p < kPer; ++p)
            out[p * plane + j] = static_cast<float>((static_cast<uint32_t>(src[j]) >> (p * BITS)) & kMask);
    const uint8_t* meta = src + plane;
    for (int g = 0; g < groups; ++g) {
        uint16_t sz[2];
        std::memcpy(&sz[0], meta + 2 * g, 2);
        std::memcpy(&sz[1], meta + 2 * (groups + g), 2);
        const float scale = half_to_float(sz[0]), zero = half_to_float(sz[1]);
        float* o = out + g * group;
        int e = 0;
        for (; e + kLanes <= group; e += kLanes) store_vec(o + e, load_vec(o + e) * scale + zero);
        for (; e < group; ++e) o[e] = o[e] * scale + zero;
    }
}

// bf16 -> fp32 is a 16-bit shift; whole vectors, then the tail.
inline void bf16_row(const uint16_t* h, int d, float* out) {
    int e = 0;
    for (; e + kLanes <= d; e += kLanes) {
        Halves16 x;
        std::memcpy(&x, h + e, sizeof x);
        const Words16 w = __builtin_convertvector(x, Words16) << 16;
        std::memcpy(out + e, &w, sizeof w);
    }
    for (; e < d; ++e) out[e] = bf16_to_float(h[e]);
}

// Values of one field of one record, in natural order, fp32: the twin of QuantFormat.decode_at.
template <int D>
inline void decode_field(const uint8_t* rec, const HfkvField& f, int dim, float* out) {
    const int d = D ? D : dim;
    const uint8_t* src = rec + f.offset;
    if (f.family == MODEL) {
        if (f.dtype == F32) {
            std::memcpy(out, src, sizeof(float) * d);
        } else if (f.dtype == BF16) {
            uint16_t h[D ? D : 512];
            std::memcpy(h, src, 2 * d);
            bf16_row(h, d, out);
        } else {
            uint16_t h[D ? D : 512];
            std::memcpy(h, src, 2 * d);
            for (int e = 0; e < d; ++e) out[e] = half_to_float(h[e]);
        }
        return;
    }
    if (f.family == FP8) {
        float scale;
        std::memcpy(&scale, src + d, 4);
        for (int e = 0; e < d; ++e) out[e] = kFp8.value[src[e]] * scale;
        return;
    }
    switch (f.bits) {
        case 8: unpack_int<D, 8>(src, f.group, dim, out); break;
        case 4: unpack_int<D, 4>(src, f.group, dim, out); break;
        default: unpack_int<D, 2>(src, f.group, dim, out);
    }
}

template <int D>
inline void decode_dense(const void* base, int32_t dtype, int64_t index, int dim, float* out) {
    const int d = D ? D : dim;
    if (dtype == F32) {
        std::memcpy(out, static_cast<const float*>(base) + index * d, sizeof(float) * d);
    } else {
        const uint16_t* h = static_cast<const uint16_t*>(base) + index * d;
        if (dtype == BF16) {
            bf16_row(h, d, out);
        } else {
            for (int e = 0; e < d; ++e) out[e] = half_to_float(h[e]);
        }
    }
}

// Where slot s of a part lives, and its tag (position + 1, 0 = empty).
struct SlotRef {
    const uint8_t* record;  // paged only
    int64_t dense_index;    // dense only: (row * H + head) * S + s
    int32_t tag;
};

inline SlotRef locate(const HfkvPart& part, int64_t bh, int s) {
    SlotRef ref{nullptr, 0, 0};
    if (part.paged) {
        const int32_t page = part.table[bh * part.table_w + s / part.tpp];
        ref.record = part.pool + page * part.page_bytes + static_cast<int64_t>(s % part.tpp) * part.record;
        std::memcpy(&ref.tag, ref.record + part.tag_offset, 4);
    } else {
        ref.dense_index = bh * part.slots + s;
        ref.tag = static_cast<int32_t>(part.pos[s] + 1);
    }
    return ref;
}

template <int D>
void attend_head(const float* q, int G, int qlen, int dim, int64_t q_start, int64_t pad_end, int nparts,
                 const HfkvPart* parts, int64_t bh, int reduction, float* out, float* delta, int64_t s_total,
                 float* logits) {
    const int d = D ? D : dim;
    const int rows = G * qlen;
    // Rows of the logits are padded to whole vectors, so the softmax and the score pass run on vectors only.
    const int64_t stride = (s_total + kLanes - 1) / kLanes * kLanes;
    std::vector<float> buf_storage(d), inv_sum(rows);
    float* buf = buf_storage.data();

    // Pass 1: masked logits of every slot; keys are read here and never again.
    int64_t col = 0;
    for (int pi = 0; pi < nparts; ++pi) {
        const HfkvPart& part = parts[pi];
        for (int s = 0; s < part.slots; ++s, ++col) {
            const SlotRef ref = locate(part, bh, s);
            const int64_t pos = static_cast<int64_t>(ref.tag) - 1;
            const bool live = ref.tag > 0 && pos >= pad_end;
            if (live) {
                if (part.paged) decode_field<D>(ref.record, part.key, d, buf);
                else decode_dense<D>(part.k, part.dense_dtype, ref.dense_index, d, buf);
            }
            int r = 0;
            if (live && pos <= q_start) {  // visible to every query row (always, when decoding)
                for (; r + 4 <= rows; r += 4) dot4<D>(q + static_cast<int64_t>(r) * d, d, buf, logits + r * stride + col, stride);
            }
            for (; r < rows; ++r) {
                const bool seen = live && pos <= q_start + r % qlen;
                logits[r * stride + col] = seen ? dot<D>(q + static_cast<int64_t>(r) * d, buf, d) : -INFINITY;
            }
        }
    }
    // Softmax per query row, in place: logits become unnormalised probabilities (0 where masked).
    for (int r = 0; r < rows; ++r) {
        float* lr = logits + r * stride;
        for (int64_t c = s_total; c < stride; ++c) lr[c] = -INFINITY;
        Vec mv = {};
        mv -= INFINITY;
        for (int64_t c = 0; c < stride; c += kLanes) {
            const Vec x = load_vec(lr + c);
            mv = x > mv ? x : mv;
        }
        float m = -INFINITY;
        for (int i = 0; i < kLanes; ++i) m = mv[i] > m ? mv[i] : m;
        const float shift = m == -INFINITY ? 0.0f : m;
        Vec sv = {};
        for (int64_t c = 0; c < stride; c += kLanes) {
            const Vec p = exp_nonpositive(load_vec(lr + c) - shift);
            store_vec(lr + c, p);
            sv += p;
        }
        const float sum = lane_sum(sv);
        inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row that sees nothing gives zeros
    }
    // Each slot's significance: probabilities reduced over the GQA group, summed over the queries.
    float* red_row = logits + static_cast<int64_t>(rows) * stride;  // scratch row after the logits
    for (int64_t c = 0; c < stride; c += kLanes) {
        Vec total = {};
        for (int qi = 0; qi < qlen; ++qi) {
            Vec red = {};
            for (int gi = 0; gi < G; ++gi) {
                const int r = gi * qlen + qi;
                const Vec p = load_vec(logits + r * stride + c) * inv_sum[r];
                if (reduction == RED_MAX) red = p > red ? p : red;
                else if (reduction == RED_MEAN) red += p;
                else red += p * p;
            }
            if (reduction == RED_MEAN) {
                red = red / static_cast<float>(G);
            } else if (reduction == RED_L2) {
                red = red / static_cast<float>(G);
                for (int i = 0; i < kLanes; ++i) red[i] = std::sqrt(red[i]);
            }
            total += red;
        }
        store_vec(red_row + c, total);
    }
    if (delta) std::memcpy(delta, red_row, sizeof(float) * s_total);
    // Pass 2: values weighted by the probabilities, and each live slot's significance added to its score
    // sum where it lies (masked and empty slots received exact zeros and are not touched).
    col = 0;
    for (int pi = 0; pi < nparts; ++pi) {
        const HfkvPart& part = parts[pi];
        for (int s = 0; s < part.slots; ++s, ++col) {
            const SlotRef ref = locate(part, bh, s);
            if (ref.tag <= 0 || static_cast<int64_t>(ref.tag) - 1 < pad_end) continue;
            if (part.paged) {
                decode_field<D>(ref.record, part.value, d, buf);
                if (part.add_scores) {
                    float* sc = reinterpret_cast<float*>(const_cast<uint8_t*>(ref.record) + part.score_offset);
                    *sc += red_row[col];
                }
            } else {
                decode_dense<D>(part.v, part.dense_dtype, ref.dense_index, d, buf);
                if (part.add_scores && part.score) part.score[ref.dense_index] += red_row[col];
            }
            int r = 0;
            for (; r + 4 <= rows; r += 4) axpy4<D>(out + static_cast<int64_t>(r) * d, d, logits + r * stride + col, stride, buf);
            for (; r < rows; ++r) axpy<D>(out + static_cast<int64_t>(r) * d, logits[r * stride + col], buf, d);
        }
    }
    for (int r = 0; r < rows; ++r) {
        float* orow = out + static_cast<int64_t>(r) * d;
        for (int e = 0; e < d; ++e) orow[e] *= inv_sum[r];
    }
}

template <int D>
void attend_all(const float* q, int B, int H, int G, int qlen, int dim, int64_t q_start, const int64_t* pad_end,
                int nparts, const HfkvPart* parts, int reduction, float* out, float* delta, float* logits) {
    int64_t s_total = 0;
    for (int pi = 0; pi < nparts; ++pi) s_total += parts[pi].slots;
    const int rows = G * qlen;
    for (int64_t bh = 0; bh < static_cast<int64_t>(B) * H; ++bh) {
        const int64_t b = bh / H;
        attend_head<D>(q + bh * rows * dim, G, qlen, dim, q_start, pad_end[b], nparts, parts, bh, reduction,
                       out + bh * rows * dim, delta ? delta + bh * s_total : nullptr, s_total, logits);
    }
}

}  // namespace

extern "C" {

// query [B, H, G * qlen, D] fp32, already scaled, rows ordered (gi, qi); out [B, H, G * qlen, D] fp32,
// zeroed; delta [B, H, sum slots] fp32 or null; logits: scratch of (G * qlen + 1) * round_up(sum slots, 16)
// floats.
// Returns 0, or -1 for a head dim beyond 512.
int hfkv_paged_decode(const float* query, int32_t B, int32_t H, int32_t G, int32_t qlen, int32_t dim,
                      int64_t q_start, const int64_t* pad_end, int32_t nparts, const HfkvPart* parts,
                      int32_t reduction, float* out, float* delta, float* logits) {
    if (dim > 512) return -1;  // the fp16 / bf16 staging buffers of decode_field
    switch (dim) {
        case 64: attend_all<64>(query, B, H, G, qlen, dim, q_start, pad_end, nparts, parts, reduction, out, delta, logits); break;
        case 128: attend_all<128>(query, B, H, G, qlen, dim, q_start, pad_end, nparts, parts, reduction, out, delta, logits); break;
        default: attend_all<0>(query, B, H, G, qlen, dim, q_start, pad_end, nparts, parts, reduction, out, delta, logits);
    }
    return 0;
}

int hfkv_part_size(void) { return static_cast<int>(sizeof(HfkvPart)); }

}  // extern "C"
