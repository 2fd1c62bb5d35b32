/* Low-bit matrix products on the CPU: our INT4 weights against activations quantized to int8
 * per block of 32, our INT8 weights against activations quantized to int16 per block of 128
 * (engine/kernels/lowbit.py).
 *
 * INT4 weights (group-wise, zero points; torch's convention w ~ (q - 8) * s + z, q in 0..15):
 * each row's 32-value blocks packed into 16 bytes (value j in the low nibble of byte j, value
 * 16 + j in its high nibble, as llama.cpp's Q4 blocks), and (s, z) per group as bf16 bits.
 * Their activations: each row of x [M, K] (K a multiple of 32) is cut into blocks of 32
 * values; a block keeps d = max|x| / 127, its values q = round(x / d) (ties to even, as
 * torch.round) and their sum s = sum(q). This is llama.cpp's q8 activation format, and the
 * approximation these kernels add: everything after it is exact integer arithmetic, then
 * float scaling. With m = z - 8 s, each block's share is d * (s * dot(q_w, q_x) + m * sum(q_x)):
 *   y[m, n] = sum_b d[m, b] * s[n, g(b)] * dot(q_w[n, b], q_x[m, b])
 *           + sum_g m[n, g] * c[m, g],   c[m, g] = sum_{b in g} d[m, b] * s_x[m, b]
 * The second sum is G = K / group products per output; c is computed once per row of x.
 *
 * The integer dot product of a block is what the instruction sets differ in:
 *   AVX-512 VNNI: vpdpbusd on 64 bytes (two blocks) at a time;
 *   AVX-VNNI:     vpdpbusd on 32 bytes (the VEX form, Alder Lake / Zen 5);
 *   AVX2:         vpmaddubsw then vpmaddwd (no pair can saturate: the weights are 0..15);
 *   NEON dotprod: sdot on 16 bytes;
 *   portable:     plain C, the reference the others are checked against.
 *
 * INT8 weights (per output channel): w [N, K] int8, one float scale per row, w ~ q * scale,
 * against int16 activations (their section below says why):
 *   y[m, n] = scale[n] * sum_b d16[m, b] * dot(q_w[n, b], q16_x[m, b])
 *
 * Which instruction set is built is decided by the compiler's target flags (-march=native, or
 * what the CPU level forced by INFERSIGHT_CPU_CAPABILITY allows); infersight_lowbit_isa()
 * names it.
 *
 * Each output is computed in the same order whatever M is and whichever rows share a tile,
 * so a row's result does not depend on the rows beside it (batch invariance): rows of x are
 * taken up to four at a time only to reuse each unpacked weight block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "quant8.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define QK 32      /* values per int8 activation block (INT4 weights) */
#define QK16 128   /* values per int16 activation block (INT8 weights) */
#define MT 4       /* rows of x per tile */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISA_AVX512_VNNI 1
#define ISA_NAME "avx512-vnni"
#elif defined(__AVXVNNI__)
#define ISA_AVX_VNNI 1
#define ISA_NAME "avx-vnni"
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA_AVX2 1
#define ISA_NAME "avx2"
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define ISA_NEON_DOT 1
#define ISA_NAME "neon-dotprod"
#else
#define ISA_NAME "portable"
#endif

const char *infersight_lowbit_isa(void) { return ISA_NAME; }



#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif
/* Ask for the weights PREFETCH_AHEAD bytes on in a thread's stream (its rows are contiguous)
 * into the outer caches. Rows of 1-2 KiB (Llama-3.2-1B's INT4 and INT8 rows) end before the
 * hardware prefetcher catches up; a prefetch past the matrix never faults. */
static inline void ahead(const void *p) {
    __builtin_prefetch((const char *)p + PREFETCH_AHEAD, 0, 1);
}

/* -- activations ------------------------------------------------------------------------ */

/* x [M, K] -> q [M, K] int8, d [M, K/32], s [M, K/32]. Division, not a multiplication by
 * 1/d, so that every path (and torch's reference) rounds the same quotient; written in
 * vectors of eight floats (IEEE division and a round-to-nearest-even by the 1.5 * 2^23 trick,
 * exact for |q| <= 127), so that the compiler needs no fast-math to vectorize it. */
