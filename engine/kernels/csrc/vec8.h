/* Eight floats as one value, and e^x on them, for the kernels in this folder
 * (paged_decode.c, layer_ops.c, quant8.h). engine/kernels/native.py hashes the headers here with each
 * source, so a change here rebuilds them all. */
#ifndef INFERSIGHT_VEC8_H
#define INFERSIGHT_VEC8_H

#include <stdint.h>
#include <string.h>

/* Eight floats as one value (GCC and clang vector extensions): one AVX register on x86-64,
 * two NEON registers on arm64. Loads and stores go through memcpy, so nothing needs to be
 * aligned. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

typedef int32_t v8i __attribute__((vector_size(32)));

/* a * b + c, fused where the CPU has FMA (one rounding, and twice the throughput of a
 * multiply then an add, which is what ISO C's no-contraction rule makes of `a * b + c`). */
#if defined(__FMA__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) {
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#elif defined(__aarch64__)
#include <arm_neon.h>
static inline v8 fma8(v8 a, v8 b, v8 c) {
    float32x4_t x[2], y[2], z[2];
    memcpy(x, &a, sizeof a), memcpy(y, &b, sizeof b), memcpy(z, &c, sizeof c);
    z[0] = vfmaq_f32(z[0], x[0], y[0]), z[1] = vfmaq_f32(z[1], x[1], y[1]);
    memcpy(&c, z, sizeof c);
    return c;
}
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif


static inline v8i bits8(v8 v) {
    v8i b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static inline v8 floats8(v8i b) {
    v8 v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* The larger of a and b in each lane (one instruction where the CPU has AVX; b where a is
 * NaN), and the smaller. */
#if defined(__AVX__)
#include <immintrin.h>
static inline v8 max8(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
static inline v8 min8(v8 a, v8 b) { return (v8)_mm256_min_ps((__m256)a, (__m256)b); }
#else
static inline v8 max8(v8 a, v8 b) {
    const v8i gt = a > b;
    return floats8((bits8(a) & gt) | (bits8(b) & ~gt));
}
static inline v8 min8(v8 a, v8 b) {
    const v8i lt = a < b;
    return floats8((bits8(a) & lt) | (bits8(b) & ~lt));
}
#endif

/* Eight bf16 values (bf16.h's conversions, lane by lane): widened exactly, and narrowed to
 * nearest even with a NaN kept a NaN. */
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 load8_bf16(const uint16_t *p) { /* one zero extension and one shift */
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#else
static inline v8 load8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return floats8((v8i)(__builtin_convertvector(h, v8u32) << 16));
}
#endif

/* n bf16 values widened to fp32 (exactly) */
static inline void bf16_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i, load8_bf16(src + i));
    for (; i < n; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, sizeof(float));
    }
}

static inline v8h bf16_8(v8 v) {
    const v8u32 b = (v8u32)bits8(v);
    const v8u32 nan = (v8u32)((b & 0x7FFFFFFFu) > 0x7F800000u);
    const v8u32 r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return __builtin_convertvector((r & ~nan) | (((b >> 16) | 0x40u) & nan), v8h);
}

static inline void store8_bf16(uint16_t *p, v8 v) {
    const v8h h = bf16_8(v);
    memcpy(p, &h, sizeof h);
}

/* v rounded to bf16, as fp32 (bf16_8's bits, kept in the high halves) */
static inline v8 round8_bf16(v8 v) {
    const v8u32 b = (v8u32)bits8(v);
    const v8u32 nan = (v8u32)((b & 0x7FFFFFFFu) > 0x7F800000u);
    const v8u32 r = (nan & (b | 0x400000u)) | (~nan & (b + 0x7FFFu + ((b >> 16) & 1u)));
    return floats8((v8i)(r & 0xFFFF0000u));
}

/* e^x for eight lanes: Cephes' expf (range reduction by ln 2, a degree-5 polynomial in fused
 * multiply-adds where the CPU has them; a few ulp from libm's expf), written in vectors so
 * that the softmax of a tile is a few instructions. Lanes below -87.3 (a masked key's -inf)
 * give exactly 0; from about 88.38 up the result is +inf (2^128), and past 88.7 garbage:
 * callers clamp there. */

static inline v8 exp8(v8 x) {
    const v8 floor_ = (v8){0} - 87.3f;
    const v8i below = x < floor_; /* all ones in the lanes whose result is 0 */
    x = floats8((bits8(x) & ~below) | (bits8(floor_) & below));
    v8 n = x * 1.44269504088896341f + 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    n -= 12582912.0f;
    const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = fma8(r, (v8){0} + 1.9875691500e-4f, (v8){0} + 1.3981999507e-3f);
    p = fma8(p, r, (v8){0} + 8.3334519073e-3f);
    p = fma8(p, r, (v8){0} + 4.1665795894e-2f);
    p = fma8(p, r, (v8){0} + 1.6666665459e-1f);
    p = fma8(p, r, (v8){0} + 5.0000001201e-1f);
    p = fma8(p * r, r, r) + 1.0f;
    const v8i pow2 = (__builtin_convertvector(n, v8i) + 127) << 23;
    return floats8(bits8(p * floats8(pow2)) & ~below);
}

/* SiLU, x / (1 + e^-x), for eight lanes: e^-x from exp8 (a few ulp from libm's expf; torch
 * uses its own vectorized exp, so the two SiLUs agree within a few ulp of fp32), its argument
 * clamped at 88.7: from about 88.4 up e^-x is +inf and the SiLU -0 (torch's turns -0 from 88.7
 * up; below it, -3e-37 at most). */
static inline v8 silu8(v8 x) {
    const v8 cap = (v8){0} + 88.7f, minus = (v8){0} - x;
    const v8i big = minus > cap;
    const v8 e = exp8(floats8((bits8(minus) & ~big) | (bits8(cap) & big)));
    return x / ((v8){0} + 1.0f + e);
}

#endif
