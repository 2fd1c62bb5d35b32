/* W8A8's int8 × int8 → int32 product on Intel AMX tiles (engine/kernels/amx.py).
 *
 * torch._int_mm reaches oneDNN's older s8s8s32 GEMM, which runs AVX-512 VNNI even where the
 * CPU has AMX (oneDNN's verbose log names it gemm_api; its bf16 matmul, brg_matmul, does use
 * AMX). On such a CPU a bf16 GEMM is then as fast as the int8 one, and W8A8 gains nothing
 * over bf16 in its products. Here the weights are packed once, at load, into AMX's tile
 * layout, and each product is tiles:
 *
 *   y[m, n] = Σ_k x[m, k] · w[n, k]   (int8 operands, exact int32 sums: what _int_mm gives)
 *
 * Four accumulator tiles (32 rows × 32 columns of y) take two A tiles (16 rows × 64 values
 * of x, loaded straight from x's rows) and two B tiles (64 values × 16 columns of w, packed)
 * per step of 64 along k. Threads take pairs of 16-column blocks; each runs every 32-row block
 * of x under its pair, so the pair's packed weights (k · 32 bytes) stay in L1 and x in L2.
 *
 * A B tile holds four consecutive k per column in each 64-byte row (vpdpbssd's grouping):
 * packed[(j · K/64 + kb) · 1024 + r · 64 + c · 4 + b] = w[16 j + c][64 kb + 4 r + b].
 *
 * Built where the compiler targets AMX-INT8 (-march=native on such a CPU); elsewhere the
 * entry points report "none" and the Python side keeps torch._int_mm. Linux hands a process
 * the AMX state only on request (arch_prctl); refused, every call returns -1. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "quant8.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 0: not asked yet, 1: granted, -1: refused */
static int permission = 0;

int infersight_amx_ready(void) {
    if (permission == 0)
        permission = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return permission == 1 ? 0 : -1;
}

/* eight tiles of 16 rows × 64 bytes: C 0-3, A 4-5, B 6-7. Set in each thread at each call:
 * another library's AMX code (oneDNN's) may have configured the thread otherwise. */
static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

void infersight_amx_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed) {
    const int64_t kbs = k / 64;
    for (int64_t j = 0; j < n / 16; j++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            int8_t *t = packed + (j * kbs + kb) * 1024;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    memcpy(t + r * 64 + c * 4, w + (16 * j + c) * k + 64 * kb + 4 * r, 4);
        }
}

/* The 32 × 32 block of y at rows of `a` (32 rows of stride k) and column pair (b0, b1),
 * stored with row stride `ldc` int32s. */
static inline void block(const int8_t *a, int64_t k, const int8_t *b0, const int8_t *b1,
                         int32_t *c, int64_t ldc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < k / 64; kb++) {
        _tile_loadd(4, a + kb * 64, k);
        _tile_loadd(5, a + 16 * k + kb * 64, k);
        _tile_loadd(6, b0 + kb * 1024, 64);
        _tile_loadd(7, b1 + kb * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    const int64_t stride = ldc * (int64_t)sizeof(int32_t);
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + 16 * ldc, stride);
    _tile_stored(3, c + 16 * ldc + 16, stride);
}

/* What a product's 32 × 32 block becomes once its sums are in `sums` (rows r0 .. r0 + rows,
 * columns c0 .. c0 + 32): the int32 sums as they are, or (`scaled`) lowbit.c's
 * infersight_scale_rows of them, the same values: ((float)sum · sx[r]) · sw[c] (+ bias[c]),
 * rounded to the output's dtype, plus the residual (rounded again) where there is one. */
typedef struct {
    int scaled, y_bf16;
    const float *sx, *sw, *bias;
    const void *residual;
} epilogue;

