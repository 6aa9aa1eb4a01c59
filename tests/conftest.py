"""Shared helpers for fastln's tests: input layouts, tolerances by dtype, snapshots of inputs.

The helpers are plain functions (imported with ``from conftest import ...``) because the
parametrizations need them at collection time; the fixtures at the bottom wrap the few that
tests take as arguments.
"""
import zlib

import numpy as np
import pytest

try:  # hypothesis is a test extra: register a fast, reproducible profile when it is present
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "fastln",
        max_examples=60,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile("fastln")
except ImportError:  # pragma: no cover - the property tests importorskip hypothesis themselves
    pass

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is optional (the "half" extra)
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None
# the half formats as parameters: bfloat16 skipped without ml_dtypes
HALF = [pytest.param(np.dtype(np.float16), id="float16"),
        pytest.param(BFLOAT16, id="bfloat16", marks=needs_ml_dtypes)]

DTYPES = (np.float32, np.float64)
THREADS = (1, 2, 3)

# Agreement expected between a kernel and the float64 reference (the issue's "How it will be
# checked": about 2e-5 relative in float32, 1e-11 in float64). The absolute part is scaled by
# the size of the compared quantity (see assert_close), so it only matters for elements that are
# small because of cancellation.
RTOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-11}
ATOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-11}


# --------------------------------------------------------------------------------------------
# Layouts: each returns an array with exactly the values of `a` (same shape, same dtype up to
# byte order) but a different memory layout. `a` is never modified.
# --------------------------------------------------------------------------------------------

def _contiguous(a):
    return np.ascontiguousarray(a).copy()


def _strided(a):
    """Every other element of a twice-as-large buffer on every axis (no axis is contiguous)."""
    base = np.zeros(tuple(2 * n for n in a.shape), a.dtype)
    view = base[tuple(slice(None, None, 2) for _ in a.shape)]
    view[...] = a
    return view


def _fortran(a):
    return np.asfortranarray(a).copy(order="F")


def _readonly(a):
    b = np.ascontiguousarray(a).copy()
    b.setflags(write=False)
    return b


def _byteswapped(a):
    """Same values stored in the non-native byte order."""
    return a.astype(a.dtype.newbyteorder("S"))


def _negative_strides(a):
    """Every axis reversed in memory: a view of a flipped copy, flipped back."""
    flip = tuple(slice(None, None, -1) for _ in a.shape)
    return a[flip].copy()[flip]


def _unaligned(a):
    """C-contiguous data that starts one byte past an aligned address."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    view = buf[1:].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert not view.flags.aligned or a.size == 0
    return view


def at_line_offset(a, offset):
    """A copy of a whose data starts offset bytes past a 64-byte cache line."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    placed = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    placed[...] = a
    return placed


def placed_after(a, after):
    """An empty array like a whose data starts `after` bytes past a's place in a 4 KiB page."""
    raw = np.empty(a.nbytes + 8192, np.uint8)
    start = (a.ctypes.data + after - raw.ctypes.data) % 4096
    return raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)


LAYOUTS = {
    "contiguous": _contiguous,
    "strided": _strided,
    "fortran": _fortran,
    "readonly": _readonly,
    "byteswapped": _byteswapped,
    "negative_strides": _negative_strides,
    "unaligned": _unaligned,
}


def make_layout(a, layout):
    out = LAYOUTS[layout](a)
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a)
    return out


# --------------------------------------------------------------------------------------------
# Snapshots: "inputs never mutated" is checked on the whole memory that backs an array.
# --------------------------------------------------------------------------------------------

def owner(a):
    """The ndarray that owns the memory `a` views (a itself if it owns it)."""
    while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray):
        a = a.base
    return a


class Snapshot:
    """Bytes of the memory behind some arrays (plus their flags), to compare after a call."""

    def __init__(self, *arrays):
        self.arrays = [a for a in arrays if isinstance(a, np.ndarray)]
        self.before = [self._state(a) for a in self.arrays]

    @staticmethod
    def _state(a):
        own = owner(a)
        return own.tobytes(), a.flags.writeable, a.shape, a.strides, a.dtype

    def assert_unchanged(self):
        for a, before in zip(self.arrays, self.before):
            after = self._state(a)
            assert after[0] == before[0], "an input's memory was modified"
            assert after[1:] == before[1:], "an input's flags/shape/strides/dtype changed"


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------

