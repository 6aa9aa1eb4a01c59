"""The readable reference: LayerNorm, RMSNorm, the fused residual add, BatchNorm and GroupNorm
(InstanceNorm), forward and backward, written out formula by formula.

A loop over rows (over features for BatchNorm) in float64, written to be checked by eye, not to
be fast. Every kernel in fastln is tested against these functions. float16 and bfloat16 inputs
are computed in float64 too and rounded once to their format (their gamma, beta and bias are
taken as float32, and their caches hold float32 statistics, as fastln's do). They take the same
arguments and raise the same errors as the fast ones (the argument checks are shared);
``num_threads`` is checked and ignored.

Right over the whole float64 range. Each row (each feature of BatchNorm, each row of dy) is
first scaled by an exact power of two ``2**k`` that brings its largest ``|value|`` into
``[0.5, 1)``: its deviations and squares can then neither overflow (values near DBL_MAX) nor
underflow (subnormal values), and k is taken back out of the results. ``sqrt(var + eps)``, which
may be beyond float64 on the way, is kept as a float and a power of two (see _sqrt_of_sum). A
result that is itself beyond float64 is +-inf, its honest value; one below it is subnormal or 0.
NaN and Inf in a row make that row's results NaN (or inf), as in fastln.
"""
import math
from typing import NamedTuple

import numpy as np

from fastln._caches import (
    BatchNormCache,
    GroupNormCache,
    LayerNormCache,
    RMSNormCache,
    check_cache,
)
from fastln._checks import (
    as_array,
    check_batch_norm_args,
    check_channel_param,
    check_eps,
    check_feature_param,
    check_group_norm_args,
    check_input,
    check_num_threads,
    check_out,
    check_out_keeps_x,
    check_out_spares_running,
    check_param,
    check_residual,
    compute_dtype,
    feature_layout,
    is_half,
    normalize_axis,
    plain_ndarray,
    rows_and_cols,
)

__all__ = ["layer_norm", "layer_norm_forward", "layer_norm_backward"]


# =============================================================================================
# Exact scaling by powers of two
# =============================================================================================

def _ldexp(values, exponent):
    """values * 2**exponent, rounded once: +-inf beyond float64, subnormal or 0 below it."""
    with np.errstate(over="ignore", under="ignore"):
        return np.ldexp(values, exponent)


def _unit_exponent(values, axis=None):
    """k such that the largest |values * 2**k| lies in [0.5, 1) (per column with axis=0); 0
    where that largest value is 0, Inf or NaN (nothing to scale, or a NaN result anyway)."""
    largest = np.max(np.abs(values), axis=axis, initial=0.0)
    return -np.frexp(largest)[1]        # frexp: largest = mantissa * 2**e, mantissa in [0.5, 1)


def _sqrt_of_sum(terms):
    """(root, e) with sqrt(sum of m * 2**p over the (m, p) in terms) = root * 2**e.

    The terms are added in units of the largest of them (an even power of two, whose square
    root is a power of two), so the sum can neither overflow nor underflow, and root lies in
    [0.5, 1.5) unless the sum is 0 (root 0) or not a number (NaN; also for a negative sum).
    A term that underflows in those units is below the sum's last bit: it could not change it.
    """
    exponents = [math.frexp(m)[1] + p for m, p in terms if math.isfinite(m) and m != 0]
    top = max(exponents, default=0)
    top += top % 2
    total = sum(float(_ldexp(m, p - top)) for m, p in terms)
    root = math.sqrt(total) if total >= 0 else math.nan
    return root, top // 2


def _reciprocal(root, exponent):
    """1 / (root * 2**exponent): inf for a root of 0 (a zero variance with eps = 0)."""
    return math.inf if root == 0 else float(_ldexp(1.0 / root, -exponent))


