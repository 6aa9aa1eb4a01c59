"""fastln's default thread count: ``set_num_threads``, ``get_num_threads``, ``num_threads(n)``.

The default (what a call with ``num_threads=None`` uses) is fastln's own setting, kept apart from
OpenMP's ``nthreads-var``: PyTorch and fastln often share one OpenMP runtime, and
``torch.set_num_threads`` must not change fastln's default, nor ``fastln.set_num_threads``
PyTorch's. It starts from ``OMP_NUM_THREADS`` (its first entry, as OpenMP reads it) or else the
number of processors the process may run on, read once at import. As in OpenMP, a setting
belongs to the thread that makes it; other threads keep the initial value. A ``num_threads=``
argument given to a call always wins.

threadpoolctl sees fastln as an OpenMP library of its own (``internal_api="fastln"``, next to the
runtime's entry): ``threadpool_info()`` reports fastln's default, and
``threadpool_limits(n, user_api="openmp")`` limits fastln as it limits the runtime. fastln tells
threadpoolctl about itself at import when threadpoolctl is installed.
"""
from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Iterator

import numpy as np

from fastln import _kernels
from fastln._checks import check_num_threads, describe

_MAX_COUNT = 2**31 - 1  # OpenMP takes a C int


def _check_count(n: object) -> int:
    if (isinstance(n, (bool, np.bool_, np.timedelta64)) or not isinstance(n, numbers.Integral)
            or not 1 <= n <= _MAX_COUNT):
        raise ValueError(f"num_threads must be a positive int (at most {_MAX_COUNT}), got "
                         f"{describe(n)}")
    return int(n)


def get_num_threads() -> int:
    """The number of threads fastln uses for a call with ``num_threads=None``.

    The calling thread's setting: ``OMP_NUM_THREADS`` (or the number of processors) unless
    changed by :func:`set_num_threads`, :func:`num_threads` or
    ``threadpoolctl.threadpool_limits``; never changed by other libraries' settings (such as
    ``torch.set_num_threads``). Always 1 when fastln was built without OpenMP.

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

    It applies to the calling thread and to fastln only: the OpenMP runtime's own setting (what
    PyTorch uses) is left alone. A ``num_threads=`` argument given to a call still wins. Results
    do not depend on the thread count. Without OpenMP this does nothing.

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


def _initial_count() -> int:
    """OMP_NUM_THREADS's first entry when it is a positive decimal number (OpenMP reads a list
    such as "4,2" for nested teams), else the processors the process may run on."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isascii() and first.isdigit() and int(first) >= 1:
        return min(int(first), _MAX_COUNT)
    return max(1, _kernels.num_procs())


def _register_with_threadpoolctl() -> None:
    """Give threadpoolctl a controller for fastln's setting (when threadpoolctl is installed,
    new enough to take one: 3.5), found by the two functions the extension exports."""
    try:
        import threadpoolctl
    except ImportError:
        return
    if not hasattr(threadpoolctl, "register"):
        return

    class FastlnController(threadpoolctl.LibController):
        user_api = "openmp"
        internal_api = "fastln"
        filename_prefixes = ("_kernels",)
        check_symbols = ("fastln_get_num_threads", "fastln_set_num_threads")

        def get_num_threads(self):
            return self.dynlib.fastln_get_num_threads()

        def set_num_threads(self, num_threads):
            self.dynlib.fastln_set_num_threads(max(1, min(int(num_threads), _MAX_COUNT)))

        def get_version(self):
            from fastln._version import __version__
            return __version__

    threadpoolctl.register(FastlnController)


_kernels.set_initial_num_threads(_initial_count())
_register_with_threadpoolctl()


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
