"""The readable reference: the lessons' LAYER_NORM_FORWARD / LAYER_NORM_BACKWARD, line by line.

A loop over rows in float64, written to be checked by eye, not to be fast. Every kernel in
fastln is tested against these functions. float16 and bfloat16 inputs are computed in float64
too and rounded once to their format (their gamma, beta and bias are taken as float32, and their
caches hold float32 statistics, as fastln's do). They take the same arguments and raise the same
errors as the fast ones (the argument checks are shared); ``num_threads`` is checked and ignored.
"""
import math

import numpy as np

from fastln._caches import BatchNormCache, LayerNormCache, RMSNormCache, check_cache
from fastln._checks import (
    as_array,
    check_batch_norm_args,
    check_eps,
    check_feature_param,
    check_input,
    check_num_threads,
    check_out,
    check_out_keeps_x,
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


def _as_rows_float64(array, n_rows, n_cols):
    return np.asarray(array, dtype=np.float64).reshape(n_rows, n_cols)


def _write_out(result, out):
    """result, or the caller's out holding it (written through a plain view of its memory)."""
    if out is None:
        return result
    plain_ndarray(out)[...] = result
    return out


def _standardize(row, eps):
    """The first four lines of the lesson's loop body: (x_hat, mu, std_inv) of one row."""
    if np.isfinite(row[0]) and np.all(row == row[0]):   # a constant row: deviations are all 0
        std_inv = math.inf if eps == 0 else 1 / math.sqrt(eps)   # (np.mean may round; and with
        return np.zeros_like(row), row[0], std_inv               #  eps = 0, x_hat is 0, not NaN)
    mu = np.mean(row)                           # scalar
    var = np.mean((row - mu) ** 2)              # population variance (divide by H, not H - 1)
    if var + eps == 0:                          # not constant, but the squares underflowed (a
        scale = 2.0 ** 600                      # subnormal spread, eps = 0): redo it exactly
        x_hat, mu, std_inv = _standardize(row * scale, eps)    # scaled; x_hat does not change
        return x_hat, mu / scale, std_inv * scale              # (std_inv may be inf: > 1e308)
    std_inv = 1 / math.sqrt(var + eps)          # eps inside the square root
    x_hat = (row - mu) * std_inv                # standardized row
    return x_hat, mu, std_inv


def layer_norm_forward(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None,
                       num_threads=None):
    """LAYER_NORM_FORWARD of the lesson, over x.shape[axis:]; returns (y, cache).

    The cache is a :class:`fastln.LayerNormCache` (x itself plus each row's mean and rstd), the
    same as fastln's, so caches work across the two implementations.
    """
    return _layer_norm_forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache=True)


def _layer_norm_forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache):
    x, dtype = check_input(x, allow_half=True)
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
            check_out_keeps_x(out, x)

    X = _as_rows_float64(x, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)
    beta = np.zeros(H) if beta is None else beta.astype(np.float64)

    y = np.zeros((N, H))
    means = np.zeros(N)
    std_invs = np.zeros(N)
    for n in range(N):
        row = X[n, :]                           # this example's H features
        x_hat, mu, std_inv = _standardize(row, eps)
        y[n, :] = gamma * x_hat + beta          # per-feature scale and shift
        means[n], std_invs[n] = mu, std_inv

    batch_shape = x.shape[:axis]
    result = _write_out(y.reshape(x.shape).astype(dtype), out)
    mean = means.astype(stats_dtype).reshape(batch_shape)
    rstd = std_invs.astype(stats_dtype).reshape(batch_shape)
    return result, LayerNormCache(x, mean, rstd, axis, eps, dtype)


def layer_norm(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """y of :func:`layer_norm_forward`; out may be x itself (in place)."""
    y, _ = _layer_norm_forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache=False)
    return y


