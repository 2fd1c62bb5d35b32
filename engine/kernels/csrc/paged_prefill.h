/* Prefill attention through the block tables: included once, by paged_decode.c (one library,
 * engine/kernels/paged_decode.py), after its decode kernel; kept apart for its size. */
#ifndef INFERSIGHT_PAGED_PREFILL_H
#define INFERSIGHT_PAGED_PREFILL_H

/* ---------------------------------------------------------------------------------------
 * Prefill: a chunk of L queries of one sequence, at positions start .. start+L-1, over the
 * keys its slots hold (positions kpos[0..T), ascending: the sink's and the window's blocks
 * where a cache window gave the others back). The decode kernel above is its one-query case.
 *
 * Flash attention: a work item is a tile of QT queries and one KV head (the `group` query
 * heads under it, so K/V are read once for all of them and never repeated). It walks the
 * keys in tiles of KT with an online softmax. Tiles no query of the item can see are never
 * read: causal (keys after the item's last query) and, under a window, the keys between the
 * sink and the first query's window. Only the tiles on those edges are masked key by key.
 *
 * The two products are register-blocked micro-GEMMs over tiles kept in L1: S = Q·Kᵀ with the
 * key tile transposed ([D][KT], two query rows by KT keys in eight-lane vectors), and
 * acc += P·V (VB rows by 32 dimensions), with fused multiply-adds where the CPU has them.
 * A bf16 model's Q·Kᵀ runs on AVX-512 BF16 dot products where the CPU has them (exact
 * products, fp32 sums). The item's last key tile stops at its last query (in whole vectors),
 * and the micro-kernel gives each row's maximum, which the softmax takes as is on the tiles
 * that need no mask.
 * Each item's arithmetic runs in the same order whatever the chunk's length or the batch
 * around it.
 */
#define QT 32 /* queries per work item */
#define RB 2  /* query rows per block of the score micro-kernel */
/* keys per tile: the score micro-kernel holds RB x KT/8 accumulators and KT/8 K vectors in
 * registers, 24 of AVX-512's 32 at 64 keys, 12 of AVX2's 16 at 32 (measured: 64 keys about
 * 5% faster than 32 with AVX-512) */
#if defined(__AVX512F__)
#define KT 64
#else
#define KT 32
#endif

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* The first index in kpos[lo..hi) whose position is > limit (kpos ascending). */
static int64_t upper(const int64_t *kpos, int64_t lo, int64_t hi, int64_t limit) {
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (kpos[mid] <= limit) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static inline float hmax8(v8 x) {
    float top = x[0];
    for (int k = 1; k < 8; k++) top = x[k] > top ? x[k] : top;
    return top;
}

/* S[r][0..8*NV) = qs[r] . K[j] for rows [r, r+nr), and top[r] their largest score: qs is
 * [rows][D] (scaled), kt is [D][KT]. RB rows at a time, NV vectors of keys each (KT/8 but
 * on the tiles the item sees only in part): the accumulators stay in registers (the small
 * constant loops are unrolled), each K vector loaded once for the RB rows. */
#define KV (KT / 8)
static inline __attribute__((always_inline)) void
scores_rows(const float *qs, const float *kt, int64_t r, int64_t nr, int64_t D, float *S,
            float *top, const int NV) {
    v8 a[RB][KV];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NV; c++) a[i][c] = (v8){0};
    for (int64_t d = 0; d < D; d++) {
        v8 k[KV];
        for (int c = 0; c < NV; c++) k[c] = load8(kt + d * KT + 8 * c);
        for (int i = 0; i < RB; i++) {
            const v8 x = splat8(i < nr ? qs[(r + i) * D + d] : 0.0f);
            for (int c = 0; c < NV; c++) a[i][c] = fma8(x, k[c], a[i][c]);
        }
    }
    for (int i = 0; i < nr; i++) {
        v8 t = a[i][0];
        for (int c = 0; c < NV; c++) store8(S + (r + i) * KT + 8 * c, a[i][c]);
        for (int c = 1; c < NV; c++) t = max8(t, a[i][c]);
        top[r + i] = hmax8(t);
    }
}

/* One instance of the micro-kernel per vector count, so that each keeps its loops unrolled
 * and its accumulators in registers. */
#define SCORES_NV(NV)                                                                        \
    static void scores_##NV(const float *qs, const float *kt, int64_t rows, int64_t D,       \
                            float *S, float *top) {                                          \
        for (int64_t r = 0; r < rows; r += RB)                                               \
            scores_rows(qs, kt, r, rows - r < RB ? rows - r : RB, D, S, top, NV);            \
    }
