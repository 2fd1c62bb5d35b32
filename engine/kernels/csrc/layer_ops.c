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
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "kv_rows.h"
#include "quant8.h"
#include "vec8.h"

/* value i of a row of fp32, or of bf16 where `bf16` */
static inline float at(const void *v, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

/* eight values of a row of fp32, or of bf16 where `bf16`, from i */
static inline v8 at8(const void *v, int bf16, int64_t i) {
    return bf16 ? load8_bf16((const uint16_t *)v + i) : load8((const float *)v + i);
}

/* 1 / sqrt(mean of squares + eps) of one row: eight partial sums, lane by lane */
static inline float inverse_rms(const void *v, int bf16, int64_t h, float eps) {
    v8 part = {0};
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        const v8 a = at8(v, bf16, i);
        part += a * a;
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
    int64_t i = 0;
    if (bf16) {
        const uint16_t *rb = (const uint16_t *)row, *wb = (const uint16_t *)w;
        uint16_t *ob = (uint16_t *)out;
        const v8 inv8 = (v8){0} + inv;
        for (; i + 8 <= h; i += 8)
            store8_bf16(ob + i, load8_bf16(wb + i) * round8_bf16(load8_bf16(rb + i) * inv8));
        for (; i < h; i++) {
            const float n = bf16_to_f32(f32_to_bf16(bf16_to_f32(rb[i]) * inv));
            ob[i] = f32_to_bf16(bf16_to_f32(wb[i]) * n);
        }
    } else {
        const float *rf = (const float *)row, *wf = (const float *)w;
        float *of = (float *)out;
        for (; i < h; i++) of[i] = rf[i] * inv * wf[i];
    }
}

static inline const void *row_of(const void *base, int bf16, int64_t r, int64_t h) {
    return bf16 ? (const void *)((const uint16_t *)base + r * h)
                : (const void *)((const float *)base + r * h);
}

/* out [rows, h] = rms_norm(x) * w; x, w and out fp32, or bf16 where `bf16`. Rows are split
 * over `threads` (each row is computed alike whichever thread takes it). */
void infersight_rms_norm(const void *x, const void *w, int64_t rows, int64_t h, float eps,
                         int bf16, void *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(row_of(x, bf16, r, h), w, h, eps, bf16, (void *)row_of(out, bf16, r, h));
}

/* sum = x + residual (in the dtype), out = rms_norm(sum) * w. */
void infersight_add_rms_norm(const void *x, const void *residual, const void *w, int64_t rows,
                             int64_t h, float eps, int bf16, void *out, void *sum, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        void *s = (void *)row_of(sum, bf16, r, h);
        if (bf16) {
            const uint16_t *xb = row_of(x, 1, r, h), *rb = row_of(residual, 1, r, h);
            int64_t i = 0;
            for (; i + 8 <= h; i += 8)
                store8_bf16((uint16_t *)s + i, load8_bf16(xb + i) + load8_bf16(rb + i));
            for (; i < h; i++)
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
 * plus their dispatch, this is one pass over the step's q, k and v. formats: bit 0 set where
 * the activations are bf16, bit 1 where the pool holds int8 rows (kv_rows.h: each k head,
 * once rotated, and each v head quantized as it is written). */
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
void infersight_rope_store(void *qkv, int formats, int64_t tokens, int64_t heads,
                           int64_t kv_heads, int64_t dim, const void *cos, const void *sin,
                           void *pool, const int64_t *slots, int threads) {
    const int bf16 = formats & 1, int8 = formats & 2;
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
    const size_t size = bf16 ? 2 : 4;
    const size_t head_bytes = int8 ? (size_t)kv_head_bytes(KV_INT8, dim) : (size_t)dim * size;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        float head[512]; /* one head's rotated values: a q head is read whole before it is written */
        float wide[512]; /* int8: a v head widened */
        char *row = (char *)qkv + (size_t)(t * width) * size;
        char *dst = (char *)pool + (size_t)slots[t] * 2 * (size_t)kv_heads * head_bytes;
        const void *c = (const char *)cos + (size_t)(t * dim) * size;
        const void *s = (const char *)sin + (size_t)(t * dim) * size;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const void *x = row + (size_t)(h * dim) * size;
            char *slot_head = dst + (size_t)(h - heads) * head_bytes;
            void *out = h < heads ? (void *)x : (void *)slot_head;
            if (h >= heads && int8) { /* rotated in the activations' dtype, then quantized */
                for (int64_t i = 0; i < dim; i++) {
                    const int64_t partner = i < half ? i + half : i - half;
                    head[i] = rotated(x, bf16, c, s, i, partner, i);
                }
                int8_quantize_row(head, dim, slot_head);
                continue;
            }
            if (!bf16) { /* the same products and sums in two runs the compiler vectorizes */
                const float *xf = x, *cf = c, *sf = s;
                for (int64_t i = 0; i < half; i++) head[i] = xf[i] * cf[i] + xf[i + half] * sf[i];
                for (int64_t i = half; i < dim; i++) head[i] = xf[i] * cf[i] + xf[i - half] * sf[i];
                memcpy(out, head, (size_t)dim * sizeof(float));
                continue;
            }
            if (half % 8 == 0) { /* bf16 in vectors: each product and the sum rounded */
                const uint16_t *xh = x, *ch = c, *sh = s;
                uint16_t *oh = (uint16_t *)head; /* the rotated head as bf16 */
                for (int64_t i = 0; i < dim; i += 8) {
                    const int64_t partner = i < half ? i + half : i - half;
                    const v8 p = round8_bf16(load8_bf16(xh + i) * load8_bf16(ch + i));
                    const v8 r = round8_bf16(load8_bf16(xh + partner) * load8_bf16(sh + i));
                    store8_bf16(oh + i, p + r);
                }
                memcpy(out, head, (size_t)dim * 2);
                continue;
            }
            for (int64_t i = 0; i < dim; i++) {
                const int64_t partner = i < half ? i + half : i - half;
                head[i] = rotated(x, bf16, c, s, i, partner, i);
            }
            for (int64_t i = 0; i < dim; i++) put(out, bf16, i, head[i]);
        }
        const char *v = row + (size_t)((heads + kv_heads) * dim) * size;
        if (!int8) {
            memcpy(dst + (size_t)kv_heads * head_bytes, v, (size_t)(kv_heads * dim) * size);
            continue;
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t i = 0; i < dim; i++) wide[i] = at(v, bf16, h * dim + i);
            int8_quantize_row(wide, dim, dst + (size_t)(kv_heads + h) * head_bytes);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * A decode step's decoder layers in one call (engine/kernels/decode_step.py).
 *
 * An eager decode step of a small model spends most of its time between its kernels: each
 * layer is about fifteen Python calls (the norms, four products, RoPE + the K/V write, the
 * attention, SiLU * up, two residual adds), each paying Python's call and, for torch's
 * operators, their dispatch. Here one call runs every layer of the step, each part on the
 * same kernel the eager step calls: the norms and RoPE above, the products and the
 * attention through pointers to our other libraries' entry points (gemv.c, lowbit.c,
 * paged_decode.c), filled in once at load. What is left in between is a few loops over a
 * row: the bias, the query heads widened to fp32 for the attention and its output rounded
 * back, SiLU(gate) * up and the residual add, each rounded to the activations' dtype where
 * torch's operator rounds.
 */
typedef int (*gemv_fn)(const void *x, int x_bf16, int64_t m, int64_t k, const void *w,
                       int type, const float *scales, int64_t n, void *y, int y_bf16,
                       int threads);
typedef int (*int8_fn)(const void *x, int x_bf16, int64_t m, int64_t k, const void *w,
                       const float *scales, int64_t n, void *y, int y_bf16, int threads);
typedef int (*int4_fn)(const void *x, int x_bf16, int64_t m, int64_t k, int64_t group,
                       const void *w, const void *sz, int64_t n, void *y, int y_bf16,
                       int threads);
typedef int (*attend_fn)(const float *q, const void *pool, int fmt, const int64_t *slots,
                         const int64_t *lens, const float *mask, float *out, int64_t B,
                         int64_t W, int64_t H, int64_t Hkv, int64_t D, float scale,
                         float cap, int threads);

/* one linear: which kernel, and its operands (engine/kernels/decode_step.py: Product) */
enum { PRODUCT_GEMV = 0, PRODUCT_INT8 = 1, PRODUCT_INT4 = 2 };
typedef struct {
    int32_t kind;    /* PRODUCT_* */
    int32_t wtype;   /* the GEMV's weight type (gemv.c: W_INT8, W_BF16, W_FP32) */
    int64_t n, k, group;
    const void *weight;
    const void *scales; /* fp32 [n] (INT8), bf16 [n, k / group, 2] (INT4), or NULL */
    const void *bias;   /* [n] in the activations' dtype, or NULL */
} product_t;

typedef struct {
    product_t qkv, o, gate_up, down;
    const void *input_norm, *post_norm; /* [hidden] in the activations' dtype */
} layer_t;

typedef struct {
    gemv_fn gemv;
    int8_fn int8;
    int4_fn int4;
    attend_fn attend;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int32_t bf16, threads;
    int32_t kv_fmt; /* the pools' format (kv_rows.h: KV_FP32, KV_BF16, KV_INT8) */
} model_t;

/* seconds spent, by kind, where the caller asked (bench --profile) */
enum { SPENT_PRODUCTS = 0, SPENT_ATTENTION = 1, SPENT_OTHER = 2 };

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* y [m, n] = x [m, k] W^T (+ bias), both in the activations' dtype */
static int product(const model_t *m, const product_t *p, const void *x, int64_t rows, void *y) {
    const int bf16 = m->bf16;
    int rc;
    if (p->kind == PRODUCT_GEMV)
        rc = m->gemv(x, bf16, rows, p->k, p->weight, p->wtype, (const float *)p->scales, p->n,
                     y, bf16, m->threads);
    else if (p->kind == PRODUCT_INT8)
        rc = m->int8(x, bf16, rows, p->k, p->weight, (const float *)p->scales, p->n, y, bf16,
                     m->threads);
    else
        rc = m->int4(x, bf16, rows, p->k, p->group, p->weight, p->scales, p->n, y, bf16,
                     m->threads);
    if (rc || p->bias == NULL) return rc;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < p->n; i++)
            put(y, bf16, r * p->n + i, at(y, bf16, r * p->n + i) + at(p->bias, bf16, i));
    return 0;
}

/* act [rows, I] = silu(gate) * up of gate_up [rows, 2 I], as torch's F.silu(gate) * up: the
 * SiLU (vec8.h's silu8) rounded to the dtype, then the product rounded. The last I mod 8
 * values take libm's expf. */

/* the SiLU of one value (libm's expf): the last I mod 8 */
static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

static void silu_mul(const void *gate_up, int bf16, int64_t rows, int64_t inter, void *act) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gate = r * 2 * inter, up = gate + inter, out = r * inter;
        int64_t i = 0;
        if (!bf16)
            for (; i + 8 <= inter; i += 8) {
                const float *gu = (const float *)gate_up;
                store8((float *)act + out + i, silu8(load8(gu + gate + i)) * load8(gu + up + i));
            }
        else /* the same, widened and narrowed eight at a time */
            for (; i + 8 <= inter; i += 8) {
                const uint16_t *gu = (const uint16_t *)gate_up;
                const v8 v = round8_bf16(silu8(load8_bf16(gu + gate + i)));
                store8_bf16((uint16_t *)act + out + i, v * load8_bf16(gu + up + i));
            }
        for (; i < inter; i++) {
            float v = silu1(at(gate_up, bf16, gate + i));
            if (bf16) v = bf16_to_f32(f32_to_bf16(v));
            put(act, bf16, out + i, v * at(gate_up, bf16, up + i));
        }
    }
}