typedef float q8f __attribute__((vector_size(32)));

void infersight_quantize_q8(const float *x, int64_t rows, int64_t k, int8_t *q, float *d,
                            int32_t *s) {
    const int64_t nb = k / QK;
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    for (int64_t r = 0; r < rows * nb; r++) {
        const float *xb = x + r * QK;
        int8_t *qb = q + r * QK;
        q8f v[QK / 8];
        memcpy(v, xb, sizeof v);
        float m = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float a = __builtin_fabsf(xb[i]);
            m = a > m ? a : m;
        }
        const float db = m / 127.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK / 8; j++) {
            const q8f quotient = db == 0.0f ? (q8f){0} : v[j] / db;
            const q8f rounded = (quotient + magic) - magic;
            for (int i = 0; i < 8; i++) {
                const int32_t value = (int32_t)rounded[i];
                qb[8 * j + i] = (int8_t)value;
                sum += value;
            }
        }
        d[r] = db;
        s[r] = sum;
    }
}

/* -- the integer dot products of one block, per instruction set ------------------------- */
/* Each returns (or accumulates into a float vector) the dot product of 32 int8 activations
 * with 32 weights: `w4` 16 packed bytes of 4-bit values (0..15), or `w8` 32 int8 values. */

#if ISA_AVX512_VNNI || ISA_AVX_VNNI
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if ISA_AVX512_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

#if ISA_AVX512_VNNI || ISA_AVX_VNNI || ISA_AVX2
/* 16 packed bytes -> 32 values 0..15 in one register, in the activations' order: the bytes
 * in both halves (one load), the upper half shifted down a nibble, then masked (three
 * instructions where splitting and joining halves took five) */
static inline __m256i unpack4(const uint8_t *w4) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w4));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)),
                            _mm256_set1_epi8(0x0F));
}

/* eight int32 partial sums of unsigned u times signed x */
static inline __m256i dot_us(__m256i u, __m256i x) {
#if ISA_AVX512_VNNI || ISA_AVX_VNNI
    return dpbusd256(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if ISA_AVX512_VNNI
/* Two blocks at a time in 512 bits: lanes 0..7 of a dot product hold block b's partial sums,
 * lanes 8..15 block b + 1's. */

/* 32 packed bytes (blocks b, b + 1) -> 64 values 0..15 in the activations' order */
static inline __m512i unpack4x2(const uint8_t *w4) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)w4);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline __m512i dot_us512(__m512i u, __m512i x) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
}

/* a in lanes 0..7, b in lanes 8..15 */
static inline __m512 halves(float a, float b) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}
#endif

/* sum_g (z - 8 s) * c[g] over one row's G groups, (s, z) as bf16 bits: eight groups at a
 * time, each pair read as one 32-bit word (s in its low half), then a fixed-order sum. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float zero_part(const uint16_t *sz, const float *c, int64_t ng) {
    v8f acc = {0};
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        v8u pairs;
        v8f cv, sv, zv;
        memcpy(&pairs, sz + 2 * g, sizeof pairs);
        memcpy(&cv, c + g, sizeof cv);
        const v8u s_bits = pairs << 16, z_bits = pairs & 0xFFFF0000u;
        memcpy(&sv, &s_bits, sizeof sv);
        memcpy(&zv, &z_bits, sizeof zv);
        acc += (zv - 8.0f * sv) * cv;
    }
    float z = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; g < ng; g++) z += (bf16_to_f32(sz[2 * g + 1]) - 8.0f * bf16_to_f32(sz[2 * g])) * c[g];
    return z;
}

/* -- INT8 weights: activations in int16 ------------------------------------------------ */
/* INT8 weights take their activations quantized to int16, not int8: per block of QK16 values
 * (a row's last block may be shorter, down to 32), d = max|x| / 32767, q = round(x / d). In
 * int8, as llama.cpp's Q8_0 does, quantizing the activations cost 0.77 of the INT8 weights'
 * own KL on the default model (docs/cpu-kernels.md); in int16 an activation is rounded more
 * finely than bf16 rounds it, unless it is 128 times smaller than its block's largest. The
 * products are int8 x int16 pairs summed in int32 (a block's sum is at most
 * 128 * 127 * 32767 < 2^31): vpdpwssd with AVX-512 VNNI, vpmaddwd + vpaddd with AVX2, smlal
 * on arm64, 32 weights in two instructions where widening them to floats takes six. */