static void finish(const epilogue *e, const int32_t *sums, int64_t r0, int64_t rows, int64_t c0,
                   int64_t n, void *y) {
    if (!e->scaled) {
        for (int64_t r = 0; r < rows; r++)
            memcpy((int32_t *)y + (r0 + r) * n + c0, sums + r * 32, 32 * sizeof(int32_t));
        return;
    }
    float v[32];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = (r0 + r) * n + c0;
        scale_row(sums + r * 32, 32, e->sx[r0 + r], e->sw + c0, e->bias ? e->bias + c0 : NULL, v);
        if (!e->y_bf16) {
            float *out = (float *)y + at;
            const float *res = e->residual ? (const float *)e->residual + at : NULL;
            for (int j = 0; j < 32; j++) out[j] = res ? v[j] + res[j] : v[j];
            continue;
        }
        uint16_t *out = (uint16_t *)y + at;
        const uint16_t *res = e->residual ? (const uint16_t *)e->residual + at : NULL;
        for (int j = 0; j < 32; j += 8) {
            const v8 x = load8(v + j);
            store8_bf16(out + j, res ? load8_bf16(res + j) + round8_bf16(x) : x);
        }
    }
}

/* A thread's part of a product: its block of sums, and x's last m mod 32 rows copied into 32
 * zero-padded ones (the tiles load whole 16-row halves); the tiles configured. */
typedef struct {
    int8_t *rest;
    int32_t *sums;
} scratch;

static int scratch_open(scratch *s, const int8_t *x, int64_t m, int64_t k) {
    const int64_t full = m / 32 * 32, tail = m - full;
    s->rest = tail ? calloc((size_t)(32 * k), 1) : NULL;
    s->sums = malloc(32 * 32 * sizeof *s->sums);
    configure();
    if (s->sums == NULL || (tail && s->rest == NULL)) return -1;
    if (tail) memcpy(s->rest, x + full * k, (size_t)(tail * k));
    return 0;
}

static void scratch_close(scratch *s) {
    _tile_release();
    free(s->rest);
    free(s->sums);
}

/* the 32 rows of x from row i: x's own, or the padded copy of its last ones */
static inline const int8_t *rows_at(const scratch *s, const int8_t *x, int64_t m, int64_t k,
                                    int64_t i) {
    return m - i < 32 ? s->rest : x + i * k;
}

static int gemm(const int8_t *x, int64_t m, int64_t k, const int8_t *packed, int64_t n, void *y,
                const epilogue *e, int threads) {
    if (infersight_amx_ready() != 0 || n % 32 || k % 64) return -1;
    const int64_t pairs = n / 32, kbs = k / 64;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        scratch s;
        failed = scratch_open(&s, x, m, k) != 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            if (failed) continue;
            const int8_t *b0 = packed + 2 * p * kbs * 1024, *b1 = b0 + kbs * 1024;
            for (int64_t i = 0; i < m; i += 32) {
                const int64_t rows = m - i < 32 ? m - i : 32;
                if (!e->scaled && rows == 32) { /* the sums straight into y */
                    block(x + i * k, k, b0, b1, (int32_t *)y + i * n + 32 * p, n);
                    continue;
                }
                block(rows_at(&s, x, m, k, i), k, b0, b1, s.sums, 32);
                finish(e, s.sums, i, rows, 32 * p, n, y);
            }
        }
        scratch_close(&s);
    }
    return failed ? -1 : 0;
}

/* W8A8's gate/up product and what follows it, for the down product's input: the sums of gate
 * column j and up column j (w [2 inter, k] packed as one weight, gate rows first) in one block
 * pair, so that each 32 × 16 block of act = silu(gate) · up (quant8.h's silu_up8 on the scaled
 * sums, rounded as bf16 activations round where `bf16`) is made as the tiles are stored; then
 * each row of act [m, inter] (fp32, the caller's) quantized to q [m, inter] with its scale
 * scale[m] (quant8.h's quantize_row; `fixed` > 0: static). lowbit.c's and layer_ops.c's calls
 * (scale_rows, infersight_w8a8_silu_quantize) give the same values. inter a multiple of 16. */
