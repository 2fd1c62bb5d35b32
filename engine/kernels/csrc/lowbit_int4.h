/* INT4 weights' products of a tile of rows (csrc/lowbit.c, whose top says how the blocks and
 * the activations are laid out): included once, by lowbit.c, after its helpers; kept apart
 * for its size. */
#ifndef INFERSIGHT_LOWBIT_INT4_H
#define INFERSIGHT_LOWBIT_INT4_H

/* -- INT4 weights ------------------------------------------------------------------------ */

static inline void int4_rows(const int8_t *qx, const float *dx, const float *cg, int64_t k,
                             int64_t group, const uint8_t *w, const uint16_t *sz, int64_t n,
                             int64_t n_out, float *y, int64_t m0, int mt) {
    const int64_t nb = k / QK, ng = k / group, per_group = group / QK;
    const uint8_t *wr = w + n * (k / 2);
    const uint16_t *szr = sz + n * ng * 2;
    float zeros[MT];  /* sum_g m[n, g] * c[m, g] */
    for (int i = 0; i < mt; i++) zeros[i] = zero_part(szr, cg + (m0 + i) * ng, ng);
    /* block b's scale is group b >> shift's: groups are 32 times a power of two */
    const int shift = __builtin_ctzll((unsigned long long)per_group);
#define SCALE(b) bf16_to_f32(szr[2 * ((b) >> shift)])
    (void)shift;
#if ISA_AVX512_VNNI || ISA_AVX_VNNI || ISA_AVX2
    __m256 acc[MT];
    int64_t b = 0;
#if ISA_AVX512_VNNI
    __m512 acc2[MT];
    for (int i = 0; i < mt; i++) acc2[i] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
        if (!(b & 3)) ahead(wr + b * (QK / 2));
        const __m512i wb = unpack4x2(wr + b * (QK / 2));
        const float s0 = SCALE(b), s1 = SCALE(b + 1);
        for (int i = 0; i < mt; i++) {
            const int64_t r = (m0 + i) * nb + b;
            const __m512i xb = _mm512_loadu_si512((const void *)(qx + r * QK));
            const __m512 dot = _mm512_cvtepi32_ps(dot_us512(wb, xb));
            acc2[i] = _mm512_fmadd_ps(dot, halves(dx[r] * s0, dx[r + 1] * s1), acc2[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm256_add_ps(_mm512_castps512_ps256(acc2[i]),
                               _mm512_extractf32x8_ps(acc2[i], 1));
    }
#else
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
#endif
    for (; b < nb; b++) {
        if (!(b & 3)) ahead(wr + b * (QK / 2));
        const float s = SCALE(b);
        const __m256i wb = unpack4(wr + b * (QK / 2));
        for (int i = 0; i < mt; i++) {
            const int64_t r = (m0 + i) * nb + b;
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(qx + r * QK));
            const __m256 dot = _mm256_cvtepi32_ps(dot_us(wb, xb));
            acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dx[r] * s), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = hsum8(acc[i]) + zeros[i];
#elif ISA_NEON_DOT
    float32x4_t acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = vdupq_n_f32(0.0f);
    const uint8x16_t low = vdupq_n_u8(0x0F);
    for (int64_t g = 0; g < ng; g++) {
        const float s = bf16_to_f32(szr[2 * g]);
        for (int64_t bg = 0; bg < per_group; bg++) {
            const int64_t b = g * per_group + bg;
            const uint8x16_t packed = vld1q_u8(wr + b * (QK / 2));
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(packed, low));
            const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
            for (int i = 0; i < mt; i++) {
                const int64_t r = (m0 + i) * nb + b;
                int32x4_t dot = vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(qx + r * QK));
                dot = vdotq_s32(dot, hi, vld1q_s8(qx + r * QK + 16));
                acc[i] = vfmaq_n_f32(acc[i], vcvtq_f32_s32(dot), dx[r] * s);
            }
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = vaddvq_f32(acc[i]) + zeros[i];
#else
    float acc[MT] = {0};
    for (int64_t g = 0; g < ng; g++) {
        const float s = bf16_to_f32(szr[2 * g]);
        for (int64_t bg = 0; bg < per_group; bg++) {
            const int64_t b = g * per_group + bg;
            const uint8_t *wb = wr + b * (QK / 2);
            for (int i = 0; i < mt; i++) {
                const int64_t r = (m0 + i) * nb + b;
                int32_t dot = 0;
                for (int j = 0; j < QK / 2; j++) {
                    dot += (int32_t)(wb[j] & 0x0F) * qx[r * QK + j];
                    dot += (int32_t)(wb[j] >> 4) * qx[r * QK + QK / 2 + j];
                }
                acc[i] += (float)dot * (dx[r] * s);
            }
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = acc[i] + zeros[i];
#endif
#undef SCALE
}

/* Groups of 32 (int4-g32, the precision people pick): every block has a (s, z) of its own, so
 * the generic loop above spends more on each block's scalars (a bf16 scale converted, times
 * the activation block's d, broadcast) than on its integer dot product. Here the scales of 8
 * (AVX2) or 16 (AVX-512) blocks are converted at once and multiplied by the activation blocks'
 * d's in one vector; each block's coefficient is then spread over its lanes by one permutation.
 * The zero terms (z - 8 s) * c are accumulated in the same pass, a vector at a time. */

#if ISA_AVX512_VNNI
static inline void int4_rows_g32(const int8_t *qx, const float *dx, const float *cg, int64_t k,
                                 const uint8_t *w, const uint16_t *sz, int64_t n, int64_t n_out,
                                 float *y, int64_t m0, int mt) {
    const int64_t nb = k / QK;
    const uint8_t *wr = w + n * (k / 2);
    const uint32_t *szr = (const uint32_t *)(sz + n * nb * 2); /* (s, z): s in the low half */
    /* a pair of blocks' lanes: block j's coefficient in lanes 0..7, block j + 1's in 8..15 */
    const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[MT], zacc[MT], coef[MT];
    for (int i = 0; i < mt; i++) acc[i] = zacc[i] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int left = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const __mmask16 mask = (__mmask16)((1u << left) - 1u);
        ahead(szr + b0);
        const __m512i pairs = _mm512_maskz_loadu_epi32(mask, szr + b0);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 z = _mm512_castsi512_ps(
            _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
        const __m512 zm = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z); /* z - 8 s */
        for (int i = 0; i < mt; i++) {
            const int64_t r = (m0 + i) * nb + b0;
            coef[i] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, dx + r));
            zacc[i] = _mm512_fmadd_ps(zm, _mm512_maskz_loadu_ps(mask, cg + r), zacc[i]);
        }
        int j = 0;
        for (; j + 2 <= left; j += 2) {
            if (!(j & 3)) ahead(wr + (b0 + j) * (QK / 2));
            const __m512i wb = unpack4x2(wr + (b0 + j) * (QK / 2));
            const __m512i lanes = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(j));
            for (int i = 0; i < mt; i++) {
                const int64_t r = (m0 + i) * nb + b0 + j;
                const __m512i xb = _mm512_loadu_si512((const void *)(qx + r * QK));
                const __m512 dot = _mm512_cvtepi32_ps(dot_us512(wb, xb));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes, coef[i]), acc[i]);
            }
        }
        if (j < left) { /* an odd last block, in the low half */
            const __m512i wb = _mm512_zextsi256_si512(unpack4(wr + (b0 + j) * (QK / 2)));
            const __m512i lanes = _mm512_set1_epi32(j);
            for (int i = 0; i < mt; i++) {
                const int64_t r = (m0 + i) * nb + b0 + j;
                const __m512i xb = _mm512_zextsi256_si512(
                    _mm256_loadu_si256((const __m256i *)(qx + r * QK)));
                const __m512 dot = _mm512_cvtepi32_ps(dot_us512(wb, xb));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes, coef[i]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++) {
        y[(m0 + i) * n_out + n] = _mm512_reduce_add_ps(acc[i]) + _mm512_reduce_add_ps(zacc[i]);
    }
}
#define HAVE_G32 1
#elif ISA_AVX_VNNI || ISA_AVX2
/* Blocks are taken in pairs: the second's product is scaled into the first's (a multiply and
 * an FMA) and the pair added to the row's sum, so that a row's chain of dependent additions
 * is one addition per pair instead of an FMA per block. On one row of x (a decode step) that
 * chain was the limit: the default model's 576-wide rows (18 blocks) streamed at 9.6 GB/s on
 * the EPYC forced to AVX2, 20 GB/s now (with the unpacking in three instructions and a group's
 * last, partial, eight loaded under a mask instead of copied). The pairs are the same whatever
 * the tile's row count, so a row's sum is too. */