void infersight_quantize_q16(const float *x, int64_t rows, int64_t k, int16_t *q, float *d) {
    const int64_t nb = (k + QK16 - 1) / QK16;
    const float magic = 12582912.0f; /* 1.5 * 2^23: rounds to nearest even, exact here */
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t c0 = b * QK16, len = k - c0 < QK16 ? k - c0 : QK16;
            const float *xb = x + r * k + c0;
            int16_t *qb = q + r * k + c0;
            float m = 0.0f;
            for (int64_t i = 0; i < len; i++) {
                const float a = __builtin_fabsf(xb[i]);
                m = a > m ? a : m;
            }
            const float db = m / 32767.0f;
            for (int64_t i = 0; i < len; i++) {
                /* within ±32767 by construction, unless d is a denormal that lost bits (a
                 * block below 4e-34): clamped, as the reference clamps */
                float quotient = db == 0.0f ? 0.0f : xb[i] / db;
                quotient = quotient > 32767.0f ? 32767.0f : quotient;
                quotient = quotient < -32767.0f ? -32767.0f : quotient;
                qb[i] = (int16_t)(int32_t)((quotient + magic) - magic);
            }
            d[r * nb + b] = db;
        }
    }
}

/* Output row n of y for rows m0 .. m0 + mt - 1 of x (K a multiple of 32). */
static inline void int8_rows(const int16_t *qx, const float *dx, int64_t k, const int8_t *w,
                             const float *ws, int64_t n, int64_t n_out, float *y, int64_t m0,
                             int mt) {
    const int64_t nb = (k + QK16 - 1) / QK16;
    const int8_t *wr = w + n * k;
#if ISA_AVX512_VNNI
    __m512 acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t c0 = b * QK16, end = k - c0 < QK16 ? k : c0 + QK16;
        __m512i dot[MT];
        for (int i = 0; i < mt; i++) dot[i] = _mm512_setzero_si512();
        for (int64_t c = c0; c < end; c += 32) {
            if (!(c & 63)) ahead(wr + c);
            const __m512i wv =
                _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + c)));
            for (int i = 0; i < mt; i++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(qx + (m0 + i) * k + c));
                dot[i] = _mm512_dpwssd_epi32(dot[i], wv, xv);
            }
        }
        for (int i = 0; i < mt; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]),
                                     _mm512_set1_ps(dx[(m0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = _mm512_reduce_add_ps(acc[i]) * ws[n];
#elif ISA_AVX_VNNI || ISA_AVX2
    __m256 acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t c0 = b * QK16, end = k - c0 < QK16 ? k : c0 + QK16;
        __m256i dot[MT];
        for (int i = 0; i < mt; i++) dot[i] = _mm256_setzero_si256();
        for (int64_t c = c0; c < end; c += 16) {
            if (!(c & 63)) ahead(wr + c);
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + c)));
            for (int i = 0; i < mt; i++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + (m0 + i) * k + c));
                dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(wv, xv));
            }
        }
        for (int i = 0; i < mt; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]),
                                     _mm256_set1_ps(dx[(m0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = hsum8(acc[i]) * ws[n];
#elif ISA_NEON_DOT
    float32x4_t acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t c0 = b * QK16, end = k - c0 < QK16 ? k : c0 + QK16;
        int32x4_t dot[MT];
        for (int i = 0; i < mt; i++) dot[i] = vdupq_n_s32(0);
        for (int64_t c = c0; c < end; c += 16) {
            const int8x16_t wv = vld1q_s8(wr + c);
            const int16x8_t lo = vmovl_s8(vget_low_s8(wv)), hi = vmovl_high_s8(wv);
            for (int i = 0; i < mt; i++) {
                const int16_t *xr = qx + (m0 + i) * k + c;
                const int16x8_t x0 = vld1q_s16(xr), x1 = vld1q_s16(xr + 8);
                dot[i] = vmlal_s16(dot[i], vget_low_s16(lo), vget_low_s16(x0));
                dot[i] = vmlal_high_s16(dot[i], lo, x0);
                dot[i] = vmlal_s16(dot[i], vget_low_s16(hi), vget_low_s16(x1));
                dot[i] = vmlal_high_s16(dot[i], hi, x1);
            }
        }
        for (int i = 0; i < mt; i++)
            acc[i] = vfmaq_n_f32(acc[i], vcvtq_f32_s32(dot[i]), dx[(m0 + i) * nb + b]);
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = vaddvq_f32(acc[i]) * ws[n];
#else
    float acc[MT] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const int64_t c0 = b * QK16, end = k - c0 < QK16 ? k : c0 + QK16;
        for (int i = 0; i < mt; i++) {
            int32_t dot = 0;
            for (int64_t c = c0; c < end; c++) dot += (int32_t)wr[c] * qx[(m0 + i) * k + c];
            acc[i] += (float)dot * dx[(m0 + i) * nb + b];
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = acc[i] * ws[n];
#endif
}

#include "lowbit_int4.h"

/* -- entry points ------------------------------------------------------------------------ */
/* Output rows are split between `threads` OpenMP threads in one contiguous range each (a row
 * of weights is read by one thread only, and each thread's weights are one stream for
 * `ahead` to run in front of); every row of x is taken by the thread that reads the weights.
 * The mt argument is a literal at each call, so that the compiler unrolls the tile. */

#define FOR_TILES(CALL)                                                                      \
    for (int64_t m0 = 0; m0 < m; m0 += MT) {                                                 \
        switch (m - m0 >= MT ? MT : (int)(m - m0)) {                                         \
        case 4: CALL(4); break;                                                              \
        case 3: CALL(3); break;                                                              \
        case 2: CALL(2); break;                                                              \
        default: CALL(1); break;                                                             \
        }                                                                                    \
    }

void infersight_int8_gemm(const int16_t *qx, const float *dx, int64_t m, int64_t k,
                          const int8_t *w, const float *ws, int64_t n_out, float *y,
                          int threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_out; n++) {
#define INT8_CALL(T) int8_rows(qx, dx, k, w, ws, n, n_out, y, m0, T)
        FOR_TILES(INT8_CALL)
#undef INT8_CALL
    }
}

/* `cg` [M, K / group]: sum over each group's blocks of d * s (see the top of this file) */
void infersight_int4_gemm(const int8_t *qx, const float *dx, const int32_t *sx, int64_t m,
                          int64_t k, int64_t group, const uint8_t *w, const uint16_t *sz,
                          int64_t n_out, float *y, float *cg, int threads) {
    const int64_t nb = k / QK, ng = k / group, per_group = group / QK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < ng; g++) {
            float c = 0.0f;
            for (int64_t bg = 0; bg < per_group; bg++) {
                const int64_t b = r * nb + g * per_group + bg;
                c += dx[b] * (float)sx[b];
            }
            cg[r * ng + g] = c;
        }
    }
    (void)threads;
#if HAVE_G32
    if (group == QK) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t n = 0; n < n_out; n++) {
#define INT4_G32_CALL(T) int4_rows_g32(qx, dx, cg, k, w, sz, n, n_out, y, m0, T)
            FOR_TILES(INT4_G32_CALL)
#undef INT4_G32_CALL
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_out; n++) {
#define INT4_CALL(T) int4_rows(qx, dx, cg, k, group, w, sz, n, n_out, y, m0, T)
        FOR_TILES(INT4_CALL)
#undef INT4_CALL
    }
}

