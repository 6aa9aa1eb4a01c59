"""`fastln bench`: its options, their checking, and the run.

Defaults, and why:
  ops      forward and backward; dtypes float32 and float64; the seven standard shapes, from one
           token's row (1x768: all call overhead) to arrays larger than most caches (32768x1024:
           128 MiB in float32, 256 MiB in float64).
  threads  1 and every CPU this process may use. One thread puts fastln and NumPy (which never
           uses more) on equal terms and shows what a core can do; all CPUs is what a user gets
           from fastln's default and shows how close it comes to the memory bandwidth. Counts
           above the usable CPUs are lowered to them (more threads than CPUs only time the
           operating system's scheduler), with a warning.
  peers    every one that is installed (numpy always is); a requested peer that is not
           installed is skipped with a warning.
  rounds   between 5 and 25 per case, as many as fit in 0.6 s (3 when one round takes more
           than a second: the largest arrays); --repeat N fixes them.
  files    the JSON (every sample) and the plot go to fastln-bench.json and fastln-bench.png
           in the current directory unless --json/--plot name other files or --no-files is
           given; the last lines of the output say where they went.
  --quick  four shapes up to 4096x4096, all CPUs only, shorter samples.

Everything is measured in this process, with the OpenMP wait policy the user has (nothing is
set: by default libgomp's idle workers spin for some milliseconds, then sleep), which is what a
program calling fastln gets. How the runner keeps one library's spinning workers from slowing
the next one down is in fastln.bench.timing; ONNX Runtime's pool does not spin at all.

Every option is checked before any work, and a bad one is one line naming it, exit status 2:
numbers are plain ASCII decimals, finite and within their range; output files must be
writable. A run in which every case was skipped (too large for the memory) exits with status 1.

Nothing heavy is imported here (no peer, no matplotlib): the parser is built every time
`fastln` starts.
"""
import argparse
import os
import re
import sys

from fastln.bench.ops import OPERATIONS
from fastln.bench.peers import PEERS

STANDARD_SHAPES = ((1, 768), (8, 768), (64, 768), (512, 768), (4096, 768), (4096, 4096),
                   (32768, 1024))
QUICK_SHAPES = ((1, 768), (64, 768), (4096, 768), (4096, 4096))
DTYPES = ("float16", "bfloat16", "float32", "float64")
DEFAULT_DTYPES = ("float32", "float64")
OPS = tuple(OPERATIONS)
# LayerNorm only, so that the default run stays at a few minutes; the normalization family
# (rms_*, add_*, batch_norm_*, group_norm*, instance_norm) runs when --ops names it.
DEFAULT_OPS = ("forward", "backward")
DEFAULT_JSON = "fastln-bench.json"
DEFAULT_PLOT = "fastln-bench.png"

# Upper limits of the numeric options: far beyond any useful value, low enough that a run
# ends (a 60 s sample, 10,000 rounds) and that numbers stay in NumPy's integer range.
MAX_SAMPLE_MS = 60_000.0
MAX_REPEAT = 10_000
MAX_SEED = 2**63 - 1
MAX_THREADS = 2**31 - 1  # OpenMP takes a C int; counts above the usable CPUs are lowered anyway
# Each copy buffer may take at most this fraction of the available memory (there are two).
COPY_BUFFER_MEMORY_FRACTION = 0.25

_ASCII_INTEGER = re.compile(r"[0-9]+", re.ASCII)
_ASCII_NUMBER = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def _ascii_int(text):
    """int(text) for plain ASCII decimal digits only (no signs, spaces, underscores or other
    scripts' digits, all of which int() accepts); None otherwise."""
    return int(text) if _ASCII_INTEGER.fullmatch(text) else None


def _comma_list(text, option):
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{option} needs at least one value, got {text!r}")
    return items


def _choices(option, allowed):
    def parse(text):
        items = _comma_list(text, option)
        unknown = [item for item in items if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown value(s) {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join(allowed)}")
        return tuple(dict.fromkeys(items))  # keep the order, drop repeats
    return parse


def parse_shapes(text):
    """'1x768,4096x4096' -> ((1, 768), (4096, 4096)); the last axis is normalized, the others
    are rows. At least two dimensions, so that every implementation sees rows the same way."""
    shapes = []
    for item in _comma_list(text, "--shapes"):
        dims = [_ascii_int(part) for part in item.lower().split("x")]
        if len(dims) < 2 or not all(dim is not None and dim > 0 for dim in dims):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a shape: write rows x columns as positive integers in ASCII "
                f"digits joined by 'x', like 4096x768 or 1x768 (more leading dimensions are "
                f"allowed), and separate shapes with commas")
        shapes.append(tuple(dims))
    return tuple(dict.fromkeys(shapes))


