"""`fastln bench --accuracy`: each implementation's error against an exact reference, on the inputs
the peers' issue trackers report trouble with.

Cases (rows of 768 unless said; the ones ONNX Runtime's and PyTorch's trackers name):
    offset + N(0,1) rows, offsets 1e3 to 1e6, float32   (E[x^2] - E[x]^2 cancels: ORT #28463)
    a constant row, 1234.0, float32                      (variance 0: ORT #21935)
    the row [40000, 40001, 40002, 40003], float32        (ORT #28463)
    |x| near 1e30, float32                               (x^2 overflows float32: PyTorch #162489)
    float16 rows with |x| above 7600                     (x^2 overflows float16: ORT #29034)
    one row with Inf and one with NaN, float32           (must stay in their rows: PyTorch #173885)
For LayerNorm and RMSNorm, forward (y) and backward (dx, for a dy of N(0,1) values), and for
BatchNorm in training mode (the same arrays read as (N, C): statistics down the columns), with
gamma = 1 and beta = 0 so that the error is the normalization's own.

The reference is computed in float64 from the inputs' exact values: a compensated two-pass mean,
the variance of the deviations, and the textbook gradient. Its error (about 1e-16 of |x| in the
deviations) is below a millionth of a float32 unit in the last place at these sizes, so it is
exact for measuring float32 and float16 results.

Per implementation: the largest absolute error; the largest error in units in the last place
(ulps) of the output format at the row's (feature's) largest exact value, so that a value near
zero does not make the count meaningless; whether it returned NaN where the exact result is a
number; whether its result is bitwise the same with 1 and 2 threads. Rows whose exact result is
not a number (the Inf and NaN rows) are left out of the errors.
"""
import sys

import numpy as np

from fastln.bench import peers
from fastln.bench.operation import EPS, Inputs, numpy_dtype
from fastln.bench.ops import OPERATIONS

SCHEMA = "fastln-accuracy/1"
N_ROWS, N_COLS = 256, 768  # 196,608 elements: enough for every library to use its threads
THREAD_COUNTS = (1, 2)
IMPLEMENTATIONS = ("fastln", "numpy-naive", "torch", "onnxruntime")
# (label, --ops name of the bench table, kind of normalization, axis the statistics run along)
OPS = (
    ("layer_norm forward", "forward", "layer", 1),
    ("layer_norm backward (dx)", "backward", "layer", 1),
    ("rms_norm forward", "rms_forward", "rms", 1),
    ("rms_norm backward (dx)", "rms_backward", "rms", 1),
    ("batch_norm forward (training)", "batch_norm_train", "layer", 0),
    ("batch_norm backward (dx)", "batch_norm_backward", "layer", 0),
)


def _offset_rows(offset):
    def make(rng):
        return offset + rng.standard_normal((N_ROWS, N_COLS))
    return make


def _constant_rows(rng):
    return np.full((N_ROWS, N_COLS), 1234.0)


def _four_values(rng):
    return np.tile([40000.0, 40001.0, 40002.0, 40003.0], (N_ROWS, 1))


def _huge_rows(rng):
    return 1e30 * rng.standard_normal((N_ROWS, N_COLS))


def _float16_large(rng):
    # |x| from about 7600 up to float16's largest values' neighbourhood (65504): x**2 overflows.
    return 7600.0 + 4000.0 * np.abs(rng.standard_normal((N_ROWS, N_COLS)))


def _inf_and_nan_rows(rng):
    x = rng.standard_normal((N_ROWS, N_COLS))
    x[3, 5] = np.inf
    x[7, 11] = np.nan
    return x


CASES = (
    ("float32 1e3 + N(0,1)", "float32", _offset_rows(1e3)),
    ("float32 1e4 + N(0,1)", "float32", _offset_rows(1e4)),
    ("float32 1e5 + N(0,1)", "float32", _offset_rows(1e5)),
    ("float32 1e6 + N(0,1)", "float32", _offset_rows(1e6)),
    ("float32 constant row 1234.0", "float32", _constant_rows),
    ("float32 row [40000, 40001, 40002, 40003]", "float32", _four_values),
    ("float32 abs(x) ~ 1e30", "float32", _huge_rows),
    ("float16 abs(x) > 7600", "float16", _float16_large),
    ("float32 Inf in one row, NaN in another", "float32", _inf_and_nan_rows),
)


# --- the exact reference ------------------------------------------------------------------------