SCORES_NV(1)
SCORES_NV(2)
SCORES_NV(3)
SCORES_NV(4)
#if KV > 4
SCORES_NV(5)
SCORES_NV(6)
SCORES_NV(7)
SCORES_NV(8)
#endif

typedef void (*scores_fn)(const float *, const float *, int64_t, int64_t, float *, float *);
#if KV > 4
static const scores_fn SCORES[KV + 1] = {NULL,     scores_1, scores_2, scores_3, scores_4,
                                         scores_5, scores_6, scores_7, scores_8};
#else
static const scores_fn SCORES[KV + 1] = {NULL, scores_1, scores_2, scores_3, scores_4};
#endif

/* The same scores from bf16 pairs where the CPU has AVX-512 BF16 and both operands are bf16
 * values (a bf16 pool, and queries a bf16 model computed): each vdpbf16ps lane adds two exact
 * products, twice the multiply-adds of an fp32 FMA per instruction. qp is [rows][P] pairs
 * (P = (D+1)/2; a pair holds dimension 2p in its low half, 2p+1 in its high half, zero past
 * D), kp is [P][KT] pairs of each key; the scale is applied to the sums. */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define BF16_DOT 1
static inline __attribute__((always_inline)) void
scores_rows_bf16(const uint32_t *qp, const uint32_t *kp, int64_t r, int64_t nr, int64_t P,
                 float scale, float *S, float *top, const int NV) {
    __m256 a[RB][KV];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NV; c++) a[i][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        __m256bh k[KV];
        for (int c = 0; c < NV; c++)
            k[c] = (__m256bh)_mm256_loadu_si256((const __m256i *)(kp + p * KT + 8 * c));
        for (int i = 0; i < RB; i++) {
            const __m256bh x = (__m256bh)_mm256_set1_epi32((int)(i < nr ? qp[(r + i) * P + p] : 0));
            for (int c = 0; c < NV; c++) a[i][c] = _mm256_dpbf16_ps(a[i][c], x, k[c]);
        }
    }
    const v8 sc = splat8(scale);
    for (int i = 0; i < nr; i++) {
        v8 t = (v8)a[i][0] * sc;
        for (int c = 0; c < NV; c++) {
            const v8 x = (v8)a[i][c] * sc;
            store8(S + (r + i) * KT + 8 * c, x);
            t = max8(t, x);
        }
        top[r + i] = hmax8(t);
    }
}

#define SCORES_BF16_NV(NV)                                                                   \
    static void scores_bf16_##NV(const uint32_t *qp, const uint32_t *kp, int64_t rows,        \
                                 int64_t P, float scale, float *S, float *top) {              \
        for (int64_t r = 0; r < rows; r += RB)                                               \
            scores_rows_bf16(qp, kp, r, rows - r < RB ? rows - r : RB, P, scale, S, top, NV); \
    }
SCORES_BF16_NV(1)
SCORES_BF16_NV(2)
SCORES_BF16_NV(3)
SCORES_BF16_NV(4)
SCORES_BF16_NV(5)
SCORES_BF16_NV(6)
SCORES_BF16_NV(7)
SCORES_BF16_NV(8)
typedef void (*scores_bf16_fn)(const uint32_t *, const uint32_t *, int64_t, int64_t, float,
                               float *, float *);
static const scores_bf16_fn SCORES_BF16[KV + 1] = {
    NULL,           scores_bf16_1, scores_bf16_2, scores_bf16_3, scores_bf16_4,
    scores_bf16_5, scores_bf16_6, scores_bf16_7, scores_bf16_8};
#else
#define BF16_DOT 0
#endif

/* acc[r][0..D) += sum_j P[r][j] * V[j][0..D) for rows [0, rows); V is [KT][D].
 * VB rows by 32 dimensions at a time, in registers over the tile's keys: each V vector is
 * loaded once for the VB rows. Sixteen accumulators where the CPU has 32 vector registers
 * (AVX-512), eight otherwise. Dimensions past the last 32: eight, then one at a time. */