def parse_threads(text):
    """'1,2' or '1,max' -> (1, 2); 'max' is every CPU this process may use."""
    from fastln.bench.machine import usable_cpus

    counts = []
    for item in _comma_list(text, "--threads"):
        count = usable_cpus() if item == "max" else _ascii_int(item)
        if count is None or not 1 <= count <= MAX_THREADS:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a thread count: use integers from 1 to {MAX_THREADS} in "
                f"ASCII digits, or 'max'")
        counts.append(count)
    return tuple(dict.fromkeys(counts))


def parse_dtypes(text):
    """'float32,bfloat16' -> ('float32', 'bfloat16'); bfloat16 needs ml_dtypes (checked here,
    before anything is measured)."""
    import importlib.util

    dtypes = _choices("--dtypes", DTYPES)(text)
    if "bfloat16" in dtypes and importlib.util.find_spec("ml_dtypes") is None:
        raise argparse.ArgumentTypeError("bfloat16 needs ml_dtypes: pip install ml_dtypes")
    return dtypes


def parse_peers(text):
    """'numpy,torch' -> ('numpy', 'torch'); 'none' measures fastln alone."""
    if text.strip() == "none":
        return ()
    return _choices("--peers", PEERS)(text)


def _bounded_int(low, high):
    def parse(text):
        value = _ascii_int(text.strip())
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low} to {high} in ASCII digits, got {text!r}")
        return value
    return parse


def _sample_ms(text):
    value = float(text) if _ASCII_NUMBER.fullmatch(text.strip()) else None
    if value is None or not 0 < value <= MAX_SAMPLE_MS:  # also refuses inf and nan
        raise argparse.ArgumentTypeError(
            f"expected a number of milliseconds above 0 and at most {MAX_SAMPLE_MS:g}, "
            f"got {text!r}")
    return value


def _copy_buffer_mib(text):
    from fastln.bench.machine import memory_bytes

    value = _ascii_int(text.strip())
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (MiB), got {text!r}")
    available = memory_bytes()[1]
    if available and value << 20 > COPY_BUFFER_MEMORY_FRACTION * available:
        raise argparse.ArgumentTypeError(
            f"{value} MiB per buffer (two of them) is more than "
            f"{COPY_BUFFER_MEMORY_FRACTION:.0%} of the {available >> 20} MiB available")
    return value


def writable_path(text):
    """The path, once a file can be created (or appended to) there; checked by doing it, so
    that a run never measures for minutes and then fails to save."""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file name")
    existed = os.path.exists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not existed:
        os.remove(text)
    return text


def _plot_path(text):
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "plotting needs matplotlib: pip install 'fastln[bench]' (or matplotlib)")
    from matplotlib.backend_bases import FigureCanvasBase

    from fastln.bench.report import plot_format

    image_format = plot_format(text)
    if image_format not in FigureCanvasBase.get_supported_filetypes():
        raise argparse.ArgumentTypeError(
            f"{text!r}: matplotlib cannot write {image_format!r} images (use .png, .svg or "
            ".pdf)")
    return writable_path(text)


