"""fastln.reference over the whole float64 range, held to exact rational arithmetic.

The reference is the oracle every kernel test trusts, so it must be right for every float64
input (issue: it returned zeros for rows above ~1e154). Rows of random values, of both signs
and with an offset now and then, are scaled by powers of two from the subnormals (where they
lose bits: the exact side takes the floats they became) up to DBL_MAX, together with eps from
0 to huge; gamma, beta and dy are scaled too. The exact side (fractions.Fraction: every float is
a rational, so means, variances and sums are exact; square roots to 160 bits) gives each true
result, and the reference must agree within a few units of float64 rounding of the terms it is
made of, or be +-inf exactly where the true value is beyond float64.

Allowances (u = 2**-53): a result made of terms of total size S may be off by 64 u S, and by
64 u kappa S where it goes through x - mean (kappa = (max|x| + |mean|) / std: the reference
centres with a float64 mean, rounded once), plus 4 units of the smallest subnormal (a result
rounded into the subnormals keeps fewer bits).
"""
import math
from fractions import Fraction

import numpy as np
import pytest

import fastln.reference as ref

U = Fraction(1, 2**53)
TINY = Fraction(1, 2**1074)             # the smallest subnormal
DBL_MAX = Fraction(float(np.finfo(np.float64).max))

# From rows whose values are all subnormal to rows reaching past 1e300; "max" rows touch DBL_MAX.
EXPONENTS = [-1075, -1070, -1060, -1040, -1022, -1000, -700, -511, -300, 0, 300, 511, 700,
             1000, 1020, "max"]
EPSILONS = [0.0, 5e-324, 1e-5, 1e300]


def fractions(values):
    return [Fraction(float(v)) for v in np.ravel(values)]


