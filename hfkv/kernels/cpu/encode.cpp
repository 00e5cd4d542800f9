// Quantize, pack and write records straight into their slots on CPU: hfkv.kernels.encode.encode_write's
// contract (torch twin: RecordLayout.encode and a scatter), bit-exact.
//
// A policy run writes a few dozen tokens per layer (the window's exits, the demoted), and the torch encoder
// spends some fifty tensor operations on them whatever their number: most of a CPU policy run was dispatch.
// Here one call writes every record: per token and field the same fp32 arithmetic as QuantFormat._encode_int
// (group min / max, fp16 zero and scale rounded up, codes rounded half to even, packed in planes), the model
// dtype casts of torch (round to nearest even) and the e4m3 rounding of torch's float8 cast.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum Family : int32_t { MODEL = 0, INT = 1, FP8 = 2 };
enum DType : int32_t { F32 = 0, F16 = 1, BF16 = 2 };

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// fp32 -> fp16 bits, round to nearest even (c10's fp16_ieee_from_fp32_value, what torch's cast computes).
inline uint16_t to_half(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = bits_of(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits_of(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// fp16 bits -> fp32 (exact).
inline float from_half(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return float_of(exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13)));
}

// The next fp16 toward +inf (torch.nextafter(h, inf)).
inline uint16_t next_up(uint16_t h) {
    if ((h & 0x7fffu) == 0) return 0x0001;
    return static_cast<uint16_t>(h & 0x8000u ? h - 1 : h + 1);
}

// fp32 -> bf16 bits, round to nearest even on the integer bits (NaN -> 0x7FC0 as torch's CPU cast).
inline uint16_t to_bf16(float f) {
    if (f != f) return 0x7FC0;
    const uint32_t u = bits_of(f);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp32 (|y| <= 448 after the clamp) -> e4m3fn byte, rounding as torch's `.to(float8_e4m3fn)`: subnormal steps
// of 2^-9 rounded half to even, else the exponent rebiased from 127 to 7 and the mantissa rounded to 3 bits.
inline uint8_t to_e4m3(float y) {
    const uint32_t u = bits_of(y);
    const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    uint32_t code;
    if (a >= 0x43F00000u) code = 0x7F;  // >= 480 or NaN
    else if (a < (121u << 23)) code = static_cast<uint32_t>(std::nearbyint(float_of(a) * 512.0f));
    else code = (a + (0xC4000000u + 0x7FFFFu) + ((a >> 20) & 1u)) >> 20;  // 0xC4000000 = (7 - 127) << 23
    return static_cast<uint8_t>(code | sign);
}

struct Field {
    int32_t family, bits, group, dtype, offset, nbytes;
};

void encode_field(const Field& f, const float* x, int dim, uint8_t* out) {
    if (f.family == MODEL) {
        if (f.dtype == F32) {
            std::memcpy(out, x, 4 * static_cast<size_t>(dim));
        } else {
            for (int e = 0; e < dim; ++e) {
                const uint16_t h = f.dtype == F16 ? to_half(x[e]) : to_bf16(x[e]);
                std::memcpy(out + 2 * e, &h, 2);
            }
        }
        return;
    }
    if (f.family == FP8) {
        float amax = 0.0f;
        for (int e = 0; e < dim; ++e) amax = std::fmax(amax, std::fabs(x[e]));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        for (int e = 0; e < dim; ++e) out[e] = to_e4m3(std::fmin(std::fmax(x[e] / scale, -448.0f), 448.0f));
        std::memcpy(out + dim, &scale, 4);
        return;
    }
    const int qmax = (1 << f.bits) - 1, per = 8 / f.bits, plane = dim / per, groups = dim / f.group;
    uint8_t codes[512];
    uint8_t* meta = out + dim * f.bits / 8;
    for (int g = 0; g < groups; ++g) {
        const float* xg = x + g * f.group;
        float mn = xg[0], mx = xg[0];
        for (int e = 1; e < f.group; ++e) {
            mn = std::fmin(mn, xg[e]);
            mx = std::fmax(mx, xg[e]);
        }
        const uint16_t zero16 = to_half(mn);
        const float zero = from_half(zero16);
        // A constant group gets scale 0 and decodes exactly to fp16(min).
        const float scale = mx > mn ? (mx - zero) / static_cast<float>(qmax) : 0.0f;
        uint16_t scale16 = to_half(scale);
        if (from_half(scale16) < scale) scale16 = next_up(scale16);  // so the top code still reaches max
        const float s = from_half(scale16);
        for (int e = 0; e < f.group; ++e) {
            float c = s > 0.0f ? std::nearbyint((xg[e] - zero) / s) : 0.0f;
            c = std::fmin(std::fmax(c, 0.0f), static_cast<float>(qmax));
            codes[g * f.group + e] = static_cast<uint8_t>(c);
        }
        std::memcpy(meta + 2 * g, &scale16, 2);
        std::memcpy(meta + 2 * (groups + g), &zero16, 2);
    }
    if (per == 1) {
        std::memcpy(out, codes, dim);
        return;
    }
    for (int j = 0; j < plane; ++j) {
        uint32_t byte = 0;
        for (int p = 0; p < per; ++p) byte |= static_cast<uint32_t>(codes[p * plane + j]) << (p * f.bits);
        out[j] = static_cast<uint8_t>(byte);
    }
}

}  // namespace

extern "C" {

// k, v: [N, D] fp32 contiguous; pos i64 [N]; score f32 [N]; dest i64 [N] byte offsets of slot bodies in a pool of
// page_bytes pages holding tpp records each. Fields: {family, bits, group, dtype, offset, nbytes} of keys and
// values; stride: a body's bytes (those between the values and its end are zeroed). The tag and score go to the
// page's tag and score regions (hfkv.storage.record).
void hfkv_encode_write(uint8_t* pool, const int64_t* dest, int64_t n, const float* k, const float* v, int32_t dk,
                       int32_t dv, const int64_t* pos, const float* score, const int32_t* key, const int32_t* value,
                       int64_t page_bytes, int32_t tpp, int32_t stride) {
    const Field fk{key[0], key[1], key[2], key[3], key[4], key[5]};
    const Field fv{value[0], value[1], value[2], value[3], value[4], value[5]};
#pragma omp parallel for schedule(static) if (n > 256)
    for (int64_t i = 0; i < n; ++i) {
        uint8_t* rec = pool + dest[i];
        encode_field(fk, k + i * dk, dk, rec + fk.offset);
        encode_field(fv, v + i * dv, dv, rec + fv.offset);
        const int32_t kv_end = fv.offset + fv.nbytes;
        if (stride > kv_end) std::memset(rec + kv_end, 0, stride - kv_end);
        const int64_t in_page = dest[i] % page_bytes;
        uint8_t* tags = rec - in_page + static_cast<int64_t>(tpp) * stride + in_page / stride * 4;
        const int32_t tag = static_cast<int32_t>(static_cast<uint32_t>(pos[i]) + 1u);
        std::memcpy(tags, &tag, 4);
        std::memcpy(tags + 4 * static_cast<int64_t>(tpp), score + i, 4);
    }
}

}  // extern "C"