def _divide(values, root):
    """values / root; a root of 0 gives +-inf (and NaN for 0 / 0), as 1 / 0 = inf would."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return values / root


# =============================================================================================
# LayerNorm
# =============================================================================================

class _Standardized(NamedTuple):
    """One row (or BatchNorm feature) standardized: x_hat = (x - mean) / sqrt(var + eps)."""
    x_hat: np.ndarray
    mean: float
    var: float          # the population variance (inf where it is beyond float64)
    root: float         # sqrt(var + eps) = root * 2**exponent (kept apart: it may be beyond
    exponent: int       #  float64, or below it)

    @property
    def std_inv(self):
        """1 / sqrt(var + eps) as a float (inf or 0 where it is beyond float64)."""
        return _reciprocal(self.root, self.exponent)


def _standardize(row, eps):
    """The mean, population variance and x_hat of one row, in the row scaled by 2**k."""
    if np.isfinite(row[0]) and np.all(row == row[0]):   # a constant row: deviations are all 0
        root, exponent = _sqrt_of_sum([(eps, 0)])          # (np.mean may round; and with eps = 0
        return _Standardized(np.zeros_like(row), row[0], 0.0, root, exponent)  # x_hat is 0)
    k = int(_unit_exponent(row))
    scaled = _ldexp(row, k)                     # exact; far smaller values round, invisibly
    with np.errstate(invalid="ignore", over="ignore"):  # Inf in the row: its results are NaN
        # np.mean may round past the largest value (and past DBL_MAX once scaled back):
        # the mean lies within the row.
        mu = np.clip(np.mean(scaled), np.min(scaled), np.max(scaled))
        # The rounded mean may be off by half an ulp of the values, as much as the spread of
        # a row like [1 + 2**-52, 1, 1]: the mean of the deviations from it is that error,
        # and taking it out of them centres the row (the kernels do the same).
        deviations = scaled - mu
        correction = np.mean(deviations)
        deviations = deviations - correction
        mu = np.clip(mu + correction, np.min(scaled), np.max(scaled))
        var = np.mean(deviations ** 2)          # population variance (divide by H, not H - 1)
    root, exponent = _sqrt_of_sum([(var, -2 * k), (eps, 0)])   # eps inside the square root
    x_hat = _ldexp(deviations / root, -k - exponent)           # the standardized row
    return _Standardized(x_hat, float(_ldexp(mu, -k)), float(_ldexp(var, -2 * k)), root,
                         exponent)


def _as_rows_float64(array, n_rows, n_cols):
    return np.asarray(array, dtype=np.float64).reshape(n_rows, n_cols)


def _write_out(result, out):
    """result, or the caller's out holding it (written through a plain view of its memory)."""
    if out is None:
        return result
    plain_ndarray(out)[...] = result
    return out


def _cast(values, dtype):
    """values in dtype; a value beyond the dtype's range becomes +-inf, its honest value."""
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def layer_norm_forward(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None,
                       num_threads=None):
    """LayerNorm over x.shape[axis:], ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` for
    each row; returns (y, cache).

    The cache is a :class:`fastln.LayerNormCache` (x itself plus each row's mean and rstd), the
    same as fastln's, so caches work across the two implementations.
    """
    return _layer_norm_forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache=True)


def _layer_norm_forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache):
    x, dtype = check_input(x)
    stats_dtype = compute_dtype(dtype)          # float32 for float16/bfloat16, else dtype
    axis = normalize_axis(axis, x.ndim)
    N, H = rows_and_cols(x.shape, axis)
    normalized_shape = x.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    beta = check_param(beta, "beta", normalized_shape, stats_dtype)
    eps = check_eps(eps)
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, x.shape, dtype)
        if keep_cache:                          # the cache keeps x: out must not overwrite it
            check_out_keeps_x(out, x, "layer_norm")

    X = _as_rows_float64(x, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)
    beta = np.zeros(H) if beta is None else beta.astype(np.float64)

    y = np.zeros((N, H))
    means = np.zeros(N)
    std_invs = np.zeros(N)
    for n in range(N):
        row = _standardize(X[n, :], eps)        # this example's H features
        with np.errstate(over="ignore", invalid="ignore"):  # y beyond float64 is +-inf
            y[n, :] = gamma * row.x_hat + beta  # per-feature scale and shift
        means[n], std_invs[n] = row.mean, row.std_inv

    batch_shape = x.shape[:axis]
    result = _write_out(_cast(y.reshape(x.shape), dtype), out)
    mean = _cast(means, stats_dtype).reshape(batch_shape)
    rstd = _cast(std_invs, stats_dtype).reshape(batch_shape)
    return result, LayerNormCache(x, mean, rstd, axis, eps, dtype)


def layer_norm(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """y of :func:`layer_norm_forward`; out may be x itself (in place)."""
    y, _ = _layer_norm_forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache=False)
    return y


