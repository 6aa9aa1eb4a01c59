"""fastln: fast, exact and deterministic LayerNorm for NumPy arrays on the CPU.

C row kernels (include/fastln/) run over the rows with OpenMP, with the GIL released; this
package checks the arguments and allocates the outputs. ``fastln.reference`` holds the readable
pure-Python version every kernel is tested against.

Optional companions, imported on demand (their dependencies are optional): ``fastln.torch``
(PyTorch modules), ``fastln.dask`` (Dask arrays). float16 and bfloat16 (``ml_dtypes``) inputs
work with layer_norm, rms_norm and the fused add variants.
"""
from fastln._add_norm import (
    add_layer_norm,
    add_layer_norm_forward,
    add_rms_norm,
    add_rms_norm_forward,
)
from fastln._batch_norm import (
    BatchNormCache,
    batch_norm,
    batch_norm_backward,
    batch_norm_forward,
)
from fastln._config import show_config
from fastln._layer_norm import (
    LayerNormCache,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
)
from fastln._memory import output_cache_info, set_output_cache
from fastln._rms_norm import (
    RMSNormCache,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)
from fastln._threads import get_num_threads, num_threads, set_num_threads
from fastln._version import __version__
from fastln import reference  # noqa: E402  (the readable twin of every function above)

__all__ = [
    "BatchNormCache",
    "LayerNormCache",
    "RMSNormCache",
    "__version__",
    "add_layer_norm",
    "add_layer_norm_forward",
    "add_rms_norm",
    "add_rms_norm_forward",
    "batch_norm",
    "batch_norm_backward",
    "batch_norm_forward",
    "get_num_threads",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "num_threads",
    "output_cache_info",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "set_num_threads",
    "set_output_cache",
    "show_config",
]
