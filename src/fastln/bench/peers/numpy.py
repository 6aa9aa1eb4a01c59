"""NumPy, two ways, for every operation: the code people commonly write, and the same maths written
well. NumPy has no threads of its own, so both run on one and are measured once for every thread
count (uses_threads=False).

    numpy-naive     x.mean, x.var and broadcasting, one temporary per term, as commonly written.
                    float16 and bfloat16 inputs are converted to float32 inside the timed call
                    (NumPy has no fast half arithmetic; bfloat16's is ml_dtypes' scalar loops),
                    computed there, and the full-size results rounded back to the input's format.
    numpy-inplace   in place into preallocated buffers, no avoidable temporaries; float32 and
                    float64 only.

The backwards start from the statistics a forward would have cached (mean and rstd per row, or
per feature for batch norm), computed untimed.
"""
import dataclasses

import numpy as np

from fastln.bench.operation import (
    EPS,
    FULL_DTYPES,
    HALF_DTYPES,
    MOMENTUM,
    Implementation,
    Prepared,
    RunningStatistics,
    as_arrays,
    batch_axes,
    numpy_dtype,
    output_mode,
    per_feature,
)


def _keep(array):
    return array


def _widen(array):
    return array.astype(np.float32)


def _naive(build, description):
    """The numpy-naive Implementation of build(inputs, widen) -> call, where widen is what the
    timed call applies to each input of x's size (a float32 conversion for the half formats)."""
    def prepare(inputs, num_threads, out_buffer):
        if inputs.dtype not in HALF_DTYPES:
            return Prepared(build(inputs, _keep), output_mode(out_buffer, False))
        # gamma, beta: one row each, converted untimed.
        small = {name: getattr(inputs, name).astype(np.float32) for name in ("gamma", "beta")
                 if getattr(inputs, name) is not None}
        call = build(dataclasses.replace(inputs, **small), _widen)
        half, size = numpy_dtype(inputs.dtype), inputs.x.size

        def rounded_back():
            return tuple(result.astype(half) if result.size == size else result
                         for result in as_arrays(call()))

        return Prepared(rounded_back, output_mode(out_buffer, False))

    return Implementation("numpy-naive", "numpy", prepare, description, uses_threads=False)


def _inplace(prepare, description):
    return Implementation("numpy-inplace", "numpy", prepare, description, uses_threads=False,
                          dtypes=FULL_DTYPES)


def _buffer_or_new(like, out_buffer):
    """() -> an output array: one preallocated array (--out-buffer), else a new one per call."""
    if out_buffer:
        buffer = np.empty_like(like)
        return lambda: buffer
    return lambda: np.empty_like(like)


def row_dots(a, b, out):
    """sum(a * b, axis=-1) of two 2-D arrays into out without an (n_rows, n_cols) temporary."""
    if hasattr(np, "vecdot"):  # NumPy >= 2.0, the faster of the two
        return np.vecdot(a, b, out=out)
    return np.einsum("ij,ij->i", a, b, out=out)


# --- LayerNorm and RMSNorm, naive ---------------------------------------------------------------

def naive_layer_norm(x, gamma, beta):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * gamma + beta


def naive_layer_norm_backward(dy, x, mean, rstd, gamma):
    x_hat = (x - mean) * rstd
    dgamma = (dy * x_hat).sum(axis=0)
    dbeta = dy.sum(axis=0)
    dx_hat = dy * gamma
    dx = rstd * (dx_hat - dx_hat.mean(axis=-1, keepdims=True)
                 - x_hat * (dx_hat * x_hat).mean(axis=-1, keepdims=True))
    return dx, dgamma, dbeta


def naive_rms_norm(x, gamma):
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + EPS) * gamma


def naive_rms_norm_backward(dy, x, rstd, gamma):
    x_hat = x * rstd
    dgamma = (dy * x_hat).sum(axis=0)
    dx_hat = dy * gamma
    dx = rstd * (dx_hat - x_hat * (dx_hat * x_hat).mean(axis=-1, keepdims=True))
    return dx, dgamma


