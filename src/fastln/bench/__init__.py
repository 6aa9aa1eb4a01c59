"""`fastln bench`: fastln side by side with NumPy, PyTorch and ONNX Runtime.

    command    the options of `fastln bench`, their checks and defaults
    ops        the table of operations: inputs, bytes moved, dtypes, fastln's call
    operation  what the table is made of: inputs, prepared calls, the result check
    peers      one module per peer (numpy, torch, onnxruntime), imported only when selected
    runner     cases, warm-up, result checks, interleaved measurement, anomalies, summary
    timing     calibrated samples, rounds, waiting for idle workers, medians and spreads
    accuracy   --accuracy: errors against an exact reference
    machine    CPU, cores, caches, memory and versions, for the JSON and the table header
    bandwidth  this machine's copy bandwidth, with the bench's own streaming copy
    report     table, summary, Markdown, JSON and plot
    progress   the progress bar on stderr

From Python: ``run_benchmark(BenchConfig(...))`` returns the report as a dict.
"""
from fastln.bench.runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "run_benchmark"]