#if defined(__AVX512F__)
#define VB 4
#else
#define VB 2
#endif
static inline void values_rows(const float *P, const float *V, int64_t tn, int64_t r,
                               int64_t nr, int64_t D, float *acc) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        v8 b[VB][4];
        for (int i = 0; i < VB; i++)
            for (int c = 0; c < 4; c++)
                b[i][c] = i < nr ? load8(acc + (r + i) * D + d + 8 * c) : (v8){0};
        for (int64_t j = 0; j < tn; j++) {
            const float *v = V + j * D + d;
            const v8 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
            for (int i = 0; i < VB; i++) {
                const v8 p = splat8(i < nr ? P[(r + i) * KT + j] : 0.0f);
                b[i][0] = fma8(p, v0, b[i][0]), b[i][1] = fma8(p, v1, b[i][1]);
                b[i][2] = fma8(p, v2, b[i][2]), b[i][3] = fma8(p, v3, b[i][3]);
            }
        }
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < 4; c++) store8(acc + (r + i) * D + d + 8 * c, b[i][c]);
    }
    for (; d + 8 <= D; d += 8)
        for (int64_t i = 0; i < nr; i++) {
            v8 x = load8(acc + (r + i) * D + d);
            for (int64_t j = 0; j < tn; j++)
                x = fma8(splat8(P[(r + i) * KT + j]), load8(V + j * D + d), x);
            store8(acc + (r + i) * D + d, x);
        }
    for (; d < D; d++)
        for (int64_t i = 0; i < nr; i++)
            for (int64_t j = 0; j < tn; j++)
                acc[(r + i) * D + d] += P[(r + i) * KT + j] * V[j * D + d];
}

static void values_tile(const float *P, const float *V, int64_t tn, int64_t rows, int64_t D,
                        float *acc) {
    for (int64_t r = 0; r < rows; r += VB)
        values_rows(P, V, tn, r, rows - r < VB ? rows - r : VB, D, acc);
}

/* One item: queries [i0, i1) under KV head kh, over kt ([tiles][D][KT]: each key tile of
 * this head transposed) and vc ([tiles * KT][D]) from the call's one copy of K/V. Rows are
 * query-major: row r is query i0 + r / group, head kh*group + r % group. `scratch` holds
 * QT*group*(2*D + KT + 3) floats. */