def _one_line_error(parser):
    """parser.error that prints one line naming the option (argparse's message), without the
    usage block that would bury it; `fastln bench --help` has the usage."""
    def error(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    return error


def add_arguments(parser):
    parser.error = _one_line_error(parser)
    parser.description = ("Time fastln's layer_norm forward and backward against NumPy "
                          "(naive and in place), PyTorch and ONNX Runtime when installed, in one "
                          "process, interleaved, with the same thread count for all; or, with "
                          "--accuracy, compare their errors against an exact reference.")
    parser.epilog = ("Measured with the OpenMP wait policy of this environment (set "
                     "OMP_WAIT_POLICY or GOMP_SPINCOUNT to time another); ONNX Runtime's "
                     "workers do not spin. Before each sample the runner waits until the "
                     "previous library's idle workers stopped spinning, then runs 1 ms and at "
                     "least 3 untimed calls; cases whose rounds disagree, or that are slower "
                     "with more threads, are measured again and flagged if they stay so.")
    parser.add_argument("--accuracy", action="store_true",
                        help="instead of timing: each implementation's error against an exact "
                             "reference on hard inputs (large offsets, constant rows, |x| near "
                             "1e30, float16 above 7600, Inf/NaN), forward and backward, and "
                             "whether it is bitwise the same on 1 and 2 threads (with --json / "
                             "--markdown: those files too)")
    parser.add_argument("--ops", type=_choices("--ops", OPS), default=DEFAULT_OPS,
                        help="operations to time, comma-separated (default: forward,backward, "
                             "a few minutes). LayerNorm: forward, backward. The "
                             "normalization family, run only when named here: rms_forward, "
                             "rms_backward (RMSNorm); add_layer_norm, add_rms_norm (residual "
                             "add + norm, forward; returns y and the sum); batch_norm_train "
                             "(forward in training mode, running statistics updated), "
                             "batch_norm_eval (forward from the running statistics), "
                             "batch_norm_backward (training mode); group_norm, group_norm_last "
                             "(channels last), group_norm_backward, group_norm_last_backward, "
                             "instance_norm. Batch norm "
                             "reads a shape as (N, C) or (N, C, H, W, ...): features on axis 1, "
                             "as in PyTorch; group and instance norm as (N, C, H, W, ...) "
                             "(group_norm_last: the same tensor laid out (N, H, W, ..., C)) "
                             "with gcd(32, C) groups")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated shapes like 1x768,4096x4096 (default: "
                             + ",".join("x".join(map(str, s)) for s in STANDARD_SHAPES) + ")")
    parser.add_argument("--dtypes", type=parse_dtypes, default=DEFAULT_DTYPES,
                        help="comma-separated, from float16, bfloat16 (needs ml_dtypes), "
                             "float32, float64 (default: float32,float64). The half formats run "
                             "every op: fastln and PyTorch on half arrays (batch norm's "
                             "statistics in float32), NumPy's naive code in float32 on a "
                             "converted copy (not batch norm), ONNX Runtime in float16")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="thread counts, e.g. 1,2 or 1,max (default: 1,max; --quick: max); "
                             "counts above the usable CPUs are lowered to them")
    parser.add_argument("--peers", type=parse_peers, default=None,
                        help="implementations to compare with: numpy (both NumPy baselines), "
                             "torch, onnxruntime, or none (default: those installed)")
    parser.add_argument("--repeat", type=_bounded_int(1, MAX_REPEAT), default=None, metavar="N",
                        help="interleaved rounds per case (default: 5-25, as many as fit in "
                             "0.6 s; 3 when a round takes over a second)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes, all CPUs only, shorter samples")
    parser.add_argument("--out-buffer", action="store_true",
                        help="reuse one preallocated output where the implementation allows it")
    parser.add_argument("--json", metavar="FILE", type=writable_path, default=None,
                        help=f"write every measurement and the machine description as JSON "
                             f"(default: {DEFAULT_JSON})")
    parser.add_argument("--markdown", metavar="FILE", type=writable_path, default=None,
                        help="write the results table as Markdown")
    parser.add_argument("--plot", metavar="FILE.png", type=_plot_path, default=None,
                        help=f"draw fastln's speed-up against each peer and the bandwidth by "
                             f"shape (matplotlib; default: {DEFAULT_PLOT} when matplotlib is "
                             f"installed)")
    parser.add_argument("--no-files", action="store_true",
                        help="write no JSON or plot unless --json/--plot name one")
    advanced = parser.add_argument_group("measurement details")
    advanced.add_argument("--min-sample-ms", type=_sample_ms, default=None, metavar="MS",
                          help="shortest timing sample; short calls are repeated to fill it "
                               "(default: 2, --quick: 1)")
    advanced.add_argument("--copy-buffer-mib", type=_copy_buffer_mib, default=None,
                          metavar="MIB", help="size of each copy-bandwidth buffer (default: "
                                              "twice the last-level cache, at least 128)")
    advanced.add_argument("--seed", type=_bounded_int(0, MAX_SEED), default=0,
                          help="seed of the random inputs (a non-negative integer)")
    advanced.add_argument("--no-progress", action="store_true",
                          help="no progress bar on stderr")


def _thread_counts(requested, log=None):
    """The requested counts, each at most the usable CPUs (with a warning), repeats dropped."""
    from fastln.bench.machine import usable_cpus

    log = log or sys.stderr
    cpus = usable_cpus()
    lowered = [count for count in requested if count > cpus]
    if lowered:
        print(f"fastln bench: warning: --threads {','.join(map(str, lowered))}: this process "
              f"may use {cpus} CPUs; measuring with {cpus} threads instead", file=log)
    return tuple(dict.fromkeys(min(count, cpus) for count in requested))