/* bf16 values [n] at the front of `v` widened in place to fp32 [n], from the back: element
 * i's four bytes cover bf16 elements 2i and 2i + 1, both read already. */
static void widen_in_place(float *v, int64_t n) {
    char *bytes = (char *)v; /* through memcpy: one buffer, read as bf16, written as fp32 */
    for (int64_t i = n - 1; i >= 0; i--) {
        uint16_t h;
        memcpy(&h, bytes + 2 * i, sizeof h);
        const float f = bf16_to_f32(h);
        memcpy(bytes + 4 * i, &f, sizeof f);
    }
}

/* dst [n] (fp32) = src [n] (fp32, or bf16 where `bf16`), eight at a time */
static void widen_run(const void *src, int bf16, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i, at8(src, bf16, i));
    for (; i < n; i++) dst[i] = at(src, bf16, i);
}

/* dst [n] (bf16) = src [n] (fp32) rounded as torch rounds, eight at a time */
static void narrow_run(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8_bf16(dst + i, load8(src + i));
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* x [n] = a [n] + b [n] in the activations' dtype (an fp32 sum, rounded where bf16) */
static void add_run(const void *a, const void *b, int bf16, int64_t n, void *x) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 v = at8(a, bf16, i) + at8(b, bf16, i);
        if (bf16)
            store8_bf16((uint16_t *)x + i, v);
        else
            store8((float *)x + i, v);
    }
    for (; i < n; i++) put(x, bf16, i, at(a, bf16, i) + at(b, bf16, i));
}