int infersight_amx_silu_quantize(const int8_t *x, int64_t m, int64_t k, const int8_t *packed,
                                 int64_t inter, const float *sx, const float *sw, int bf16,
                                 float fixed, float *act, int8_t *q, float *scale, int threads) {
    if (infersight_amx_ready() != 0 || inter % 16 || k % 64) return -1;
    const int64_t blocks = inter / 16, kbs = k / 64;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        scratch s;
        failed = scratch_open(&s, x, m, k) != 0;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < blocks; j++) {
            if (failed) continue;
            const int8_t *gate = packed + j * kbs * 1024, *up = gate + blocks * kbs * 1024;
            for (int64_t i = 0; i < m; i += 32) {
                const int64_t rows = m - i < 32 ? m - i : 32;
                block(rows_at(&s, x, m, k, i), k, gate, up, s.sums, 32);
                for (int64_t r = 0; r < rows; r++) {
                    const int32_t *a = s.sums + r * 32;
                    const v8 row = (v8){0} + sx[i + r];
                    for (int c = 0; c < 16; c += 8) {
                        v8i ga, ua;
                        memcpy(&ga, a + c, sizeof ga);
                        memcpy(&ua, a + 16 + c, sizeof ua);
                        const v8 g = __builtin_convertvector(ga, v8) * row * load8(sw + 16 * j + c);
                        const v8 u = __builtin_convertvector(ua, v8) * row *
                                     load8(sw + inter + 16 * j + c);
                        store8(act + (i + r) * inter + 16 * j + c, silu_up8(g, u, bf16));
                    }
                }
            }
        }
        scratch_close(&s);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            scale[r] = quantize_row(act + r * inter, inter, fixed, q + r * inter);
    }
    return failed ? -1 : 0;
}

/* y [m, n] int32 = x [m, k] int8 · wᵀ, w packed by infersight_amx_pack; n a multiple of 32,
 * k of 64, any m (the last rows through a zero-padded copy). 0, or -1 (no AMX state for this
 * process, or out of memory). */
int infersight_amx_gemm(const int8_t *x, int64_t m, int64_t k, const int8_t *packed, int64_t n,
                        int32_t *y, int threads) {
    const epilogue e = {0, 0, NULL, NULL, NULL, NULL};
    return gemm(x, m, k, packed, n, y, &e, threads);
}

/* The same product, each block's sums scaled as it leaves the tiles (the int32 sums never
 * reach memory): y [m, n] fp32 or bf16 (`y_bf16`) = ((float)sum · sx[m]) · sw[n] (+ bias[n])
 * (+ residual [m, n] of y's dtype), infersight_scale_rows's values. */
int infersight_amx_gemm_scaled(const int8_t *x, int64_t m, int64_t k, const int8_t *packed,
                               int64_t n, const float *sx, const float *sw, const float *bias,
                               const void *residual, void *y, int y_bf16, int threads) {
    const epilogue e = {1, y_bf16, sx, sw, bias, residual};
    return gemm(x, m, k, packed, n, y, &e, threads);
}

const char *infersight_amx_isa(void) { return "amx-int8"; }

#else

int infersight_amx_ready(void) { return -1; }

void infersight_amx_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed) {
    (void)w, (void)n, (void)k, (void)packed;
}

int infersight_amx_gemm(const int8_t *x, int64_t m, int64_t k, const int8_t *packed, int64_t n,
                        int32_t *y, int threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)y, (void)threads;
    return -1;
}

int infersight_amx_gemm_scaled(const int8_t *x, int64_t m, int64_t k, const int8_t *packed,
                               int64_t n, const float *sx, const float *sw, const float *bias,
                               const void *residual, void *y, int y_bf16, int threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)sx, (void)sw, (void)bias;
    (void)residual, (void)y, (void)y_bf16, (void)threads;
    return -1;
}

int infersight_amx_silu_quantize(const int8_t *x, int64_t m, int64_t k, const int8_t *packed,
                                 int64_t inter, const float *sx, const float *sw, int bf16,
                                 float fixed, float *act, int8_t *q, float *s, int threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)inter, (void)sx, (void)sw, (void)bf16;
    (void)fixed, (void)act, (void)q, (void)s, (void)threads;
    return -1;
}

const char *infersight_amx_isa(void) { return "none"; }

#endif
