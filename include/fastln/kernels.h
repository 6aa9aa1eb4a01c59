/* fastln's kernels: one dispatch table of task functions, [instruction set][storage type][task].
 *
 * Every operation is a few phases of tasks (fastln/entries.h) over a call structure that
 * describes the arrays: fastln_rows_call for the row normalizations (LayerNorm, RMSNorm, the
 * fused adds), fastln_bn_call for BatchNorm. The kernel templates (statistics, forward,
 * backward, rare rows) are written once and instantiated here for each storage type - float16,
 * bfloat16, float32, float64 (fastln/storage.h) - and each instruction-set variant - AVX-512,
 * AVX2 + F16C, and the x86-64 baseline (fastln/isa.h); fastln_select_tasks picks the variant the
 * CPU runs. The variants round identically (no fused multiply-adds, the same slot order for
 * every sum), so the choice changes the speed, never a result. */
#ifndef FASTLN_KERNELS_H
#define FASTLN_KERNELS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "fastln/simd.h"
#include "fastln/convert.h"

#define FASTLN_PASTE(a, b) a##b
#define FASTLN_XPASTE(a, b) FASTLN_PASTE(a, b)

/* Storage types: the dtype codes the Python layer passes (fastln/_kernels.pyx). Macros, not an
 * enum: fastln/storage.h tests them with #if. */
#define FASTLN_FLOAT16 0
#define FASTLN_BFLOAT16 1
#define FASTLN_FLOAT32 2
#define FASTLN_FLOAT64 3
#define FASTLN_N_STORAGES 4

/* Instruction-set variants. */
enum {
    FASTLN_ISA_BASE = 0,
    FASTLN_ISA_AVX2 = 1,
    FASTLN_ISA_AVX512 = 2,
    FASTLN_ISA_AVX512_BF16 = 3, /* AVX-512's kernels, with AVX512_BF16's rounding for bfloat16 */
    FASTLN_N_ISAS = 4
};

/* Tasks: the phases of every operation, in the order each operation runs them. */
enum {
    FASTLN_LAYER_NORM_FORWARD,          /* rows */
    FASTLN_RMS_NORM_FORWARD,            /* rows */
    FASTLN_ADD_LAYER_NORM_FORWARD,      /* rows */
    FASTLN_ADD_RMS_NORM_FORWARD,        /* rows */
    FASTLN_LAYER_NORM_BACKWARD,         /* row blocks, then FASTLN_COLUMN_SUMS */
    FASTLN_RMS_NORM_BACKWARD,           /* row blocks, then FASTLN_COLUMN_SUMS */
    FASTLN_COLUMN_SUMS,                 /* columns */
    FASTLN_BN_FIRST_VALUES,             /* training forward: one task */
    FASTLN_BN_STATISTICS,               /*   statistics tasks */
    FASTLN_BN_TRAIN_CONSTANTS,          /*   one task */
    FASTLN_BN_EVAL_CONSTANTS,           /* evaluation forward: one task */
    FASTLN_BN_APPLY,                    /* both modes: write units */
    FASTLN_BN_FINISH_RESCALED,          /* training, when *n_finish > 0: one task */
    FASTLN_BN_BACKWARD_SUMS,            /* backward: statistics tasks */
    FASTLN_BN_BACKWARD_CONSTANTS,       /*   one task */
    FASTLN_BN_BACKWARD_APPLY,           /*   write units */
    FASTLN_BN_BACKWARD_FEATURES,        /*   or, segments in one block: features */
    FASTLN_BN_BACKWARD_WAITING,         /*   then one task */
    FASTLN_BN_BACKWARD_FINISH_RESCALED, /*   when *n_finish > 0: one task */
    FASTLN_GN_FORWARD_GROUPS,           /* GroupNorm, channels first: groups */
    FASTLN_GN_STATISTICS,               /*   or, few groups: pieces (channels last: blocks) */
    FASTLN_GN_FINISH_STATISTICS,        /*   groups */
    FASTLN_GN_APPLY,                    /*   pieces (channels last: blocks) */
    FASTLN_GN_FINISH_RARE,              /*   channels last, when a group is rare: one task */
    FASTLN_GN_BACKWARD_GROUPS,          /* backward, channels first: groups */
    FASTLN_GN_BACKWARD_PARAMETERS,      /*   then one task */
    FASTLN_GN_BACKWARD_SUMS,            /*   or, few groups: pieces (channels last: blocks) */
    FASTLN_GN_BACKWARD_CONSTANTS,       /*   one task */
    FASTLN_GN_BACKWARD_APPLY,           /*   pieces (channels last: blocks) */
    FASTLN_WIDEN,                       /* the half types' conversions alone: elements */
    FASTLN_NARROW,
    FASTLN_N_TASKS
};