static void prefill_item(const float *q, const float *kt, const float *vc, const int64_t *kpos,
                         int64_t T, int64_t start, int64_t i0, int64_t i1, int64_t kh,
                         int64_t H, int64_t Hkv, int64_t D, float scale, float cap,
                         int64_t sink, int64_t window, int dot, float *out, float *scratch) {
    const int64_t group = H / Hkv, rows = (i1 - i0) * group, P = (D + 1) / 2;
    float *qs = scratch;        /* [rows][D] scaled queries */
    float *acc = qs + rows * D; /* [rows][D] */
    float *S = acc + rows * D;  /* [rows][KT] scores, then probabilities */
    float *m = S + rows * KT;   /* [rows] running maximum */
    float *l = m + rows;        /* [rows] running sum */
    float *top_ = l + rows;     /* [rows] each row's largest score in the tile */
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < group; g++) {
            const float *src = q + (i * H + kh * group + g) * D;
            const int64_t row = (i - i0) * group + g;
            if (dot) { /* bf16 pairs: the values are bf16, so the top halves are exact */
                uint32_t *dst = (uint32_t *)qs + row * P, bits[2];
                for (int64_t p = 0; p < P; p++) {
                    memcpy(&bits[0], src + 2 * p, sizeof(float));
                    if (2 * p + 1 < D) memcpy(&bits[1], src + 2 * p + 1, sizeof(float));
                    else bits[1] = 0;
                    dst[p] = (bits[0] >> 16) | (bits[1] & 0xFFFF0000u);
                }
            } else {
                float *dst = qs + row * D;
                for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
            }
        }
    memset(acc, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.0f;

    const int64_t first_q = start + i0, last_q = start + i1 - 1;
    const int64_t end = upper(kpos, 0, T, last_q); /* keys after it: no query sees them */
    /* Under a window, the keys from the sink's end up to the first query's window are seen
     * by no query of the item (later queries see even less of them). In whole tiles: the
     * sink's tiles, then the tiles from the one holding the first key seen again. */
    int64_t sink_tiles = 0, from = 0;
    if (window > 0) {
        const int64_t sink_end = upper(kpos, 0, end, sink - 1);
        sink_tiles = (sink_end + KT - 1) / KT;
        from = upper(kpos, sink_end, end, first_q - window) / KT;
        from = from > sink_tiles ? from : sink_tiles;
    }
    const int64_t end_tiles = (end + KT - 1) / KT;
    for (int64_t tile = 0; tile < end_tiles; tile++) {
        if (tile == sink_tiles && from > tile) tile = from; /* the keys no query sees */
        if (tile >= end_tiles) break;
        /* The tile's first kn keys are the ones some query of the item may see (the item's
         * last tile stops at its last query): scores in nv vectors of eight keys. */
        const int64_t t0 = tile * KT, kn = end - t0 < KT ? end - t0 : KT;
        const int64_t nv = (kn + 7) / 8, width = 8 * nv;
#if BF16_DOT
        if (dot)
            SCORES_BF16[nv]((const uint32_t *)qs, (const uint32_t *)(kt + tile * D * KT), rows, P,
                            scale, S, top_);
        else
#endif
            SCORES[nv](qs, kt + tile * D * KT, rows, D, S, top_);
        if (cap > 0.0f) /* soft-capped scores; the cap keeps their order, so each row's top */
            for (int64_t r = 0; r < rows; r++) {
                float *s = S + r * KT;
                for (int64_t j = 0; j < width; j++) s[j] = cap * tanhf(s[j] / cap);
                top_[r] = cap * tanhf(top_[r] / cap);
            }
        /* Masked key by key only on an edge: a key after some query, or (windowed) one
         * out of some query's window that is not a sink. Elsewhere every computed score
         * counts, and the micro-kernel's maximum is the row's. */
        const int64_t kfirst = kpos[t0], klast = kpos[t0 + kn - 1];
        const int edge = klast > first_q ||
                         (window > 0 && klast >= sink && kfirst <= last_q - window);
        const int whole = !edge && kn == width;
        for (int64_t r = 0; r < rows; r++) {
            float *s = S + r * KT;
            float top = top_[r];
            if (!whole) {
                const int64_t qp = start + i0 + r / group;
                for (int64_t j = kn; j < width; j++) s[j] = -INFINITY;
                if (edge) { /* keys ascend: the sink's keys, then one run */
                    const int64_t seen = upper(kpos, t0, t0 + kn, qp) - t0; /* keys <= qp */
                    for (int64_t j = seen; j < kn; j++) s[j] = -INFINITY;
                    if (window > 0) { /* [from sink's end, first key in the window): hidden */
                        const int64_t in = upper(kpos, t0, t0 + seen, qp - window) - t0;
                        const int64_t sunk = upper(kpos, t0, t0 + in, sink - 1) - t0;
                        for (int64_t j = sunk; j < in; j++) s[j] = -INFINITY;
                    }
                }
                v8 top8 = load8(s);
                for (int64_t j = 8; j < width; j += 8) top8 = max8(top8, load8(s + j));
                top = hmax8(top8);
            }
            if (top == -INFINITY) { /* nothing visible to this row yet */
                for (int64_t j = 0; j < width; j++) s[j] = 0.0f;
                continue;
            }
            if (top > m[r]) {
                const float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - top);
                float *x = acc + r * D;
                for (int64_t d = 0; d < D; d++) x[d] *= corr;
                l[r] *= corr;
                m[r] = top;
            } else top = m[r];
            const v8 top_v = splat8(top);
            v8 sum = {0};
            for (int64_t j = 0; j < width; j += 8) {
                const v8 e = exp8(load8(s + j) - top_v);
                store8(s + j, e);
                sum += e;
            }
            l[r] += ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
        }
        values_tile(S, vc + t0 * D, kn, rows, D, acc);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = i0 + r / group, h = kh * group + r % group;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float *dst = out + (i * H + h) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
    }
}

/* Key tile `tile` of head kh: K transposed into kt ([D][KT], zero past the last key; bf16
 * pairs [P][KT] for the bf16 dot products) and V into vc ([KT][D]), as fp32. */
