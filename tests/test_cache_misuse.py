"""Caches used wrongly (issue 7): a cache passed to a backward with a dy of another shape or
dtype, a cache from another operation, something that is not a cache, and caches forged or
tampered with through the public classes. Each is a clear TypeError/ValueError - never a crash,
never a silently wrong answer - and leaves dy, the cache and its x untouched.

The forged caches run in child processes, one each: a backward that trusts a forged cache can
read or write outside its arrays, and a crash there must fail a test, not end the run.
"""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fastln
import fastln.reference as ref
from conftest import HALF, Snapshot, assert_close

IMPLS = {"fastln": fastln, "reference": ref}
# A test's `module`: fastln, then the reference (ids "fastln", "reference").
each_implementation = pytest.mark.parametrize("module", [IMPLS[name] for name in sorted(IMPLS)],
                                              ids=sorted(IMPLS))
SHAPE = (6, 8)


def _inputs(dtype=np.float64, shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def _forward(module, op, x, axis=-1):
    """(cache, backward name) of one forward."""
    if op == "layer_norm":
        return module.layer_norm_forward(x, axis=axis)[1], "layer_norm_backward"
    if op == "rms_norm":
        return module.rms_norm_forward(x, axis=axis)[1], "rms_norm_backward"
    if op == "add_layer_norm":
        return module.add_layer_norm_forward(x, x * 0.5, axis=axis)[2], "layer_norm_backward"
    if op == "add_rms_norm":
        return module.add_rms_norm_forward(x, x * 0.5, axis=axis)[2], "rms_norm_backward"
    assert op == "batch_norm"
    return module.batch_norm_forward(x, training=True, axis=axis)[1], "batch_norm_backward"


OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "batch_norm"]
BACKWARDS = ["layer_norm_backward", "rms_norm_backward", "batch_norm_backward"]


def _cache_state(cache):
    return {name: getattr(cache, name) for name in ("axis", "eps", "op")}