def _check_row_backward(op, dy, cache, gamma, out, num_threads):
    """The checks of layer_norm_backward and rms_norm_backward (op), in fastln's order: dy, the
    cache, x.shape[axis:] not empty, gamma, num_threads, out. Returns dy as an array, the
    checked copy of the cache, gamma (flattened, in the statistics dtype; or None) and the
    (rows, columns) x is taken as."""
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, op)
    N, H = rows_and_cols(cache.shape, cache.axis)   # its error (an empty x.shape[axis:]) first
    gamma = check_param(gamma, "gamma", cache.shape[cache.axis:], compute_dtype(cache.dtype))
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, cache.shape, cache.dtype)
    return dy, cache, gamma, N, H


def _scaled_gamma(gamma, n):
    """(gamma * 2**g, g) with the largest |gamma * 2**g| in [0.5, 1) (gamma None: ones)."""
    gamma = np.ones(n) if gamma is None else gamma.astype(np.float64)
    g = int(_unit_exponent(gamma))
    return _ldexp(gamma, g), g


def layer_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """LayerNorm backward; returns (dx, dgamma, dbeta).

    With x_hat and std_inv = 1 / sqrt(var + eps) recomputed from x, and dx_hat = dy * gamma,
    per row of H values::

        dx = std_inv / H * (H * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat))
        dgamma = sum over rows of dy * x_hat,   dbeta = sum over rows of dy

    The backward is linear in dy: each row of dy (each column, for the sums over rows) is
    scaled by a power of two like x's rows, and the scale taken out of the results.
    """
    dy, cache, gamma, N, H = _check_row_backward("layer_norm", dy, cache, gamma, out, num_threads)
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)          # dgamma, dbeta: float32 for float16/bfloat16
    normalized_shape = cache.shape[cache.axis:]

    X = _as_rows_float64(cache.x, N, H)
    dY = _as_rows_float64(dy, N, H)
    gamma, g = _scaled_gamma(gamma, H)          # gamma * 2**g
    column_exponents = _unit_exponent(dY, axis=0)   # dgamma, dbeta in units of 2**-exponent

    dGamma = np.zeros(H)
    dBeta = np.zeros(H)
    dX = np.zeros((N, H))
    for n in range(N):
        # The cache holds x rather than x_hat (O(rows) memory): recompute it.
        row = _standardize(X[n, :], cache.eps)
        dy_columns = _ldexp(dY[n, :], column_exponents)
        with np.errstate(invalid="ignore"):     # NaN in dy (or x) makes its sums NaN
            dGamma += dy_columns * row.x_hat
            dBeta += dy_columns
            j = int(_unit_exponent(dY[n, :]))
            dx_hat = _ldexp(dY[n, :], j) * gamma    # chain through the scale: dy * gamma * 2**(j+g)
            sum_dxhat = np.sum(dx_hat)
            sum_dxhat_xhat = np.sum(dx_hat * row.x_hat)
            bracket = H * dx_hat - sum_dxhat - row.x_hat * sum_dxhat_xhat
            dX[n, :] = _ldexp(_divide(bracket / H, row.root), -row.exponent - j - g)

    dx = _write_out(_cast(dX.reshape(cache.shape), dtype), out)
    dGamma = _ldexp(dGamma, -column_exponents).reshape(normalized_shape)
    dBeta = _ldexp(dBeta, -column_exponents).reshape(normalized_shape)
    return dx, _cast(dGamma, stats_dtype), _cast(dBeta, stats_dtype)


# =============================================================================================
# The normalization family: RMSNorm, residual add + norm, BatchNorm (same conventions as above:
# the caches are fastln's own, so caches work across the two implementations)
# =============================================================================================

__all__ += [
    "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "add_layer_norm", "add_layer_norm_forward", "add_rms_norm", "add_rms_norm_forward",
    "batch_norm", "batch_norm_forward", "batch_norm_backward",
]


def _rms_standardize(row, eps):
    """x_hat = x / sqrt(mean(x**2) + eps) of one row (no mean subtraction), in the row
    scaled by 2**k; mean and var are not used."""
    k = int(_unit_exponent(row))
    scaled = _ldexp(row, k)
    with np.errstate(over="ignore", invalid="ignore"):  # Inf in the row: its results are NaN
        mean_square = np.mean(scaled ** 2)      # float64 squares, no mean subtraction
    root, exponent = _sqrt_of_sum([(mean_square, -2 * k), (eps, 0)])
    if root == 0:                               # an all-zero row with eps = 0: x_hat is 0
        return _Standardized(np.zeros_like(row), 0.0, 0.0, 0.0, 0)
    with np.errstate(invalid="ignore"):
        x_hat = _ldexp(scaled / root, -k - exponent)
    return _Standardized(x_hat, 0.0, 0.0, root, exponent)


