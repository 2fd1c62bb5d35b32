/* A decode step's routed experts in one call (engine/kernels/experts.py), compiled into
 * lowbit.c (it uses that file's products):
 *
 *   y[K] = sum_e r[e] * down_e(act(gate_e(x)) * up_e(x))
 *
 * for one token's x [K] and the n experts it was routed to, in the order given (the caller's:
 * ascending expert ids, as the layer sums them). Each expert is a gated MLP of `inner`
 * channels: gate_up [2 * inner, K] (the gate's rows, then the up's) and down [K, inner], both
 * our INT4 weights (kind 4: packed values and bf16 (s, z) per group) or our INT8 ones (kind 8:
 * int8 values and fp32 scales per row). x is quantized once for every expert's gate_up, as each
 * product would quantize it; the gate's activation (0: SiLU, 1: GELU with tanh) and the
 * weighted sum run in fp32, where the layer by layer path rounds each output to the
 * activations' dtype. One call replaces 2n products, 3n torch operators and their dispatch.
 * Returns 0, or -1 where scratch space could not be allocated. */

static inline float expert_act(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

/* out [n_out] = w · (x as quantized into (q, d, s)) for one row: INT4 or INT8 */
static void expert_product(int kind, const void *qx, const float *dx, const int32_t *sx,
                           int64_t k, int64_t group, const void *w, const void *scales,
                           int64_t n_out, float *out, float *cg, int threads) {
    if (kind == 4)
        infersight_int4_gemm((const int8_t *)qx, dx, sx, 1, k, group, (const uint8_t *)w,
                             (const uint16_t *)scales, n_out, out, cg, threads);
    else
        infersight_int8_gemm((const int16_t *)qx, dx, 1, k, (const int8_t *)w,
                             (const float *)scales, n_out, out, threads);
}

/* x [k] quantized for `kind`'s products: int8 per block of 32 (with sums) or int16 per 128 */
static void expert_quantize(int kind, const float *x, int64_t k, void *q, float *d,
                            int32_t *s) {
    if (kind == 4)
        infersight_quantize_q8(x, 1, k, (int8_t *)q, d, s);
    else
        infersight_quantize_q16(x, 1, k, (int16_t *)q, d);
}

int infersight_experts(const void *x, int x_bf16, int64_t k, int64_t inner, int kind,
                       int64_t group, int64_t n, const void *const *w_gate_up,
                       const void *const *s_gate_up, const void *const *w_down,
                       const void *const *s_down, const float *r, int act, float *y,
                       int threads) {
    const int64_t width = k > inner ? k : inner;
    float *wide;
    const float *xf = widened(x, x_bf16, k, &wide);
    /* x's quantization (once) and the hidden activations' (per expert): int16 room for
     * either kind's values, a scale and a sum per block of 32 */
    void *qx = malloc((size_t)k * sizeof(int16_t)), *qh = malloc((size_t)inner * sizeof(int16_t));
    float *dx = malloc((size_t)(k / QK + 1) * sizeof *dx);
    float *dh = malloc((size_t)(inner / QK + 1) * sizeof *dh);
    int32_t *sx = malloc((size_t)(k / QK + 1) * sizeof *sx);
    int32_t *sh = malloc((size_t)(inner / QK + 1) * sizeof *sh);
    float *cg = malloc((size_t)(width / QK + 1) * sizeof *cg);
    float *h = malloc((size_t)(2 * inner) * sizeof *h);
    float *out = malloc((size_t)k * sizeof *out);
    int rc = -1;
    if (xf && qx && qh && dx && dh && sx && sh && cg && h && out) {
        memset(y, 0, (size_t)k * sizeof *y);
        expert_quantize(kind, xf, k, qx, dx, sx);
        for (int64_t e = 0; e < n; e++) {
            expert_product(kind, qx, dx, sx, k, group, w_gate_up[e], s_gate_up[e], 2 * inner,
                           h, cg, threads);
            for (int64_t i = 0; i < inner; i++) h[i] = expert_act(h[i], act) * h[inner + i];
            expert_quantize(kind, h, inner, qh, dh, sh);
            expert_product(kind, qh, dh, sh, inner, group, w_down[e], s_down[e], k, out, cg,
                           threads);
            for (int64_t i = 0; i < k; i++) y[i] += r[e] * out[i];
        }
        rc = 0;
    }
    free(wide);
    free(qx);
    free(qh);
    free(dx);
    free(dh);
    free(sx);
    free(sh);
    free(cg);
    free(h);
    free(out);
    return rc;
}