def _assert_refused(backward, dy, cache, error, words, **kwargs):
    """backward(dy, cache) raises `error` naming `words`; dy, the cache and its x unchanged."""
    arrays = [dy, cache.x] + [getattr(cache, n) for n in ("mean", "rstd")
                              if isinstance(getattr(cache, n, None), np.ndarray)]
    snapshot = Snapshot(*arrays)
    state = _cache_state(cache)
    with pytest.raises(error) as info:
        backward(dy, cache, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    snapshot.assert_unchanged()
    assert _cache_state(cache) == state


# --------------------------------------------------------------------------------------------
# dy that does not match the cache
# --------------------------------------------------------------------------------------------

WRONG_DY_SHAPES = {
    "transposed": lambda dy: dy.T.copy(),
    "one-row-fewer": lambda dy: dy[:-1].copy(),
    "one-column-more": lambda dy: np.concatenate([dy, dy[:, :1]], axis=1),
    "broadcastable-row": lambda dy: dy[:1].copy(),
    "extra-axis": lambda dy: dy[None].copy(),
    "flattened": lambda dy: dy.reshape(-1).copy(),
    "same-size-other-shape": lambda dy: dy.reshape(SHAPE[1], SHAPE[0]).copy(),
    "scalar": lambda dy: np.float64(1.0),
}


@each_implementation
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("wrong", sorted(WRONG_DY_SHAPES))
def test_dy_of_another_shape(module, op, wrong):
    x, dy = _inputs()
    cache, backward = _forward(module, op, x)
    _assert_refused(getattr(module, backward), WRONG_DY_SHAPES[wrong](dy), cache, ValueError,
                    ["dy", "shape"])


@each_implementation
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("x_dtype, dy_dtype", [
    (np.float32, np.float64), (np.float64, np.float32), (np.float32, np.int32),
    (np.float64, np.int64), (np.float64, np.bool_), (np.float32, np.complex64),
    (np.int64, np.int64),  # integer x computes in float64: dy must be float64 too
])
def test_dy_of_another_dtype(module, op, x_dtype, dy_dtype):
    x, dy = _inputs()
    cache, backward = _forward(module, op, (x * 10).astype(x_dtype))
    _assert_refused(getattr(module, backward), dy.astype(dy_dtype), cache, ValueError,
                    ["dy", "dtype"])


@each_implementation
@pytest.mark.parametrize("op", OPS)
def test_dy_with_the_right_dtype_in_another_byte_order_or_layout_works(module, op):
    """Not misuse: dy matching the cache in any layout or byte order gives the usual result.
    (A nested list is not: it converts to float64, which a float32 cache refuses.)"""
    x, dy = _inputs(np.float32)
    cache, backward = _forward(module, op, x)
    expected = getattr(module, backward)(dy, cache)
    for variant in (dy.astype(dy.dtype.newbyteorder("S")), np.asfortranarray(dy),
                    dy[::-1][::-1]):
        for got, want in zip(getattr(module, backward)(variant, cache), expected):
            assert_close(got, want)


@each_implementation
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", HALF)
def test_cache_built_without_dtype_for_half_x_is_refused_in_every_layout(module, op, dtype):
    """A cache built by hand without a dtype has its statistics' (float32): not a float16 or
    bfloat16 x's own. Refused whatever dy's layout, which decides only which path checks it."""
    x, dy = _inputs(np.float32)
    x, dy = x.astype(dtype), dy.astype(dtype)
    cache, backward = _forward(module, op, x)
    fields = (x, cache.rstd) if op == "rms_norm" else (x, cache.mean, cache.rstd)
    built = (fastln.RMSNormCache if op == "rms_norm" else fastln.LayerNormCache)(
        *fields, 1, cache.eps)
    wider = np.zeros((SHAPE[0], 2 * SHAPE[1]), dtype)
    wider[:, ::2] = dy
    for variant in (dy, wider[:, ::2]):
        _assert_refused(getattr(module, backward), variant, built, ValueError,
                        ["cache.dtype", "float32"])


# --------------------------------------------------------------------------------------------
# A cache from another operation, and things that are not caches
# --------------------------------------------------------------------------------------------

def _expected_backward(op):
    return {"layer_norm": "layer_norm_backward", "add_layer_norm": "layer_norm_backward",
            "rms_norm": "rms_norm_backward", "add_rms_norm": "rms_norm_backward",
            "batch_norm": "batch_norm_backward"}[op]


@each_implementation
@pytest.mark.parametrize("op, backward", [(op, backward) for op in OPS for backward in BACKWARDS
                                          if backward != _expected_backward(op)])
def test_cache_from_another_operation(module, op, backward):
    x, dy = _inputs()
    cache, _ = _forward(module, op, x)
    _assert_refused(getattr(module, backward), dy, cache, ValueError,
                    [backward.replace("_backward", "")])


@pytest.mark.parametrize("op", OPS)
def test_square_inputs_do_not_hide_a_wrong_cache(op):
    """With a square x, a BatchNorm cache and a LayerNorm cache have the same shapes
    everywhere (mean and rstd of length n): only the operation tells them apart."""
    x, dy = _inputs(shape=(5, 5))
    cache, right = _forward(fastln, op, x)
    for backward in BACKWARDS:
        if backward != right:
            _assert_refused(getattr(fastln, backward), dy, cache, ValueError, [])


NOT_CACHES = {
    "None": lambda y, cache: None,
    "y": lambda y, cache: y,
    "forward-result-tuple": lambda y, cache: (y, cache),
    "dict": lambda y, cache: {"x": y, "mean": cache.mean, "rstd": cache.rstd},
    "list-of-fields": lambda y, cache: [cache.x, cache.mean, cache.rstd],
    "string": lambda y, cache: "layer_norm",
}


@each_implementation
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("thing", sorted(NOT_CACHES))
def test_not_a_cache(module, backward, thing):
    x, dy = _inputs()
    y, cache = module.layer_norm_forward(x)
    with pytest.raises(TypeError, match="cache"):
        getattr(module, backward)(dy, NOT_CACHES[thing](y, cache))


@pytest.mark.parametrize("backward_impl", sorted(IMPLS))
@pytest.mark.parametrize("forward_impl", sorted(IMPLS))
@pytest.mark.parametrize("op", OPS)
def test_caches_work_across_implementations_and_calls(backward_impl, forward_impl, op):
    """Not misuse: a cache is reusable (a backward does not consume or change it) and works
    with either implementation's backward."""
    x, dy = _inputs()
    cache, backward = _forward(IMPLS[forward_impl], op, x)
    snapshot = Snapshot(x, cache.x, cache.mean if hasattr(cache, "mean") else None, cache.rstd)
    first = getattr(IMPLS[backward_impl], backward)(dy, cache)
    second = getattr(IMPLS[backward_impl], backward)(dy, cache)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    expected = getattr(ref, backward)(dy, _forward(ref, op, x)[0])
    for got, want in zip(first, expected):
        assert_close(got, want)
    snapshot.assert_unchanged()


# --------------------------------------------------------------------------------------------
# Forged and tampered caches (public classes, inconsistent fields), in a child process
# --------------------------------------------------------------------------------------------

FORGED_SETUP = textwrap.dedent("""
    import json, sys
    import numpy as np
    import fastln
    from fastln import BatchNormCache, LayerNormCache, RMSNormCache

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8))
    dy = rng.standard_normal((6, 8))
    ln = fastln.layer_norm_forward(x)[1]
    rms = fastln.rms_norm_forward(x)[1]
    bn = fastln.batch_norm_forward(x, training=True)[1]
    bn_eval = fastln.batch_norm_forward(x, running_mean=np.zeros(8), running_var=np.ones(8))[1]

    def tampered(cache, **changes):
        for name, value in changes.items():
            setattr(cache, name, value)
        return cache
""")

# name -> (backward, dy expression, cache expression); every one must be a TypeError/ValueError.
# Short arrays are fresh copies, so that reading past them is reading past an allocation (which
# the sanitizer build of tools/sanitize.sh reports).
FORGED = {
    "ln-mean-too-short": ("layer_norm_backward", "dy",
                          "LayerNormCache(x, ln.mean[:2].copy(), ln.rstd, 1, 1e-5)"),
    "ln-rstd-too-long": ("layer_norm_backward", "dy",
                         "LayerNormCache(x, ln.mean, np.ones(40), 1, 1e-5)"),
    "ln-axis-out-of-range": ("layer_norm_backward", "dy",
                             "LayerNormCache(x, ln.mean, ln.rstd, 5, 1e-5)"),
    "ln-axis-not-an-int": ("layer_norm_backward", "dy",
                           "LayerNormCache(x, ln.mean, ln.rstd, 'last', 1e-5)"),
    "ln-x-a-list": ("layer_norm_backward", "dy",
                    "LayerNormCache(x.tolist(), ln.mean, ln.rstd, 1, 1e-5)"),
    "ln-mean-None": ("layer_norm_backward", "dy", "LayerNormCache(x, None, ln.rstd, 1, 1e-5)"),
    "ln-x-swapped-for-a-bigger-one": ("layer_norm_backward", "np.ones((60, 8))",
                                      "tampered(ln, x=np.ones((60, 8)))"),
    "rms-rstd-too-short": ("rms_norm_backward", "dy",
                           "RMSNormCache(x, rms.rstd[:2].copy(), 1, 1e-5)"),
    "rms-axis-out-of-range": ("rms_norm_backward", "dy", "RMSNormCache(x, rms.rstd, 7, 1e-5)"),
    "rms-rstd-None": ("rms_norm_backward", "dy", "RMSNormCache(x, None, 1, 1e-5)"),
    "bn-mean-too-short": ("batch_norm_backward", "dy",
                          "BatchNormCache(x, bn.mean[:2].copy(), bn.rstd, 1, 1e-5, True,"
                          " bn.dtype)"),
    "bn-rstd-too-short": ("batch_norm_backward", "dy",
                          "BatchNormCache(x, bn_eval.mean, bn_eval.rstd[:1].copy(), 1, 1e-5,"
                          " False, bn.dtype)"),
    "bn-axis-out-of-range": ("batch_norm_backward", "dy",
                             "BatchNormCache(x, bn.mean, bn.rstd, 9, 1e-5, True, bn.dtype)"),
    "bn-dtype-tampered-float16": ("batch_norm_backward", "dy.astype(np.float16)",
                                  "tampered(bn, dtype=np.dtype(np.float16))"),
    "bn-x-swapped-for-a-bigger-one": ("batch_norm_backward", "np.ones((6, 800))",
                                      "tampered(bn, x=np.ones((6, 800)))"),
}

FORGED_RUNNER = FORGED_SETUP + textwrap.dedent("""
    backward, dy_expr, cache_expr = json.loads(sys.argv[1])
    try:
        result = getattr(fastln, backward)(eval(dy_expr), eval(cache_expr))
    except (TypeError, ValueError) as exc:
        outcome = [type(exc).__name__, str(exc)]
    except Exception as exc:  # noqa: BLE001
        outcome = ["unclear " + type(exc).__name__, str(exc)]
    else:
        outcome = ["returned", str([np.shape(r) for r in result])]
    print(json.dumps(outcome), flush=True)
""")


@pytest.fixture(scope="module")
def forged_outcomes():
    """Every forged case in a child process of its own, all at once: a case that corrupts
    memory may crash its child at any later point (even at exit)."""
    children = {name: subprocess.Popen([sys.executable, "-c", FORGED_RUNNER, json.dumps(case)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for name, case in FORGED.items()}
    outcomes = {}
    for name, child in children.items():
        try:
            stdout, stderr = child.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, stderr = child.communicate()
            outcomes[name] = ["hung", stderr[-500:]]
            continue
        lines = stdout.splitlines()
        outcome = json.loads(lines[-1]) if lines else ["no outcome", ""]
        if child.returncode != 0:
            outcome = [f"crashed (exit status {child.returncode}) after {outcome[0]}",
                       stderr[-500:]]
        outcomes[name] = outcome
    return outcomes


@pytest.mark.parametrize("name", sorted(FORGED))
def test_forged_cache_is_refused(forged_outcomes, name):
    outcome, detail = forged_outcomes[name]
    assert outcome in ("TypeError", "ValueError"), (
        f"{FORGED[name][0]} with {FORGED[name][2]}: {outcome}: {detail}")
    assert detail
