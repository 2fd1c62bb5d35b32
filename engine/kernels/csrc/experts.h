/* A decode step's routed experts in one call (engine/kernels/experts.py), compiled into
 * lowbit.c (it uses that file's products):
 *
 *   y[r] = sum_{e chosen by r, ascending} w[r, e] * down_e(act(gate_e(x[r])) * up_e(x[r]))
 *
 * for the m rows of x [m, K] and the `top` experts each row was routed to (chosen [m, top],
 * their shares w [m, top]). Each expert is a gated MLP of `inner` channels: gate_up
 * [2 * inner, K] (the gate's rows, then the up's) and down [K, inner], both our INT4 weights
 * (kind 4: packed values and bf16 (s, z) per group) or our INT8 ones (kind 8: int8 values and
 * fp32 scales per row), found by expert id in the tables of all `experts`. The rows are
 * quantized once; each expert any row chose runs once, on the rows that chose it (gathered),
 * and adds its weighted output to each of them. The products compute a row the same way
 * whatever rows share the call (lowbit.c's batch invariance) and every row sums its experts
 * in ascending order, so a row's result does not depend on the rows beside it. The gate's
 * activation (0: SiLU, 1: GELU with tanh) and the sums run in fp32. One call replaces 2n
 * products, 3n torch operators and their dispatch. Returns 0, or -1 where scratch space
 * could not be allocated. */

static inline float expert_act(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

/* Row i of a quantized batch: its values, scales and (INT4) sums, whatever the kind */
typedef struct {
    int kind;
    int64_t k, blocks;  /* values a row; scale blocks a row (32 for INT4, 128 for INT8) */
    void *q;
    float *d;
    int32_t *s;
} quantized_rows;

static int rows_alloc(quantized_rows *r, int kind, int64_t m, int64_t k) {
    r->kind = kind;
    r->k = k;
    r->blocks = kind == 4 ? k / QK : (k + QK16 - 1) / QK16;
    r->q = malloc((size_t)(m * k) * (kind == 4 ? 1 : sizeof(int16_t)));
    r->d = malloc((size_t)(m * r->blocks) * sizeof(float));
    r->s = malloc((size_t)(m * r->blocks) * sizeof(int32_t));
    return r->q && r->d && r->s;
}

static void rows_free(quantized_rows *r) {
    free(r->q);
    free(r->d);
    free(r->s);
}

static void rows_quantize(quantized_rows *r, const float *x, int64_t m) {
    if (r->kind == 4)
        infersight_quantize_q8(x, m, r->k, (int8_t *)r->q, r->d, r->s);
    else
        infersight_quantize_q16(x, m, r->k, (int16_t *)r->q, r->d);
}

/* row `from` of `src` into row `to` of `dst` (both quantized alike) */
static size_t r_width(const quantized_rows *r) {
    return (size_t)r->k * (r->kind == 4 ? 1 : sizeof(int16_t));
}

static void rows_copy(quantized_rows *dst, int64_t to, const quantized_rows *src, int64_t from) {
    const size_t width = r_width(src);
    memcpy((char *)dst->q + to * width, (const char *)src->q + from * width, width);
    memcpy(dst->d + to * src->blocks, src->d + from * src->blocks, src->blocks * sizeof(float));
    memcpy(dst->s + to * src->blocks, src->s + from * src->blocks, src->blocks * sizeof(int32_t));
}

/* out [m, n_out] = w · rows for m quantized rows: INT4 or INT8 */
static void rows_product(const quantized_rows *r, int64_t m, int64_t group, const void *w,
                         const void *scales, int64_t n_out, float *out, float *cg,
                         int threads) {
    if (r->kind == 4)
        infersight_int4_gemm((const int8_t *)r->q, r->d, r->s, m, r->k, group,
                             (const uint8_t *)w, (const uint16_t *)scales, n_out, out, cg,
                             threads);
    else
        infersight_int8_gemm((const int16_t *)r->q, r->d, m, r->k, (const int8_t *)w,
                             (const float *)scales, n_out, out, threads);
}

int infersight_experts(const void *x, int x_bf16, int64_t m, int64_t k, int64_t inner, int kind,
                       int64_t group, int64_t top, const int64_t *chosen, const float *w,
                       int64_t experts, const void *const *w_gate_up,
                       const void *const *s_gate_up, const void *const *w_down,
                       const void *const *s_down, int act, float *y, int threads) {
    float *wide;
    const float *xf = widened(x, x_bf16, m * k, &wide);
    quantized_rows all = {0}, picked = {0}, hidden = {0};
    int64_t *rows = malloc((size_t)m * sizeof *rows);
    float *shares = malloc((size_t)m * sizeof *shares);
    float *h = malloc((size_t)(m * 2 * inner) * sizeof *h);
    float *hx = malloc((size_t)(m * inner) * sizeof *hx);
    float *out = malloc((size_t)(m * k) * sizeof *out);
    float *cg = malloc((size_t)(m * ((k > inner ? k : inner) / QK + 1)) * sizeof *cg);
    int ok = xf && rows && shares && h && hx && out && cg;
    ok = ok && rows_alloc(&all, kind, m, k) && rows_alloc(&picked, kind, m, k);
    ok = ok && rows_alloc(&hidden, kind, m, inner);
    if (ok) {
        memset(y, 0, (size_t)(m * k) * sizeof *y);
        rows_quantize(&all, xf, m);
        for (int64_t e = 0; e < experts; e++) {
            int64_t n = 0;
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < top; j++)
                    if (chosen[r * top + j] == e) {
                        rows[n] = r;
                        shares[n] = w[r * top + j];
                        rows_copy(&picked, n++, &all, r);
                    }
            if (!n) continue;
            rows_product(&picked, n, group, w_gate_up[e], s_gate_up[e], 2 * inner, h, cg,
                         threads);
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = 0; c < inner; c++)
                    hx[i * inner + c] = expert_act(h[i * 2 * inner + c], act) *
                                        h[i * 2 * inner + inner + c];
            rows_quantize(&hidden, hx, n);
            rows_product(&hidden, n, group, w_down[e], s_down[e], k, out, cg, threads);
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = 0; c < k; c++) y[rows[i] * k + c] += shares[i] * out[i * k + c];
        }
    }
    free(wide);
    rows_free(&all);
    rows_free(&picked);
    rows_free(&hidden);
    free(rows);
    free(shares);
    free(h);
    free(hx);
    free(out);
    free(cg);
    return ok ? 0 : -1;
}