/* The decoder layers of a decode step: x [B, hidden] (one token of each of B sequences, in
 * the activations' dtype) goes through every layer in place. cos, sin [B, D]: the step's
 * angles (as for infersight_rope_store); write_slots [B]: where each token's K/V go; slots
 * [B, W], lens [B], mask [B, W] or NULL: what each sequence's query reads (as for
 * infersight_paged_decode); pools[l]: layer l's [S, 2 Hkv, D]. Where `head` is not NULL, then
 * the fp32 logits [n_rows, vocab] of x's rows `rows` (final norm weights `norm`) into
 * `logits`. spent[3], or NULL: seconds added by kind; layer_spent[2 l], [2 l + 1], or NULL:
 * seconds added for layer l's attention block (its q/k/v product to its o product) and its
 * MLP (gate/up product to down product), what the eager step's layer timings time. Returns
 * 0, or the first failing kernel's code (-1: out of memory), or -2 for a row outside x or
 * more rows than x has. */
__attribute__((optimize("fp-contract=off")))
int infersight_decode_step(const model_t *m, const layer_t *layers, int64_t n_layers,
                           void *const *pools, void *x, int64_t B, const void *cos,
                           const void *sin, const int64_t *write_slots, const int64_t *slots,
                           const int64_t *lens, const float *mask, int64_t W,
                           const product_t *head, const void *norm, const int64_t *rows,
                           int64_t n_rows, float *logits, double *spent, double *layer_spent) {
    const int bf16 = m->bf16;
    const size_t es = bf16 ? 2 : 4;
    const int64_t hidden = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim;
    const int64_t inter = m->intermediate, width = (H + 2 * Hkv) * D, qd = H * D;
    if (head != NULL && n_rows > B) return -2; /* the scratch space holds B rows */
    for (int64_t r = 0; r < n_rows && head != NULL; r++)
        if (rows[r] < 0 || rows[r] >= B) return -2;
    /* the activations' buffers, then the fp32 ones from a 64-byte boundary */
    const size_t narrow = (es * (size_t)B * (size_t)(3 * hidden + width + qd + 3 * inter) + 63)
                          & ~(size_t)63;
    char *buf = malloc(narrow + sizeof(float) * (size_t)(2 * B * qd));
    if (buf == NULL) return -1;
    void *h = buf, *sum = buf + es * B * hidden, *o = buf + 2 * es * B * hidden;
    void *qkv = buf + 3 * es * B * hidden, *a = (char *)qkv + es * B * width;
    void *gate_up = (char *)a + es * B * qd, *act = (char *)gate_up + 2 * es * B * inter;
    float *qf = (float *)(buf + narrow), *af = qf + B * qd;
    double t = spent ? now() : 0.0, dt[3] = {0, 0, 0};
#define SPENT(kind)                                                                           \
    do {                                                                                      \
        if (spent) {                                                                          \
            const double t1 = now();                                                          \
            dt[kind] += t1 - t;                                                               \
            t = t1;                                                                           \
        }                                                                                     \
    } while (0)
    int rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        const layer_t *L = layers + l;
        infersight_rms_norm(x, L->input_norm, B, hidden, m->eps, bf16, h, 1);
        SPENT(SPENT_OTHER);
        double lt = layer_spent ? now() : 0.0;
        if ((rc = product(m, &L->qkv, h, B, qkv))) break;
        SPENT(SPENT_PRODUCTS);
        infersight_rope_store(qkv, bf16 | (m->kv_fmt == KV_INT8) << 1, B, H, Hkv, D, cos, sin,
                              pools[l], write_slots, 1);
        for (int64_t b = 0; b < B; b++)
            widen_run((const char *)qkv + es * (size_t)(b * width), bf16, qd, qf + b * qd);
        SPENT(SPENT_OTHER);
        if ((rc = m->attend(qf, pools[l], m->kv_fmt, slots, lens, mask, af, B, W, H, Hkv, D,
                            m->scale, 0.0f, m->threads))) /* the models it runs cap none */
            break;
        SPENT(SPENT_ATTENTION);
        const void *attended = af;
        if (bf16) {
            narrow_run(af, B * qd, (uint16_t *)a);
            attended = a;
        }
        SPENT(SPENT_OTHER);
        if ((rc = product(m, &L->o, attended, B, o))) break;
        SPENT(SPENT_PRODUCTS);
        if (layer_spent) layer_spent[2 * l] += now() - lt;
        infersight_add_rms_norm(o, x, L->post_norm, B, hidden, m->eps, bf16, h, sum, 1);
        SPENT(SPENT_OTHER);
        if (layer_spent) lt = now();
        if ((rc = product(m, &L->gate_up, h, B, gate_up))) break;
        SPENT(SPENT_PRODUCTS);
        silu_mul(gate_up, bf16, B, inter, act);
        SPENT(SPENT_OTHER);
        if ((rc = product(m, &L->down, act, B, o))) break;
        SPENT(SPENT_PRODUCTS);
        if (layer_spent) layer_spent[2 * l + 1] += now() - lt;
        add_run(sum, o, bf16, B * hidden, x);
        SPENT(SPENT_OTHER);
    }
    if (rc == 0 && head != NULL && n_rows > 0) {
        /* the final norm of the sampled rows, the head's product in the activations' dtype
         * (written into the front of `logits`), widened to fp32 */
        const size_t row = es * (size_t)hidden;
        for (int64_t r = 0; r < n_rows; r++)
            memcpy((char *)sum + r * row, (const char *)x + rows[r] * row, row);
        infersight_rms_norm(sum, norm, n_rows, hidden, m->eps, bf16, h, 1);
        SPENT(SPENT_OTHER);
        rc = product(m, head, h, n_rows, logits);
        SPENT(SPENT_PRODUCTS);
        if (rc == 0 && bf16) widen_in_place(logits, n_rows * head->n);
        SPENT(SPENT_OTHER);
    }
