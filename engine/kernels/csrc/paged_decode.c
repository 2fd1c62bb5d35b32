/* Decode attention read straight through the block tables (engine/paged_attention.py).
 *
 * One query token per sequence attends to the keys its row of `slots` names in the paged
 * pool. The pool is [slots, 2*Hkv, D]: a slot holds the token's K heads, then its V heads,
 * so the keys of a sequence lie in runs of block_size consecutive slots (one block each).
 *
 * A work item is one sequence and a range of its KV heads: the whole row when the batch has
 * at least as many sequences as threads, a share of the heads otherwise. It walks the keys in
 * tiles of TILE columns, reading each slot's K and V once, in address order, with an online
 * softmax (flash-decoding): per tile, the scores of every query head (q.k * scale + the
 * additive mask), the running maximum and sum rescaled when the maximum grows, then the
 * probability-weighted V rows added in. Nothing is gathered into a padded copy first.
 *
 * Each item is computed in the same order whatever else is in the batch, so a sequence's
 * output does not depend on its neighbours (batch invariance). The arithmetic is written in
 * vectors of eight floats, so its order is fixed by the source, not by the compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16

/* Eight floats as one value (GCC and clang vector extensions): one AVX register on x86-64,
 * two NEON registers on arm64. Loads and stores go through memcpy, so nothing needs to be
 * aligned. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* a.b with two partial sums of eight lanes each, then a fixed-order reduction */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    v8 s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 += load8(a + i) * load8(b + i);
        s1 += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) s0 += load8(a + i) * load8(b + i);
    s0 += s1;
    float s = ((s0[0] + s0[4]) + (s0[1] + s0[5])) + ((s0[2] + s0[6]) + (s0[3] + s0[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* e^x for eight lanes: Cephes' expf (range reduction by ln 2, a degree-5 polynomial; within
 * 2 ulp of expf), written in vectors so the softmax of a tile is a few instructions. Lanes
 * below -87.3 (a masked key's -inf) give exactly 0. */
static inline v8i bits8(v8 v) {
    v8i b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static inline v8 floats8(v8i b) {
    v8 v;
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline v8 exp8(v8 x) {
    const v8 floor_ = (v8){0} - 87.3f;
    const v8i below = x < floor_; /* all ones in the lanes whose result is 0 */
    x = floats8((bits8(x) & ~below) | (bits8(floor_) & below));
    v8 n = x * 1.44269504088896341f + 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    n -= 12582912.0f;
    const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v8i pow2 = (__builtin_convertvector(n, v8i) + 127) << 23;
    return floats8(bits8(p * floats8(pow2)) & ~below);
}

static inline void bf16_row(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, sizeof(float));
    }
}

/* One sequence b, KV heads [h0, h1): writes out[b, h0*group : h1*group, :]. `scratch` holds
 * (h1-h0) * (group*(TILE + 2 + D) + 2*TILE*D) floats. */
static void attend_item(const float *q, const void *pool, int bf16, const int64_t *srow,
                        int64_t n, const float *mrow, float *out, int64_t Hkv, int64_t group,
                        int64_t D, float scale, int64_t h0, int64_t h1, float *scratch) {
    const int64_t heads = (h1 - h0) * group; /* query heads of this item */
    const int64_t row = 2 * Hkv * D;          /* elements per slot */
    float *s = scratch;                       /* [heads, TILE] scores, then probabilities */
    float *m = s + heads * TILE;              /* [heads] running maximum */
    float *l = m + heads;                     /* [heads] running sum */
    float *acc = l + heads;                   /* [heads, D] running weighted V */
    float *tb = acc + heads * D;              /* [TILE, width]: each slot's K heads, V heads */
    const int64_t span = (h1 - h0) * D, width = 2 * span;
    const int whole = h0 == 0 && h1 == Hkv; /* whole slots: a tile row is a pool row */
    const float *qh = q + h0 * group * D;
    for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, (size_t)(heads * D) * sizeof(float));

    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t tn = n - t0 < TILE ? n - t0 : TILE;
        /* This tile's K and V heads, copied into a small buffer (L1-sized) first: a copy
         * with nothing between its loads keeps many cache misses in flight, where loads
         * spread among the dot products would wait for each one in turn. An item that takes
         * whole slots copies each run of consecutive slots (a block) in one piece. */
        for (int64_t j = 0; j < tn;) {
            const int64_t first = srow[t0 + j];
            int64_t run = 1;
            if (whole)
                while (j + run < tn && srow[t0 + j + run] == first + run) run++;
            for (int64_t part = 0; part < (whole ? 1 : 2); part++) {
                const int64_t src = first * row + (whole ? 0 : (part * Hkv + h0) * D);
                const int64_t len = whole ? run * row : span;
                float *dst = tb + j * width + (whole ? 0 : part * span);
                if (bf16)
                    bf16_row((const uint16_t *)pool + src, len, dst);
                else
                    memcpy(dst, (const float *)pool + src, (size_t)len * sizeof(float));
            }
            j += run;
        }
        for (int64_t j = 0; j < tn; j++) {
            const float *k = tb + j * width;
            const float add = mrow ? mrow[t0 + j] : 0.0f;
            for (int64_t kh = 0; kh < h1 - h0; kh++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = kh * group + g;
                    s[h * TILE + j] = dot_f32(qh + h * D, k + kh * D, D) * scale + add;
                }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *sh = s + h * TILE, top = m[h];
            for (int64_t j = 0; j < tn; j++) top = sh[j] > top ? sh[j] : top;
            if (top == -INFINITY) { /* every key so far is masked out */
                for (int64_t j = 0; j < tn; j++) sh[j] = 0.0f;
                continue;
            }
            if (top > m[h]) {
                const float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - top);
                float *a = acc + h * D;
                for (int64_t d = 0; d < D; d++) a[d] *= corr;
                l[h] *= corr;
                m[h] = top;
            }
            for (int64_t j = tn; j < TILE; j++) sh[j] = -INFINITY; /* a short last tile */
            float total = 0.0f;
            for (int64_t j = 0; j < TILE; j += 8) {
                const v8 e = exp8(load8(sh + j) - top);
                store8(sh + j, e);
                total += ((e[0] + e[4]) + (e[1] + e[5])) + ((e[2] + e[6]) + (e[3] + e[7]));
            }
            l[h] += total;
        }
        /* acc[h] += sum_j p[h, j] * V[j]: each group of four lanes-of-eight accumulates in
         * registers over the whole tile, and is loaded and stored once per tile. */
        for (int64_t kh = 0; kh < h1 - h0; kh++)
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kh * group + g;
                const float *p = s + h * TILE;
                float *a = acc + h * D;
                int64_t d = 0;
                for (; d + 32 <= D; d += 32) {
                    v8 a0 = load8(a + d), a1 = load8(a + d + 8);
                    v8 a2 = load8(a + d + 16), a3 = load8(a + d + 24);
                    for (int64_t j = 0; j < tn; j++) {
                        const float *v = tb + j * width + span + kh * D + d;
                        a0 += p[j] * load8(v), a1 += p[j] * load8(v + 8);
                        a2 += p[j] * load8(v + 16), a3 += p[j] * load8(v + 24);
                    }
                    store8(a + d, a0), store8(a + d + 8, a1);
                    store8(a + d + 16, a2), store8(a + d + 24, a3);
                }
                for (; d < D; d++)
                    for (int64_t j = 0; j < tn; j++) a[d] += p[j] * tb[j * width + span + kh * D + d];
            }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[h0 * group * D + h * D + d] = acc[h * D + d] * inv;
    }
}