/* Tasks [begin, end) of a call. */
typedef void (*fastln_task)(const void *call, int64_t begin, int64_t end);

/* A row normalization: n_rows rows of n_cols storage elements, row after row. Parameters and
 * per-row statistics are in the parameter type (float for the 32-bit-and-narrower storage
 * types, double for float64). */
typedef struct {
    const void *x, *residual, *dy;   /* input rows (residual: the fused adds; dy: backwards) */
    void *y, *s, *dx;                /* output rows (s: the fused adds' sum) */
    const void *gamma, *beta, *bias; /* n_cols parameters each, or NULL */
    void *mean, *rstd;               /* n_rows statistics: written by forwards (NULL: not kept),
                                      * read by backwards */
    int64_t n_rows, n_cols;
    double eps;
    int streaming;                   /* outputs far larger than the caches: non-temporal stores */
    int rows_alone;                  /* backwards: each row's write pass on its own, not in
                                      * groups of FASTLN_BACKWARD_GROUP (dy, x and dx beyond the
                                      * cache: a row's two passes then overlap the next row's
                                      * loads better; docs/performance.md) */
    int fetch_ahead;                 /* backwards: each group's write pass fetches the next
                                      * group's lines (dy, x and dx beyond L2) */
    int add_in_float;                /* the fused adds: x + residual in float (the half
                                      * formats always; float32 with the call's arrays in
                                      * cache, else in double, which measured faster from L3) */
    /* Backwards: row blocks of rows_per_block rows, each with its own zeroed partial sums (one
     * or two rows of n_cols doubles: dgamma, then dbeta) and, for the float32-compute types, its
     * own zeroed float accumulators (two rows of n_cols); the column sums go to dgamma and dbeta
     * (n_cols parameters; dbeta NULL for RMSNorm). */
    int64_t n_blocks, rows_per_block;
    double *partials;
    float *accumulators;
    void *dgamma, *dbeta;
} fastln_rows_call;

/* A BatchNorm: x viewed as (n_outer, n_features, n_inner); per-feature arrays in double. */
typedef struct {
    const void *x, *dy;
    void *y, *dx;
    int64_t n_outer, n_features, n_inner;
    double eps;
    int training;
    int streaming; /* the rows layout's y (dx): non-temporal stores where rows are aligned */
    const double *gamma, *beta;               /* or NULL */
    const double *running_mean, *running_var; /* evaluation forward */
    double *mean, *var, *rstd;                /* the statistics normalized with (var: training) */
    void *dgamma_out, *dbeta_out;             /* backward: n_features parameters */
    /* the layout (fastln_bn_layout) */
    int64_t n_blocks, rows_per_block, n_chunks, n_units, rows_per_unit;
    /* scratch: per-feature doubles, the block partials (zeroed), and the rare features */
    double *shift, *center, *scale, *offset, *sum, *sumsq;
    double *sum_dy, *sum_dy_d, *sum_d, *dgamma, *correction, *k, *mean_dy, *coef;
    double *dx_mean; /* the dx pass's mean: the cache's, 0 for the features the rare path
                     * finishes (so that x - dx_mean cannot overflow while dy is copied) */
    float *float_constants; /* float32-compute types (else NULL): the float passes'
                             * per-feature constants, arrays of n_features: forward head,
                             * tail, scale, offset (fastln_bn_float_constants), backward head,
                             * tail, k, mean_dy, coef (fastln_bn_backward_float_constants) */
    double *partials;
    int64_t *finish, *n_finish;
    int64_t *waiting; /* bn_backward_features_task: 1 for the features the rare path may need */
} fastln_bn_call;

/* A GroupNorm: x is (n_samples, n_channels, n_spatial) (channels first, NCHW) or
 * (n_samples, n_spatial, n_channels) (channels last, NHWC), C-contiguous; statistics per
 * (sample, group) over the n_channels / n_groups channels of the group and every spatial
 * position. Parameters, statistics and dgamma/dbeta in the parameter type; the scratch is in
 * double, its layout fixed by fastln_gn_layout (the shape alone). */