def build_config(args, log=None):
    """A BenchConfig from parsed options, with --quick and the defaults filled in."""
    log = log or sys.stderr
    from fastln.bench import peers, timing
    from fastln.bench.machine import usable_cpus
    from fastln.bench.runner import BenchConfig

    if args.peers is None:
        selected = peers.installed_peers()
    else:
        selected = tuple(peer for peer in args.peers if peers.is_installed(peer))
        for peer in args.peers:
            if peer not in selected:
                print(f"fastln bench: warning: --peers {peer}: not installed, skipped "
                      f"({peers.INSTALL_HINTS.get(peer, 'pip install ' + peer)})", file=log)

    if args.quick:
        schedule = timing.Schedule(min_sample_seconds=0.001, min_rounds=3, max_rounds=10,
                                   case_budget_seconds=0.2, slow_min_rounds=3)
        default_shapes, default_threads = QUICK_SHAPES, (usable_cpus(),)
    else:
        schedule = timing.Schedule()
        default_shapes = STANDARD_SHAPES
        default_threads = tuple(dict.fromkeys((1, usable_cpus())))
    if args.min_sample_ms is not None:
        schedule.min_sample_seconds = args.min_sample_ms / 1e3
    schedule.fixed_rounds = args.repeat

    return BenchConfig(
        ops=tuple(args.ops),
        shapes=args.shapes or default_shapes,
        dtypes=tuple(args.dtypes),
        threads=_thread_counts(args.threads or default_threads, log),
        peers=selected,
        out_buffer=args.out_buffer,
        schedule=schedule,
        copy_buffer_bytes=None if args.copy_buffer_mib is None else args.copy_buffer_mib << 20,
        copy_repeats=3 if args.quick else 5,
        seed=args.seed,
        progress=not args.no_progress,
    )


def output_files(args, log=None):
    """{kind: path} of the files to write: those named, and unless --no-files the default JSON
    and plot (the plot only with matplotlib; a default that cannot be written is left out with
    a warning, never an error: the user did not ask for it)."""
    import importlib.util

    log = log or sys.stderr
    files = {kind: getattr(args, kind) for kind in ("json", "markdown", "plot")
             if getattr(args, kind)}
    if args.no_files:
        return files
    defaults = {"json": DEFAULT_JSON}
    if importlib.util.find_spec("matplotlib") is not None:
        defaults["plot"] = DEFAULT_PLOT
    for kind, path in defaults.items():
        if kind in files:
            continue
        try:
            files[kind] = writable_path(path)
        except argparse.ArgumentTypeError as exc:
            print(f"fastln bench: warning: no {kind} file: {exc}", file=log)
    return files


def run(args):
    """Run the benchmark (or --accuracy), print the table, write the files; the exit status."""
    from fastln.bench import report as output

    command_line = getattr(args, "command_line", None)
    if args.accuracy:
        from fastln.bench import accuracy

        # Only the files asked for: --accuracy has no plot and writes nothing by default.
        files = {kind: getattr(args, kind) for kind in ("json", "markdown")
                 if getattr(args, kind)}
        result = accuracy.run_accuracy(command_line, progress=not args.no_progress,
                                       seed=args.seed)
        sys.stdout.write(accuracy.format_table(result))
        writers = {"json": output.write_json, "markdown": accuracy.write_markdown}
    else:
        from fastln.bench.runner import run_benchmark

        files = output_files(args)
        result = run_benchmark(build_config(args), command_line=command_line)
        sys.stdout.write(output.format_table(result))
        writers = {"json": output.write_json, "markdown": output.write_markdown,
                   "plot": output.write_plot}
    written, status = {}, 0
    if not args.accuracy and not result["results"] and result["skipped"]:
        print("fastln bench: error: nothing was measured: every case was skipped (see above)",
              file=sys.stderr)
        status = 1
    for kind, path in files.items():
        try:
            writers[kind](result, path)
            written[kind] = path
        except OSError as exc:  # a full disk, /dev/full: the table above is all there is
            print(f"fastln bench: error: argument --{kind}: cannot write {path!r}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            status = 2
    if written:
        print("\nwrote " + ", ".join(f"{kind} {os.path.abspath(path)}"
                                     for kind, path in written.items()))
    return status