def row_statistics(x):
    """Per-row mean and rstd as (n_rows, 1) columns in x's dtype (what a forward would cache)."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + EPS)
    return mean.astype(x.dtype), rstd.astype(x.dtype)


def row_rstd(x):
    """Per-row RMSNorm rstd as an (n_rows, 1) column in x's dtype."""
    return (1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS)).astype(x.dtype)


def _naive_forward(inputs, widen):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    return lambda: naive_layer_norm(widen(x), gamma, beta)


def _naive_backward(inputs, widen):
    x, dy, gamma = inputs.rows("x"), inputs.rows("dy"), inputs.gamma
    mean, rstd = row_statistics(widen(x))
    return lambda: naive_layer_norm_backward(widen(dy), widen(x), mean, rstd, gamma)


def _naive_rms_forward(inputs, widen):
    x, gamma = inputs.x, inputs.gamma
    return lambda: naive_rms_norm(widen(x), gamma)


def _naive_rms_backward(inputs, widen):
    x, dy, gamma = inputs.rows("x"), inputs.rows("dy"), inputs.gamma
    rstd = row_rstd(widen(x))
    return lambda: naive_rms_norm_backward(widen(dy), widen(x), rstd, gamma)


def _naive_add(norm):
    def build(inputs, widen):
        x, residual, gamma, beta = inputs.x, inputs.residual, inputs.gamma, inputs.beta
        params = (gamma,) if beta is None else (gamma, beta)

        def call():
            s = widen(x) + widen(residual)
            return norm(s, *params), s

        return call
    return build


# --- LayerNorm and RMSNorm, in place ------------------------------------------------------------

def inplace_layer_norm(n_rows, dtype, gamma, beta):
    """normalize(x, y) -> y: LayerNorm of the rows of a 2-D x into y, in place.

    One (n_rows,) buffer per statistic, made here and kept across calls like a training loop
    would.
    """
    mean = np.empty(n_rows, dtype)
    rstd = np.empty(n_rows, dtype)
    mean_column, rstd_column = mean[:, None], rstd[:, None]

    def normalize(x, y):
        np.mean(x, axis=1, out=mean)
        np.subtract(x, mean_column, out=y)             # y holds x - mean
        row_dots(y, y, out=rstd)                       # rstd holds sum((x - mean)^2)
        np.divide(rstd, x.shape[1], out=rstd)
        np.add(rstd, EPS, out=rstd)
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)
        y *= rstd_column
        y *= gamma
        y += beta
        return y

    return normalize


def inplace_rms_norm(n_rows, dtype, gamma):
    """normalize(x, y) -> y: RMSNorm of the rows of a 2-D x into y, in place (the (n_rows,) rstd
    buffer is made here and kept across calls)."""
    rstd = np.empty(n_rows, dtype)
    rstd_column = rstd[:, None]

    def normalize(x, y):
        row_dots(x, x, out=rstd)                       # rstd holds sum(x^2)
        np.divide(rstd, x.shape[1], out=rstd)
        np.add(rstd, EPS, out=rstd)
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)
        np.multiply(x, rstd_column, out=y)
        y *= gamma
        return y

    return normalize


def _normalizer(inputs, kind):
    n_rows = inputs.rows("x").shape[0]
    if kind == "layer_norm":
        return inplace_layer_norm(n_rows, inputs.x.dtype, inputs.gamma, inputs.beta)
    return inplace_rms_norm(n_rows, inputs.x.dtype, inputs.gamma)


def _inplace_norm(kind):
    def prepare(inputs, num_threads, out_buffer):
        x = inputs.rows("x")
        normalize, output = _normalizer(inputs, kind), _buffer_or_new(x, out_buffer)
        return Prepared(lambda: normalize(x, output()), output_mode(out_buffer, True))
    return prepare


