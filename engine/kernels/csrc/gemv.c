/* Matrix products of a few rows with float activations: y [M, N] = x [M, K] · Wᵀ, W [N, K]
 * stored as int8 with one float scale per output row (our INT8 weights), as bf16, or as fp32
 * (engine/kernels/gemv.py).
 *
 * These serve the step shapes that read every weight once and do little with it: a decode
 * step (M = 1) and a verification or a small batch (M up to 16). There a product is bound by
 * memory, and what matters is streaming the weights at the bandwidth the CPU has. Each thread
 * takes one contiguous run of output rows and reads it front to back, one weight row at a
 * time: a single sequential stream, which the prefetchers follow best (four rows read side
 * by side, four short streams each a few KiB long, streamed the default model's fp32 layers
 * at 28-30 GB/s on one core of the EPYC where one stream reaches 35-37), fetched 2 KiB ahead
 * (`ahead`, for two threads at once). Each weight is converted to fp32 in
 * registers and multiplied into fp32 accumulators: NACC partial sums per product, over
 * interleaved vectors, so that the additions of a row form independent chains. Nothing is
 * approximated beyond the order of the sums: the activations stay float (unlike
 * csrc/lowbit.c, which quantizes them).
 *
 * x and y are fp32 or bf16 (y rounded to nearest even, as torch rounds); bf16 x is widened
 * to fp32 (into scratch space, or as it is read for long rows: WIDEN_MAX), except where bf16
 * weights meet bf16 x on a CPU with
 * AVX512-BF16, which multiplies the pairs as they are (`vdpbf16ps`). Several rows of x take
 * NT weight rows side by side; each product is summed in the same order whatever M is, so a
 * row's result does not depend on its neighbours.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NACC 4 /* partial sums per product */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define NT 4 /* weight rows read side by side for several rows of x: NT * NACC sums in 32 */
#else
#define NT 2 /* vector registers, or in 16 */
#endif

enum { W_INT8 = 0, W_BF16 = 1, W_FP32 = 2 };

