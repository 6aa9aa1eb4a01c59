/* GroupNorm's layout and per-group arithmetic, the same for every storage type: how a call is
 * cut into tasks, and the statistics of a group from the sums of its pieces. Plain double
 * arithmetic.
 *
 * Channels first (NCHW), the channels of a (sample, group) are one contiguous run of
 * (n_channels / n_groups) * n_spatial values - a LayerNorm row, except that gamma and beta are
 * constant over each channel's n_spatial values. The forward cuts the run into pieces of
 * FASTLN_GN_PIECE values (a multiple of FASTLN_SLOTS) and sums each piece with LayerNorm's
 * slot order; the backward sums each channel's n_spatial values in pieces of the same size.
 * Channels last (NHWC), each spatial position holds a row of every group's channels: a sample
 * is cut into blocks of spatial rows, and each block sums each channel down its rows in row
 * order (float64 as BatchNorm's rows layout does; the float32-compute types in float runs,
 * fastln/statistics.h). Either way the pieces' (blocks') sums are added in
 * piece order: the layout is a function of the shape alone, so the results are identical for
 * every thread count and every batch, also when a call has fewer groups than threads (the
 * pieces then go to the threads). */
#ifndef FASTLN_GROUP_NORM_H
#define FASTLN_GROUP_NORM_H

#include <float.h>
#include <math.h>
#include <stdint.h>

/* The channels-first backward by groups fetches dx for writing while it sums (unless dx is
 * streamed) from this many bytes of dy, x and dx (fastln/entries.h, gn_backward_groups_task). */
#define FASTLN_GN_FETCH_DX_BYTES (16 * 1024 * 1024)

/* Channels last fetches its streamed rows ahead as it writes them (fastln_rows_fetched_ahead)
 * only from this many bytes of x: smaller inputs are still in L3 after the statistics pass, and
 * there the fetch cost more than it saved (docs/performance.md, "BatchNorm's streamed rows
 * fetched ahead"). */
#define FASTLN_GN_FETCH_ROWS_BYTES (32 * 1024 * 1024)

/* Values per piece: large enough that a task's overhead vanishes, small enough that a single
 * group of an image the size of a diffusion UNet's first stage ([1, 128, 256, 256] in 32
 * groups: 262144 values) still makes work for several threads. */
#define FASTLN_GN_PIECE 32768

/* Channels last, the float32-compute types: the rows of a float run (fastln/statistics.h,
 * gn_float_block_sums). 16 rows of 512 float32 channels fit L1 as a chunk is read down them. */
#define FASTLN_GN_FLOAT_RUN 16

/* The doubles a group keeps in group_scratch: the forward's fastln_ln_stats fields (shift,
 * mean_shifted, var, rstd, rstd_scaled, exponent, mean, center, prescale, rare), the backward's
 * constants (mean, mean correction, rstd, mean(dx_hat), mean(dx_hat * x_hat)). */
#define FASTLN_GN_GROUP_FIELDS 10

/* The doubles per (sample, channel) in channel_scratch: the forward's channels-last write
 * constants (shift, center, scale, offset, then the same in float: fastln_gn_float_constants);
 * the backward's dgamma and dbeta terms and, channels last, the six write constants of
 * gn_backward_apply_rows, then the same six in float (three doubles' room:
 * fastln_gn_backward_float_constants). */
#define FASTLN_GN_CHANNEL_FIELDS 11
/* Of those, the channels-last forward's: four doubles, then four floats (two doubles' room). */
#define FASTLN_GN_FORWARD_CHANNEL_FIELDS 6

static inline int64_t fastln_gn_group_size(const fastln_gn_call *call)
{
    return call->n_channels / call->n_groups * call->n_spatial;
}

/* The pieces (or blocks) of a call, forward or backward. */
static inline void fastln_gn_layout(fastln_gn_call *call, int backward)
{
    if (call->channels_last) {
        call->piece = fastln_max(FASTLN_GN_PIECE / fastln_max(call->n_channels, 1), 1);
        call->n_pieces = (call->n_spatial + call->piece - 1) / call->piece;
    } else {
        const int64_t run = backward ? call->n_spatial : fastln_gn_group_size(call);
        call->piece = FASTLN_GN_PIECE;
        call->n_pieces = (run + FASTLN_GN_PIECE - 1) / FASTLN_GN_PIECE;
    }
    call->n_pieces = fastln_max(call->n_pieces, 1);
}

/* The tasks of the piece (block) phases. */
static inline int64_t fastln_gn_piece_tasks(const fastln_gn_call *call, int backward)
{
    if (call->channels_last) return call->n_samples * call->n_pieces;
    return call->n_samples * (backward ? call->n_channels : call->n_groups) * call->n_pieces;
}

/* The doubles of the partials: a piece's sum and sum of squares (channels first, forward); a
 * piece's sum(dy), sum(dy * d), sum(d) (channels first, backward); a block's per-channel shift
 * (or mean), then its two (three) per-channel sums (channels last). */