def _inplace_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = inputs.rows("x"), inputs.rows("dy"), inputs.gamma
    n_rows, n_cols = x.shape
    mean, rstd = row_statistics(x)
    # dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * gamma needs two full
    # arrays at once: x_hat lives in dx, g in one scratch buffer kept across calls.
    scratch = np.empty_like(x)
    g_mean, g_xhat_mean = np.empty(n_rows, x.dtype), np.empty(n_rows, x.dtype)
    dgamma, dbeta = np.empty(n_cols, x.dtype), np.empty(n_cols, x.dtype)
    output = _buffer_or_new(x, out_buffer)

    def call():
        dx = x_hat = output()
        np.subtract(x, mean, out=x_hat)
        x_hat *= rstd
        np.einsum("ij,ij->j", dy, x_hat, out=dgamma)
        np.sum(dy, axis=0, out=dbeta)
        g = np.multiply(dy, gamma, out=scratch)
        np.mean(g, axis=1, out=g_mean)
        row_dots(g, x_hat, out=g_xhat_mean)
        np.divide(g_xhat_mean, n_cols, out=g_xhat_mean)
        x_hat *= g_xhat_mean[:, None]
        g -= g_mean[:, None]
        g -= x_hat
        np.multiply(g, rstd, out=dx)
        return dx, dgamma, dbeta

    return Prepared(call, output_mode(out_buffer, True))


def _inplace_rms_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = inputs.rows("x"), inputs.rows("dy"), inputs.gamma
    n_rows, n_cols = x.shape
    rstd = row_rstd(x)
    # dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * gamma and x_hat = x * rstd:
    # x_hat lives in dx, g in one scratch buffer kept across calls.
    scratch = np.empty_like(x)
    g_xhat_mean, dgamma = np.empty(n_rows, x.dtype), np.empty(n_cols, x.dtype)
    output = _buffer_or_new(x, out_buffer)

    def call():
        dx = x_hat = np.multiply(x, rstd, out=output())
        np.einsum("ij,ij->j", dy, x_hat, out=dgamma)
        g = np.multiply(dy, gamma, out=scratch)
        row_dots(g, x_hat, out=g_xhat_mean)
        np.divide(g_xhat_mean, n_cols, out=g_xhat_mean)
        x_hat *= g_xhat_mean[:, None]
        g -= x_hat
        np.multiply(g, rstd, out=dx)
        return dx, dgamma

    return Prepared(call, output_mode(out_buffer, True))


def _inplace_add(kind):
    def prepare(inputs, num_threads, out_buffer):
        x, residual = inputs.rows("x"), inputs.rows("residual")
        normalize = _normalizer(inputs, kind)
        y_output, s_output = _buffer_or_new(x, out_buffer), _buffer_or_new(x, out_buffer)

        def call():
            s = np.add(x, residual, out=s_output())
            return normalize(s, y_output()), s

        return Prepared(call, output_mode(out_buffer, True))
    return prepare


# --- batch norm ---------------------------------------------------------------------------------

def naive_batch_norm_train(x, gamma, beta, running_mean, running_var):
    axes = batch_axes(x.ndim)
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + EPS) * per_feature(gamma, x.ndim) + per_feature(beta, x.ndim)
    running_mean[:] = MOMENTUM * running_mean + (1 - MOMENTUM) * mean.ravel()
    running_var[:] = MOMENTUM * running_var + (1 - MOMENTUM) * var.ravel()
    return y


def naive_batch_norm_eval(x, gamma, beta, running_mean, running_var):
    ndim = x.ndim
    return ((x - per_feature(running_mean, ndim)) / np.sqrt(per_feature(running_var, ndim) + EPS)
            * per_feature(gamma, ndim) + per_feature(beta, ndim))


def naive_batch_norm_backward(dy, x, mean, rstd, gamma):
    axes = batch_axes(x.ndim)
    x_hat = (x - mean) * rstd
    dgamma = (dy * x_hat).sum(axis=axes)
    dbeta = dy.sum(axis=axes)
    dx_hat = dy * per_feature(gamma, x.ndim)
    dx = rstd * (dx_hat - dx_hat.mean(axis=axes, keepdims=True)
                 - x_hat * (dx_hat * x_hat).mean(axis=axes, keepdims=True))
    return dx, dgamma, dbeta


