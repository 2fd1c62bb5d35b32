/* W8A8's row operations (engine/quant/w8a8.py), shared by lowbit.c (one operation per call)
 * and layer_ops.c (fused into the layer's norms and SiLU on a prefill's rows): a row of
 * activations to INT8 with its scale, and a row of int32 sums back to floats. Written in
 * eight-lane vectors (vec8.h) with the same operations, in the same order, as the scalar
 * definitions below them state, so that the values are torch's reference's exactly
 * (engine/kernels/lowbit_rows.py: quantize_rows_reference, scale_rows_reference). */
#ifndef INFERSIGHT_QUANT8_H
#define INFERSIGHT_QUANT8_H

#include <stdint.h>
#include <string.h>

#include "vec8.h"

typedef int8_t v8b __attribute__((vector_size(8)));

/* x [k] fp32 -> q int8 [k]; returns the scale s = max|x| / 127 (floored at 1e-12), or `fixed`
 * where it is > 0 (static scales); q = x / s (a true division, as torch's), clamped to ±127,
 * rounded to nearest even (clamping first gives what torch's round-then-clamp gives, and keeps
 * the 1.5·2^23 rounding trick exact). */
static inline float quantize_row(const float *x, int64_t k, float fixed, int8_t *q) {
    float scale = fixed;
    if (fixed <= 0.0f) {
        const v8i abs_mask = (v8i){0} + 0x7FFFFFFF;
        v8 m8 = {0};
        int64_t j = 0;
        for (; j + 8 <= k; j += 8) {
            const v8 a = floats8(bits8(load8(x + j)) & abs_mask);
            m8 = max8(a, m8);
        }
        float m = 0.0f;
        for (int i = 0; i < 8; i++) m = m8[i] > m ? m8[i] : m;
        for (; j < k; j++) {
            const float a = __builtin_fabsf(x[j]);
            m = a > m ? a : m;
        }
        scale = m / 127.0f > 1e-12f ? m / 127.0f : 1e-12f;
    }
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    const v8 s8 = (v8){0} + scale, hi = (v8){0} + 127.0f, lo = (v8){0} - 127.0f;
    const v8 magic8 = (v8){0} + magic;
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        v8 v = load8(x + j) / s8;
        v = max8(min8(v, hi), lo); /* a ternary's clamp: v > 127 -> 127, then v < -127 */
        const v8b b = __builtin_convertvector(__builtin_convertvector((v + magic8) - magic8, v8i), v8b);
        memcpy(q + j, &b, sizeof b);
    }
    for (; j < k; j++) {
        float v = x[j] / scale;
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[j] = (int8_t)(int32_t)((v + magic) - magic);
    }
    return scale;
}

/* y [n] = ((float)acc · sx) · sw (+ bias), in that order and never contracted into fused
 * multiply-adds (ISO C): what torch's operators give on the same int32 sums, in fp32. */
static inline void scale_row(const int32_t *acc, int64_t n, float sx, const float *sw,
                             const float *bias, float *y) {
    const v8 row = (v8){0} + sx;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8i a;
        memcpy(&a, acc + j, sizeof a);
        v8 v = __builtin_convertvector(a, v8) * row * load8(sw + j);
        if (bias) v += load8(bias + j);
        store8(y + j, v);
    }
    for (; j < n; j++) {
        float v = (float)acc[j] * sx * sw[j];
        if (bias) v += bias[j];
        y[j] = v;
    }
}

/* silu(gate) · up for eight lanes of the gate/up product's scaled sums (fp32), rounded where
 * torch's bf16 operators round (`bf16`): the product's output g and u, the SiLU, the product. */
static inline v8 silu_up8(v8 g, v8 u, int bf16) {
    if (!bf16) return silu8(g) * u;
    g = round8_bf16(g), u = round8_bf16(u);
    return round8_bf16(round8_bf16(silu8(g)) * u);
}

#endif