def exact(x, dy, kind, axis):
    """(y, dx) in float64 for x and dy given in float64: LayerNorm ("layer") or RMSNorm ("rms")
    with gamma = 1, beta = 0, statistics along `axis`."""
    with np.errstate(all="ignore"):  # the Inf/NaN rows give NaN, as they should
        if kind == "layer":
            mean = x.mean(axis=axis, keepdims=True)
            mean += (x - mean).mean(axis=axis, keepdims=True)  # the compensating second pass
            deviation = x - mean
        else:
            deviation = x
        rstd = 1.0 / np.sqrt((deviation * deviation).mean(axis=axis, keepdims=True) + EPS)
        x_hat = deviation * rstd
        projection = x_hat * (dy * x_hat).mean(axis=axis, keepdims=True)
        centring = dy.mean(axis=axis, keepdims=True) if kind == "layer" else 0.0
        dx = rstd * (dy - centring - projection)
    return x_hat, dx


def errors(result, reference, dtype, axis):
    """{max_abs, max_ulps, nan} of result against the exact reference (only where it is a
    number); ulps at the largest exact value of each row (axis=1) or feature (axis=0), or at 1
    (the scale of a normalized output) where that value is 0."""
    result = np.asarray(result, dtype=np.float64).reshape(reference.shape)
    finite = np.isfinite(reference)
    # A row or feature with a non-finite exact value is left out whole.
    valid = np.all(finite, axis=axis, keepdims=True) & np.ones_like(finite)
    with np.errstate(all="ignore"):
        error = np.abs(result - reference)
        scale = np.max(np.where(valid, np.abs(reference), 0.0), axis=axis, keepdims=True)
        scale = np.where(scale > 0, scale, 1.0)
        ulp = np.spacing(scale.astype(dtype)).astype(np.float64)
        ulps = error / np.maximum(ulp, np.finfo(dtype).smallest_subnormal)
    nan = bool(np.any(np.isnan(result) & valid))
    if not np.any(valid):
        return {"max_abs": None, "max_ulps": None, "nan": nan}
    # NaN errors (a NaN result) count as infinitely wrong.
    return {"max_abs": float(np.max(np.where(valid, np.nan_to_num(error, nan=np.inf), 0.0))),
            "max_ulps": float(np.max(np.where(valid, np.nan_to_num(ulps, nan=np.inf), 0.0))),
            "nan": nan}


# --- running the implementations ----------------------------------------------------------------

def _inputs(x, dy, dtype, axis):
    n_params = x.shape[1]
    inputs = Inputs(x, np.ones(n_params, dtype), np.zeros(n_params, dtype), dy=dy)
    if axis == 0:  # batch norm's running statistics, which the check does not look at
        inputs.running_mean = np.zeros(n_params, dtype)
        inputs.running_var = np.ones(n_params, dtype)
    return inputs


def _run(implementation, inputs, num_threads):
    # NumPy's naive code overflows on some cases (that is measured, not warned about).
    with np.errstate(all="ignore"):
        prepared = implementation.prepare(inputs, num_threads, False)
        if prepared.before_sample is not None:
            prepared.before_sample()
        return [np.array(array, copy=True) for array in prepared.result_arrays(prepared.call())]


def _bitwise_same(first, second):
    """The same bits in every element, a NaN matching any NaN: which NaN comes out where two
    meet (their sign and payload) IEEE 754 leaves open, and it follows the code path an element
    takes (vector or scalar, which the arrays' alignment decides), not the thread count."""
    def canonical(array):
        array = np.array(array, copy=True)
        if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
            array[np.isnan(array)] = np.nan
        return array.tobytes()
    return all(a.dtype == b.dtype and a.shape == b.shape and canonical(a) == canonical(b)
               for a, b in zip(first, second))


def measure(implementation, inputs, reference, dtype, axis):
    """One cell: errors of the first result (y or dx), and whether 1 and 2 threads agree."""
    try:
        results = {threads: _run(implementation, inputs, threads)
                   for threads in (THREAD_COUNTS if implementation.uses_threads else (1,))}
    except Exception as exc:  # a peer that cannot run this case: reported, not fatal
        if implementation.peer == "fastln":
            raise
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    cell = errors(results[1][0], reference, dtype, axis)
    cell["bitwise_same_1_and_2_threads"] = (
        _bitwise_same(results[1], results[2]) if len(results) > 1 else None)
    return cell