def layer_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """LAYER_NORM_BACKWARD of the lesson; returns (dx, dgamma, dbeta)."""
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, "layer_norm")
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)          # dgamma, dbeta: float32 for float16/bfloat16
    N, H = rows_and_cols(cache.shape, cache.axis)
    normalized_shape = cache.shape[cache.axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, cache.shape, dtype)

    X = _as_rows_float64(cache.x, N, H)
    dY = _as_rows_float64(dy, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)

    dGamma = np.zeros(H)
    dBeta = np.zeros(H)
    dX = np.zeros((N, H))
    for n in range(N):
        # The cache holds x rather than the lesson's x_hat (O(rows) memory): recompute it.
        x_hat, _, std_inv = _standardize(X[n, :], cache.eps)
        dy_row = dY[n, :]
        dGamma += dy_row * x_hat
        dBeta += dy_row
        dx_hat = dy_row * gamma                 # chain through the scale
        sum_dxhat = np.sum(dx_hat)
        sum_dxhat_xhat = np.sum(dx_hat * x_hat)
        dX[n, :] = (std_inv / H) * (H * dx_hat - sum_dxhat - x_hat * sum_dxhat_xhat)

    dx = _write_out(dX.reshape(cache.shape).astype(dtype), out)
    return (dx, dGamma.reshape(normalized_shape).astype(stats_dtype),
            dBeta.reshape(normalized_shape).astype(stats_dtype))


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
    """(x_hat, std_inv) of one row: divide by the root-mean-square, no mean subtraction."""
    mean_square = np.mean(row ** 2)             # float64 squares, no mean subtraction
    if mean_square + eps == 0 and np.any(row):  # the squares underflowed (subnormal x, eps = 0):
        scale = 2.0 ** 600                      # redo it exactly scaled; x_hat does not change
        x_hat, std_inv = _rms_standardize(row * scale, eps)
        return x_hat, std_inv * scale           # (std_inv may be inf: > 1e308)
    if mean_square + eps == 0:                  # an all-zero row with eps = 0: x_hat is 0
        return np.zeros_like(row), math.inf
    std_inv = 1 / math.sqrt(mean_square + eps)
    return row * std_inv, std_inv


def _rms_norm(x, gamma, eps, axis, out, num_threads, keep_cache):
    x, dtype = check_input(x, allow_half=True)
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
            check_out_keeps_x(out, x)

    X = _as_rows_float64(x, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)

    y = np.zeros((N, H))
    std_invs = np.zeros(N)
    for n in range(N):
        x_hat, std_invs[n] = _rms_standardize(X[n, :], eps)
        y[n, :] = gamma * x_hat                  # scale only, no shift

    result = _write_out(y.reshape(x.shape).astype(dtype), out)
    rstd = std_invs.astype(stats_dtype).reshape(x.shape[:axis])
    return result, RMSNormCache(x, rstd, axis, eps, dtype)


