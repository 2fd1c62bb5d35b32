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

#include "kv_rows.h"
#include "vec8.h"

#define TILE 16

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

/* One sequence b, KV heads [h0, h1): writes out[b, h0*group : h1*group, :]. `scratch` holds
 * (h1-h0) * (group*(TILE + 2 + D) + 2*TILE*D) floats. */
static void attend_item(const float *q, const void *pool, int fmt, const int64_t *srow,
                        int64_t n, const float *mrow, float *out, int64_t Hkv, int64_t group,
                        int64_t D, float scale, float cap, int64_t h0, int64_t h1,
                        float *scratch) {
    const int64_t heads = (h1 - h0) * group; /* query heads of this item */
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
            for (int64_t part = 0; part < (whole ? 1 : 2); part++) /* dequantized as read */
                kv_heads_f32(pool, fmt, first, Hkv, whole ? 0 : part * Hkv + h0,
                             whole ? run * 2 * Hkv : h1 - h0, D,
                             tb + j * width + (whole ? 0 : part * span));
            j += run;
        }
        for (int64_t j = 0; j < tn; j++) {
            const float *k = tb + j * width;
            const float add = mrow ? mrow[t0 + j] : 0.0f;
            for (int64_t kh = 0; kh < h1 - h0; kh++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = kh * group + g;
                    const float x = dot_f32(qh + h * D, k + kh * D, D) * scale;
                    s[h * TILE + j] = (cap > 0.0f ? cap * tanhf(x / cap) : x) + add;
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

/* q: [B, H, D] fp32; pool: [S, 2*Hkv, D] of format fmt (kv_rows.h: fp32, bf16, or int8 rows
 * of D values and their scale); slots: [B, W];
 * lens[b]: how many leading columns of row b are real (the rest is padding); mask: [B, W]
 * additive fp32 or NULL; cap > 0: each score s is soft-capped to cap * tanh(s / cap) before
 * the mask is added (Gemma 2's attn_logit_softcapping), 0: not; out: [B, H, D] fp32.
 * S: the pool's slots. Returns 0; -1 when out of memory; -2 when a length is outside
 * [0, W] or a slot a length covers outside [0, S) (nothing is read then). */
int infersight_paged_decode(const float *q, const void *pool, int fmt, const int64_t *slots,
                            const int64_t *lens, const float *mask, float *out, int64_t B,
                            int64_t W, int64_t H, int64_t Hkv, int64_t D, float scale,
                            float cap, int threads, int64_t S) {
    for (int64_t b = 0; b < B; b++) { /* the block tables, before any read through them */
        if (lens[b] < 0 || lens[b] > W) return -2;
        for (int64_t j = 0; j < lens[b]; j++)
            if (slots[b * W + j] < 0 || slots[b * W + j] >= S) return -2;
    }
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
            attend_item(q + b * H * D, pool, fmt, slots + b * W, lens[b],
                        mask ? mask + b * W : NULL, out + b * H * D, Hkv, group, D, scale, cap,
                        h0, h1, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

#include "paged_prefill.h"