/* -- INT4 weights dequantized, for prefill chunks ---------------------------------------- */
/* Rows n0 .. n1 of INT4 weights as bf16, out [n1 - n0, K]: w = (q - 8) s + z in fp32 (the
 * product is exact: 4 bits times bf16's 8), rounded to nearest even. A prefill chunk's rows
 * then share oneDNN's bf16 GEMM (engine/quant/int4.py) where our kernel reuses each weight
 * block for four rows only. */
void infersight_int4_dequantize(const uint8_t *w, const uint16_t *sz, int64_t k, int64_t group,
                                int64_t n0, int64_t n1, uint16_t *out, int threads) {
    const int64_t ng = k / group;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * (k / 2);
        uint16_t *o = out + (n - n0) * k;
        for (int64_t b = 0; b < k / QK; b++) {
            const int64_t g = b * QK / group;
            const float s = bf16_to_f32(sz[2 * (n * ng + g)]);
            const float z = bf16_to_f32(sz[2 * (n * ng + g) + 1]);
            const uint8_t *wb = wr + b * (QK / 2);
            for (int j = 0; j < QK / 2; j++) {
                o[b * QK + j] = f32_to_bf16((float)((wb[j] & 0x0F) - 8) * s + z);
                o[b * QK + QK / 2 + j] = f32_to_bf16((float)((wb[j] >> 4) - 8) * s + z);
            }
        }
    }
}