def rms_norm_forward(x, gamma=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """RMSNorm (the lessons: "skips the mean subtraction and divides by the root-mean-square
    only"), over x.shape[axis:]; returns (y, cache) with a :class:`fastln.RMSNormCache`."""
    return _rms_norm(x, gamma, eps, axis, out, num_threads, keep_cache=True)


def rms_norm(x, gamma=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """y of :func:`rms_norm_forward` (out may be x itself here)."""
    return _rms_norm(x, gamma, eps, axis, out, num_threads, keep_cache=False)[0]


def rms_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """RMSNorm backward; returns (dx, dgamma).

    y = gamma * x_hat with x_hat = x * std_inv and std_inv = (mean(x**2) + eps)**-0.5, so
    d std_inv / dx = -std_inv**3 * x / H and, with dx_hat = dy * gamma,
        dx = std_inv * (dx_hat - x_hat * mean(dx_hat * x_hat)).
    """
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, "rms_norm")
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)
    N, H = rows_and_cols(cache.shape, cache.axis)
    normalized_shape = cache.shape[cache.axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    check_num_threads(num_threads)
    if out is not None:
        check_out(out, cache.shape, dtype)

    X = _as_rows_float64(cache.x, N, H)
    dY = _as_rows_float64(dy, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)

    dGamma = np.zeros(H)
    dX = np.zeros((N, H))
    for n in range(N):
        x_hat, std_inv = _rms_standardize(X[n, :], cache.eps)   # recomputed from x
        dy_row = dY[n, :]
        dGamma += dy_row * x_hat
        dx_hat = dy_row * gamma
        dX[n, :] = std_inv * (dx_hat - x_hat * np.mean(dx_hat * x_hat))

    dx = _write_out(dX.reshape(cache.shape).astype(dtype), out)
    return dx, dGamma.reshape(normalized_shape).astype(stats_dtype)


def _residual_sum(x, residual, bias, axis, out, sum_out):
    """s = x + residual (+ bias) in float64, rounded once to the output dtype; checks included.

    (float16/bfloat16: rounded to float32 and then to the half format, as NumPy's float16
    addition does and as fastln promises.)"""
    x, dtype = check_input(x, allow_half=True)
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
    s = np.asarray(x, dtype=np.float64) + residual.astype(dtype).astype(np.float64)
    if bias is not None:
        s = s + bias.astype(np.float64).reshape(x.shape[axis:])
    if is_half(dtype):
        s = s.astype(np.float32)
    return s.astype(dtype), axis


def add_layer_norm_forward(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1,
                           out=None, sum_out=None, num_threads=None):
    """s = x + residual (+ bias), then LAYER_NORM_FORWARD of s; returns (y, s, cache)."""
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


def _batch_statistics(column, eps):
    """(x_hat, mu, var, std_inv) of one feature over the batch (section 8.2.1-8.2.2)."""
    if np.isfinite(column[0]) and np.all(column == column[0]):   # constant: deviations all 0
        std_inv = math.inf if eps == 0 else 1 / math.sqrt(eps)   # (x_hat is 0, not NaN)
        return np.zeros_like(column), column[0], 0.0, std_inv
    mu = np.mean(column)                        # batch mean
    var = np.mean((column - mu) ** 2)           # biased batch variance (divide by m)
    std_inv = 1 / np.sqrt(var + eps)            # (float64: inf, not ZeroDivisionError, when
                                                #  var + eps underflows to 0)
    return (column - mu) * std_inv, mu, var, std_inv


def _batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis, out,
                num_threads, keep_cache):
    (x, dtype, axis, (_, C, _), gamma, beta, running_mean, running_var, training, alpha, eps,
     _) = check_batch_norm_args(x, gamma, beta, running_mean, running_var, training, momentum,
                                eps, axis, num_threads)
    if out is not None:
        check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(out, x)

    X = _feature_columns(x, axis)               # (m, C): the m values of each feature
    gamma = np.ones(C) if gamma is None else gamma
    beta = np.zeros(C) if beta is None else beta

    Y = np.zeros(X.shape)
    means, std_invs, batch_vars = np.zeros(C), np.zeros(C), np.zeros(C)
    for c in range(C):
        column = X[:, c]                        # feature c across the whole batch
        if training:
            x_hat, mu, batch_vars[c], std_inv = _batch_statistics(column, eps)
        else:                                   # population estimates from training
            mu = float(running_mean[c])
            variance = float(running_var[c]) + eps
            # A negative running_var has no square root: NaN, as the kernels give.
            std_inv = 1 / math.sqrt(variance) if variance >= 0 else math.nan
            x_hat = (column - mu) * std_inv
        Y[:, c] = gamma[c] * x_hat + beta[c]
        means[c], std_invs[c] = mu, std_inv

    if training and running_mean is not None:  # exponential moving averages, alpha on the old
        running_mean[...] = alpha * running_mean.astype(np.float64) + (1 - alpha) * means
        running_var[...] = alpha * running_var.astype(np.float64) + (1 - alpha) * batch_vars

    result = _write_out(_from_feature_columns(Y, x.shape, axis).astype(dtype), out)
    return result, BatchNormCache(x, means, std_invs, axis, eps, training, dtype)


def batch_norm_forward(x, gamma=None, beta=None, running_mean=None, running_var=None, *,
                       training=False, momentum=0.9, eps=1e-5, axis=-1, out=None,
                       num_threads=None):
    """The lesson's BatchNorm (section 8.2): per-feature statistics over the batch; returns
    (y, cache) and, in training mode, updates the running statistics in place (8.2.3)."""
    return _batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                       out, num_threads, keep_cache=True)


def batch_norm(x, gamma=None, beta=None, running_mean=None, running_var=None, *, training=False,
               momentum=0.9, eps=1e-5, axis=-1, out=None, num_threads=None):
    """y of :func:`batch_norm_forward` (out may be x itself here)."""
    return _batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                       out, num_threads, keep_cache=False)[0]


def batch_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """BatchNorm backward; returns (dx, dgamma, dbeta).

    Training: the same two-reduction identity as LAYER_NORM_BACKWARD, with the sums running
    down each feature's m values instead of along a row (x_hat recomputed from x). Evaluation:
    the statistics are constants, so dx = dy * gamma * std_inv.
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
        if cache.training:
            x_hat, _, _, std_inv = _batch_statistics(X[:, c], cache.eps)
        else:
            std_inv = float(cache.rstd[c])
            x_hat = (X[:, c] - cache.mean[c]) * std_inv
        dy_column = dY[:, c]
        dGamma[c] = np.sum(dy_column * x_hat)
        dBeta[c] = np.sum(dy_column)
        dx_hat = dy_column * gamma[c]
        if cache.training:
            dX[:, c] = (std_inv / m) * (m * dx_hat - np.sum(dx_hat)
                                        - x_hat * np.sum(dx_hat * x_hat))
        else:
            dX[:, c] = dx_hat * std_inv

    dx = _write_out(_from_feature_columns(dX, cache.shape, cache.axis).astype(dtype), out)
    return dx, dGamma.astype(dtype), dBeta.astype(dtype)