def _rms_norm(x, gamma, eps, axis, out, num_threads, keep_cache):
    x, dtype = check_input(x)
    stats_dtype = compute_dtype(dtype)
    axis = normalize_axis(axis, x.ndim)
    N, H = rows_and_cols(x.shape, axis)
    normalized_shape = x.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    eps = check_eps(eps)
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(out, x, "rms_norm")

    X = _as_rows_float64(x, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)

    y = np.zeros((N, H))
    std_invs = np.zeros(N)
    for n in range(N):
        row = _rms_standardize(X[n, :], eps)
        with np.errstate(over="ignore", invalid="ignore"):
            y[n, :] = gamma * row.x_hat         # scale only, no shift
        std_invs[n] = row.std_inv

    result = _write_out(_cast(y.reshape(x.shape), dtype), out)
    rstd = _cast(std_invs, stats_dtype).reshape(x.shape[:axis])
    return result, RMSNormCache(x, rstd, axis, eps, dtype)


def rms_norm_forward(x, gamma=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """RMSNorm over x.shape[axis:], ``y = gamma * x / sqrt(mean(x**2) + eps)`` for each row
    (no mean subtraction, no shift); returns (y, cache) with a :class:`fastln.RMSNormCache`."""
    return _rms_norm(x, gamma, eps, axis, out, num_threads, keep_cache=True)


def rms_norm(x, gamma=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """y of :func:`rms_norm_forward` (out may be x itself here)."""
    return _rms_norm(x, gamma, eps, axis, out, num_threads, keep_cache=False)[0]


def rms_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """RMSNorm backward; returns (dx, dgamma).

    y = gamma * x_hat with x_hat = x * std_inv and std_inv = (mean(x**2) + eps)**-0.5, so
    d std_inv / dx = -std_inv**3 * x / H and, with dx_hat = dy * gamma,
        dx = std_inv * (dx_hat - x_hat * mean(dx_hat * x_hat)),
        dgamma = sum over rows of dy * x_hat
    (dy scaled by powers of two as in :func:`layer_norm_backward`).
    """
    dy, cache, gamma, N, H = _check_row_backward("rms_norm", dy, cache, gamma, out, num_threads)
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)
    normalized_shape = cache.shape[cache.axis:]

    X = _as_rows_float64(cache.x, N, H)
    dY = _as_rows_float64(dy, N, H)
    gamma, g = _scaled_gamma(gamma, H)
    column_exponents = _unit_exponent(dY, axis=0)

    dGamma = np.zeros(H)
    dX = np.zeros((N, H))
    for n in range(N):
        row = _rms_standardize(X[n, :], cache.eps)  # recomputed from x
        with np.errstate(invalid="ignore"):
            dGamma += _ldexp(dY[n, :], column_exponents) * row.x_hat
            j = int(_unit_exponent(dY[n, :]))
            dx_hat = _ldexp(dY[n, :], j) * gamma    # dy * gamma * 2**(j + g)
            bracket = dx_hat - row.x_hat * np.mean(dx_hat * row.x_hat)
            dX[n, :] = _ldexp(_divide(bracket, row.root), -row.exponent - j - g)

    dx = _write_out(_cast(dX.reshape(cache.shape), dtype), out)
    dGamma = _ldexp(dGamma, -column_exponents).reshape(normalized_shape)
    return dx, _cast(dGamma, stats_dtype)


def _residual_sum(x, residual, bias, axis, out, sum_out):
    """s = x + residual (+ bias) in float64, rounded once to the output dtype; checks included.

    (float16/bfloat16: rounded to float32 and then to the half format, as NumPy's float16
    addition does and as fastln promises.) A sum beyond the output dtype is +-inf."""
    x, dtype = check_input(x)
    residual = check_residual(residual, x)
    axis = normalize_axis(axis, x.ndim)
    rows_and_cols(x.shape, axis)
    bias = check_param(bias, "bias", x.shape[axis:], compute_dtype(dtype))
    if out is not None:
        check_out(out, x.shape, dtype)
    if sum_out is not None:
        check_out(sum_out, x.shape, dtype, name="sum_out")
    if (out is not None and sum_out is not None
            and np.may_share_memory(plain_ndarray(out), plain_ndarray(sum_out))):
        raise ValueError("out and sum_out overlap: they must be different arrays")
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.asarray(x, dtype=np.float64) + _cast(residual, dtype).astype(np.float64)
        if bias is not None:
            s = s + bias.astype(np.float64).reshape(x.shape[axis:])
    if is_half(dtype):
        s = _cast(s, np.float32)
    return _cast(s, dtype), axis


def add_layer_norm_forward(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1,
                           out=None, sum_out=None, num_threads=None):
    """s = x + residual (+ bias), then the LayerNorm forward of s; returns (y, s, cache)."""
    s, axis = _residual_sum(x, residual, bias, axis, out, sum_out)
    # Normalize the sum before writing anything: the normalization's own arguments (gamma,
    # beta, eps, num_threads) are checked there, and a bad one must leave sum_out untouched.
    y, cache = layer_norm_forward(s, gamma, beta, eps, axis=axis, num_threads=num_threads)
    s = _write_out(s, sum_out)
    cache = LayerNormCache(plain_ndarray(s), cache.mean, cache.rstd, axis, cache.eps, cache.dtype)
    return _write_out(y, out), s, cache


def add_layer_norm(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                   sum_out=None, num_threads=None):
    """(y, s) of :func:`add_layer_norm_forward`."""
    y, s, _ = add_layer_norm_forward(x, residual, gamma, beta, eps, bias=bias, axis=axis, out=out,
                                     sum_out=sum_out, num_threads=num_threads)
    return y, s


def add_rms_norm_forward(x, residual, gamma=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                         sum_out=None, num_threads=None):
    """s = x + residual (+ bias), then the RMSNorm forward of s; returns (y, s, cache)."""
    s, axis = _residual_sum(x, residual, bias, axis, out, sum_out)
    # As in add_layer_norm_forward: every check before anything is written.
    y, cache = rms_norm_forward(s, gamma, eps, axis=axis, num_threads=num_threads)
    s = _write_out(s, sum_out)
    cache = RMSNormCache(plain_ndarray(s), cache.rstd, axis, cache.eps, cache.dtype)
    return _write_out(y, out), s, cache


def add_rms_norm(x, residual, gamma=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                 sum_out=None, num_threads=None):
    """(y, s) of :func:`add_rms_norm_forward`."""
    y, s, _ = add_rms_norm_forward(x, residual, gamma, eps, bias=bias, axis=axis, out=out,
                                   sum_out=sum_out, num_threads=num_threads)
    return y, s


def _feature_columns(array, axis):
    """(m, C) float64: column c holds every value of feature c (the feature axis moved last)."""
    moved = np.moveaxis(np.asarray(array, dtype=np.float64), axis, -1)
    m = int(np.prod(moved.shape[:-1], dtype=np.int64))
    return moved.reshape(m, moved.shape[-1])


def _from_feature_columns(columns, shape, axis):
    moved_shape = shape[:axis] + shape[axis + 1:] + (shape[axis],)
    return np.moveaxis(columns.reshape(moved_shape), -1, axis)


def _centred(column, centre):
    """(column - centre) * 2**k and k, with k bringing the largest of |column| and |centre|
    into [0.5, 1): the difference of values near -DBL_MAX and DBL_MAX does not overflow."""
    k = int(_unit_exponent(np.append(column, centre)))
    with np.errstate(invalid="ignore"):         # Inf - Inf: NaN, as in fastln
        return _ldexp(column, k) - _ldexp(centre, k), k


def _moving_average(alpha, running, batch):
    """alpha * running + (1 - alpha) * batch in float64: alpha weighs the old value (momentum).

    A term of weight 0 is left out whatever its value, as 0 * inf would be NaN: alpha = 1
    keeps the running value (also next to a batch variance beyond float64, inf), alpha = 0
    takes the batch's (also in place of an old value that is not finite)."""
    if alpha == 1:
        return running.astype(np.float64)
    if alpha == 0:
        return np.asarray(batch, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return alpha * running.astype(np.float64) + (1 - alpha) * batch


def _batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis, out,
                num_threads, keep_cache):
    (x, dtype, axis, (_, C, _), gamma, beta, running_mean, running_var, training, alpha, eps,
     _) = check_batch_norm_args(x, gamma, beta, running_mean, running_var, training, momentum,
                                eps, axis, num_threads)
    if out is not None:
        check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(out, x, "batch_norm")
        check_out_spares_running(out, running_mean, running_var, training)

    X = _feature_columns(x, axis)               # (m, C): the m values of each feature
    gamma = np.ones(C) if gamma is None else gamma
    beta = np.zeros(C) if beta is None else beta

    Y = np.zeros(X.shape)
    means, std_invs, batch_vars = np.zeros(C), np.zeros(C), np.zeros(C)
    for c in range(C):
        column = X[:, c]                        # feature c across the whole batch
        if training:                            # its mean and biased variance (divide by m)
            feature = _standardize(column, eps)
            x_hat, mu, batch_vars[c], std_inv = (feature.x_hat, feature.mean, feature.var,
                                                 feature.std_inv)
        else:                                   # the population estimates from training
            mu = float(running_mean[c])
            # A negative running_var + eps has no square root: NaN, as the kernels give.
            root, exponent = _sqrt_of_sum([(float(running_var[c]), 0), (eps, 0)])
            deviations, k = _centred(column, mu)            # (x - mu) * 2**k
            x_hat = _ldexp(_divide(deviations, root), -k - exponent)
            std_inv = _reciprocal(root, exponent)
        with np.errstate(over="ignore", invalid="ignore"):
            Y[:, c] = gamma[c] * x_hat + beta[c]
        means[c], std_invs[c] = mu, std_inv

    if training and running_mean is not None:  # exponential moving averages, alpha on the old
        running_mean[...] = _moving_average(alpha, running_mean, means)
        running_var[...] = _moving_average(alpha, running_var, batch_vars)

    result = _write_out(_cast(_from_feature_columns(Y, x.shape, axis), dtype), out)
    return result, BatchNormCache(x, means, std_invs, axis, eps, training, dtype)


def batch_norm_forward(x, gamma=None, beta=None, running_mean=None, running_var=None, *,
                       training=False, momentum=0.9, eps=1e-5, axis=-1, out=None,
                       num_threads=None):
    """BatchNorm, ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` per feature (the index
    along axis), its mean and biased variance taken over every other axis; returns (y, cache).

    Training mode normalizes with the batch statistics and updates the running statistics in
    place: ``running = momentum * running + (1 - momentum) * batch``; evaluation mode
    normalizes with the running statistics."""
    return _batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                       out, num_threads, keep_cache=True)