/* Rows ids[0 .. n) of INT4 weights [N, K] as a tied head's embedding reads them
 * (engine/quant/embedding.py): each value (q - 8) s + z as above, times inv[c], in fp32 with
 * every product and sum rounded as torch's operators round them, columns [0, width), into
 * out [n, width] as fp32 or bf16 (out_bf16, rounded to nearest even). One call where the
 * torch code runs about ten operators per step. Returns 0, or -1 for an id outside [0, N)
 * (nothing is read then). */
__attribute__((optimize("fp-contract=off")))
int infersight_int4_rows(const uint8_t *w, const uint16_t *sz, int64_t N, int64_t k,
                         int64_t group, const int64_t *ids, int64_t n, const float *inv,
                         int64_t width, void *out, int out_bf16) {
    const int64_t ng = k / group;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= N) return -1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t row = ids[r];
        const uint8_t *wr = w + row * (k / 2);
        const uint16_t *szr = sz + 2 * row * ng;
        for (int64_t c = 0; c < width; c++) {
            const int64_t j = c % QK, g = c / group;
            const uint8_t byte = wr[(c / QK) * (QK / 2) + j % (QK / 2)];
            const int q = (j < QK / 2 ? (byte & 0x0F) : (byte >> 4)) - 8;
            const float v = ((float)q * bf16_to_f32(szr[2 * g]) + bf16_to_f32(szr[2 * g + 1]))
                            * inv[c];
            if (out_bf16)
                ((uint16_t *)out)[r * width + c] = f32_to_bf16(v);
            else
                ((float *)out)[r * width + c] = v;
        }
    }
    return 0;
}

/* -- one call per layer: the activations quantized into scratch space, then the product ---- */
/* x and y are fp32 or bf16 (x_bf16, y_bf16): a bf16 x is widened (exactly) before it is
 * quantized, and a bf16 y is the fp32 result rounded to nearest even, as torch's .to()
 * rounds, so each gives what converting around an fp32 call gives, without the two torch
 * operators per layer. Returns 0, or -1 where the scratch space could not be allocated. */