typedef struct {
    const void *x, *dy;
    void *y, *dx;
    const void *gamma, *beta;         /* n_channels parameters each, or NULL */
    void *mean, *rstd;                /* (n_samples, n_groups): forwards write them (NULL: not
                                       * kept), backwards read them */
    void *dgamma, *dbeta;             /* backward: n_channels parameters each */
    int64_t n_samples, n_channels, n_groups, n_spatial;
    int channels_last, streaming;
    double eps;
    /* the layout: n_pieces pieces of `piece` elements per group (channels first, forward), per
     * channel (channels first, backward), or blocks of `piece` spatial rows per sample
     * (channels last) */
    int64_t n_pieces, piece;
    double *partials;                 /* per piece or block, zeroed (fastln_gn_partials) */
    double *channel_scratch;          /* per (sample, channel) (fastln_gn_channel_scratch) */
    double *group_scratch;            /* per (sample, group) (fastln_gn_group_scratch) */
    int64_t *rare;                    /* per (sample, group): done by a rare path (rare.h) */
} fastln_gn_call;

FASTLN_INLINE int64_t fastln_min(int64_t a, int64_t b) { return a < b ? a : b; }
FASTLN_INLINE int64_t fastln_max(int64_t a, int64_t b) { return a > b ? a : b; }

/* Write passes over rows from memory fetch into L2 the rows at least this far on, and at least
 * two rows on (LayerNorm's and RMSNorm's backward: prefetch_step_ahead; BatchNorm's streamed
 * rows: fastln_rows_fetched_ahead). */
#define FASTLN_FETCH_AHEAD_BYTES 8192

/* Backwards add their column sums over blocks of at least FASTLN_MIN_ROWS_PER_BLOCK rows, at
 * most FASTLN_MAX_BLOCKS blocks: a function of n_rows only, never of the thread count. */
#define FASTLN_MIN_ROWS_PER_BLOCK 32
#define FASTLN_MAX_BLOCKS 64

static inline int64_t fastln_row_blocks(int64_t n_rows)
{
    return fastln_min(fastln_max(n_rows / FASTLN_MIN_ROWS_PER_BLOCK, 1), FASTLN_MAX_BLOCKS);
}

/* How many rows from next_row a backward group's write pass fetches, when the call fetches
 * ahead: the next group's (of `group` rows), or with rows taken alone the next two (the next
 * one alone came too late for its first pass); those of them before task_end. */
static inline int64_t fastln_rows_to_fetch(const fastln_rows_call *call, int64_t group,
                                           int64_t next_row, int64_t task_end)
{
    const int64_t rows = call->rows_alone ? 2 : group;
    return call->fetch_ahead ? fastln_min(rows, task_end - next_row) : 0;
}

/* Column sums (BatchNorm's rows layout, channels-last GroupNorm) read a chunk of columns down a
 * run of run_rows rows, then the next chunk: `at` prefetches its own place two runs down, into
 * L2. Not into L1, which a run's rows can fill by themselves (16 rows of 512 float32 are 32 KiB):
 * lines brought there ahead evicted the run's own (docs/performance.md, "Channels-last
 * GroupNorm's two passes"). */
#define FASTLN_PREFETCH_RUNS_AHEAD(at, run_rows, row_stride)                                   \
    __builtin_prefetch((at) + 2 * (run_rows) * (row_stride), 0, 2)

/* The backward's float sums of n products dy * d stand (LayerNorm's rule, floats_hold_runs)
 * when sum(dy * d) is at least this: below, products under float's normal range, which keep
 * only a few bits, could matter. */
static inline double fastln_products_floor(double n)
{
    return n * n * FLT_MIN;
}

/* Whether a scale (an rstd) is one the float write passes take: float holds it, and its
 * products with ordinary values, well. Outside this range the passes compute in double. */
static inline int fastln_scale_fits_float(double scale)
{
    return scale > 1e-30 && scale < 1e30;
}

#include "fastln/batch_norm.h"

/* One row's LayerNorm statistics (ln_statistics): the sums are taken on x - shift (shift = x[0],
 * or the mean where those sums overflow; float32-compute rows: a float near the mean), and
 * x_hat = ((x - shift) - mean_shifted) * rstd, rstd = 1 / sqrt(var + eps); mean is the row's
 * mean. A row of the rare paths (rare set: an rstd beyond double's range - eps = 0 and a spread
 * below ~1e-308 -, deviations beyond double - values of both signs near DBL_MAX -) has
 * x_hat = fastln_ln_rare_x_hat instead: its deviations computed under 2^prescale, brought to
 * about 1 by 2^(exponent - prescale), less their mean center, times rstd_scaled; and
 * rstd = ldexp(rstd_scaled, exponent). var is 0 only for a constant row (and is in the scaled
 * units on the rescaled path). */