def feature_statistics(x):
    """Per-feature mean and rstd, broadcastable along axis 1, in x's dtype (a forward's cache)."""
    axes = batch_axes(x.ndim)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=axes, keepdims=True) + EPS)
    return mean.astype(x.dtype), rstd.astype(x.dtype)


def _feature_dot_subscripts(ndim):
    """einsum subscripts of sum(a * b) over the batch axes, per feature: 'ab,ab->b', ..."""
    letters = "abcdefghijklmnop"[:ndim]
    return f"{letters},{letters}->{letters[1]}"


def _naive_batch_norm_train(inputs, num_threads, out_buffer):
    running = RunningStatistics(inputs)

    def call():
        running.updates += 1
        return naive_batch_norm_train(inputs.x, inputs.gamma, inputs.beta, running.mean,
                                      running.var)

    return Prepared(call, output_mode(out_buffer, False), result_arrays=running.result_arrays)


def _naive_batch_norm_eval(inputs, num_threads, out_buffer):
    return Prepared(lambda: naive_batch_norm_eval(inputs.x, inputs.gamma, inputs.beta,
                                                  inputs.running_mean, inputs.running_var),
                    output_mode(out_buffer, False))


def _naive_batch_norm_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = inputs.x, inputs.dy, inputs.gamma
    mean, rstd = feature_statistics(x)
    return Prepared(lambda: naive_batch_norm_backward(dy, x, mean, rstd, gamma),
                    output_mode(out_buffer, False))


