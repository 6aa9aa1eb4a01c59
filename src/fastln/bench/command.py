"""`fastln bench`: its options, their checking, and the run.

Defaults, and why:
  ops      forward and backward; dtypes float32 and float64; the seven standard shapes, from one
           token's row (1x768: all call overhead) to arrays larger than most caches (32768x1024:
           128 MiB in float32, 256 MiB in float64).
  threads  1 and every CPU this process may use. One thread puts fastln and NumPy (which never
           uses more) on equal terms and shows what a core can do; all CPUs is what a user gets
           from fastln's default and shows how close it comes to the memory bandwidth. Both fit
           in about two minutes on a 2-core machine.
  peers    every one that is installed (numpy always is); a requested peer that is not
           installed is skipped with a warning.
  rounds   between 5 and 25 per case, as many as fit in 0.6 s (3 when one round takes more
           than a second: the largest arrays); --repeat N fixes them.
  --quick  four shapes up to 4096x4096, all CPUs only, shorter samples: under a minute.

The measurements run in a child process with GOMP_SPINCOUNT=10000 (unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is already set, which is then respected): how long an idle OpenMP worker spins,
waiting for the next parallel region, before it sleeps. Interleaving puts several thread pools in
one process (libgomp's, which fastln and PyTorch share, and ONNX Runtime's); by default libgomp's
idle workers spin for 300,000 iterations (about 5 ms on the machine of docs/results.md) and ONNX
Runtime's for tens of milliseconds, so on a machine with few cores the next implementation waits
for a core and multi-threaded timings are off by orders of magnitude. Workers that sleep at once
(OMP_WAIT_POLICY=PASSIVE) must be woken through the kernel at every call instead, which costs
tens of microseconds on a virtual machine: a 512x768 forward became slower with two threads than
with one. 10,000 iterations (about 0.2 ms there) keep a pool awake between back-to-back calls
and free the cores soon after the last one; ONNX Runtime's workers spin as briefly
(fastln.bench.ops.base.onnxruntime_spinning), and every sample follows a millisecond of untimed
calls that outlasts the previous implementation's spinning (fastln.bench.timing). The count must
be set before libgomp loads, hence the fresh process. docs/performance.md has the figures.

Nothing heavy is imported here (no peer, no matplotlib): the parser is built every time
`fastln` starts.
"""
import argparse
import os
import subprocess
import sys

from fastln.bench.ops import OPERATIONS
from fastln.bench.peers.onnxruntime import ONNXRUNTIME_SPIN_MICROSECONDS
from fastln.bench.peers import PEERS

STANDARD_SHAPES = ((1, 768), (8, 768), (64, 768), (512, 768), (4096, 768), (4096, 4096),
                   (32768, 1024))
QUICK_SHAPES = ((1, 768), (64, 768), (4096, 768), (4096, 4096))
DTYPES = ("float16", "bfloat16", "float32", "float64")
DEFAULT_DTYPES = ("float32", "float64")
OPS = tuple(OPERATIONS)
# libgomp's spin before an idle worker sleeps, in iterations of a pause loop (see above).
GOMP_SPIN_COUNT = 10000
# LayerNorm only, so that the default run stays at about two minutes; the normalization family
# (rms_*, add_*, batch_norm_*) runs when --ops names it.
DEFAULT_OPS = ("forward", "backward")


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
        parts = item.lower().split("x")
        if len(parts) < 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a shape: write rows x columns as positive integers joined "
                f"by 'x', like 4096x768 or 1x768 (more leading dimensions are allowed), and "
                f"separate shapes with commas")
        shapes.append(tuple(int(part) for part in parts))
    return tuple(dict.fromkeys(shapes))


def parse_threads(text):
    """'1,2' or '1,max' -> (1, 2); 'max' is every CPU this process may use."""
    from fastln.bench.machine import usable_cpus

    counts = []
    for item in _comma_list(text, "--threads"):
        if item == "max":
            counts.append(usable_cpus())
        elif item.isdigit() and int(item) > 0:
            counts.append(int(item))
        else:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a thread count: use positive integers or 'max'")
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


def _positive_int(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _plot_path(text):
    # Checked before the run, not after two minutes of measuring.
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "plotting needs matplotlib: pip install 'fastln[bench]' (or matplotlib)")
    return text


