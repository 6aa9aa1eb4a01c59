"""The benchmark registry: every operation `fastln bench` knows, by its --ops name.

To add an operation, write a module like ``layer_norm.py`` (inputs, bytes moved, one
Implementation per peer, its OPERATIONS) and add the module to MODULES here.
"""
from fastln.bench.ops import add_norm, batch_norm, layer_norm, rms_norm
from fastln.bench.ops.base import (
    OUTPUT_NEW,
    OUTPUT_NO_OUT,
    OUTPUT_REUSED,
    Implementation,
    Operation,
    Prepared,
    compare_results,
)

MODULES = (
    layer_norm,   # forward, backward
    rms_norm,     # rms_forward, rms_backward
    add_norm,     # add_layer_norm, add_rms_norm
    batch_norm,   # batch_norm_train, batch_norm_backward
)

OPERATIONS = {operation.name: operation for module in MODULES for operation in module.OPERATIONS}

__all__ = [
    "OPERATIONS",
    "OUTPUT_NEW",
    "OUTPUT_NO_OUT",
    "OUTPUT_REUSED",
    "Implementation",
    "Operation",
    "Prepared",
    "compare_results",
]
