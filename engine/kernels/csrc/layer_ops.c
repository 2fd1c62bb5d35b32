/* A decoder layer's RMSNorms on the CPU, one call each (engine/kernels/layer_ops.py).
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

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* value i of a row of fp32, or of bf16 where `bf16` */
static inline float at(const void *v, int bf16, int64_t i) {
    return bf16 ? from_bf16(((const uint16_t *)v)[i]) : ((const float *)v)[i];
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
            const float n = from_bf16(to_bf16(from_bf16(rb[i]) * inv));
            ob[i] = to_bf16(from_bf16(wb[i]) * n);
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
                ((uint16_t *)s)[i] = to_bf16(from_bf16(xb[i]) + from_bf16(rb[i]));
        } else {
            const float *xf = row_of(x, 0, r, h), *rf = row_of(residual, 0, r, h);
            for (int64_t i = 0; i < h; i++) ((float *)s)[i] = xf[i] + rf[i];
        }
        norm_row(s, w, h, eps, bf16, (void *)row_of(out, bf16, r, h));
    }
}

const char *infersight_layer_ops_isa(void) { return "scalar"; }