static inline void int4_rows_g32(const int8_t *qx, const float *dx, const float *cg, int64_t k,
                                 const uint8_t *w, const uint16_t *sz, int64_t n, int64_t n_out,
                                 float *y, int64_t m0, int mt) {
    const int64_t nb = k / QK;
    const uint8_t *wr = w + n * (k / 2);
    const uint32_t *szr = (const uint32_t *)(sz + n * nb * 2); /* (s, z): s in the low half */
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[MT], zacc[MT], coef[MT];
    for (int i = 0; i < mt; i++) acc[i] = zacc[i] = _mm256_setzero_ps();
/* block b0 + j's product for row i, scaled by its coefficient */
#define G32_DOT(wb, j, i)                                                                     \
    _mm256_cvtepi32_ps(dot_us(wb, _mm256_loadu_si256(                                        \
        (const __m256i *)(qx + ((m0 + (i)) * nb + b0 + (j)) * QK))))
#define G32_COEF(j, i) _mm256_permutevar8x32_ps(coef[i], _mm256_set1_epi32(j))
#define G32_PAIR(j)                                                                           \
    do {                                                                                      \
        if (!((j) & 3)) ahead(wr + (b0 + (j)) * (QK / 2));                                    \
        const __m256i w0 = unpack4(wr + (b0 + (j)) * (QK / 2));                               \
        const __m256i w1 = unpack4(wr + (b0 + (j) + 1) * (QK / 2));                           \
        for (int i = 0; i < mt; i++) {                                                        \
            const __m256 p1 = _mm256_mul_ps(G32_DOT(w1, (j) + 1, i), G32_COEF((j) + 1, i));   \
            acc[i] = _mm256_add_ps(acc[i],                                                    \
                                   _mm256_fmadd_ps(G32_DOT(w0, j, i), G32_COEF(j, i), p1));   \
        }                                                                                     \
    } while (0)
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int left = nb - b0 < 8 ? (int)(nb - b0) : 8;
        ahead(szr + b0);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), iota);
        const __m256i pairs = _mm256_maskload_epi32((const int *)(szr + b0), mask);
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        const __m256 z = _mm256_castsi256_ps(
            _mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
        const __m256 zm = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z); /* z - 8 s */
        for (int i = 0; i < mt; i++) {
            const int64_t r = (m0 + i) * nb + b0;
            coef[i] = _mm256_mul_ps(s, _mm256_maskload_ps(dx + r, mask));
            zacc[i] = _mm256_fmadd_ps(zm, _mm256_maskload_ps(cg + r, mask), zacc[i]);
        }
        if (left == 8) { /* literal offsets, unrolled */
            G32_PAIR(0);
            G32_PAIR(2);
            G32_PAIR(4);
            G32_PAIR(6);
        } else {
            int j = 0;
            for (; j + 2 <= left; j += 2) G32_PAIR(j);
            if (j < left) { /* an odd last block */
                const __m256i w0 = unpack4(wr + (b0 + j) * (QK / 2));
                for (int i = 0; i < mt; i++)
                    acc[i] = _mm256_fmadd_ps(G32_DOT(w0, j, i), G32_COEF(j, i), acc[i]);
            }
        }
    }
#undef G32_PAIR
#undef G32_COEF
#undef G32_DOT
    for (int i = 0; i < mt; i++) y[(m0 + i) * n_out + n] = hsum8(acc[i]) + hsum8(zacc[i]);
}
#define HAVE_G32 1
#endif

#endif