#undef SPENT
    free(buf);
    if (spent)
        for (int k = 0; k < 3; k++) spent[k] += dt[k];
    return rc;
}

/* ---------------------------------------------------------------------------------------
 * A W8A8 layer's row operations on a prefill's rows (engine/quant/w8a8.py: fused_layer).
 *
 * Between its four int8 × int8 products a W8A8 layer runs a norm, a residual add, SiLU · up,
 * and before each product a quantization of its activations and after it a scaling of the
 * int32 sums. Each runs over rows that fit in L2, and each alone is one pass over memory
 * costing as much as the pass itself: here the passes that meet at a product are one call,
 * one row at a time through a buffer of the thread's, on `threads` threads. Each part is the
 * function its single call runs (norm_row, silu_mul, quant8.h's quantize_row and scale_row),
 * each value rounded to the activations' dtype where the unfused code rounds it, so the
 * results are the unfused calls' bit for bit (fp32 or bf16 activations, `bf16`).
 * ------------------------------------------------------------------------------------- */

/* row r of the activations' dtype as fp32: itself, or widened into `wide` */
static inline const float *as_f32(const void *row, int bf16, int64_t n, float *wide) {
    if (!bf16) return (const float *)row;
    bf16_row((const uint16_t *)row, n, wide);
    return wide;
}

