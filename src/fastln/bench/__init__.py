"""`fastln bench`: fastln side by side with NumPy, PyTorch and ONNX Runtime.

    command    the options of `fastln bench` and their defaults
    runner     cases, warm-up, result checks, interleaved measurement
    timing     calibrated samples, rounds, medians and spreads
    ops        the registry: each operation and its implementations, one module per operation
    peers      which optional libraries are installed (imported only when selected)
    machine    CPU, cores, caches, memory and versions, for the JSON and the table header
    bandwidth  this machine's copy bandwidth, with fastln's own streaming copy
    report     table, Markdown, JSON and plot
    progress   the progress bar on stderr

From Python: ``run_benchmark(BenchConfig(...))`` returns the report as a dict.
"""
from fastln.bench.runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "run_benchmark"]
