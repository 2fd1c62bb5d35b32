/* Matrix products of a few rows with float activations: y [M, N] = x [M, K] · Wᵀ, W [N, K]
 * stored as int8 with one float scale per output row (our INT8 weights), as bf16, or as fp32
 * (engine/kernels/gemv.py).
 *
 * These serve the step shapes that read every weight once and do little with it: a decode
 * step (M = 1) and a verification or a small batch (M up to 16). There a product is bound by
 * memory, and what matters is streaming the weights at the bandwidth the CPU has: each output
 * row's weights are read once, converted to fp32 in registers and multiplied into fp32
 * accumulators (one per output row and x row), four output rows at a time so that each load
 * of x serves four of them. Nothing is approximated beyond the order of the sums: the
 * activations stay float (unlike csrc/lowbit.c, which quantizes them).
 *
 * x and y are fp32 or bf16 (y rounded to nearest even, as torch rounds); bf16 x is widened
 * into scratch space once per call, except where bf16 weights meet bf16 x on a CPU with
 * AVX512-BF16, which multiplies the pairs as they are (tile_dpbf16). Rows of x are taken up to four at a time; each output is
 * computed in the same order whatever M is, so a row's result does not depend on its
 * neighbours.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NT 4 /* output rows per tile */
#define MT 4 /* rows of x per tile */

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
#define VLOADX(p) _mm512_loadu_ps(p)
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
#define VLOADX(p) _mm256_loadu_ps(p)
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
static inline vf VLOADX(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
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

/* Output rows n0 .. n0 + nt - 1 for rows m0 .. m0 + mt - 1 of x (fp32). The vector part
 * covers K rounded down to the vector width; the rest is added in scalar, in order. */
static inline void tile(const float *x, int64_t k, const void *w, int type, const float *ws,
                        int64_t n0, int nt, int64_t m0, int mt, float *out) {
    const size_t row_bytes = (size_t)k * w_size(type);
    const void *wr[NT];
    for (int j = 0; j < nt; j++) wr[j] = (const char *)w + (size_t)(n0 + j) * row_bytes;
    vf acc[MT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = VZERO();
    const int64_t kv = k / VW * VW;
    const size_t ws_bytes = w_size(type);
    for (int64_t c = 0; c < kv; c += VW) {
        /* The next tile's rows follow this tile's in memory: fetch them while this one
         * computes, a cache line per row per 64 bytes read. Rows of a few KiB end before the
         * hardware prefetcher has caught up with four streams (Llama-3.2-1B's int8 rows read at
         * half the bandwidth without this). A prefetch past the matrix never faults. */
        if ((c * ws_bytes) % 64 == 0)
            for (int j = 0; j < nt; j++)
                __builtin_prefetch((const char *)wr[j] + NT * row_bytes + c * ws_bytes, 0, 1);
        vf wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = load_w(wr[j], type, c);
        for (int i = 0; i < mt; i++) {
            const vf xv = VLOADX(x + (m0 + i) * k + c);
            for (int j = 0; j < nt; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++) {
        for (int j = 0; j < nt; j++) {
            float s = vsum(acc[i][j]);
            for (int64_t c = kv; c < k; c++) s += x[(m0 + i) * k + c] * w_at(wr[j], type, c);
            out[i * NT + j] = ws ? s * ws[n0 + j] : s;
        }
    }
}

/* One row of x (a decode step) over NT output rows, `type` a literal where it is called (each
 * caller is a function of its own, below, so the compiler specializes the loads). Each
 * iteration reads one 64-byte line of every weight row and fetches the same line of the next
 * tile's rows into L1: a row of a few KiB ends before the hardware prefetchers have caught up
 * with its stream, and a fetch one tile ahead (a few KiB) covers the memory's latency.
 * Against the general tile above (a prefetch into L2 and the type tested in the loop), this
 * streamed the default model's fp32 rows (576 wide) at 38 GB/s on one core of the EPYC
 * instead of 23: oneDNN's packed layout reads 37 (docs/cpu-kernels.md). */
static inline __attribute__((always_inline)) void tile1(const float *x, int64_t k,
                                                         const void *w, int type,
                                                         const float *ws, int64_t n0,
                                                         float *out) {
    const size_t esz = w_size(type);
    const size_t row_bytes = (size_t)k * esz;
    const char *wr[NT];
    for (int j = 0; j < NT; j++) wr[j] = (const char *)w + (size_t)(n0 + j) * row_bytes;
    vf acc[NT];
    for (int j = 0; j < NT; j++) acc[j] = VZERO();
    const int64_t line = 64 / (int64_t)esz; /* weights per line: a multiple of VW */
    const int64_t kl = k / line * line, kv = k / VW * VW;
    int64_t c = 0;
    for (; c < kl; c += line) {
        for (int j = 0; j < NT; j++)
            __builtin_prefetch(wr[j] + NT * row_bytes + (size_t)c * esz, 0, 3);
        for (int64_t u = c; u < c + line; u += VW) {
            const vf xv = VLOADX(x + u);
            for (int j = 0; j < NT; j++) acc[j] = VFMA(xv, load_w(wr[j], type, u), acc[j]);
        }
    }
    for (; c < kv; c += VW) {
        const vf xv = VLOADX(x + c);
        for (int j = 0; j < NT; j++) acc[j] = VFMA(xv, load_w(wr[j], type, c), acc[j]);
    }
    for (int j = 0; j < NT; j++) {
        float s = vsum(acc[j]);
        for (int64_t r = kv; r < k; r++) s += x[r] * w_at(wr[j], type, r);
        out[j] = ws ? s * ws[n0 + j] : s;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
/* bf16 weights times bf16 activations where the CPU has AVX512-BF16 (Zen 4, Cooper Lake and
 * later Xeons): `vdpbf16ps` multiplies 32 pairs at once and adds them into 16 fp32 sums. A
 * product of two bf16 values is exact in fp32, so this computes what `tile` computes from the
 * widened operands, in another order (each lane adds its pair's odd product, then its even
 * one) and with denormal operands and results read as zero, as the instruction does whatever
 * the FPU's control register says; a third of the instructions per weight, where the
 * widening otherwise costs more than the bandwidth leaves time for. */
static inline void tile_dpbf16(const uint16_t *x, int64_t k, const uint16_t *w, int64_t n0,
                               int nt, int64_t m0, int mt, float *out) {
    const uint16_t *wr[NT];
    for (int j = 0; j < nt; j++) wr[j] = w + (size_t)(n0 + j) * (size_t)k;
    __m512 acc[MT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t kv = k / 32 * 32;
    for (int64_t c = 0; c < kv; c += 32) {
        for (int j = 0; j < nt; j++)
            __builtin_prefetch((const char *)(wr[j] + NT * (size_t)k + c), 0, 3);
        __m512bh wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + c);
        for (int i = 0; i < mt; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * k + c);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mt; i++) {
        for (int j = 0; j < nt; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            for (int64_t c = kv; c < k; c++)
                s += bf16_to_f32(x[(m0 + i) * k + c]) * bf16_to_f32(wr[j][c]);
            out[i * NT + j] = s;
        }
    }
}
#endif

static inline void store(void *y, int y_bf16, int64_t at, const float *v, int count) {
    for (int j = 0; j < count; j++) {
        if (y_bf16)
            ((uint16_t *)y)[at + j] = f32_to_bf16(v[j]);
        else
            ((float *)y)[at + j] = v[j];
    }
}

/* One row of x over the whole tiles [t0, t1): a function per weight type (and for bf16 pairs),
 * each a loop of its own that the compiler specializes; inlined into one loop that chose
 * among them per tile, the same code streamed fp32 rows at two thirds of the speed. */
#define SPAN1(name, TYPE)                                                                       \
    static __attribute__((noinline)) void name(const void *x, int64_t k, const void *w,        \
                                               const float *ws, int64_t t0, int64_t t1,       \
                                               void *y, int y_bf16) {                         \
        for (int64_t t = t0; t < t1; t++) {                                                     \
            float out[NT];                                                                      \
            tile1((const float *)x, k, w, TYPE, ws, t * NT, out);                               \
            store(y, y_bf16, t * NT, out, NT);                                                  \
        }                                                                                       \
    }
SPAN1(span_int8, W_INT8)
SPAN1(span_bf16, W_BF16)
SPAN1(span_fp32, W_FP32)

#if HAVE_DPBF16
static __attribute__((noinline)) void span_dpbf16(const void *x, int64_t k, const void *w,
                                                   const float *ws, int64_t t0, int64_t t1,
                                                   void *y, int y_bf16) {
    (void)ws;
    for (int64_t t = t0; t < t1; t++) {
        float out[NT];
        tile_dpbf16((const uint16_t *)x, k, (const uint16_t *)w, t * NT, NT, 0, 1, out);
        store(y, y_bf16, t * NT, out, NT);
    }
}
#endif

typedef void (*span_fn)(const void *, int64_t, const void *, const float *, int64_t, int64_t,
                        void *, int);

/* y [M, N] = (x [M, K] · Wᵀ) (· scales, for int8 weights). x_bf16 / y_bf16: x and y are bf16
 * (else fp32). Returns 0, or -1 where the scratch space for a bf16 x could not be had. */
int infersight_gemv(const void *x, int x_bf16, int64_t m, int64_t k, const void *w, int type,
                    const float *scales, int64_t n_out, void *y, int y_bf16, int threads) {
    float *wide = NULL;
    const float *xf = (const float *)x;
#if HAVE_DPBF16
    const int dp = x_bf16 && type == W_BF16;
#define SPAN_DP span_dpbf16
#else
#define SPAN_DP span_bf16
    const int dp = 0;
#endif
    if (x_bf16 && !dp) {
        wide = malloc((size_t)(m * k) * sizeof *wide);
        if (!wide) return -1;
        for (int64_t i = 0; i < m * k; i++) wide[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = wide;
    }
    const float *ws = type == W_INT8 ? scales : NULL;
    if (m == 1) {
        /* a decode step: each thread one contiguous run of whole tiles, the last rows after */
        const span_fn span = dp ? SPAN_DP : type == W_INT8 ? span_int8
                             : type == W_BF16            ? span_bf16
                                                         : span_fp32;
        const void *xs = dp ? x : (const void *)xf;
        const int64_t whole = n_out / NT;
        const int parts = threads < 1 ? 1 : whole < threads ? (int)(whole ? whole : 1) : threads;
        (void)parts;
#pragma omp parallel for schedule(static) num_threads(parts)
        for (int p = 0; p < parts; p++)
            span(xs, k, w, ws, whole * p / parts, whole * (p + 1) / parts, y, y_bf16);
        if (n_out > whole * NT) {
            float out[NT] = {0};
            const int nt = (int)(n_out - whole * NT);
#if HAVE_DPBF16
            if (dp)
                tile_dpbf16(x, k, w, whole * NT, nt, 0, 1, out);
            else
#endif
                tile(xf, k, w, type, ws, whole * NT, nt, 0, 1, out);
            store(y, y_bf16, whole * NT, out, nt);
        }
        free(wide);
        return 0;
    }
    const int64_t tiles = (n_out + NT - 1) / NT;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NT;
        const int nt = n_out - n0 < NT ? (int)(n_out - n0) : NT;
        for (int64_t m0 = 0; m0 < m; m0 += MT) {
            const int mt = m - m0 < MT ? (int)(m - m0) : MT;
            float out[MT * NT];
            /* literal tile sizes where they are full, so the compiler unrolls them */
#if HAVE_DPBF16
            if (dp && nt == NT && mt == 1)
                tile_dpbf16(x, k, w, n0, NT, m0, 1, out);
            else if (dp)
                tile_dpbf16(x, k, w, n0, nt, m0, mt, out);
            else
#endif
            if (nt == NT && mt == 1)
                tile(xf, k, w, type, ws, n0, NT, m0, 1, out);
            else if (nt == NT && mt == MT)
                tile(xf, k, w, type, ws, n0, NT, m0, MT, out);
            else
                tile(xf, k, w, type, ws, n0, nt, m0, mt, out);
            for (int i = 0; i < mt; i++) store(y, y_bf16, (m0 + i) * n_out + n0, out + i * NT, nt);
        }
    }
    free(wide);
    return 0;
}