#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512BF16__)
#define ISA_NAME "avx512-bf16"
#else
#define ISA_NAME "avx512"
#endif
#define VW 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
static inline vf load_w(const void *w, int type, int64_t i) {
    if (type == W_INT8) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)w + i));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    if (type == W_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + i);
}
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA_NAME "avx2"
#define VW 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
static inline vf load_w(const void *w, int type, int64_t i) {
    if (type == W_INT8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    if (type == W_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define ISA_NAME "portable"
#define VW 8
typedef float vf __attribute__((vector_size(32)));
#define VZERO() ((vf){0})
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VADD(a, b) ((a) + (b))
static inline vf load_w(const void *w, int type, int64_t i) {
    vf v;
    for (int j = 0; j < VW; j++) {
        v[j] = type == W_INT8   ? (float)((const int8_t *)w)[i + j]
               : type == W_BF16 ? bf16_to_f32(((const uint16_t *)w)[i + j])
                                : ((const float *)w)[i + j];
    }
    return v;
}
static inline float vsum(vf v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
#endif

const char *infersight_gemv_isa(void) { return ISA_NAME; }

static inline float w_at(const void *w, int type, int64_t i) {
    return type == W_INT8   ? (float)((const int8_t *)w)[i]
           : type == W_BF16 ? bf16_to_f32(((const uint16_t *)w)[i])
                            : ((const float *)w)[i];
}

static inline size_t w_size(int type) { return type == W_INT8 ? 1 : type == W_BF16 ? 2 : 4; }

/* The lines of `bytes` weights AHEAD bytes on in the stream, fetched past the caches' upper
 * levels (prefetchnta): with two threads each streaming its half of the rows, the default
 * model's fp32 products read at 51 GB/s on the 2-core EPYC against 42 with the hardware
 * prefetchers alone; on one thread, as fast as without (40.5). A fetch past the matrix never
 * faults. */
#define AHEAD 2048
static inline void ahead(const char *p, size_t bytes) {
    for (size_t q = 0; q < bytes; q += 64) __builtin_prefetch(p + AHEAD + q, 0, 0);
}

static inline void store(void *y, int y_bf16, int64_t at, float v) {
    if (y_bf16)
        ((uint16_t *)y)[at] = f32_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

/* Weight rows n .. n + nt - 1 times row i of x (`xtype`: W_FP32, or W_BF16 widened as it is
 * read: exact, so the same sums; a bf16 row of x stays half the size in L1, where a widened
 * copy of Llama-3.2-1B's 8192 inputs took 32 KiB, beside the weights) into y: NACC vectors of K at a time,
 * the j-th into partial sum j; then whole vectors into sum 0; the sums added pairwise, across
 * lanes, and the rest of K in scalar, in order: the same order whatever nt, so a product's
 * sum does not depend on the rows beside it. `type` and `nt` are literals where it is called
 * (below), so that the compiler specializes the loads and unrolls the rows. */
static inline __attribute__((always_inline)) void row(const void *x, int xtype, int64_t k,
                                                       const void *w, int type,
                                                       const float *ws, int64_t n, int nt,
                                                       int64_t n_out, int64_t i, void *y,
                                                       int y_bf16) {
    const size_t esz = w_size(type), rb = (size_t)k * esz;
    const char *wr[NT];
    for (int t = 0; t < nt; t++) wr[t] = (const char *)w + (size_t)(n + t) * rb;
    const char *xr = (const char *)x + (size_t)i * (size_t)k * w_size(xtype);
    vf acc[NT][NACC];
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < NACC; j++) acc[t][j] = VZERO();
    const int64_t kq = k / (NACC * VW) * (NACC * VW), kv = k / VW * VW;
    int64_t c = 0;
    for (; c < kq; c += NACC * VW) {
        for (int t = 0; t < nt; t++) ahead(wr[t] + c * (int64_t)esz, NACC * VW * esz);
        for (int j = 0; j < NACC; j++) {
            const vf xv = load_w(xr, xtype, c + j * VW);
            for (int t = 0; t < nt; t++)
                acc[t][j] = VFMA(xv, load_w(wr[t], type, c + j * VW), acc[t][j]);
        }
    }
    for (; c < kv; c += VW) {
        const vf xv = load_w(xr, xtype, c);
        for (int t = 0; t < nt; t++) acc[t][0] = VFMA(xv, load_w(wr[t], type, c), acc[t][0]);
    }
    for (int t = 0; t < nt; t++) {
        float s = vsum(VADD(VADD(acc[t][0], acc[t][1]), VADD(acc[t][2], acc[t][3])));
        for (int64_t r = kv; r < k; r++) s += w_at(xr, xtype, r) * w_at(wr[t], type, r);
        store(y, y_bf16, i * n_out + n + t, ws ? s * ws[n + t] : s);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
/* bf16 weights times bf16 activations where the CPU has AVX512-BF16 (Zen 4, Cooper Lake and
 * later Xeons): `vdpbf16ps` multiplies 32 pairs at once and adds them into 16 fp32 sums. A
 * product of two bf16 values is exact in fp32, so this computes what `row` computes from the
 * widened operands, in another order (each lane adds its pair's odd product, then its even
 * one) and with denormal operands and results read as zero, as the instruction does whatever
 * the FPU's control register says; a third of the instructions per weight, where the
 * widening otherwise costs more than the bandwidth leaves time for. */
static inline __attribute__((always_inline)) void row_dpbf16(const uint16_t *x, int64_t k,
                                                              const uint16_t *w, int64_t n,
                                                              int nt, int64_t n_out, int64_t i,
                                                              void *y, int y_bf16) {
    const uint16_t *wr[NT];
    for (int t = 0; t < nt; t++) wr[t] = w + (size_t)(n + t) * (size_t)k;
    const uint16_t *xr = x + i * k;
    __m512 acc[NT][NACC];
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < NACC; j++) acc[t][j] = _mm512_setzero_ps();
    const int64_t kq = k / (NACC * 32) * (NACC * 32), kv = k / 32 * 32;
    int64_t c = 0;
    for (; c < kq; c += NACC * 32) {
        for (int t = 0; t < nt; t++) ahead((const char *)(wr[t] + c), NACC * 32 * sizeof *xr);
        for (int j = 0; j < NACC; j++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + c + j * 32);
            for (int t = 0; t < nt; t++)
                acc[t][j] = _mm512_dpbf16_ps(acc[t][j], xv,
                                             (__m512bh)_mm512_loadu_si512(wr[t] + c + j * 32));
        }
    }
    for (; c < kv; c += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + c);
        for (int t = 0; t < nt; t++)
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], xv, (__m512bh)_mm512_loadu_si512(wr[t] + c));
    }
    for (int t = 0; t < nt; t++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                                     _mm512_add_ps(acc[t][2], acc[t][3])));
        for (int64_t r = kv; r < k; r++) s += bf16_to_f32(xr[r]) * bf16_to_f32(wr[t][r]);
        store(y, y_bf16, i * n_out + n + t, s);
    }
}
#define DP_ROW(nt) row_dpbf16((const uint16_t *)x, k, (const uint16_t *)w, n, nt, n_out, i, y, y_bf16)
#endif

/* Output rows [n0, n1) for every row of x: functions of their own per weight type (and for
 * bf16 pairs) and for one row of x (a decode step) or several, each a loop that the compiler
 * specializes (with the row counts in one function, it merged them into one loop that tested
 * the count at every vector: 10% slower on one row). One row of x reads one weight row at a
 * time, front to back; several read NT weight rows side by side for each row of x, so that
 * each load of x serves NT of them (one weight row at a time, a row of x reloaded for each,
 * was 1.23x the time of the tiles before this kernel at 16 rows of x, fp32 2048 x 2048; NT
 * side by side 0.96x). */