def add_arguments(parser):
    parser.description = ("Time fastln's layer_norm forward and backward against NumPy "
                          "(naive and in place), PyTorch and ONNX Runtime when installed, in one "
                          "process, interleaved, with the same thread count for all.")
    parser.epilog = (f"The measurements run in a child process with "
                     f"GOMP_SPINCOUNT={GOMP_SPIN_COUNT}, so that idle OpenMP workers stay awake "
                     "between one library's back-to-back calls but soon stop spinning on the "
                     "cores the next one needs (ONNX Runtime's spin for "
                     f"{ONNXRUNTIME_SPIN_MICROSECONDS} µs), and every sample follows 1 ms and "
                     "at least 3 untimed calls; set GOMP_SPINCOUNT or "
                     "OMP_WAIT_POLICY yourself to measure in this process with your policy "
                     "(OMP_WAIT_POLICY=passive stops ONNX Runtime's spinning too).")
    parser.add_argument("--ops", type=_choices("--ops", OPS), default=DEFAULT_OPS,
                        help="operations to time, comma-separated (default: forward,backward, "
                             "about two minutes). LayerNorm: forward, backward. The "
                             "normalization family, run only when named here: rms_forward, "
                             "rms_backward (RMSNorm); add_layer_norm, add_rms_norm (residual "
                             "add + norm, forward; returns y and the sum); batch_norm_train "
                             "(forward in training mode, running statistics updated), "
                             "batch_norm_backward (training mode). Batch norm reads a shape as "
                             "(N, C) or (N, C, H, W, ...): features on axis 1, as in PyTorch")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated shapes like 1x768,4096x4096 (default: "
                             + ",".join("x".join(map(str, s)) for s in STANDARD_SHAPES) + ")")
    parser.add_argument("--dtypes", type=parse_dtypes, default=DEFAULT_DTYPES,
                        help="comma-separated, from float16, bfloat16 (needs ml_dtypes), "
                             "float32, float64 (default: float32,float64). The half formats run "
                             "the LayerNorm, RMSNorm and fused add ops: fastln and PyTorch on "
                             "half arrays, NumPy's naive code in float32 on a converted copy, "
                             "ONNX Runtime in float16")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="thread counts, e.g. 1,2 or 1,max (default: 1,max; --quick: max)")
    parser.add_argument("--peers", type=parse_peers, default=None,
                        help="implementations to compare with: numpy (both NumPy baselines), "
                             "torch, onnxruntime, or none (default: those installed)")
    parser.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                        help="interleaved rounds per case (default: 5-25, as many as fit in "
                             "0.6 s; 3 when a round takes over a second)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes, all CPUs only, shorter samples: under a minute")
    parser.add_argument("--out-buffer", action="store_true",
                        help="reuse one preallocated output where the implementation allows it")
    parser.add_argument("--json", metavar="FILE", help="write every measurement and the machine "
                                                       "description as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the results table as Markdown")
    parser.add_argument("--plot", metavar="FILE.png", type=_plot_path,
                        help="draw bandwidth by shape for every implementation (matplotlib)")
    advanced = parser.add_argument_group("measurement details")
    advanced.add_argument("--min-sample-ms", type=_positive_float, default=None, metavar="MS",
                          help="shortest timing sample; short calls are repeated to fill it "
                               "(default: 2, --quick: 1)")
    advanced.add_argument("--copy-buffer-mib", type=_positive_int, default=None, metavar="MIB",
                          help="size of each copy-bandwidth buffer (default: twice the "
                               "last-level cache, at least 128)")
    advanced.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    advanced.add_argument("--no-progress", action="store_true",
                          help="no progress bar on stderr")


def build_config(args):
    """A BenchConfig from parsed options, with --quick and the defaults filled in."""
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
                      f"({peers.INSTALL_HINTS.get(peer, 'pip install ' + peer)})",
                      file=sys.stderr)

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
        threads=args.threads or default_threads,
        peers=selected,
        out_buffer=args.out_buffer,
        schedule=schedule,
        copy_buffer_bytes=None if args.copy_buffer_mib is None else args.copy_buffer_mib << 20,
        copy_repeats=3 if args.quick else 5,
        seed=args.seed,
        progress=not args.no_progress,
    )


# Marks the child process, so that it measures instead of spawning again.
CHILD_ENVIRONMENT = "FASTLN_BENCH_CHILD"


def _wait_policy_is_set():
    return any(name in os.environ for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                               CHILD_ENVIRONMENT))


def _run_in_child(argv):
    """Run `fastln <argv>` in a fresh process whose idle OpenMP workers spin only briefly."""
    environment = dict(os.environ, GOMP_SPINCOUNT=str(GOMP_SPIN_COUNT),
                       **{CHILD_ENVIRONMENT: "1"})
    # stderr (progress bar, warnings) goes straight through; stdout is relayed so that the
    # table lands wherever this process's stdout points.
    try:
        child = subprocess.run([sys.executable, "-m", "fastln", *argv], env=environment,
                               stdout=subprocess.PIPE, text=True)
    except KeyboardInterrupt:  # the child got the Ctrl-C too and stops on its own
        return 130
    sys.stdout.write(child.stdout)
    sys.stdout.flush()
    return child.returncode


def run(args):
    """Run the benchmark, print the table, write the requested files; returns the exit status."""
    argv = getattr(args, "argv", None)
    if argv is not None and not _wait_policy_is_set():
        return _run_in_child(argv)

    from fastln.bench import report as output
    from fastln.bench.runner import run_benchmark

    config = build_config(args)
    result = run_benchmark(config, command_line=getattr(args, "command_line", None))
    sys.stdout.write(output.format_table(result))
    written = []
    if args.json:
        output.write_json(result, args.json)
        written.append(args.json)
    if args.markdown:
        output.write_markdown(result, args.markdown)
        written.append(args.markdown)
    if args.plot:
        output.write_plot(result, args.plot)
        written.append(args.plot)
    for path in written:
        print(f"wrote {os.path.abspath(path)}", file=sys.stderr)
    return 0
