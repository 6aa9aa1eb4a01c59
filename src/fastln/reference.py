"""The readable reference: the lessons' LAYER_NORM_FORWARD / LAYER_NORM_BACKWARD, line by line.

A loop over rows in float64, written to be checked by eye, not to be fast. Every kernel in
fastln is tested against these functions. They take the same arguments and raise the same
errors as the fast ones (the argument checks are shared); ``num_threads`` is checked and ignored.
"""
import math
from dataclasses import dataclass

import numpy as np

from fastln._layer_norm import check_cache
from fastln._validation import (
    as_array,
    check_eps,
    check_input,
    check_out,
    check_param,
    normalize_axis,
    resolve_num_threads,
    rows_and_cols,
)

__all__ = ["layer_norm", "layer_norm_forward", "layer_norm_backward", "ReferenceLayerNormCache"]


@dataclass
class ReferenceLayerNormCache:
    """Per-row (x_hat, std_inv, mu) as the lesson's forward stores them, plus the call's shape."""

    x_hat: np.ndarray  # (n_rows, n_cols), float64
    mean: np.ndarray   # x.shape[:axis], y's dtype
    rstd: np.ndarray   # x.shape[:axis], y's dtype
    x: np.ndarray      # the forward's input (kept only for its shape)
    axis: int
    eps: float
    op = "layer_norm"

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.mean.dtype


def _as_rows_float64(array, n_rows, n_cols):
    return np.asarray(array, dtype=np.float64).reshape(n_rows, n_cols)


def layer_norm_forward(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None,
                       num_threads=None):
    """LAYER_NORM_FORWARD of the lesson, over x.shape[axis:]; returns (y, cache)."""
    x, dtype = check_input(x)
    axis = normalize_axis(axis, x.ndim)
    N, H = rows_and_cols(x.shape, axis)
    normalized_shape = x.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, dtype)
    beta = check_param(beta, "beta", normalized_shape, dtype)
    eps = check_eps(eps)
    resolve_num_threads(num_threads)
    if out is not None:
        check_out(out, x.shape, dtype)

    X = _as_rows_float64(x, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)
    beta = np.zeros(H) if beta is None else beta.astype(np.float64)

    y = np.zeros((N, H))
    x_hat_rows = np.zeros((N, H))
    means = np.zeros(N)
    std_invs = np.zeros(N)
    for n in range(N):
        row = X[n, :]                           # this example's H features
        mu = np.mean(row)                       # scalar
        var = np.mean((row - mu) ** 2)          # population variance (divide by H, not H - 1)
        std_inv = 1 / math.sqrt(var + eps)      # eps inside the square root
        x_hat = (row - mu) * std_inv            # standardized row
        y[n, :] = gamma * x_hat + beta          # per-feature scale and shift
        x_hat_rows[n], means[n], std_invs[n] = x_hat, mu, std_inv

    batch_shape = x.shape[:axis]
    result = y.reshape(x.shape).astype(dtype)
    if out is not None:
        out[...] = result
        result = out
    cache = ReferenceLayerNormCache(
        x_hat=x_hat_rows,
        mean=means.astype(dtype).reshape(batch_shape),
        rstd=std_invs.astype(dtype).reshape(batch_shape),
        x=x,
        axis=axis,
        eps=eps,
    )
    return result, cache


def layer_norm(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """y of :func:`layer_norm_forward`."""
    y, _ = layer_norm_forward(x, gamma, beta, eps, axis=axis, out=out, num_threads=num_threads)
    return y


def layer_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """LAYER_NORM_BACKWARD of the lesson; returns (dx, dgamma, dbeta)."""
    dy = as_array(dy, "dy")
    check_cache(cache, dy, "layer_norm")
    dtype = cache.dtype
    N, H = rows_and_cols(cache.shape, cache.axis)
    normalized_shape = cache.shape[cache.axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, dtype)
    resolve_num_threads(num_threads)
    if out is not None:
        check_out(out, cache.shape, dtype)

    dY = _as_rows_float64(dy, N, H)
    gamma = np.ones(H) if gamma is None else gamma.astype(np.float64)
    std_invs = np.asarray(cache.rstd, dtype=np.float64).reshape(N)

    dGamma = np.zeros(H)
    dBeta = np.zeros(H)
    dX = np.zeros((N, H))
    for n in range(N):
        x_hat, std_inv = cache.x_hat[n], std_invs[n]
        dy_row = dY[n, :]
        dGamma += dy_row * x_hat
        dBeta += dy_row
        dx_hat = dy_row * gamma                 # chain through the scale
        sum_dxhat = np.sum(dx_hat)
        sum_dxhat_xhat = np.sum(dx_hat * x_hat)
        dX[n, :] = (std_inv / H) * (H * dx_hat - sum_dxhat - x_hat * sum_dxhat_xhat)

    dx = dX.reshape(cache.shape).astype(dtype)
    if out is not None:
        out[...] = dx
        dx = out
    return (dx, dGamma.reshape(normalized_shape).astype(dtype),
            dBeta.reshape(normalized_shape).astype(dtype))
