// Small vectorisable building blocks shared by the CPU decode kernels.
//
// The kernels are loops over 8-float vector types (GCC/Clang vector extensions, no intrinsics), so they build
// for any target. K3_KERNEL compiles a function three times on x86-64
// (AVX-512, AVX2/FMA and baseline SSE2) and picks one at load time (GNU ifunc), so the default build runs on
// any x86-64 and uses the widest of them the CPU has; other targets get one portable build. The AVX-512 clone
// runs the same 8-float vectors (same arithmetic, same order) but with 32 vector registers instead of 16, so
// the multi-head accumulators stay in registers: the MLA decode kernel runs ~20% faster on one core, with
// results bit-identical to the AVX2 clone there. Kernels are also flattened: every
// helper is inlined into each clone, so it is compiled for that clone's vector width (a helper left out of
// line would be baseline code passing vectors through memory). The FMA clones contract a * b + c into FMAs,
// so they may differ from the SSE2 one in the last bit; each is deterministic, whatever the batch around a sequence.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define K3_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))
#elif defined(__GNUC__)
#define K3_KERNEL __attribute__((flatten))
#else
#define K3_KERNEL
#endif

namespace k3 {

// 8-float vectors (GCC/Clang vector extensions): one AVX register in the AVX2 clone, two SSE registers in the
// baseline one. The unaligned, aliasing load type lets a vector be read from any float address.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline float hsum8(v8 x) { return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7])); }

// a · b in 16 interleaved partial sums, then a fixed tree: the order depends only on n.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
    v8 lo = {}, hi = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo += load8(a + i) * load8(b + i);
        hi += load8(a + i + 8) * load8(b + i + 8);
    }
    if (i + 8 <= n) {
        lo += load8(a + i) * load8(b + i);
        i += 8;
    }
    float s = hsum8(lo + hi);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// c in the shape of the first argument: a float, or 8 equal lanes
inline float splat(float, float c) { return c; }
inline v8 splat(v8, float c) { return v8{} + c; }

// exp(x - n ln 2) for |x - n ln 2| <= ln2 / 2: ln 2 subtracted in two parts (exact enough), then a degree-6
// polynomial. One template for a float and for 8 lanes, so each lane equals the scalar result.
template <class T>
inline T exp_reduced(T x, T n) {
    T r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    T p = splat(r, 1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (softmax weights after the max is subtracted), ~2 ulp, written with arithmetic only so
// that a loop over it vectorises (libm's expf does not). Values below -87 flush to 0.
inline float exp_nonpos(float x) {
    const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer kept in the low mantissa bits
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f + magic;
    float n = t - magic;  // round(x / ln 2)
    int32_t ni = static_cast<int32_t>(float_to_bits(t) - float_to_bits(magic));
    float scale = bits_to_float(static_cast<uint32_t>((ni + 127) << 23));
    return x <= -87.0f ? 0.0f : exp_reduced(x, n) * scale;
}

// exp_nonpos on 8 lanes (same steps, so each lane equals the scalar result).
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 exp8_nonpos(v8 x) {
    const v8 lo = v8{} - 87.0f, magic = v8{} + 12582912.0f;
    x = x < lo ? lo : x;
    v8 t = x * 1.44269504088896341f + magic;
    v8 n = t - magic;
    v8i ni = reinterpret_cast<v8i>(t) - reinterpret_cast<v8i>(magic);
    v8 scale = reinterpret_cast<v8>((ni + 127) << 23);
    return x <= lo ? v8{} : exp_reduced(x, n) * scale;
}

// exp on 8 lanes for any x (1 / exp(-x) on the positive side; +inf above ~87).
inline v8 exp8(v8 x) {
    v8 e = exp8_nonpos(x < 0.0f ? x : -x);
    return x < 0.0f ? e : 1.0f / e;
}

// log(1 + u) on 8 lanes for u >= 0: log a = e ln2 + 2 atanh((m - 1) / (m + 1)) with a = 1 + u = m 2^e,
// m in [sqrt(1/2), sqrt(2)); times u / (a - 1) to recover what rounding 1 + u lost for small u.
inline v8 log1p8_nonneg(v8 u) {
    v8 a = u + 1.0f;
    v8i bits = reinterpret_cast<v8i>(a);
    v8i e = ((bits + (0x3f800000 - 0x3f3504f3)) >> 23) - 127;  // exponent after moving m below sqrt(2)
    v8 m = reinterpret_cast<v8>(bits - (e << 23));
    v8 s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    v8 poly = ((((s2 * (1.0f / 9) + 1.0f / 7) * s2 + 1.0f / 5) * s2 + 1.0f / 3) * s2 + 1.0f) * (2.0f * s);
    v8 log_a = __builtin_convertvector(e, v8) * 0.693147180559945f + poly;
    v8 d = a - 1.0f;
    return d == 0.0f ? u : log_a * (u / d);
}

// exp(x) for any x: exp_nonpos on the negative side, 1 / exp(-x) on the positive (overflow above 88 to inf).
inline float exp_any(float x) {
    float e = exp_nonpos(x < 0.0f ? x : -x);
    return x < 0.0f ? e : (x > 88.0f ? INFINITY : 1.0f / e);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_any(-x)); }

}  // namespace k3