typedef struct {
    double shift, mean_shifted, mean, var, rstd, rstd_scaled, center;
    int exponent, prescale, rare;
} fastln_ln_stats;

/* A deviation of the rare paths: (x - shift) - mean_shifted, each term scaled by 2^prescale
 * first (exactly: prescale is 0 for rows with subnormal values). */
FASTLN_INLINE double fastln_ln_deviation(double x, const fastln_ln_stats *stats)
{
    return (ldexp(x, stats->prescale) - ldexp(stats->shift, stats->prescale))
           - ldexp(stats->mean_shifted, stats->prescale);
}

/* Whether rescaled statistics (ln_rescaled_statistics) need the rare paths' x_hat: the vector
 * passes cannot take a non-constant row (group) whose x_hat needs the scaled deviations - a
 * deviation beyond double, an rstd beyond double, or a mean whose rounding the scaled deviations
 * show above rounding noise (subnormal spreads). */
FASTLN_INLINE int fastln_ln_needs_rare(const fastln_ln_stats *stats)
{
    return stats->var > 0.0
           && (stats->prescale != 0 || isinf(stats->rstd) || fabs(stats->center) > 0x1p-26);
}

/* x_hat of the rare paths: the deviation brought to about 1, less the deviations' own mean. */
FASTLN_INLINE double fastln_ln_rare_x_hat(double x, const fastln_ln_stats *stats)
{
    return (ldexp(fastln_ln_deviation(x, stats), stats->exponent - stats->prescale)
            - stats->center) * stats->rstd_scaled;
}

/* The one-pass variance sum(d * d) / n - mean(d)^2 is recomputed around the mean when the two
 * terms cancel by more than this factor (4 bits): a row whose first element lies more than four
 * standard deviations from its mean. */
#define FASTLN_MAX_CANCELLATION 16.0

/* The float-run statistics (fastln/statistics.h) keep a row only when mean(d)^2 is at most this
 * fraction of the variance: sum(d * d) / n is then at most 1.5 variances, so the variance keeps
 * the float sums' relative accuracy. Their shift is the first block's mean, so ordinary rows
 * pass; the others are summed again around their mean. */
#define FASTLN_MAX_FLOAT_CANCELLATION 0.5

/* Variances (and eps) below this are taken again on rescaled values: their squares may have
 * underflowed in double. */
#define FASTLN_TINY 1e-250

/* A LayerNorm row's backward sums from its first pass, in double: sum(dx_hat), sum(dx_hat * d)
 * with d = x - mean, mean(d) (the correction to the cache's mean) and sum(dx_hat * x_hat); n_cols
 * is the row's length (the write pass may be given a piece of the row). */
typedef struct {
    double mean, rstd, mean_correction, total_dxhat, total_dxhat_d, total_dxhat_xhat;
    int64_t n_cols;
} fastln_ln_backward_sums;

/* The same as the float write pass uses them. */
typedef struct {
    float mean_head, mean_tail, rstd, mean_dxhat, mean_dxhat_xhat;
} fastln_ln_backward_floats;

/* An RMSNorm row's constants for the backward's write pass: x_hat = x * x_scale,
 * dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat)). */
typedef struct {
    double rstd, x_scale, mean_dxhat_xhat;
} fastln_rms_backward_row;

/* x_hat = x * fastln_rms_x_scale(rstd): rstd, except 0 for the Inf rstd of an all-zero row
 * with eps = 0 (x_hat is 0 there, as LayerNorm's for a constant row, not 0 * Inf = NaN). */
FASTLN_INLINE double fastln_rms_x_scale(double rstd)
{
    return rstd <= DBL_MAX ? rstd : (rstd == rstd ? 0.0 : rstd);
}

/* The rare paths' scaling of dx_hat = dy * gamma: max |dy| < 2^dy and max |gamma| < 2^gamma,
 * over their finite values (0 for a row of zeros, or no gamma). */
typedef struct {
    int dy, gamma;
} fastln_dx_hat_scale;

/* Backward rows go through the write pass in groups of this many (layer_norm_backward_rows,
 * rms_norm_backward_rows); the float32-compute types' float dgamma/dbeta accumulators are
 * folded into the double partial sums every FASTLN_ROWS_PER_FLUSH rows of a block (a multiple
 * of the group). */
#define FASTLN_BACKWARD_GROUP 4
#define FASTLN_ROWS_PER_FLUSH 16

/* The longest row whose forward write pass prefetches the next row (fastln/forward.h). */
#define FASTLN_PREFETCH_ROW_BYTES 8192