/* q, s = quantize(rms_norm(x) * w): the input norm, then the qkv product's activations. */
void infersight_w8a8_norm_quantize(const void *x, const void *w, int64_t rows, int64_t h,
                                   float eps, int bf16, float fixed, int8_t *q, float *s,
                                   int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = malloc((size_t)(2 * h) * sizeof *buf); /* the normed row; widened */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            norm_row(row_of(x, bf16, r, h), w, h, eps, bf16, buf);
            s[r] = quantize_row(as_f32(buf, bf16, h, buf + h), h, fixed, q + r * h);
        }
        free(buf);
    }
}

/* The o product's sums scaled (sx [rows], sw [h], bias [h] or NULL, fp32) and rounded to the
 * dtype, plus the residual: `sum` [rows, h], the new residual stream; then q, s = quantize(
 * rms_norm(sum) * w): the post-attention norm and the gate/up product's activations. */
void infersight_w8a8_add_norm_quantize(const int32_t *acc, const float *sx, const float *sw,
                                       const float *bias, const void *residual, const void *w,
                                       int64_t rows, int64_t h, float eps, int bf16, float fixed,
                                       void *sum, int8_t *q, float *s, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = malloc((size_t)(2 * h) * sizeof *buf);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            void *out = (void *)row_of(sum, bf16, r, h);
            const void *res = row_of(residual, bf16, r, h);
            scale_row(acc + r * h, h, sx[r], sw, bias, buf);
            int64_t i = 0; /* the product in the dtype, then the add */
            if (bf16)
                for (; i + 8 <= h; i += 8)
                    store8_bf16((uint16_t *)out + i,
                                load8_bf16((const uint16_t *)res + i) + round8_bf16(load8(buf + i)));
            for (; i < h; i++) {
                const float y = bf16 ? bf16_to_f32(f32_to_bf16(buf[i])) : buf[i];
                put(out, bf16, i, at(res, bf16, i) + y);
            }
            norm_row(out, w, h, eps, bf16, buf);
            s[r] = quantize_row(as_f32(buf, bf16, h, buf + h), h, fixed, q + r * h);
        }
        free(buf);
    }
}

