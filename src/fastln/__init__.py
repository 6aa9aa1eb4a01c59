"""fastln: fast, exact and deterministic LayerNorm for NumPy arrays on the CPU.

C row kernels (include/fastln/) run over the rows with OpenMP, with the GIL released; this
package checks the arguments and allocates the outputs. ``fastln.reference`` holds the readable
pure-Python version every kernel is tested against.

Optional companions, imported on demand (their dependencies are optional): ``fastln.torch``
(PyTorch modules), ``fastln.dask`` (Dask arrays). float16 and bfloat16 (``ml_dtypes``) inputs
work with every function.

The functions that run the compiled kernels are imported with the package; where the extension
cannot be loaded (a broken build), ``import fastln.reference`` and the cache classes still work,
and the first use of any other function raises the ImportError that loading gave: a broken
build does not take the readable oracle with it.
"""
import importlib as _importlib

from fastln import reference
from fastln._caches import BatchNormCache, GroupNormCache, LayerNormCache, RMSNormCache
from fastln._version import __version__

# Public name -> the module that defines it (each of these loads the compiled kernels).
_COMPILED = {
    "add_layer_norm": "fastln._row_norms",
    "add_layer_norm_forward": "fastln._row_norms",
    "add_rms_norm": "fastln._row_norms",
    "add_rms_norm_forward": "fastln._row_norms",
    "batch_norm": "fastln._batch_norm",
    "batch_norm_backward": "fastln._batch_norm",
    "batch_norm_forward": "fastln._batch_norm",
    "get_num_threads": "fastln._threads",
    "group_norm": "fastln._group_norm",
    "group_norm_backward": "fastln._group_norm",
    "group_norm_forward": "fastln._group_norm",
    "instance_norm": "fastln._group_norm",
    "instance_norm_backward": "fastln._group_norm",
    "instance_norm_forward": "fastln._group_norm",
    "layer_norm": "fastln._row_norms",
    "layer_norm_backward": "fastln._row_norms",
    "layer_norm_forward": "fastln._row_norms",
    "num_threads": "fastln._threads",
    "output_cache_info": "fastln._memory",
    "rms_norm": "fastln._row_norms",
    "rms_norm_backward": "fastln._row_norms",
    "rms_norm_forward": "fastln._row_norms",
    "set_num_threads": "fastln._threads",
    "set_output_cache": "fastln._memory",
    "show_config": "fastln._config",
}

__all__ = sorted(["BatchNormCache", "GroupNormCache", "LayerNormCache", "RMSNormCache",
                  "__version__",
                  *_COMPILED])


def _load_compiled():
    """Import every compiled-backed function into this namespace; the ImportError, if any."""
    try:
        functions = {name: getattr(_importlib.import_module(module), name)
                     for name, module in _COMPILED.items()}
    except ImportError as error:
        return error
    globals().update(functions)
    return None


_LOAD_ERROR = _load_compiled()


def __getattr__(name):
    if name in _COMPILED and _LOAD_ERROR is not None:
        raise ImportError(f"fastln.{name} needs fastln's compiled kernels, which could not be "
                          f"loaded ({_LOAD_ERROR}); fastln.reference works without them") \
            from _LOAD_ERROR
    raise AttributeError(f"module 'fastln' has no attribute {name!r}")