#define SPAN(name, ROW)                                                                         \
    static __attribute__((noinline)) void name##_1(const void *x, int64_t m, int64_t k,       \
                                                   const void *w, const float *ws, int64_t n0, \
                                                   int64_t n1, int64_t n_out, void *y,        \
                                                   int y_bf16) {                              \
        (void)ws, (void)m;                                                                      \
        const int64_t i = 0;                                                                    \
        for (int64_t n = n0; n < n1; n++) ROW(1);                                               \
    }                                                                                           \
    static __attribute__((noinline)) void name(const void *x, int64_t m, int64_t k,           \
                                               const void *w, const float *ws, int64_t n0,    \
                                               int64_t n1, int64_t n_out, void *y,            \
                                               int y_bf16) {                                  \
        (void)ws;                                                                               \
        int64_t n = n0;                                                                         \
        for (; n + NT <= n1; n += NT)                                                           \
            for (int64_t i = 0; i < m; i++) ROW(NT);                                            \
        for (; n < n1; n++)                                                                     \
            for (int64_t i = 0; i < m; i++) ROW(1);                                             \
    }
#define INT8_ROW(nt) row(x, W_FP32, k, w, W_INT8, ws, n, nt, n_out, i, y, y_bf16)
#define BF16_ROW(nt) row(x, W_FP32, k, w, W_BF16, NULL, n, nt, n_out, i, y, y_bf16)
#define FP32_ROW(nt) row(x, W_FP32, k, w, W_FP32, NULL, n, nt, n_out, i, y, y_bf16)
#define INT8_ROW_H(nt) row(x, W_BF16, k, w, W_INT8, ws, n, nt, n_out, i, y, y_bf16)
#define BF16_ROW_H(nt) row(x, W_BF16, k, w, W_BF16, NULL, n, nt, n_out, i, y, y_bf16)
#define FP32_ROW_H(nt) row(x, W_BF16, k, w, W_FP32, NULL, n, nt, n_out, i, y, y_bf16)
SPAN(span_int8, INT8_ROW)
SPAN(span_bf16, BF16_ROW)
SPAN(span_fp32, FP32_ROW)
SPAN(span_int8_h, INT8_ROW_H) /* bf16 rows of x */
SPAN(span_bf16_h, BF16_ROW_H)
SPAN(span_fp32_h, FP32_ROW_H)
#if HAVE_DPBF16
SPAN(span_dpbf16, DP_ROW)
#endif

typedef void (*span_fn)(const void *, int64_t, int64_t, const void *, const float *, int64_t,
                        int64_t, int64_t, void *, int);

/* One bf16 row of x is widened into scratch space once per call up to this many fp32 bytes
 * (it stays in L1 beside the weights streaming past: Llama-3.2-1B's 2048 inputs read 7-10%
 * faster so, on the EPYC forced to AVX2), and widened as it is read above (its 8192 inputs:
 * 0.81-0.86x the time of a 32 KiB widened copy). Several rows of x are widened into scratch
 * (each load of x serves NT weight rows there: four rows of 8192 read as bf16 took 1.11x). */
#define WIDEN_MAX (16 << 10)

/* y [M, N] = (x [M, K] · Wᵀ) (· scales, for int8 weights). x_bf16 / y_bf16: x and y are bf16
 * (else fp32). Returns 0, or -1 where the scratch space for a widened x could not be had. */
int infersight_gemv(const void *x, int x_bf16, int64_t m, int64_t k, const void *w, int type,
                    const float *scales, int64_t n_out, void *y, int y_bf16, int threads) {
    const void *xs = x;
    float *wide = NULL;
#if HAVE_DPBF16
    const int dp = x_bf16 && type == W_BF16;
#else
    const int dp = 0;
#endif
    if (x_bf16 && !dp && (m > 1 || k * (int64_t)sizeof(float) <= WIDEN_MAX)) {
        wide = malloc((size_t)(m * k) * sizeof *wide);
        if (!wide) return -1;
        for (int64_t i = 0; i < m * k; i++) wide[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xs = wide;
        x_bf16 = 0;
    }
    const int one = m == 1;
    span_fn span;
    if (x_bf16)
        span = type == W_INT8   ? (one ? span_int8_h_1 : span_int8_h)
               : type == W_BF16 ? (one ? span_bf16_h_1 : span_bf16_h)
                                : (one ? span_fp32_h_1 : span_fp32_h);
    else
        span = type == W_INT8   ? (one ? span_int8_1 : span_int8)
               : type == W_BF16 ? (one ? span_bf16_1 : span_bf16)
                                : (one ? span_fp32_1 : span_fp32);
#if HAVE_DPBF16
    if (dp) span = one ? span_dpbf16_1 : span_dpbf16;
#endif
    const float *ws = type == W_INT8 ? scales : NULL;
    /* each thread one contiguous run of output rows: one stream, front to back */
    const int parts = threads < 1 ? 1 : n_out < threads ? (int)(n_out ? n_out : 1) : threads;
    if (parts == 1) { /* no parallel region to enter */
        span(xs, m, k, w, ws, 0, n_out, n_out, y, y_bf16);
    } else {
#pragma omp parallel for schedule(static) num_threads(parts)
        for (int p = 0; p < parts; p++)
            span(xs, m, k, w, ws, n_out * p / parts, n_out * (p + 1) / parts, n_out, y, y_bf16);
    }
    free(wide);
    return 0;
}