/* Whether a LayerNorm backward's sums stay in its float accumulators: one block of at most
 * FASTLN_ROWS_PER_FLUSH rows (small calls) folds them once into zeros, and rounding that fold
 * back to float gives the accumulators' own floats, so column_sums_task reads them directly.
 * (RMSNorm's backward has no accumulators: call->accumulators is NULL.) */
static inline int fastln_sums_stay_in_accumulators(const fastln_rows_call *call)
{
    return call->accumulators != NULL && call->n_blocks == 1
           && call->n_rows <= FASTLN_ROWS_PER_FLUSH;
}

/* partials += accumulators, and the accumulators cleared; a block's first flush sets the
 * partials instead (so they need no zeroing before): the same bits, as an accumulator that
 * started at +0.0 is never -0.0. */
FASTLN_INLINE void fastln_flush_accumulators(float *FASTLN_RESTRICT accumulators,
                                             double *FASTLN_RESTRICT partials, int64_t n,
                                             int first)
{
    if (first)
        for (int64_t j = 0; j < n; j++) {
            partials[j] = (double)accumulators[j];
            accumulators[j] = 0.0f;
        }
    else
        for (int64_t j = 0; j < n; j++) {
            partials[j] += (double)accumulators[j];
            accumulators[j] = 0.0f;
        }
}

#include "fastln/group_norm.h"

/* ---- the instruction-set variants ---------------------------------------------------------- */

#if FASTLN_X86_VARIANTS
/* Only the bfloat16 kernels differ with AVX512_BF16 (its rounding instruction, in
 * fastln/isa.h's store_bfloat16); the variant's other storage types are AVX-512's. */
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#define FASTLN_ISA_SUFFIX _v4bf16
#define FASTLN_ISA_BFLOAT16_ONLY 1
#include "fastln/isa.h"
#undef FASTLN_ISA_BFLOAT16_ONLY
#undef FASTLN_ISA_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define FASTLN_ISA_SUFFIX _v4
#include "fastln/isa.h"
#undef FASTLN_ISA_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FASTLN_ISA_SUFFIX _v3
#include "fastln/isa.h"
#undef FASTLN_ISA_SUFFIX
#pragma GCC pop_options
#endif

#define FASTLN_ISA_SUFFIX _base
#include "fastln/isa.h"
#undef FASTLN_ISA_SUFFIX

#define FASTLN_STORAGE_ROWS(suffix)                                                          \
    { fastln_tasks_f16##suffix, fastln_tasks_bf16##suffix, fastln_tasks_f32##suffix,         \
      fastln_tasks_f64##suffix }

static const fastln_task *const fastln_tasks_base[FASTLN_N_STORAGES] = FASTLN_STORAGE_ROWS(_base);
#if FASTLN_X86_VARIANTS
static const fastln_task *const fastln_tasks_v3[FASTLN_N_STORAGES] = FASTLN_STORAGE_ROWS(_v3);
static const fastln_task *const fastln_tasks_v4[FASTLN_N_STORAGES] = FASTLN_STORAGE_ROWS(_v4);
static const fastln_task *const fastln_tasks_v4bf16[FASTLN_N_STORAGES] = {
    fastln_tasks_f16_v4, fastln_tasks_bf16_v4bf16, fastln_tasks_f32_v4, fastln_tasks_f64_v4};
#endif

/* The best variant this CPU runs. */
static inline int fastln_cpu_isa(void)
{
#if FASTLN_X86_VARIANTS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return __builtin_cpu_supports("avx512bf16") ? FASTLN_ISA_AVX512_BF16 : FASTLN_ISA_AVX512;
    if (__builtin_cpu_supports("x86-64-v3")) return FASTLN_ISA_AVX2;
#endif
    return FASTLN_ISA_BASE;
}

/* The task of a storage type in a variant's dispatch table. isa must not exceed
 * fastln_cpu_isa(), nor storage and task their counts. */
static inline fastln_task fastln_task_for(int isa, int storage, int task)
{
#if FASTLN_X86_VARIANTS
    if (isa == FASTLN_ISA_AVX512_BF16) return fastln_tasks_v4bf16[storage][task];
    if (isa == FASTLN_ISA_AVX512) return fastln_tasks_v4[storage][task];
    if (isa == FASTLN_ISA_AVX2) return fastln_tasks_v3[storage][task];
#endif
    (void)isa;
    return fastln_tasks_base[storage][task];
}

#endif /* FASTLN_KERNELS_H */