static inline int64_t fastln_gn_partials(const fastln_gn_call *call, int backward)
{
    const int64_t per_task = call->channels_last ? (backward ? 4 : 3) * call->n_channels
                                                 : (backward ? 3 : 2);
    return fastln_gn_piece_tasks(call, backward) * per_task;
}

static inline int64_t fastln_gn_channel_scratch(const fastln_gn_call *call, int backward)
{
    /* Channels first, the forward writes from its groups' statistics and the backward keeps
     * only the dgamma and dbeta terms; channels last, the forward's constants take
     * FASTLN_GN_FORWARD_CHANNEL_FIELDS: no more to allocate (and zero) for many channels. */
    const int64_t last_fields = backward ? FASTLN_GN_CHANNEL_FIELDS
                                         : FASTLN_GN_FORWARD_CHANNEL_FIELDS;
    const int64_t fields = call->channels_last ? last_fields : (backward ? 2 : 0);
    return fields * call->n_samples * call->n_channels;
}

/* The forward's channels-last float constants (head, tail, scale, offset per (sample,
 * channel): fastln/forward.h, gn_float_channel), in the channel fields the forward leaves free
 * after its four double ones. */
static inline float *fastln_gn_float_constants(const fastln_gn_call *call)
{
    return (float *)(call->channel_scratch + 4 * call->n_samples * call->n_channels);
}

/* The channels-last backward's float write constants (fastln/backward.h,
 * gn_backward_apply_rows_float), after its eight double fields. */
static inline float *fastln_gn_backward_float_constants(const fastln_gn_call *call)
{
    return (float *)(call->channel_scratch + 8 * call->n_samples * call->n_channels);
}

static inline int64_t fastln_gn_group_scratch(const fastln_gn_call *call)
{
    return FASTLN_GN_GROUP_FIELDS * call->n_samples * call->n_groups;
}

/* A group's statistics from its shifted sums, sum(d) and sum(d * d) with d = x - shift over its
 * n values: 1 and *stats filled when they are good, 0 when the group needs its statistics taken
 * again by the careful path (ln_statistics, channels first; gn_view_statistics, channels last):
 * a first value far from the mean (the two terms of the variance cancel by more than
 * FASTLN_MAX_CANCELLATION), sums beyond double's range, a NaN or an Inf, or a variance so
 * small (with an eps as small) that its squares may have underflowed. The careful path gives
 * the same statistics as these sums where both apply; it costs a few more passes. */
static inline int fastln_gn_statistics_from_sums(double shift, double sum, double sumsq,
                                                 double n, double eps, fastln_ln_stats *stats)
{
    const double mean_shifted = sum / n;
    double var = sumsq / n - mean_shifted * mean_shifted;
    if (!isfinite(mean_shifted) || !isfinite(var)
        || mean_shifted * mean_shifted > FASTLN_MAX_CANCELLATION * var)
        return 0;
    if (var < 0.0) var = 0.0; /* rounding only */
    if (var < FASTLN_TINY && eps < FASTLN_TINY) return 0;
    stats->shift = shift;
    stats->mean_shifted = mean_shifted;
    stats->mean = shift + mean_shifted;
    stats->var = var;
    stats->rstd = stats->rstd_scaled = 1.0 / sqrt(var + eps);
    stats->center = 0.0;
    stats->exponent = stats->prescale = stats->rare = 0;
    return 1;
}

/* A channels-last group's statistics from its blocks' double sums around its first value
 * (float64): each channel's block sums in block order, then the channels' in channel order; the
 * blocks are read one after the other for up to CHUNK channels at a time (a channel's sums are
 * 3 * C doubles apart from block to block). 1 and *stats filled as
 * fastln_gn_statistics_from_sums does; 0 when the group needs the careful path. */
static inline int fastln_gn_block_statistics(const double *blocks, int64_t C, int64_t n_blocks,
                                             int64_t first, int64_t per_group, double size,
                                             double eps, fastln_ln_stats *stats)
{
    enum { CHUNK = 64 };
    double sum = 0.0, sumsq = 0.0;
    for (int64_t chunk = first; chunk < first + per_group; chunk += CHUNK) {
        const int64_t width = fastln_min(CHUNK, first + per_group - chunk);
        double channel_sum[CHUNK] = {0}, channel_sumsq[CHUNK] = {0};
        for (int64_t b = 0; b < n_blocks; b++) {
            const double *block = blocks + 3 * C * b + chunk;
            for (int64_t k = 0; k < width; k++) {
                channel_sum[k] += block[C + k];
                channel_sumsq[k] += block[2 * C + k];
            }
        }
        for (int64_t k = 0; k < width; k++) {
            sum += channel_sum[k];
            sumsq += channel_sumsq[k];
        }
    }
    return fastln_gn_statistics_from_sums(blocks[first], sum, sumsq, size, eps, stats);
}

/* Whether a block's float sums of a group (sum(d), sum(d * d) over n values) keep their
 * relative accuracy in the block's variance: its mean near the shift, as for a LayerNorm row
 * (ln_float_statistics_from_sums). A block equal to its shift (0, 0) holds. */
