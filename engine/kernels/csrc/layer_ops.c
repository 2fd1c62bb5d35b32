/* A decoder layer's RMSNorms, and its RoPE with the K/V write, on the CPU, one call each
 * (engine/kernels/layer_ops.py).
 *
 * In eager PyTorch an RMSNorm of one bf16 row is about a dozen operators (the cast to fp32,
 * the square, the mean, the add, the rsqrt, the products, the casts back), each paying its
 * dispatch: about 40 µs per norm on the 2-core EPYC, 61 norms per step of SmolLM2, 13% of an
 * INT4 decode step. Here each is one pass over the row, computed as the model's torch code
 * computes it (engine/model/transformer.py: rms_norm, add_rms_norm):
 *
 *   fp32: out = x * rsqrt(mean(x²) + eps) * w
 *   bf16: n = bf16(x * rsqrt(mean(x²) + eps)), out = bf16(w * n), the sums in fp32;
 *   with the residual add first: s = x + r (rounded to the dtype), then the norm of s.
 *
 * Only the order of the sum of squares differs from torch's (eight partial sums here).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* value i of a row of fp32, or of bf16 where `bf16` */
static inline float at(const void *v, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

/* 1 / sqrt(mean of squares + eps) of one row */
static inline float inverse_rms(const void *v, int bf16, int64_t h, float eps) {
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        for (int j = 0; j < 8; j++) {
            const float a = at(v, bf16, i + j);
            part[j] += a * a;
        }
    }
    float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < h; i++) {
        const float a = at(v, bf16, i);
        ss += a * a;
    }
    return 1.0f / sqrtf(ss / (float)h + eps);
}

/* One row of `row` (fp32, or bf16 where `bf16`), normalized and scaled into `out`. */
static inline void norm_row(const void *row, const void *w, int64_t h, float eps, int bf16,
                            void *out) {
    const float inv = inverse_rms(row, bf16, h, eps);
    if (bf16) {
        const uint16_t *rb = (const uint16_t *)row, *wb = (const uint16_t *)w;
        uint16_t *ob = (uint16_t *)out;
        for (int64_t i = 0; i < h; i++) {
            const float n = bf16_to_f32(f32_to_bf16(bf16_to_f32(rb[i]) * inv));
            ob[i] = f32_to_bf16(bf16_to_f32(wb[i]) * n);
        }
    } else {
        const float *rf = (const float *)row, *wf = (const float *)w;
        float *of = (float *)out;
        for (int64_t i = 0; i < h; i++) of[i] = rf[i] * inv * wf[i];
    }
}

static inline const void *row_of(const void *base, int bf16, int64_t r, int64_t h) {
    return bf16 ? (const void *)((const uint16_t *)base + r * h)
                : (const void *)((const float *)base + r * h);
}

/* out [rows, h] = rms_norm(x) * w; x, w and out fp32, or bf16 where `bf16`. */
void infersight_rms_norm(const void *x, const void *w, int64_t rows, int64_t h, float eps,
                         int bf16, void *out) {
    for (int64_t r = 0; r < rows; r++)
        norm_row(row_of(x, bf16, r, h), w, h, eps, bf16, (void *)row_of(out, bf16, r, h));
}

/* sum = x + residual (in the dtype), out = rms_norm(sum) * w. */
void infersight_add_rms_norm(const void *x, const void *residual, const void *w, int64_t rows,
                             int64_t h, float eps, int bf16, void *out, void *sum) {
    for (int64_t r = 0; r < rows; r++) {
        void *s = (void *)row_of(sum, bf16, r, h);
        if (bf16) {
            const uint16_t *xb = row_of(x, 1, r, h), *rb = row_of(residual, 1, r, h);
            for (int64_t i = 0; i < h; i++)
                ((uint16_t *)s)[i] = f32_to_bf16(bf16_to_f32(xb[i]) + bf16_to_f32(rb[i]));
        } else {
            const float *xf = row_of(x, 0, r, h), *rf = row_of(residual, 0, r, h);
            for (int64_t i = 0; i < h; i++) ((float *)s)[i] = xf[i] + rf[i];
        }
        norm_row(s, w, h, eps, bf16, (void *)row_of(out, bf16, r, h));
    }
}

/* RoPE on the q and k heads of a fused qkv [T, (H + 2 Hkv) D], and the K/V write: the rotated
 * k heads and the v heads go to pool[slots[t]] ([slots, 2 Hkv, D], k heads first), the rotated
 * q heads stay in place in qkv; qkv's k columns are left as they were. cos and sin [T, D] are
 * the model's tables (sin holding [-sin, sin]: engine/model/transformer.py, RotaryEmbedding),
 * so a head x rotates to x * cos + roll(x, D/2) * sin, each product and the sum rounded to the
 * dtype as torch's three operators round them (never contracted into a fused multiply-add).
 * Where the torch code runs two operators per layer for the rotation and one for the write,
 * plus their dispatch, this is one pass over the step's q, k and v. */
__attribute__((optimize("fp-contract=off")))
static inline float rotated(const void *x, int bf16, const void *cos, const void *sin,
                            int64_t i, int64_t partner, int64_t angle) {
    const float p = at(x, bf16, i) * at(cos, bf16, angle);
    const float r = at(x, bf16, partner) * at(sin, bf16, angle);
    if (bf16) {
        const float sum = bf16_to_f32(f32_to_bf16(p)) + bf16_to_f32(f32_to_bf16(r));
        return bf16_to_f32(f32_to_bf16(sum));
    }
    return p + r;
}

static inline void put(void *v, int bf16, int64_t i, float value) {
    if (bf16)
        ((uint16_t *)v)[i] = f32_to_bf16(value);
    else
        ((float *)v)[i] = value;
}

__attribute__((optimize("fp-contract=off")))
void infersight_rope_store(void *qkv, int bf16, int64_t tokens, int64_t heads, int64_t kv_heads,
                           int64_t dim, const void *cos, const void *sin, void *pool,
                           const int64_t *slots) {
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
    const int64_t pool_row = 2 * kv_heads * dim;
    const size_t size = bf16 ? 2 : 4;
    float head[512];  /* one head's rotated values: a q head is read whole before it is written */
    for (int64_t t = 0; t < tokens; t++) {
        char *row = (char *)qkv + (size_t)(t * width) * size;
        char *dst = (char *)pool + (size_t)(slots[t] * pool_row) * size;
        const void *c = (const char *)cos + (size_t)(t * dim) * size;
        const void *s = (const char *)sin + (size_t)(t * dim) * size;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const void *x = row + (size_t)(h * dim) * size;
            for (int64_t i = 0; i < dim; i++) {
                const int64_t partner = i < half ? i + half : i - half;
                head[i] = rotated(x, bf16, c, s, i, partner, i);
            }
            void *out = h < heads ? (void *)x : (void *)(dst + (size_t)((h - heads) * dim) * size);
            for (int64_t i = 0; i < dim; i++) put(out, bf16, i, head[i]);
        }
        const char *v = row + (size_t)((heads + kv_heads) * dim) * size;
        memcpy(dst + (size_t)(kv_heads * dim) * size, v, (size_t)(kv_heads * dim) * size);
    }
}

const char *infersight_layer_ops_isa(void) { return "scalar"; }