def assert_close(actual, desired, dtype=None, rtol=None, atol=None, scale=None, err_msg="",
                 extra_atol=0.0):
    """assert_allclose with the tolerance of `dtype` (default: desired's dtype).

    The absolute tolerance is ``atol * scale + extra_atol`` with ``scale = max(1, max|desired|)``
    by default: values that are small only because of cancellation are compared at the scale of
    the whole result. ``extra_atol`` is for known error terms of the comparison itself.
    """
    actual = np.asarray(actual)
    desired = np.asarray(desired)
    dtype = np.dtype(dtype if dtype is not None else desired.dtype).newbyteorder("=")
    rtol = RTOL[dtype] if rtol is None else rtol
    atol = ATOL[dtype] if atol is None else atol
    if scale is None:
        finite = desired[np.isfinite(desired)]
        scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    assert actual.shape == desired.shape, (actual.shape, desired.shape)
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol * scale + extra_atol,
                               err_msg=err_msg)


def assert_bitwise_equal(a, b, err_msg=""):
    """Same dtype, shape and bytes (NaNs with the same payload compare equal)."""
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype, err_msg)
    assert a.shape == b.shape, (a.shape, b.shape, err_msg)
    if a.tobytes() != b.tobytes():
        bits_a = np.ascontiguousarray(a).reshape(-1).view(f"u{a.itemsize}")
        bits_b = np.ascontiguousarray(b).reshape(-1).view(f"u{b.itemsize}")
        diff = np.flatnonzero(bits_a != bits_b)
        worst = np.max(np.abs(a.reshape(-1)[diff].astype(np.float64)
                              - b.reshape(-1)[diff].astype(np.float64)))
        raise AssertionError(f"not bitwise equal {err_msg}: {diff.size} of {a.size} element(s) "
                             f"differ (first flat indices {diff[:5].tolist()}, max |diff| {worst})")


def assert_output_array(y, shape, dtype):
    """A fresh output: ndarray of the right shape and native dtype, writeable."""
    assert isinstance(y, np.ndarray)
    assert y.shape == tuple(shape)
    assert y.dtype == np.dtype(dtype).newbyteorder("=")
    assert y.dtype.isnative
    assert y.flags.writeable


def numeric_gradient(f, value, h=1e-6):
    """Central differences of the scalar f() in each element of value (changed in place and
    restored)."""
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        saved = value[index]
        value[index] = saved + h
        up = f()
        value[index] = saved - h
        down = f()
        value[index] = saved
        grad[index] = (up - down) / (2 * h)
    return grad


def random_params(rng, shape, dtype):
    """gamma and beta of `shape` that are far from ones/zeros, so that mixing them up shows."""
    gamma = (0.5 + rng.random(shape)) * rng.choice([-1.0, 1.0], size=shape)
    beta = rng.standard_normal(shape)
    return gamma.astype(dtype), beta.astype(dtype)


def random_input(rng, shape, dtype, offset=0.0, scale=1.0):
    """Rows with different means and spreads (so a row mix-up or shared statistic shows)."""
    shape = tuple(shape)
    x = rng.standard_normal(shape) * scale
    if len(shape) >= 1 and shape[0] > 0:
        per_row = rng.standard_normal((shape[0],) + (1,) * (len(shape) - 1))
        x = x * (1.0 + 0.5 * np.abs(per_row)) + 3.0 * per_row
    return (x + offset).astype(dtype)


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------

@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id: reproducible, different for every test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def onnx_node_cases(module_name, class_name, seed=23):
    """ONNX's own backend test cases of one operator, regenerated from onnx's case module
    (onnx.backend.test.case.node.<module_name>): (name, inputs, outputs, attributes) each.
    Skips when onnx is missing."""
    pytest.importorskip("onnx", reason="ONNX's node cases need the onnx package")
    import importlib

    from onnx import helper

    module = importlib.import_module(f"onnx.backend.test.case.node.{module_name}")
    cases = []

    def expect(node, inputs, outputs, name, **kwargs):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        cases.append((name, inputs, outputs, attributes))

    saved_expect = module.expect
    state = np.random.get_state()
    module.expect = expect
    try:
        np.random.seed(seed)
        case_class = getattr(module, class_name)
        for name in dir(case_class):
            if name.startswith("export"):
                getattr(case_class, name)()
    finally:
        module.expect = saved_expect
        np.random.set_state(state)
    return cases