/* q: [B, H, D] fp32; pool: [S, 2*Hkv, D] fp32 (bf16 = 0) or bf16 (bf16 = 1); slots: [B, W];
 * lens[b]: how many leading columns of row b are real (the rest is padding); mask: [B, W]
 * additive fp32 or NULL; out: [B, H, D] fp32. Returns 0, or -1 when out of memory. */
int infersight_paged_decode(const float *q, const void *pool, int bf16, const int64_t *slots,
                            const int64_t *lens, const float *mask, float *out, int64_t B,
                            int64_t W, int64_t H, int64_t Hkv, int64_t D, float scale,
                            int threads) {
    const int64_t group = H / Hkv;
    /* fewer sequences than threads: split each one's KV heads into `split` ranges */
    int64_t split = B >= threads ? 1 : (threads + B - 1) / B;
    split = split > Hkv ? Hkv : split;
    const int64_t per = (Hkv + split - 1) / split;
    const size_t scratch = (size_t)(per * (group * (TILE + 2 + D) + 2 * TILE * D));
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = malloc(scratch * sizeof(float));
        if (buf == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * split; item++) {
            const int64_t b = item / split, h0 = (item % split) * per;
            const int64_t h1 = h0 + per < Hkv ? h0 + per : Hkv;
            if (buf == NULL || h0 >= h1) continue;
            attend_item(q + b * H * D, pool, bf16, slots + b * W, lens[b],
                        mask ? mask + b * W : NULL, out + b * H * D, Hkv, group, D, scale, h0,
                        h1, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
