"""The benchmark registry: every operation `fastln bench` knows, by its --ops name.

To add an operation, write a module like ``layer_norm.py`` (inputs, bytes moved, one
Implementation per peer) and add its OPERATIONS here.
"""
from fastln.bench.ops import layer_norm
from fastln.bench.ops.base import (
    OUTPUT_NEW,
    OUTPUT_NO_OUT,
    OUTPUT_REUSED,
    Implementation,
    Operation,
    Prepared,
    compare_results,
)

OPERATIONS = {operation.name: operation for operation in layer_norm.OPERATIONS}

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
