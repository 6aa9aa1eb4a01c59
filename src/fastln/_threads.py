"""fastln's default thread count: ``set_num_threads``, ``get_num_threads``, ``num_threads(n)``.

The default (what a call with ``num_threads=None`` uses) is OpenMP's own: the ``nthreads-var``
setting of the OpenMP runtime fastln is linked with, which ``OMP_NUM_THREADS`` initialises. There
is no second copy of it in fastln, so the three ways of changing it agree with each other:
``fastln.set_num_threads``, ``threadpoolctl.threadpool_limits`` (which finds fastln's OpenMP
library like any other) and ``OMP_NUM_THREADS``. As in OpenMP, the setting belongs to the thread
that makes it; threads started later begin from ``OMP_NUM_THREADS`` (or the number of cores).
A ``num_threads=`` argument given to a call always wins.
"""
from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator

import numpy as np

from fastln import _kernels
from fastln._checks import check_num_threads

_MAX_COUNT = 2**31 - 1  # OpenMP takes a C int


def _check_count(n: object) -> int:
    if (isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral)
            or not 1 <= n <= _MAX_COUNT):
        raise ValueError(f"num_threads must be a positive int (at most {_MAX_COUNT}), got {n!r}")
    return int(n)


def get_num_threads() -> int:
    """The number of threads fastln uses for a call with ``num_threads=None``.

    This is OpenMP's default team size for the calling thread: ``OMP_NUM_THREADS`` (or the
    number of cores) unless changed by :func:`set_num_threads`, :func:`num_threads` or
    ``threadpoolctl.threadpool_limits``. Always 1 when fastln was built without OpenMP.

    Returns
    -------
    int

    Examples
    --------
    >>> import fastln
    >>> with fastln.num_threads(1):
    ...     fastln.get_num_threads()
    1
    """
    return int(_kernels.default_num_threads())


def set_num_threads(n: int) -> None:
    """Set the number of threads fastln uses for calls with ``num_threads=None``.

    It sets OpenMP's default team size for the calling thread (``omp_set_num_threads``), which
    is also what ``threadpoolctl`` reads and limits. A ``num_threads=`` argument given to a call
    still wins. Results do not depend on the thread count. Without OpenMP this does nothing.

    Parameters
    ----------
    n : int
        A positive number of threads (more than the cores is allowed, as in OpenMP).

    Raises
    ------
    ValueError
        When ``n`` is not a positive int.

    Examples
    --------
    >>> import fastln
    >>> previous = fastln.get_num_threads()
    >>> fastln.set_num_threads(1)
    >>> fastln.get_num_threads()
    1
    >>> fastln.set_num_threads(previous)
    """
    _kernels.set_default_num_threads(_check_count(n))


def resolve_num_threads(num_threads):
    """The thread count of a call: None means the default (get_num_threads()); a positive int.

    Counts above fastln's cap (4 threads per processor, at least 64) are lowered to it: the
    results are the same for every count, and a team of 10**5 threads could exhaust the process.
    """
    checked = check_num_threads(num_threads)
    if checked is None:
        return _kernels.default_num_threads()
    return min(checked, _kernels.thread_cap())


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[int]:
    """Context manager: fastln's default thread count is ``n`` inside the ``with`` block.

    The previous default is restored on exit, also when the block raises. Like
    :func:`set_num_threads`, it applies to the calling thread.

    Parameters
    ----------
    n : int
        A positive number of threads.

    Raises
    ------
    ValueError
        When ``n`` is not a positive int (before anything is changed).

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.random.default_rng(0).standard_normal((512, 256))
    >>> with fastln.num_threads(1):
    ...     y1 = fastln.layer_norm(x)
    >>> bool((y1 == fastln.layer_norm(x, num_threads=2)).all())   # same bits for any count
    True
    """
    count = _check_count(n)
    previous = get_num_threads()
    set_num_threads(count)
    try:
        yield count
    finally:
        set_num_threads(previous)
