"""Docstring paragraphs that several public functions share, written once.

A docstring names a shared paragraph by a line of its own, ``{name}`` at the paragraph's
indentation; :func:`shares_docs` puts the paragraph in when the module is imported. Pure Python:
``fastln.reference`` may import it.
"""
import re

_PARAGRAPHS = {
    # the end of a forward's parameters, and what it returns
    "forward_out": """\
    out : ndarray, optional
        C-contiguous, shape ``x.shape``, the output dtype. May be ``x`` itself (in place).
    num_threads : int, optional
        OpenMP threads; None uses fastln's default (``fastln.get_num_threads()``). Results are
        identical for every value.

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)""",
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