def _inplace_batch_norm_train(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    ndim, m = x.ndim, inputs.values_per_feature
    axes, feature_dot = batch_axes(ndim), _feature_dot_subscripts(ndim)
    running = RunningStatistics(inputs)
    running_mean, running_var = running.mean, running.var
    # Per-feature buffers, kept across calls like a training loop would.
    mean, var, scale, scratch = (np.empty(inputs.n_features, x.dtype) for _ in range(4))
    mean_f, scale_f, beta_f = (per_feature(v, ndim) for v in (mean, scale, beta))
    output = _buffer_or_new(x, out_buffer)

    def call():
        running.updates += 1
        y = output()
        np.mean(x, axis=axes, out=mean)
        np.subtract(x, mean_f, out=y)                  # y holds x - mean
        np.einsum(feature_dot, y, y, out=var)          # var holds sum((x - mean)^2)
        np.divide(var, m, out=var)
        np.multiply(running_mean, MOMENTUM, out=running_mean)
        np.add(running_mean, np.multiply(mean, 1.0 - MOMENTUM, out=scratch), out=running_mean)
        np.multiply(running_var, MOMENTUM, out=running_var)
        np.add(running_var, np.multiply(var, 1.0 - MOMENTUM, out=scratch), out=running_var)
        np.add(var, EPS, out=scale)
        np.sqrt(scale, out=scale)
        np.divide(gamma, scale, out=scale)             # scale = gamma * rstd
        y *= scale_f
        y += beta_f
        return y

    return Prepared(call, output_mode(out_buffer, True), result_arrays=running.result_arrays)


def _inplace_batch_norm_eval(inputs, num_threads, out_buffer):
    x, ndim = inputs.x, inputs.x.ndim
    # Per-feature scale = gamma / sqrt(running_var + eps): its buffer is kept across calls, its
    # values computed in each, as fastln's and the other peers' calls do.
    scale = np.empty(inputs.n_features, x.dtype)
    mean_f, scale_f, beta_f = (per_feature(v, ndim) for v in (inputs.running_mean, scale,
                                                               inputs.beta))
    output = _buffer_or_new(x, out_buffer)

    def call():
        y = np.subtract(x, mean_f, out=output())
        np.add(inputs.running_var, EPS, out=scale)
        np.sqrt(scale, out=scale)
        np.divide(inputs.gamma, scale, out=scale)
        y *= scale_f
        y += beta_f
        return y

    return Prepared(call, output_mode(out_buffer, True))


def _inplace_batch_norm_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = inputs.x, inputs.dy, inputs.gamma
    ndim, m = x.ndim, inputs.values_per_feature
    axes, feature_dot = batch_axes(ndim), _feature_dot_subscripts(ndim)
    mean, rstd = feature_statistics(x)
    # With g = dy * gamma, mean(g) = gamma * dbeta / m and mean(g * x_hat) = gamma * dgamma / m,
    # so dx = gamma * rstd * (dy - dbeta / m - x_hat * dgamma / m): x_hat lives in dx, no
    # full-size scratch is needed.
    dgamma, dbeta, scratch = (np.empty(inputs.n_features, x.dtype) for _ in range(3))
    scratch_f = per_feature(scratch, ndim)
    output = _buffer_or_new(x, out_buffer)

    def call():
        dx = x_hat = np.subtract(x, mean, out=output())
        x_hat *= rstd
        np.einsum(feature_dot, dy, x_hat, out=dgamma)
        np.sum(dy, axis=axes, out=dbeta)
        np.divide(dgamma, m, out=scratch)
        x_hat *= scratch_f                             # dx holds x_hat * dgamma / m
        np.subtract(dy, dx, out=dx)
        np.divide(dbeta, m, out=scratch)
        dx -= scratch_f
        np.multiply(gamma, rstd.ravel(), out=scratch)
        dx *= scratch_f
        return dx, dgamma, dbeta

    return Prepared(call, output_mode(out_buffer, True))


IMPLEMENTATIONS = {
    "forward": (
        _naive(_naive_forward, "x.mean / x.var and broadcasting"),
        _inplace(_inplace_norm("layer_norm"), "NumPy in place into preallocated buffers")),
    "backward": (
        _naive(_naive_backward, "broadcasting, one temporary per term"),
        _inplace(_inplace_backward, "NumPy in place, one preallocated scratch array")),
    "rms_forward": (
        _naive(_naive_rms_forward, "(x**2).mean and broadcasting"),
        _inplace(_inplace_norm("rms_norm"), "NumPy in place into preallocated buffers")),
    "rms_backward": (
        _naive(_naive_rms_backward, "broadcasting, one temporary per term"),
        _inplace(_inplace_rms_backward, "NumPy in place, one preallocated scratch array")),
    "add_layer_norm": (
        _naive(_naive_add(naive_layer_norm), "x + residual, then mean / var and broadcasting"),
        _inplace(_inplace_add("layer_norm"), "np.add into s, then LayerNorm in place")),
    "add_rms_norm": (
        _naive(_naive_add(naive_rms_norm), "x + residual, then (s**2).mean and broadcasting"),
        _inplace(_inplace_add("rms_norm"), "np.add into s, then RMSNorm in place")),
    "batch_norm_train": (
        Implementation("numpy-naive", "numpy", _naive_batch_norm_train,
                       "x.mean / x.var over the batch axes and broadcasting",
                       uses_threads=False, dtypes=FULL_DTYPES),
        _inplace(_inplace_batch_norm_train, "NumPy in place into preallocated buffers")),
    "batch_norm_eval": (
        Implementation("numpy-naive", "numpy", _naive_batch_norm_eval,
                       "broadcasting over the running statistics", uses_threads=False,
                       dtypes=FULL_DTYPES),
        _inplace(_inplace_batch_norm_eval, "NumPy in place into a preallocated buffer")),
    "batch_norm_backward": (
        Implementation("numpy-naive", "numpy", _naive_batch_norm_backward,
                       "broadcasting, one temporary per term", uses_threads=False,
                       dtypes=FULL_DTYPES),
        _inplace(_inplace_batch_norm_backward, "NumPy in place, no full-size scratch")),
}