def run_accuracy(command_line=None, progress=True, seed=0, log=sys.stderr):
    """Every case, op and installed implementation; returns the report (a JSON-ready dict)."""
    from fastln.bench.machine import describe_machine

    installed = ("fastln",) + peers.installed_peers()
    rows = []
    for label, op, kind, axis in OPS:
        operation = OPERATIONS[op]
        for case, dtype, make in CASES:
            if progress:
                print(f"accuracy: {label}, {case}", file=log, flush=True)
            rng = np.random.default_rng(seed)
            x64 = make(rng)
            dy64 = rng.standard_normal(x64.shape)
            x = x64.astype(numpy_dtype(dtype))
            dy = dy64.astype(numpy_dtype(dtype))
            # The reference from the values the implementations really get.
            y_exact, dx_exact = exact(x.astype(np.float64), dy.astype(np.float64), kind, axis)
            reference = dx_exact if "backward" in op else y_exact
            cells = {}
            for implementation in operation.implementations:
                if (implementation.name not in IMPLEMENTATIONS
                        or implementation.peer not in installed
                        or not implementation.supports(dtype)):
                    continue
                cells[implementation.name] = measure(
                    implementation, _inputs(x, dy, x.dtype, axis), reference,
                    numpy_dtype(dtype), axis)
            rows.append({"op": label, "bench_op": op, "case": case, "dtype": dtype,
                         "results": cells})
    return {"schema": SCHEMA, "command": command_line,
            "reference": "float64 from the inputs' exact values: compensated two-pass mean, "
                         "variance of the deviations, textbook gradient (gamma = 1, beta = 0)",
            "shape": [N_ROWS, N_COLS], "eps": EPS, "thread_counts": list(THREAD_COUNTS),
            "machine": describe_machine(peers.peer_versions(peers.installed_peers())),
            "rows": rows}


# --- the table ----------------------------------------------------------------------------------

def format_cell(cell):
    """'3.2e-07 (2.1 ulp)', with 'NaN' when it returned NaN and '1T!=2T' when the thread
    counts disagree; 'error' when it could not run."""
    if cell is None:
        return ""
    if "error" in cell:
        return "error"
    if cell["max_abs"] is None:
        text = "-"
    elif np.isinf(cell["max_abs"]):
        text = "inf"
    else:
        text = f"{cell['max_abs']:.1e} ({cell['max_ulps']:.3g} ulp)"
    if cell["nan"]:
        text += " NaN"
    if cell["bitwise_same_1_and_2_threads"] is False:
        text += " 1T!=2T"
    return text


def table(report):
    """(header, rows of cells), one row per op and case."""
    names = [name for name in IMPLEMENTATIONS
             if any(name in row["results"] for row in report["rows"])]
    rows = [[row["op"], row["case"]] + [format_cell(row["results"].get(name)) for name in names]
            for row in report["rows"]]
    return ["op", "case"] + names, rows


NOTES = (
    "Each cell: the largest |result - exact| over the rows whose exact result is a number, "
    "and the same in units in the last place of the output format at the row's (batch norm: "
    "the feature's) largest exact value (at 1 where that is 0).",
    "NaN: the implementation returned NaN where the exact result is a number. 1T!=2T: its "
    "result with 2 threads differs bitwise from its result with 1, a NaN matching any NaN "
    "(IEEE 754 leaves open which of two NaNs an operation returns; NumPy has no threads: no "
    "mark). error: it could not compute the case (the message is in the JSON).",
    "numpy-naive: x.mean, x.var and broadcasting in the input's dtype (float16 in float32 on "
    "a converted copy). ONNX Runtime has no backward ops.",
)


def format_table(report):
    header, rows = table(report)
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    described = report["machine"]
    out = [f"accuracy against an exact reference on {described['cpu_model']}; "
           f"{report['shape'][0]}x{report['shape'][1]} arrays, eps {report['eps']:g}",
           f"reference: {report['reference']}",
           f"software: numpy {described['numpy']}, "
           + ", ".join(f"{name} {version}" for name, version in described["peers"].items()
                       if name != "numpy"),
           ""]
    previous_op = None
    for row in [header] + rows:
        if row is not header and row[0] == previous_op:
            row = [""] + row[1:]
        else:
            previous_op = row[0] if row is not header else None
            if row is not header:
                out.append("")
        out.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    out += [""] + [f"* {note}" for note in NOTES]
    return "\n".join(out) + "\n"


def format_markdown(report):
    header, rows = table(report)
    out = [f"Accuracy on {report['machine']['cpu_model']}, {report['shape'][0]}x"
           f"{report['shape'][1]} arrays; reference: {report['reference']}.", "",
           "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += [""] + [f"- {note}" for note in NOTES]
    return "\n".join(out) + "\n"


def write_markdown(report, path):
    with open(path, "w") as f:
        f.write(format_markdown(report))