def batch_norm(x, gamma=None, beta=None, running_mean=None, running_var=None, *, training=False,
               momentum=0.9, eps=1e-5, axis=-1, out=None, num_threads=None):
    """y of :func:`batch_norm_forward` (out may be x itself here)."""
    return _batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                       out, num_threads, keep_cache=False)[0]


def batch_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """BatchNorm backward; returns (dx, dgamma, dbeta).

    Training: the same two-reduction identity as :func:`layer_norm_backward`, with the sums
    running down each feature's m values instead of along a row (x_hat recomputed from x).
    Evaluation: the statistics are constants, so dx = dy * gamma * std_inv. In both,
    dgamma = sum(dy * x_hat) and dbeta = sum(dy) per feature. Each feature's dy and gamma are
    scaled by powers of two (the backward is linear in them) and the scales taken out again.
    """
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, "batch_norm")
    dtype = cache.dtype
    _, C, _ = feature_layout(cache.shape, cache.axis)
    gamma = check_feature_param(gamma, "gamma", C, dtype)
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, cache.shape, dtype)

    X = _feature_columns(cache.x, cache.axis)
    dY = _feature_columns(dy, cache.axis)
    gamma = np.ones(C) if gamma is None else gamma
    m = dY.shape[0]

    dGamma, dBeta = np.zeros(C), np.zeros(C)
    dX = np.zeros(dY.shape)
    for c in range(C):
        j = int(_unit_exponent(dY[:, c]))
        g = int(_unit_exponent(gamma[c]))
        dy_column = _ldexp(dY[:, c], j)         # dy * 2**j
        dx_hat = dy_column * _ldexp(gamma[c], g)    # dy * gamma * 2**(j + g)
        with np.errstate(invalid="ignore", over="ignore"):
            if cache.training:
                feature = _standardize(X[:, c], cache.eps)
                dGamma[c] = _ldexp(np.sum(dy_column * feature.x_hat), -j)
                bracket = (m * dx_hat - np.sum(dx_hat)
                           - feature.x_hat * np.sum(dx_hat * feature.x_hat)) / m
                dX[:, c] = _ldexp(_divide(bracket, feature.root), -feature.exponent - j - g)
            else:
                # x_hat = (x - mean) * std_inv: centred and std_inv split as mantissa * 2**e,
                # so that neither the difference nor the product overflows on the way.
                deviations, k = _centred(X[:, c], float(cache.mean[c]))
                std_inv, e = math.frexp(float(cache.rstd[c]))     # (inf, 0) for inf
                x_hat_scaled = deviations * std_inv               # x_hat * 2**(k - e)
                dGamma[c] = _ldexp(np.sum(dy_column * x_hat_scaled), e - k - j)
                dX[:, c] = _ldexp(dx_hat * std_inv, e - j - g)
        dBeta[c] = _ldexp(np.sum(dy_column), -j)

    dx = _write_out(_cast(_from_feature_columns(dX, cache.shape, cache.axis), dtype), out)
    return dx, _cast(dGamma, compute_dtype(dtype)), _cast(dBeta, compute_dtype(dtype))


