"""Every instruction-set variant of the kernels gives the same bits.

The kernels are compiled for AVX-512 (and AVX-512 with BF16, for bfloat16), AVX2 + F16C and the
x86-64 baseline (fastln/isa.h) and the best one the CPU runs is used; each variant works in its
native vector width, but does the same operations in the same order (no fused multiply-adds,
the same slot order for every sum). Here every variant this CPU runs is held to the baseline,
bit for bit, over the operations, the four storage types, odd widths and the value families the
kernels treat apart.
"""
import numpy as np
import pytest

import fastln
from fastln import _kernels

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a test extra
    ml_dtypes = None

VARIANTS = _kernels.instruction_sets()
BASELINE = VARIANTS[0]
DTYPES = [np.float16, np.float32, np.float64] + ([ml_dtypes.bfloat16] if ml_dtypes else [])
WIDTHS = (1, 5, 16, 31, 33, 64, 100, 777)


def _inputs(rng, shape, dtype, family):
    x = rng.standard_normal(shape)
    if family == "offset":
        x = x + 1e4
    elif family == "special":
        x[0, 0] = np.inf
        x[-1, -1] = np.nan
        x[shape[0] // 2] = 3.0  # a constant row
    param_dtype = np.float64 if dtype is np.float64 else np.float32
    gamma = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(param_dtype)
    beta = rng.standard_normal(shape[-1]).astype(param_dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.astype(dtype), rng.standard_normal(shape).astype(dtype),
                rng.standard_normal(shape).astype(dtype), gamma, beta)


def _outputs(x, residual, dy, gamma, beta, num_threads):
    """Every array the row operations return, forward and backward."""
    kw = dict(num_threads=num_threads)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, **kw)
    results = [y, cache.mean, cache.rstd, *fastln.layer_norm_backward(dy, cache, gamma, **kw)]
    y, cache = fastln.rms_norm_forward(x, gamma, **kw)
    results += [y, cache.rstd, *fastln.rms_norm_backward(dy, cache, gamma, **kw)]
    y, s, cache = fastln.add_layer_norm_forward(x, residual, gamma, beta, bias=beta, **kw)
    results += [y, s, cache.mean, cache.rstd]
    y, s, cache = fastln.add_rms_norm_forward(x, residual, gamma, **kw)
    results += [y, s, cache.rstd]
    return results


def _batch_norm_outputs(x, dy, axis, training, num_threads):
    n_features = x.shape[axis]
    running_mean, running_var = np.zeros(n_features), np.ones(n_features)
    y, cache = fastln.batch_norm_forward(x, None, None, running_mean, running_var,
                                         training=training, axis=axis, num_threads=num_threads)
    return [y, cache.mean, cache.rstd, running_mean, running_var,
            *fastln.batch_norm_backward(dy, cache, None, num_threads=num_threads)]


def _same_bits(expected, actual):
    assert len(expected) == len(actual)
    for index, (a, b) in enumerate(zip(expected, actual)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        a_bits = np.ascontiguousarray(a).reshape(-1).view(f"u{a.itemsize}")
        b_bits = np.ascontiguousarray(b).reshape(-1).view(f"u{b.itemsize}")
        differ = a_bits != b_bits
        # Two NaNs match whatever their payload: which NaN an operation passes on depends on
        # the operand order the compiler picked, not on the variant's arithmetic.
        with np.errstate(invalid="ignore"):
            both_nan = (np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64)))
        assert not (differ & ~both_nan.reshape(-1)).any(), f"output {index} differs"


def _in_each_variant(compute):
    results = {}
    try:
        for variant in VARIANTS:
            _kernels.use_instruction_set(variant)
            results[variant] = compute()
    finally:
        _kernels.use_instruction_set(None)
    return results


@pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU runs only the baseline variant: there "
                                              "is no other to compare it with")
@pytest.mark.parametrize("family", ["normal", "offset", "special"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("width", WIDTHS)
def test_row_operations_give_the_same_bits_in_every_variant(width, dtype, family):
    rng = np.random.default_rng(width)
    inputs = _inputs(rng, (40, width), dtype, family)
    for num_threads in (1, 2):
        results = _in_each_variant(lambda: _outputs(*inputs, num_threads))
        for variant in VARIANTS[1:]:
            _same_bits(results[BASELINE], results[variant])


@pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU runs only the baseline variant: there "
                                              "is no other to compare it with")
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, axis", [((70, 33), -1), ((4, 7, 5, 5), 1), ((3, 6, 40), 1)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_gives_the_same_bits_in_every_variant(dtype, shape, axis, training):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 100).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    results = _in_each_variant(lambda: _batch_norm_outputs(x, dy, axis, training, 2))
    for variant in VARIANTS[1:]:
        _same_bits(results[BASELINE], results[variant])


@pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU runs only the baseline variant: there "
                                              "is no other to compare it with")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, num_groups, channel_axis",
                         [((2, 6, 9, 7), 3, 1), ((2, 33, 17, 96), 32, -1), ((1, 70, 3, 20), 4, -1),
                          ((2, 5, 5, 512), 32, -1)])
def test_group_norm_gives_the_same_bits_in_every_variant(dtype, shape, num_groups, channel_axis):
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape) + 1e4
    x.reshape(-1)[7] = np.inf  # a rare group beside ordinary ones
    x, dy = x.astype(dtype), rng.standard_normal(shape).astype(dtype)

    def outputs():
        y, cache = fastln.group_norm_forward(x, num_groups, channel_axis=channel_axis,
                                             num_threads=2)
        return [y, cache.mean, cache.rstd, *fastln.group_norm_backward(dy, cache, num_threads=2)]

    results = _in_each_variant(outputs)
    for variant in VARIANTS[1:]:
        _same_bits(results[BASELINE], results[variant])


def test_the_variant_in_use_is_the_best_this_cpu_runs():
    assert _kernels.instruction_set() == VARIANTS[-1]
    with pytest.raises(ValueError, match="instruction set"):
        _kernels.use_instruction_set("no such variant")