static const float *widened(const void *x, int x_bf16, int64_t count, float **scratch) {
    *scratch = NULL;
    if (!x_bf16) return (const float *)x;
    float *wide = malloc((size_t)count * sizeof *wide);
    if (wide)
        for (int64_t i = 0; i < count; i++) wide[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    *scratch = wide;
    return wide;
}

/* y as the product wants it: the caller's fp32 buffer, or scratch space for a bf16 one */
static float *product_out(void *y, int y_bf16, int64_t count) {
    return y_bf16 ? malloc((size_t)count * sizeof(float)) : (float *)y;
}

static void finish_out(void *y, int y_bf16, float *yf, int64_t count) {
    if (!y_bf16) return;
    for (int64_t i = 0; i < count; i++) ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
    free(yf);
}

int infersight_int8_linear(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w,
                           const float *ws, int64_t n_out, void *y, int y_bf16, int threads) {
    const int64_t nb = (k + QK16 - 1) / QK16;
    float *wide;
    const float *xf = widened(x, x_bf16, m * k, &wide);
    int16_t *q = malloc((size_t)(m * k) * sizeof *q);
    float *d = malloc((size_t)(m * nb) * sizeof *d);
    float *yf = product_out(y, y_bf16, m * n_out);
    int rc = -1;
    if (xf && q && d && yf) {
        infersight_quantize_q16(xf, m, k, q, d);
        infersight_int8_gemm(q, d, m, k, w, ws, n_out, yf, threads);
        rc = 0;
    }
    if (yf) {
        if (rc == 0) finish_out(y, y_bf16, yf, m * n_out);
        else if (y_bf16) free(yf);
    }
    free(wide);
    free(q);
    free(d);
    return rc;
}

int infersight_int4_linear(const void *x, int x_bf16, int64_t m, int64_t k, int64_t group,
                           const uint8_t *w, const uint16_t *sz, int64_t n_out, void *y,
                           int y_bf16, int threads) {
    const int64_t nb = k / QK;
    float *wide;
    const float *xf = widened(x, x_bf16, m * k, &wide);
    int8_t *q = malloc((size_t)(m * k));
    float *d = malloc((size_t)(m * nb) * sizeof *d);
    int32_t *s = malloc((size_t)(m * nb) * sizeof *s);
    float *cg = malloc((size_t)(m * (k / group)) * sizeof *cg);
    float *yf = product_out(y, y_bf16, m * n_out);
    int rc = -1;
    if (xf && q && d && s && cg && yf) {
        infersight_quantize_q8(xf, m, k, q, d, s);
        infersight_int4_gemm(q, d, s, m, k, group, w, sz, n_out, yf, cg, threads);
        rc = 0;
    }
    if (yf) {
        if (rc == 0) finish_out(y, y_bf16, yf, m * n_out);
        else if (y_bf16) free(yf);
    }
    free(wide);
    free(q);
    free(d);
    free(s);
    free(cg);
    return rc;
}

/* -- W8A8 (engine/quant/w8a8.py): activations per row, and the int32 products scaled ------ */

/* x [rows, k] (fp32, or bf16 widened exactly) -> q int8 [rows, k] and s [rows], each row as
 * quant8.h's quantize_row: its scale max|x| / 127, or `fixed` where it is > 0. */
void infersight_quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t k, float fixed,
                              int8_t *q, float *s, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *wide = x_bf16 ? malloc((size_t)k * sizeof *wide) : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *row = (const float *)x + r * k;
            if (x_bf16) {
                bf16_row((const uint16_t *)x + r * k, k, wide);
                row = wide;
            }
            s[r] = quantize_row(row, k, fixed, q + r * k);
        }
        free(wide);
    }
}

/* y [rows, n] = ((float)acc · sx[r]) · sw[n] (+ bias[n]) (quant8.h's scale_row), then fp32
 * or bf16 (nearest even); where `residual` ([rows, n] in y's dtype) is given, y + residual
 * rounded to the dtype again: torch's operators on the same int32 sums, then its add. */
void infersight_scale_rows(const int32_t *acc, int64_t rows, int64_t n, const float *sx,
                           const float *sw, const float *bias, const void *residual, void *y,
                           int y_bf16, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *wide = y_bf16 ? malloc((size_t)n * sizeof *wide) : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!y_bf16) {
                float *yf = (float *)y + r * n;
                scale_row(acc + r * n, n, sx[r], sw, bias, yf);
                if (residual) {
                    const float *res = (const float *)residual + r * n;
                    for (int64_t j = 0; j < n; j++) yf[j] += res[j];
                }
                continue;
            }
            scale_row(acc + r * n, n, sx[r], sw, bias, wide);
            uint16_t *yh = (uint16_t *)y + r * n;
            const uint16_t *res = residual ? (const uint16_t *)residual + r * n : NULL;
            int64_t j = 0;
            if (res)
                for (; j + 8 <= n; j += 8)
                    store8_bf16(yh + j, load8_bf16(res + j) + round8_bf16(load8(wide + j)));
            else
                for (; j + 8 <= n; j += 8) store8_bf16(yh + j, load8(wide + j));
            for (; j < n; j++) {
                uint16_t v = f32_to_bf16(wide[j]);
                if (res) v = f32_to_bf16(bf16_to_f32(v) + bf16_to_f32(res[j]));
                yh[j] = v;
            }
        }
        free(wide);
    }
}

#include "experts.h"