# =============================================================================================
# GroupNorm and InstanceNorm: LayerNorm of each (sample, group of channels), then a scale and
# shift per channel
# =============================================================================================

__all__ += [
    "group_norm", "group_norm_forward", "group_norm_backward",
    "instance_norm", "instance_norm_forward", "instance_norm_backward",
]


def _channels_first(array, channel_axis):
    """array as float64 (N, C, S): channels second, the spatial positions flattened."""
    array = np.moveaxis(np.asarray(array, dtype=np.float64), channel_axis, 1)
    spatial = int(np.prod(array.shape[2:], dtype=np.int64))  # (-1 cannot size an empty array)
    return array.reshape(array.shape[0], array.shape[1], spatial)


def _from_channels_first(values, shape, channel_axis):
    """The inverse of _channels_first for an array of `shape`."""
    moved = list(shape)
    moved.insert(1, moved.pop(channel_axis))
    return np.moveaxis(values.reshape(moved), 1, channel_axis)


def _group_norm(name, x, num_groups, gamma, beta, eps, channel_axis, out, num_threads,
                keep_cache):
    x, dtype, layout, gamma, beta, eps, _ = check_group_norm_args(
        x, num_groups, gamma, beta, eps, channel_axis, num_threads)
    stats_dtype = compute_dtype(dtype)
    if out is not None:
        check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(out, x, name)
    N, C, G = layout.n_samples, layout.n_channels, layout.n_groups
    per_group = C // G
    X = _channels_first(x, layout.channel_axis)           # (N, C, S)
    gamma = np.ones(C) if gamma is None else gamma.astype(np.float64)
    beta = np.zeros(C) if beta is None else beta.astype(np.float64)

    Y = np.zeros(X.shape)
    means = np.zeros((N, G))
    std_invs = np.zeros((N, G))
    for n in range(N):
        for g in range(G):
            channels = slice(g * per_group, (g + 1) * per_group)
            group = _standardize(X[n, channels, :].ravel(), eps)  # its channels x positions
            x_hat = group.x_hat.reshape(per_group, X.shape[2])
            with np.errstate(over="ignore", invalid="ignore"):
                Y[n, channels, :] = gamma[channels, None] * x_hat + beta[channels, None]
            means[n, g], std_invs[n, g] = group.mean, group.std_inv

    result = _write_out(_cast(_from_channels_first(Y, x.shape, layout.channel_axis), dtype), out)
    cache = GroupNormCache(x, _cast(means, stats_dtype), _cast(std_invs, stats_dtype), G,
                           layout.channel_axis, eps, dtype)
    return result, cache


