"""fastln: fast, exact and deterministic LayerNorm for NumPy arrays on the CPU.

C row kernels (include/fastln/) run over the rows with OpenMP, with the GIL released; this
package checks the arguments and allocates the outputs. ``fastln.reference`` holds the readable
pure-Python version every kernel is tested against.
"""
from fastln._config import show_config
from fastln._layer_norm import (
    LayerNormCache,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
)
from fastln._version import __version__

__all__ = [
    "LayerNormCache",
    "__version__",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "show_config",
]