/* The gate/up product's sums [rows, 2 inter] scaled (sx [rows], sw [2 inter], fp32; quant8.h's
 * scale_row) and rounded to the dtype, then act = silu(gate) * up as silu_mul computes it,
 * then q, s = quantize(act): the down product's activations. */
void infersight_w8a8_silu_quantize(const int32_t *acc, const float *sx, const float *sw,
                                   int64_t rows, int64_t inter, int bf16, float fixed,
                                   int8_t *q, float *s, int threads) {
    const int64_t n = 2 * inter;
#pragma omp parallel num_threads(threads)
    {
        float *act = malloc((size_t)inter * sizeof *act);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int32_t *a = acc + r * n;
            const v8 row = (v8){0} + sx[r];
            int64_t i = 0;
            for (; i + 8 <= inter; i += 8) {
                v8i ga, ua;
                memcpy(&ga, a + i, sizeof ga);
                memcpy(&ua, a + inter + i, sizeof ua);
                const v8 g = __builtin_convertvector(ga, v8) * row * load8(sw + i);
                const v8 u = __builtin_convertvector(ua, v8) * row * load8(sw + inter + i);
                store8(act + i, silu_up8(g, u, bf16));
            }
            for (; i < inter; i++) {
                float g = (float)a[i] * sx[r] * sw[i];
                float u = (float)a[inter + i] * sx[r] * sw[inter + i];
                if (bf16) g = bf16_to_f32(f32_to_bf16(g)), u = bf16_to_f32(f32_to_bf16(u));
                float v = silu1(g);
                if (bf16) v = bf16_to_f32(f32_to_bf16(v));
                act[i] = bf16 ? bf16_to_f32(f32_to_bf16(v * u)) : v * u;
            }
            s[r] = quantize_row(act, inter, fixed, q + r * inter);
        }
        free(act);
    }
}

const char *infersight_layer_ops_isa(void) { return "scalar"; }