def group_norm_forward(x, num_groups, gamma=None, beta=None, eps=1e-5, *, channel_axis=1,
                       out=None, num_threads=None):
    """GroupNorm, ``y = gamma_c * (x - mean) / sqrt(var + eps) + beta_c``, with the mean and
    population variance of each (sample, group of C / num_groups channels) over its channels and
    every spatial position; returns (y, cache), the cache a :class:`fastln.GroupNormCache`."""
    return _group_norm("group_norm", x, num_groups, gamma, beta, eps, channel_axis, out,
                       num_threads, keep_cache=True)


def group_norm(x, num_groups, gamma=None, beta=None, eps=1e-5, *, channel_axis=1, out=None,
               num_threads=None):
    """y of :func:`group_norm_forward`; out may be x itself (in place)."""
    return _group_norm("group_norm", x, num_groups, gamma, beta, eps, channel_axis, out,
                       num_threads, keep_cache=False)[0]


def _group_norm_backward(name, dy, cache, gamma, out, num_threads):
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, "group_norm", name)
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)
    C = cache.shape[cache.channel_axis]
    gamma = check_channel_param(gamma, "gamma", C, stats_dtype)
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, cache.shape, dtype)

    X = _channels_first(cache.x, cache.channel_axis)      # (N, C, S)
    dY = _channels_first(dy, cache.channel_axis)
    N, G = X.shape[0], cache.num_groups
    per_group = C // G
    gamma, g_exp = _scaled_gamma(gamma, C)                  # gamma * 2**g_exp
    channel_exponents = _unit_exponent(dY.transpose(1, 0, 2).reshape(C, N * X.shape[2]).T, axis=0)

    dGamma = np.zeros(C)
    dBeta = np.zeros(C)
    dX = np.zeros(X.shape)
    for n in range(N):
        for g in range(G):
            channels = slice(g * per_group, (g + 1) * per_group)
            # The cache holds x rather than x_hat (O(groups) memory): recompute it.
            group = _standardize(X[n, channels, :].ravel(), cache.eps)
            x_hat = group.x_hat.reshape(per_group, X.shape[2])
            H = x_hat.size
            dy_group = dY[n, channels, :]
            with np.errstate(invalid="ignore"):     # NaN in dy (or x) makes its sums NaN
                dy_channels = _ldexp(dy_group, channel_exponents[channels, None])
                dGamma[channels] += np.sum(dy_channels * x_hat, axis=1)
                dBeta[channels] += np.sum(dy_channels, axis=1)
                j = int(_unit_exponent(dy_group))
                # dy * gamma_c * 2**(j + g_exp): the chain through each channel's scale
                dx_hat = _ldexp(dy_group, j) * gamma[channels, None]
                bracket = H * dx_hat - np.sum(dx_hat) - x_hat * np.sum(dx_hat * x_hat)
                dX[n, channels, :] = _ldexp(_divide(bracket / H, group.root),
                                            -group.exponent - j - g_exp)

    dx = _write_out(_cast(_from_channels_first(dX, cache.shape, cache.channel_axis), dtype), out)
    dGamma = _ldexp(dGamma, -channel_exponents)
    dBeta = _ldexp(dBeta, -channel_exponents)
    return dx, _cast(dGamma, stats_dtype), _cast(dBeta, stats_dtype)


