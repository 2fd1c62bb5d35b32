/* The KV pool's formats as the kernels in this folder read and write them
 * (engine/formats/kv.py): a slot holds 2*Hkv head rows, K heads then V heads. A float pool's
 * row is D values (fp32 or bf16); an int8 pool's is D int8 values followed by the row's fp32
 * scale (four bytes), each value q * scale in fp32. Rows are dequantized into the kernels'
 * fp32 tiles as they are read: the pool is never copied whole. */
#ifndef INFERSIGHT_KV_ROWS_H
#define INFERSIGHT_KV_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

enum { KV_FP32 = 0, KV_BF16 = 1, KV_INT8 = 2 };
#define KV_SCALE_BYTES 4

typedef int8_t v8c __attribute__((vector_size(8)));

/* bytes of one head's row in a pool of format fmt */
static inline int64_t kv_head_bytes(int fmt, int64_t D) {
    return fmt == KV_INT8 ? D + KV_SCALE_BYTES : D * (fmt == KV_BF16 ? 2 : 4);
}

/* eight int8 values widened to fp32 (exact): one sign extension and one conversion where
 * the CPU has AVX2 (the vector extensions' own conversion compiles to a lane at a time) */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 widen8_i8(const int8_t *q) {
    const __m128i c = _mm_loadl_epi64((const __m128i *)q);
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
}
#else
static inline v8 widen8_i8(const int8_t *q) {
    v8c c;
    memcpy(&c, q, sizeof c);
    return __builtin_convertvector(c, v8);
}
#endif

/* one int8 row (D values, then its scale) as fp32: q * scale, one rounding each */
static inline void int8_row(const char *src, int64_t D, float *dst) {
    float s;
    memcpy(&s, src + D, sizeof s);
    const int8_t *q = (const int8_t *)src;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) store8(dst + d, widen8_i8(q + d) * s);
    for (; d < D; d++) dst[d] = (float)q[d] * s;
}

/* n consecutive head rows of `slot` from head h (of 2*Hkv), as fp32 into dst ([n][D]) */
static inline void kv_heads_f32(const void *pool, int fmt, int64_t slot, int64_t Hkv, int64_t h,
                                int64_t n, int64_t D, float *dst) {
    const int64_t hb = kv_head_bytes(fmt, D);
    const char *src = (const char *)pool + (slot * 2 * Hkv + h) * hb;
    if (fmt == KV_FP32)
        memcpy(dst, src, (size_t)(n * D) * sizeof(float));
    else if (fmt == KV_BF16)
        bf16_row((const uint16_t *)src, n * D, dst);
    else
        for (int64_t i = 0; i < n; i++) int8_row(src + i * hb, D, dst + i * D);
}

/* fp32 values x[0..D) as an int8 row at dst (engine/formats/kv.py: quantize): scale =
 * max|x| / 127, each value x / scale rounded to nearest even; a row of zeros keeps scale 0 */
static inline void int8_quantize_row(const float *x, int64_t D, char *dst) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float s = amax / 127.0f, by = s > 0.0f ? s : 1.0f;
    int8_t *q = (int8_t *)dst;
    for (int64_t d = 0; d < D; d++) {
        const float r = nearbyintf(x[d] / by);
        q[d] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
    }
    memcpy(dst + D, &s, sizeof s);
}

#endif
