"""Docstring paragraphs that several public functions share, written once.

A docstring names a shared paragraph by a line of its own, ``{name}`` at the paragraph's
indentation; :func:`shares_docs` puts the paragraph in when the module is imported. Pure Python:
``fastln.reference`` may import it.
"""
import re

_NUM_THREADS = """\
    num_threads : int, optional
        OpenMP threads; None uses fastln's default (``fastln.get_num_threads()``). Results are
        identical for every value."""

_PARAGRAPHS = {
    # the end of a forward's parameters, and what it returns
    "forward_out": """\
    out : ndarray, optional
        C-contiguous, shape ``x.shape``, the output dtype. May be ``x`` itself (in place).
""" + _NUM_THREADS + """

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)""",
    # the fused residual adds (add_layer_norm, add_rms_norm): how s is formed
    "add_sum": """\
    ``s = x + residual + bias`` is computed in float64 and rounded once to the output dtype (for
    float32 without bias that is exactly NumPy's ``x + residual``), and y is bitwise what the
    unfused normalization of that s gives. The output dtype is x's (see
    :func:`fastln.layer_norm`); residual and bias are cast to it. For float16/bfloat16 x, s is
    rounded to float32 and then to x's format (for float16 without bias exactly NumPy's
    ``x + residual``, which adds in float32), residual is cast to x's format and gamma, beta and
    bias to float32.""",
    # their first parameters, before the normalization's own
    "add_inputs": """\
    Parameters
    ----------
    x : array_like
        The sublayer output (float32/float64 as they are; integer and bool as float64).
    residual : array_like of x's shape
        The residual stream. Not broadcast: it must have exactly x's shape.""",
    # their parameters after the normalization's own
    "add_outputs": """\
    bias : array_like of shape ``x.shape[axis:]``, optional
        Added to the sum before normalizing (the sublayer's bias folded in).
    axis : int, default -1
        The first normalized axis.
    out : ndarray, optional
        Buffer for y: C-contiguous, shape ``x.shape``, the output dtype. May be x or residual.
    sum_out : ndarray, optional
        Buffer for s, with the same rules. May be ``residual`` itself (the in-place
        residual-stream update) or x; must not overlap ``out``.
""" + _NUM_THREADS,
    # a backward's dy
    "backward_dy": """\
    dy : array_like
        Gradient of the loss with respect to y: y's shape and dtype.""",
    # the end of a backward's parameters, and the first thing it returns
    "backward_out": """\
    gamma : array_like, optional
        The scale the forward used, of the forward's gamma's shape (None: ones).
    out : ndarray, optional
        Buffer for dx, with the rules of the forward's ``out``; may be dy itself.
    num_threads : int, optional

    Returns
    -------
    dx : ndarray of x's shape""",
}

_PLACE = re.compile(r"^ *\{(" + "|".join(_PARAGRAPHS) + r")\}$", re.MULTILINE)


def shares_docs(function):
    """``function`` with each ``{name}`` line of its docstring replaced by that paragraph."""
    if function.__doc__:  # None under python -OO
        function.__doc__ = _PLACE.sub(lambda place: _PARAGRAPHS[place.group(1)],
                                      function.__doc__)
    return function