def group_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """GroupNorm backward; returns (dx, dgamma, dbeta). Per (sample, group) of H values, with
    x_hat recomputed from x and dx_hat = dy * gamma_c, the LayerNorm identity::

        dx = std_inv / H * (H * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat))
        dgamma_c = sum of dy * x_hat over channel c's values,   dbeta_c = sum of dy over them
    """
    return _group_norm_backward("group_norm", dy, cache, gamma, out, num_threads)


def instance_norm_forward(x, gamma=None, beta=None, eps=1e-5, *, channel_axis=1, out=None,
                          num_threads=None):
    """InstanceNorm: :func:`group_norm_forward` with one group per channel."""
    return _group_norm("instance_norm", x, None, gamma, beta, eps, channel_axis, out,
                       num_threads, keep_cache=True)


def instance_norm(x, gamma=None, beta=None, eps=1e-5, *, channel_axis=1, out=None,
                  num_threads=None):
    """y of :func:`instance_norm_forward`."""
    return _group_norm("instance_norm", x, None, gamma, beta, eps, channel_axis, out,
                       num_threads, keep_cache=False)[0]


def instance_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """InstanceNorm backward: :func:`group_norm_backward` of a cache with one group per
    channel."""
    return _group_norm_backward("instance_norm", dy, cache, gamma, out, num_threads)