static inline int fastln_gn_block_holds(double sum, double sumsq, double n)
{
    const double mean_shifted = sum / n;
    return isfinite(sum) && sumsq < INFINITY
           && mean_shifted * mean_shifted
                  <= FASTLN_MAX_FLOAT_CANCELLATION * (sumsq / n - mean_shifted * mean_shifted);
}

/* A channels-last group's statistics from its blocks' float sums (blocks[3 * C * b]: shifts,
 * sums, sums of squares; block b holds min(block_rows, n_spatial - b * block_rows) rows): each
 * block's mean and sum of squared deviations, combined in block order by the pairwise update
 * (Chan, Golub and LeVeque) in double, which has no cancellation whatever the group's offset. 1 and *stats filled when
 * every block holds (fastln_gn_block_holds), the sums are finite, the squares are not near
 * float's underflow (sum(d * d) >= n * FLT_MIN) and the variance is not tiny with an eps as
 * tiny; 0 when the group needs the careful path (gn_view_statistics). */
static inline int fastln_gn_float_block_statistics(const double *blocks, int64_t C,
                                                  int64_t n_blocks, int64_t block_rows,
                                                  int64_t n_spatial, int64_t first,
                                                  int64_t per_group, double eps,
                                                  fastln_ln_stats *stats)
{
    double count = 0.0, mean = 0.0, squares = 0.0, all_sumsq = 0.0;
    int holds = 1;
    for (int64_t b = 0; b < n_blocks; b++) {
        const double *block = blocks + 3 * C * b;
        const double n = (double)(fastln_min(block_rows, n_spatial - b * block_rows) * per_group);
        double sum = 0.0, sumsq = 0.0;
        for (int64_t c = first; c < first + per_group; c++) {
            sum += block[C + c];
            sumsq += block[2 * C + c];
        }
        holds &= fastln_gn_block_holds(sum, sumsq, n);
        all_sumsq += sumsq;
        const double block_mean = block[first] + sum / n;
        const double block_squares = fmax(sumsq - sum * (sum / n), 0.0);
        if (b == 0) {
            count = n;
            mean = block_mean;
            squares = block_squares;
            continue;
        }
        const double total = count + n, delta = block_mean - mean;
        mean += delta * (n / total);
        squares += block_squares + delta * delta * (count * n / total);
        count = total;
    }
    const double var = squares / count;
    if (!holds || !isfinite(mean) || !isfinite(var) || !(all_sumsq >= count * FLT_MIN)
        || (var < FASTLN_TINY && eps < FASTLN_TINY))
        return 0;
    stats->shift = stats->mean = mean;
    stats->mean_shifted = 0.0;
    stats->var = var;
    stats->rstd = stats->rstd_scaled = 1.0 / sqrt(var + eps);
    stats->center = 0.0;
    stats->exponent = stats->prescale = stats->rare = 0;
    return 1;
}

/* What a group's write pass scales its centred values by: rstd, except 0 for a constant group
 * with eps = 0 (x_hat is 0 there and y = beta, not 0 * Inf = NaN), as LayerNorm's rows. */
static inline double fastln_gn_x_hat_scale(const fastln_ln_stats *stats, double eps)
{
    return stats->var + eps == 0.0 ? 0.0 : stats->rstd;
}

/* Whether a group's write needs the rescaled path (rare.h): an rstd beyond double's range. */
static inline void fastln_gn_store_stats(double *fields, const fastln_ln_stats *stats)
{
    fields[0] = stats->shift;
    fields[1] = stats->mean_shifted;
    fields[2] = stats->var;
    fields[3] = stats->rstd;
    fields[4] = stats->rstd_scaled;
    fields[5] = (double)stats->exponent;
    fields[6] = stats->mean;
    fields[7] = stats->center;
    fields[8] = (double)stats->prescale;
    fields[9] = (double)stats->rare;
}

static inline fastln_ln_stats fastln_gn_load_stats(const double *fields)
{
    fastln_ln_stats stats;
    stats.shift = fields[0];
    stats.mean_shifted = fields[1];
    stats.var = fields[2];
    stats.rstd = fields[3];
    stats.rstd_scaled = fields[4];
    stats.exponent = (int)fields[5];
    stats.mean = fields[6];
    stats.center = fields[7];
    stats.prescale = (int)fields[8];
    stats.rare = (int)fields[9];
    return stats;
}

/* A group seen as n_rows rows of width values, rows `stride` values apart, for the rare paths
 * (fastln/rare.h): channels first, a row per channel (n_spatial values, stride n_spatial);
 * channels last, a row per spatial position (the group's channels, stride n_channels). The
 * channel of value (r, j) is first_channel + r, or first_channel + j channels last. */
typedef struct {
    int64_t n_rows, width, stride, first_channel;
    int channels_last;
} fastln_gn_view;

static inline int64_t fastln_gn_view_channel(const fastln_gn_view *view, int64_t r, int64_t j)
{
    return view->first_channel + (view->channels_last ? j : r);
}

#endif /* FASTLN_GROUP_NORM_H */
