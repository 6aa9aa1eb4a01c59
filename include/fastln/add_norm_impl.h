/* Template body of add_norm.h, instantiated per element type by fastln/instantiate.h (which
 * lists the macros it defines). No include guard on purpose.
 *
 * Aliasing: s may be x or residual itself (the in-place residual-stream update), and y may be x
 * or residual: within a row every element of x and residual is read before s is written, and s
 * is complete before y is written. y and s must be different memory. */

/* s = x + residual (+ bias) for eight elements, in double, rounded once. bias may be NULL. */
FASTLN_INLINE void FASTLN_NAME(fastln_add_write8)(
    const FASTLN_T *x, const FASTLN_T *residual, const FASTLN_T *bias, FASTLN_T *s)
{
    fastln_d8 sum = FASTLN_LOAD8(x) + FASTLN_LOAD8(residual);
    if (bias) sum += FASTLN_LOAD8(bias);
    FASTLN_STORE8(s, sum);
}

/* s = x + residual (+ bias) over one row. */
FASTLN_INLINE void FASTLN_NAME(fastln_add_row)(
    const FASTLN_T *x, const FASTLN_T *residual, const FASTLN_T *bias, FASTLN_T *s,
    int64_t n_cols)
{
    int64_t i = 0;
    for (; i + 8 <= n_cols; i += 8)
        FASTLN_NAME(fastln_add_write8)(x + i, residual + i, bias ? bias + i : NULL, s + i);
    if (i < n_cols) {
        const size_t rest = (size_t)(n_cols - i);
        FASTLN_T x_tail[8] = {0}, residual_tail[8] = {0}, bias_tail[8] = {0}, s_tail[8];
        memcpy(x_tail, x + i, rest * sizeof(FASTLN_T));
        memcpy(residual_tail, residual + i, rest * sizeof(FASTLN_T));
        if (bias) memcpy(bias_tail, bias + i, rest * sizeof(FASTLN_T));
        FASTLN_NAME(fastln_add_write8)(x_tail, residual_tail, bias ? bias_tail : NULL, s_tail);
        memcpy(s + i, s_tail, rest * sizeof(FASTLN_T));
    }
}

/* s = x + residual (+ bias), then y = LayerNorm(s) with mean_out/rstd_out as in
 * fastln_layer_norm_forward_row. gamma, beta and bias may be NULL. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_add_layer_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_T *residual, const FASTLN_T *FASTLN_RESTRICT bias,
    const FASTLN_T *FASTLN_RESTRICT gamma, const FASTLN_T *FASTLN_RESTRICT beta, FASTLN_T *s,
    FASTLN_T *y, int64_t n_cols, double eps, double *mean_out, double *rstd_out)
{
    FASTLN_NAME(fastln_add_row)(x, residual, bias, s, n_cols);
    /* streaming = 0: y is written with ordinary stores (the values are the same either way). */
    FASTLN_NAME(fastln_layer_norm_forward_row)(s, gamma, beta, y, n_cols, eps, mean_out, rstd_out,
                                               0);
}

/* s = x + residual (+ bias), then y = RMSNorm(s) with rstd_out as in fastln_rms_norm_forward_row.
 * gamma and bias may be NULL. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_add_rms_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_T *residual, const FASTLN_T *FASTLN_RESTRICT bias,
    const FASTLN_T *FASTLN_RESTRICT gamma, FASTLN_T *s, FASTLN_T *y, int64_t n_cols, double eps,
    double *rstd_out)
{
    FASTLN_NAME(fastln_add_row)(x, residual, bias, s, n_cols);
    FASTLN_NAME(fastln_rms_norm_forward_row)(s, gamma, y, n_cols, eps, rstd_out);
}