static void copy_tile(const void *pool, int fmt, int dot, const int64_t *slots, int64_t T,
                      int64_t tile, int64_t kh, int64_t Hkv, int64_t D, float *kt, float *vc) {
    const int64_t row = 2 * Hkv * D, t0 = tile * KT, P = (D + 1) / 2;
    const int bf16 = fmt == KV_BF16;
    uint32_t *kp = (uint32_t *)kt;
    for (int64_t j = 0; j < KT; j++) {
        if (t0 + j >= T) {
            if (dot)
                for (int64_t p = 0; p < P; p++) kp[p * KT + j] = 0;
            else
                for (int64_t d = 0; d < D; d++) kt[d * KT + j] = 0.0f;
            memset(vc + j * D, 0, (size_t)D * sizeof(float));
            continue;
        }
        const int64_t base = slots[t0 + j] * row;
        const int64_t ko = base + kh * D, vo = base + (Hkv + kh) * D;
        if (dot) { /* K as bf16 pairs, [P][KT] */
            const uint16_t *k = (const uint16_t *)pool + ko;
            for (int64_t p = 0; p < P; p++)
                kp[p * KT + j] = k[2 * p] | (2 * p + 1 < D ? (uint32_t)k[2 * p + 1] << 16 : 0u);
            bf16_row((const uint16_t *)pool + vo, D, vc + j * D);
        } else if (fmt == KV_INT8) { /* K dequantized, then transposed; V dequantized */
            float *k = vc + j * D; /* V's place holds K until it is transposed */
            kv_heads_f32(pool, fmt, slots[t0 + j], Hkv, kh, 1, D, k);
            for (int64_t d = 0; d < D; d++) kt[d * KT + j] = k[d];
            kv_heads_f32(pool, fmt, slots[t0 + j], Hkv, Hkv + kh, 1, D, vc + j * D);
        } else if (bf16) {
            const uint16_t *k = (const uint16_t *)pool + ko;
            for (int64_t d = 0; d < D; d++) {
                const uint32_t bits = (uint32_t)k[d] << 16;
                memcpy(kt + d * KT + j, &bits, sizeof(float));
            }
            bf16_row((const uint16_t *)pool + vo, D, vc + j * D);
        } else {
            const float *k = (const float *)pool + ko;
            for (int64_t d = 0; d < D; d++) kt[d * KT + j] = k[d];
            memcpy(vc + j * D, (const float *)pool + vo, (size_t)D * sizeof(float));
        }
    }
}

/* q: [L, H, D] fp32 for positions start .. start+L-1; pool as for decode; formats: bit 0
 * set when the pool holds bf16, bit 1 when q's values are bf16 too (a bf16 model's queries,
 * widened: Q.K may then run on bf16 dot products), bit 2 when the pool holds int8 rows
 * (kv_rows.h: dequantized as each tile is copied); slots[T] and kpos[T]: the sequence's
 * slots and their positions, ascending; a key is seen by query p when kpos <= p and
 * (window == 0, or kpos > p - window, or kpos < sink); cap as for decode; out: [L, H, D]
 * fp32. S: the pool's slots. Returns 0; -1 when out of memory; -2 when a slot is outside
 * [0, S) (nothing is read then).
 *
 * The keys and values are read from the pool once, into one fp32 copy of the call (K
 * transposed tile by tile), which every query tile then reads. */
int infersight_paged_prefill(const float *q, const void *pool, int formats, const int64_t *slots,
                             const int64_t *kpos, float *out, int64_t L, int64_t T,
                             int64_t start, int64_t H, int64_t Hkv, int64_t D, float scale,
                             float cap, int64_t sink, int64_t window, int threads,
                             int64_t S) {
    for (int64_t t = 0; t < T; t++) /* the slots, before any read through them */
        if (slots[t] < 0 || slots[t] >= S) return -2;
    const int64_t group = H / Hkv, tiles = (L + QT - 1) / QT, ktiles = (T + KT - 1) / KT;
    const int fmt = formats & 4 ? KV_INT8 : (formats & 1 ? KV_BF16 : KV_FP32);
    const int dot = BF16_DOT && (formats & 7) == 3;
    const size_t per_head = (size_t)(ktiles * KT * D);
    float *kv = malloc(2 * (size_t)Hkv * per_head * sizeof(float));
    if (kv == NULL) return -1;
    const size_t scratch = (size_t)(QT * group * (2 * D + KT + 3));
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < Hkv * ktiles; item++) {
            const int64_t kh = item / ktiles, tile = item % ktiles;
            copy_tile(pool, fmt, dot, slots, T, tile, kh, Hkv, D, kv + kh * per_head + tile * D * KT,
                      kv + (Hkv + kh) * per_head + tile * KT * D);
        }
        float *buf = malloc(scratch * sizeof(float));
        if (buf == NULL) failed = 1;
        /* the last query tiles see the most keys: handed out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * Hkv; item++) {
            const int64_t tile = tiles - 1 - item / Hkv, kh = item % Hkv;
            const int64_t i0 = tile * QT, i1 = i0 + QT < L ? i0 + QT : L;
            if (buf == NULL) continue;
            prefill_item(q, kv + kh * per_head, kv + (Hkv + kh) * per_head, kpos, T, start, i0,
                         i1, kh, H, Hkv, D, scale, cap, sink, window, dot, out, buf);
        }
        free(buf);
    }
    free(kv);
    return failed ? -1 : 0;
}

#endif