def sqrt_fraction(q, bits=160):
    """sqrt(q) for a Fraction q >= 0, within a relative 2**-bits."""
    if q == 0:
        return Fraction(0)
    shift = 2 * bits - (q.numerator.bit_length() - q.denominator.bit_length())
    shift += shift % 2
    scaled = (q.numerator << shift) // q.denominator if shift >= 0 else \
        q.numerator // (q.denominator << -shift)
    return Fraction(math.isqrt(scaled)) / Fraction(2) ** (shift // 2)


def to_float(value):
    """A Fraction rounded to float64 (+-inf beyond it)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def assert_exact(got, exact, allowed, what):
    """Each float of `got` within `allowed` (Fractions) of the exact Fraction, or +-inf where
    the exact value rounds beyond float64."""
    got = np.ravel(np.asarray(got, np.float64))
    assert len(got) == len(exact) == len(allowed), what
    for index, (value, true, slack) in enumerate(zip(got, exact, allowed)):
        slack = slack + 4 * TINY
        if math.isinf(value):
            assert abs(true) + slack >= DBL_MAX and (value > 0) == (true > 0), \
                f"{what}[{index}] = {value}, but the exact value is {to_float(true)!r}"
            continue
        assert math.isfinite(value), f"{what}[{index}] = {value}, exact {to_float(true)!r}"
        error = abs(Fraction(float(value)) - true)
        assert error <= slack, (f"{what}[{index}] = {value!r}, exact {to_float(true)!r}, "
                                f"error {to_float(error)!r} > allowed {to_float(slack)!r}")


class Exact:
    """One row (or BatchNorm feature) standardized exactly: x_hat = (x - mean) / root with
    root = sqrt(var + eps) (for RMSNorm: no mean, root = sqrt(mean(x**2) + eps))."""

    def __init__(self, row, eps, rms=False):
        values = fractions(row)
        n = len(values)
        self.mean = Fraction(0) if rms else sum(values, Fraction(0)) / n
        deviations = [v - self.mean for v in values]
        self.var = sum((d * d for d in deviations), Fraction(0)) / n
        self.root = sqrt_fraction(self.var + Fraction(eps))
        self.x_hat = [d / self.root for d in deviations]
        self.rstd = 1 / self.root
        largest = max(abs(v) for v in values)
        self.kappa = (largest + abs(self.mean)) / self.root

    def centred_slack(self, size):
        """The allowance for a result of terms of total size `size` that goes through x_hat."""
        return 64 * U * (1 + self.kappa) * size


def scaled_rows(rng, n_cols, exponents, offset=False):
    """One row per exponent: random values (with a large offset when `offset`) scaled by
    2**exponent, or up to DBL_MAX for "max"."""
    rows = []
    for exponent in exponents:
        base = rng.standard_normal(n_cols) + (8.0 if offset else 0.0)
        if exponent == "max":  # both signs, the largest at DBL_MAX (minus a little)
            base = base - base.mean()
            rows.append(base / np.abs(base).max() * np.finfo(np.float64).max * (1 - 2**-30))
        else:
            rows.append(np.ldexp(base, exponent))
    return np.array(rows)


def row_cases():
    return [pytest.param(eps, offset, id=f"eps{eps:g}-{'offset' if offset else 'centred'}")
            for eps in EPSILONS for offset in (False, True)]


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("eps, offset", row_cases())
def test_row_forward_over_the_whole_range(rms, eps, offset):
    rng = np.random.default_rng(1)
    x = scaled_rows(rng, 7, EXPONENTS, offset)
    gamma, beta = rng.standard_normal(7), rng.standard_normal(7)
    if rms:
        y, cache = ref.rms_norm_forward(x, gamma, eps)
    else:
        y, cache = ref.layer_norm_forward(x, gamma, beta, eps)
    g, b = fractions(gamma), fractions(np.zeros(7) if rms else beta)
    for n, row in enumerate(x):
        exact = Exact(row, eps, rms)
        expected = [gi * xh + bi for gi, xh, bi in zip(g, exact.x_hat, b)]
        sizes = [abs(gi) * (abs(xh) + 1) + abs(bi) for gi, xh, bi in zip(g, exact.x_hat, b)]
        assert_exact(y[n], expected, [exact.centred_slack(s) for s in sizes], f"y row {n}")
        assert_exact([cache.rstd[n]], [exact.rstd], [8 * U * exact.rstd], f"rstd row {n}")
        if not rms:
            size = max(abs(v) for v in fractions(row))
            assert_exact([cache.mean[n]], [exact.mean], [64 * U * size], f"mean row {n}")


def backward_exact(exact, dy, gamma, rms):
    """dx of one row, exactly, and the size of its terms (for the allowance)."""
    n = len(dy)
    dx_hat = [d * g for d, g in zip(dy, gamma)]
    projection = sum((d * xh for d, xh in zip(dx_hat, exact.x_hat)), Fraction(0)) / n
    size = sum((abs(d) * (1 + abs(xh)) for d, xh in zip(dx_hat, exact.x_hat)), Fraction(0))
    if rms:
        dx = [exact.rstd * (d - xh * projection) for d, xh in zip(dx_hat, exact.x_hat)]
    else:
        mean = sum(dx_hat, Fraction(0)) / n
        dx = [exact.rstd * (d - mean - xh * projection) for d, xh in zip(dx_hat, exact.x_hat)]
    return dx, [exact.rstd * (abs(d) * (1 + abs(xh)) + size / n)
                for d, xh in zip(dx_hat, exact.x_hat)]


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dy_exponent", [-1060, -500, 0, 500, 1000])
@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_row_backward_over_the_whole_range(rms, dy_exponent, eps):
    rng = np.random.default_rng(2)
    x = scaled_rows(rng, 5, EXPONENTS)
    dy = np.ldexp(rng.standard_normal(x.shape), dy_exponent)
    dy[::3] *= 2.0 ** -40            # rows of dy of other sizes too: the column sums mix them
    gamma = np.ldexp(rng.standard_normal(5), -3)
    if rms:
        _, cache = ref.rms_norm_forward(x, eps=eps)
        dx, dgamma = ref.rms_norm_backward(dy, cache, gamma)
    else:
        _, cache = ref.layer_norm_forward(x, eps=eps)
        dx, dgamma, dbeta = ref.layer_norm_backward(dy, cache, gamma)
    g = fractions(gamma)
    exact_dgamma = [Fraction(0)] * 5
    dgamma_size = [Fraction(0)] * 5
    for n, row in enumerate(x):
        exact = Exact(row, eps, rms)
        dy_row = fractions(dy[n])
        expected, sizes = backward_exact(exact, dy_row, g, rms)
        assert_exact(dx[n], expected, [exact.centred_slack(s) for s in sizes], f"dx row {n}")
        for i in range(5):
            exact_dgamma[i] += dy_row[i] * exact.x_hat[i]
            dgamma_size[i] += exact.centred_slack(abs(dy_row[i]) * (1 + abs(exact.x_hat[i])))
    assert_exact(dgamma, exact_dgamma, dgamma_size, "dgamma")
    if not rms:
        columns = [fractions(dy[:, i]) for i in range(5)]
        assert_exact(dbeta, [sum(c, Fraction(0)) for c in columns],
                     [64 * U * sum((abs(v) for v in c), Fraction(0)) for c in columns], "dbeta")


def feature_columns(rng, m):
    """x of shape (m, features): each column scaled as a row of scaled_rows."""
    return scaled_rows(rng, m, EXPONENTS).T.copy()


@pytest.mark.parametrize("eps", EPSILONS)
def test_batch_norm_training_over_the_whole_range(eps):
    rng = np.random.default_rng(3)
    x = feature_columns(rng, 6)
    n_features = x.shape[1]
    gamma, beta = rng.standard_normal(n_features), rng.standard_normal(n_features)
    # momentum 0 with zeros: the running statistics come back holding the batch's own
    running_mean, running_var = np.zeros(n_features), np.zeros(n_features)
    y, cache = ref.batch_norm_forward(x, gamma, beta, running_mean, running_var, training=True,
                                      momentum=0.0, eps=eps)
    dy = np.ldexp(rng.standard_normal(x.shape), 700)
    dx, dgamma, dbeta = ref.batch_norm_backward(dy, cache, gamma)
    for c in range(n_features):
        exact = Exact(x[:, c], eps)
        g, b = Fraction(float(gamma[c])), Fraction(float(beta[c]))
        assert_exact(y[:, c], [g * xh + b for xh in exact.x_hat],
                     [exact.centred_slack(abs(g) * (abs(xh) + 1) + abs(b))
                      for xh in exact.x_hat], f"y feature {c}")
        size = max(abs(v) for v in fractions(x[:, c]))
        assert_exact([cache.mean[c], running_mean[c]], [exact.mean] * 2, [64 * U * size] * 2,
                     f"mean feature {c}")
        assert_exact([cache.rstd[c]], [exact.rstd], [8 * U * exact.rstd], f"rstd feature {c}")
        assert_exact([running_var[c]], [exact.var], [exact.centred_slack(exact.var)],
                     f"batch variance feature {c}")
        dy_column = fractions(dy[:, c])
        expected, sizes = backward_exact(exact, dy_column, [g] * len(dy_column), rms=False)
        assert_exact(dx[:, c], expected, [exact.centred_slack(s) for s in sizes],
                     f"dx feature {c}")
        assert_exact([dgamma[c]], [sum((d * xh for d, xh in zip(dy_column, exact.x_hat)),
                                       Fraction(0))],
                     [exact.centred_slack(sum((abs(d) * (1 + abs(xh)) for d, xh
                                               in zip(dy_column, exact.x_hat)), Fraction(0)))],
                     f"dgamma feature {c}")
        assert_exact([dbeta[c]], [sum(dy_column, Fraction(0))],
                     [64 * U * sum((abs(d) for d in dy_column), Fraction(0))],
                     f"dbeta feature {c}")


@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e300])
def test_batch_norm_evaluation_over_the_whole_range(eps):
    """The running statistics at the extremes too: a running mean of the other sign from x
    near DBL_MAX (x - mean beyond float64), running variances from subnormal to DBL_MAX."""
    rng = np.random.default_rng(4)
    x = feature_columns(rng, 5)
    n_features = x.shape[1]
    centre = -np.sign(x[0]) * np.abs(x).max(axis=0) * 0.75
    running_var = np.ldexp(0.5 + rng.random(n_features),
                           rng.integers(-1074, 1023, n_features))
    running_var[-1] = np.finfo(np.float64).max
    gamma = rng.standard_normal(n_features)
    y, cache = ref.batch_norm_forward(x, gamma, None, centre, running_var, eps=eps)
    dy = np.ldexp(rng.standard_normal(x.shape), -600)
    dx, dgamma, _ = ref.batch_norm_backward(dy, cache, gamma)
    for c in range(n_features):
        mu, g = Fraction(float(centre[c])), Fraction(float(gamma[c]))
        root = sqrt_fraction(Fraction(float(running_var[c])) + Fraction(eps))
        x_hat = [(v - mu) / root for v in fractions(x[:, c])]
        assert_exact(y[:, c], [g * xh for xh in x_hat],
                     [64 * U * abs(g) * (abs(xh) + 1) for xh in x_hat], f"y feature {c}")
        assert_exact([cache.rstd[c]], [1 / root], [8 * U / root], f"rstd feature {c}")
        # The backward takes the cache's rstd, a float64: it is exact from there on.
        rstd = Fraction(float(cache.rstd[c])) if np.isfinite(cache.rstd[c]) else 1 / root
        dy_column = fractions(dy[:, c])
        assert_exact(dx[:, c], [d * g * rstd for d in dy_column],
                     [8 * U * abs(d * g * rstd) for d in dy_column], f"dx feature {c}")
        terms = [d * (v - mu) * rstd for d, v in zip(dy_column, fractions(x[:, c]))]
        assert_exact([dgamma[c]], [sum(terms, Fraction(0))],
                     [64 * U * sum((abs(t) for t in terms), Fraction(0))], f"dgamma feature {c}")


def test_the_reported_rows_above_1e154():
    """The issue's reproducer: [3e160, 1e160, -2e160] was normalized to zeros."""
    x = np.array([3e160, 1e160, -2e160])
    expected = [to_float(v) for v in Exact(x, 1e-5).x_hat]
    np.testing.assert_allclose(ref.layer_norm(x), expected, rtol=1e-15)
    np.testing.assert_allclose(ref.batch_norm(x[:, None], training=True)[:, 0], expected,
                               rtol=1e-15)
    np.testing.assert_allclose(ref.add_layer_norm(x / 2, x / 2)[0], expected, rtol=1e-15)
    rms = [to_float(v) for v in Exact(x, 1e-5, rms=True).x_hat]
    np.testing.assert_allclose(ref.rms_norm(x), rms, rtol=1e-15)
    np.testing.assert_allclose(ref.add_rms_norm(x / 2, x / 2)[0], rms, rtol=1e-15)


def test_the_sum_of_the_residual_add_is_rounded_once_also_at_the_extremes():
    rng = np.random.default_rng(5)
    x = scaled_rows(rng, 6, EXPONENTS)
    residual = scaled_rows(rng, 6, EXPONENTS[::-1])
    y, s = ref.add_layer_norm(x, residual, eps=0.0)
    for n in range(len(x)):
        sums = [a + b for a, b in zip(fractions(x[n]), fractions(residual[n]))]
        assert_exact(s[n], sums, [U * abs(v) for v in sums], f"s row {n}")
        if np.all(np.isfinite(s[n])):
            exact = Exact(s[n], 0.0)
            assert_exact(y[n], exact.x_hat, [exact.centred_slack(abs(xh) + 1)
                                             for xh in exact.x_hat], f"y row {n}")
