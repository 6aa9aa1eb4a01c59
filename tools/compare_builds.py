"""Hold this checkout's build of fastln against a previous one, in one process.

    tools/build_previous.sh REV                       # installs REV as fastln_previous
    python tools/compare_builds.py --bits 600         # random cases, every output bit for bit
    python tools/compare_builds.py --time             # interleaved timings, new/previous ratios

--bits draws random calls over the operations (forward and backward), dtypes, shapes, axes,
layouts (contiguous, Fortran order, strided, byte-swapped), values (large offsets, constant
rows, zeros, NaN and Inf, float64 extremes), eps, parameters, out= and thread counts, runs each
on both builds and compares every array they return (and the running statistics they update)
bit for bit. A call the previous build refuses (a dtype it had no kernel for) is counted apart.
--time times both builds on the standard shapes, interleaved, and prints the medians and their
ratio (new / previous: below 1 is faster).
"""
import argparse
import importlib
import statistics
import sys
import time

import numpy as np

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

WIDTHS = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 768, 777, 1024, 4096)
DTYPES = ["float32", "float64", "float16"] + (["bfloat16"] if ml_dtypes else [])
OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "batch_norm", "group_norm")


def numpy_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def values(rng, shape, dtype_name):
    """Random rows of one of the value families the kernels treat apart."""
    family = rng.choice(["normal", "offset", "tiny", "constant", "zeros", "special", "huge"])
    x = rng.standard_normal(shape)
    if family == "offset":
        x = x * 10.0 ** rng.integers(-3, 2) + rng.choice([1e3, 1e4, 1e5, -3e5, 1e6])
    elif family == "tiny":
        x = x * (1e-30 if dtype_name != "float64" else rng.choice([1e-160, 1e-300, 1e-310]))
    elif family == "constant":
        x = np.full(shape, rng.choice([0.0, 1.5, -1234.0, 1e4]))
    elif family == "zeros":
        x = np.zeros(shape)
    elif family == "special" and x.size:
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size)] = rng.choice([np.nan, np.inf, -np.inf])
    elif family == "huge" and dtype_name == "float64":
        x = x * rng.choice([1e150, 1e200, 1e300]) + rng.choice([0.0, 1e300])
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(numpy_dtype(dtype_name))


def layout(rng, array):
    """The same values in another memory layout."""
    kind = rng.choice(["contiguous", "fortran", "strided", "swapped"])
    if kind == "fortran":
        return np.asfortranarray(array)
    if kind == "strided":
        padded = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
        padded[..., ::2] = array
        return padded[..., ::2]
    if kind == "swapped" and array.dtype.kind == "f":
        return array.astype(array.dtype.newbyteorder())
    return array


def random_case(rng):
    op = rng.choice(OPS)
    dtype_name = rng.choice(DTYPES)
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(rng.choice((1, 2, 3, 5, 9, 33))) for _ in range(ndim - 1))
    shape += (int(rng.choice(WIDTHS)),)
    if op == "batch_norm" and ndim == 1:
        shape = (int(rng.choice((2, 3, 40))),) + shape
    axis = int(rng.integers(-len(shape), len(shape))) if rng.random() < 0.3 else -1
    if op == "batch_norm":
        axis = int(rng.choice([-1, 1 % len(shape)]))
    num_groups = 1
    if op == "group_norm":  # (N, C, *spatial), channels on axis 1 or last
        n_channels = int(rng.choice((1, 2, 3, 4, 6, 8, 32, 64)))
        num_groups = int(rng.choice([g for g in range(1, n_channels + 1) if n_channels % g == 0]))
        spatial = tuple(int(rng.choice((1, 3, 7, 16, 33, 64))) for _ in range(rng.integers(0, 3)))
        shape = (int(rng.choice((1, 2, 3, 5))), n_channels) + spatial
        axis = int(rng.choice([1, -1]))
        if axis == -1:
            shape = (shape[0],) + spatial + (n_channels,)
    x = values(rng, shape, dtype_name)
    return dict(op=op, dtype=dtype_name, shape=shape, axis=axis, x=x,
                residual=values(rng, shape, dtype_name), dy=values(rng, shape, dtype_name),
                layout_seed=int(rng.integers(1 << 30)), eps=float(rng.choice([1e-5, 0.0, 1e-3])),
                params=bool(rng.random() < 0.7), num_threads=int(rng.choice([1, 2, 3])),
                training=bool(rng.random() < 0.7), in_place=bool(rng.random() < 0.2),
                param_seed=int(rng.integers(1 << 30)), num_groups=num_groups)


def parameters(case, rng, shape, dtype, count):
    """gamma (around 1), then count - 1 standard normal arrays (beta, then bias), of shape and
    dtype, drawn from rng in that order; all None for a case without parameters."""
    if not case["params"]:
        return (None,) * count
    gamma = (1 + 0.1 * rng.standard_normal(shape)).astype(dtype)
    return (gamma,) + tuple(rng.standard_normal(shape).astype(dtype) for _ in range(count - 1))


def run(module, case):
    """Every array the case's calls return or update, in a fixed order."""
    rng = np.random.default_rng(case["layout_seed"])
    x, residual, dy = (layout(rng, case[name].copy()) for name in ("x", "residual", "dy"))
    shape, axis, op = case["shape"], case["axis"], case["op"]
    param_rng = np.random.default_rng(case["param_seed"])
    half = case["dtype"] in ("float16", "bfloat16")
    # Half-precision parameters come as float32 or, every other case, in x's own format (as a
    # model in float16 holds them); the parameter seed decides, so the cases stay those of
    # earlier versions of this script.
    half_params = half and case["param_seed"] % 2 == 1
    param_dtype = np.float32 if half and not half_params else numpy_dtype(case["dtype"])
    common = dict(num_threads=case["num_threads"])
    if op == "batch_norm":
        n_features = shape[axis]
        gamma, beta = parameters(case, param_rng, n_features, param_dtype, 2)
        running_mean = param_rng.standard_normal(n_features)
        running_var = param_rng.random(n_features) + 0.5
        y, cache = module.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                             training=case["training"], eps=case["eps"],
                                             axis=axis, **common)
        dx, dgamma, dbeta = module.batch_norm_backward(dy, cache, gamma, **common)
        return [y, cache.mean, cache.rstd, running_mean, running_var, dx, dgamma, dbeta]
    if op == "group_norm":
        gamma, beta = parameters(case, param_rng, shape[axis], param_dtype, 2)
        y, cache = module.group_norm_forward(x, case["num_groups"], gamma, beta, eps=case["eps"],
                                             channel_axis=axis, **common)
        return [y, cache.mean, cache.rstd] + list(module.group_norm_backward(dy, cache, gamma,
                                                                             **common))
    normalized = shape[axis % len(shape):]
    gamma, beta, bias = parameters(case, param_rng, normalized, param_dtype, 3)
    if op in ("layer_norm", "rms_norm"):
        forward = getattr(module, op + "_forward")
        args = (gamma, beta) if op == "layer_norm" else (gamma,)
        y, cache = forward(x, *args, eps=case["eps"], axis=axis, **common)
        outputs = [y, cache.rstd] + ([cache.mean] if op == "layer_norm" else [])
        if case["in_place"] and x.flags.c_contiguous and x.dtype.isnative:
            in_place = x.copy()
            getattr(module, op)(in_place, *args, eps=case["eps"], axis=axis, out=in_place,
                                **common)
            outputs.append(in_place)
        outputs += list(getattr(module, op + "_backward")(dy, cache, gamma, **common))
        return outputs
    forward = getattr(module, op + "_forward")
    args = (gamma, beta) if op == "add_layer_norm" else (gamma,)
    y, s, cache = forward(x, residual, *args, eps=case["eps"], bias=bias, axis=axis, **common)
    backward = getattr(module, op.replace("add_", "") + "_backward")
    return [y, s, cache.rstd] + list(backward(dy, cache, gamma, **common))


def bits(array):
    array = np.ascontiguousarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}")) if array.dtype.itemsize in (2, 4, 8) \
        else array


def same_bits(a, b):
    """Every element the same bits, except that two NaNs match whatever their sign and payload
    (which NaN an operation passes on depends on the operand order the compiler picks for a
    commutative operation; NumPy promises nothing about it either)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a_bits, b_bits = bits(a).reshape(-1), bits(b).reshape(-1)
    differ = a_bits != b_bits
    if not differ.any():
        return True
    with np.errstate(invalid="ignore"):
        a_nan = np.isnan(np.asarray(a, np.float64).reshape(-1))
        b_nan = np.isnan(np.asarray(b, np.float64).reshape(-1))
    return bool(np.all(a_nan[differ] & b_nan[differ]))


def compare_bits(new, previous, n_cases, seed):
    rng = np.random.default_rng(seed)
    counts = {"same": 0, "different": 0, "refused by previous": 0, "refused by both": 0}
    for index in range(n_cases):
        case = random_case(rng)
        results = []
        for module in (new, previous):
            with np.errstate(all="ignore"):
                try:
                    results.append(("ok", run(module, case)))
                except (TypeError, ValueError) as error:
                    results.append(("error", f"{type(error).__name__}: {error}"))
        (new_status, new_out), (old_status, old_out) = results
        if old_status == "error" and new_status == "error":
            counts["refused by both"] += 1
        elif old_status == "error":
            counts["refused by previous"] += 1
        elif new_status == "error":
            counts["different"] += 1
            print(f"case {index}: only the new build refuses: {new_out}", case["op"],
                  case["dtype"], case["shape"])
        elif len(new_out) == len(old_out) and all(same_bits(a, b)
                                                   for a, b in zip(new_out, old_out)):
            counts["same"] += 1
        else:
            counts["different"] += 1
            where = [i for i, (a, b) in enumerate(zip(new_out, old_out)) if not same_bits(a, b)]
            print(f"case {index}: outputs {where} differ:", {k: case[k] for k in
                  ("op", "dtype", "shape", "axis", "eps", "params", "num_threads", "training",
                   "num_groups")})
    print(", ".join(f"{count} {name}" for name, count in counts.items()), f"of {n_cases} cases")
    return counts["different"] == 0


def median_seconds(calls, rounds):
    """Interleaved rounds: each round times every call once (a sample of at least 2 ms)."""
    numbers = {}
    for name, call in calls.items():
        call()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.002:
            call()
            n += 1
        numbers[name] = max(n, 1)
    samples = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(reversed(list(calls)))):
            call = calls[name]
            for _ in range(3):
                call()
            start = time.perf_counter()
            for _ in range(numbers[name]):
                call()
            samples[name].append((time.perf_counter() - start) / numbers[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def compare_times(new, previous, shapes, dtypes, threads, ops, rounds, half_params=False):
    rng = np.random.default_rng(0)
    print(f"{'op':22s} {'shape':11s} {'dtype':8s} thr  new(us)  previous(us)  new/previous")
    for shape in shapes:
        n = shape[1] if len(shape) > 2 else shape[-1]  # parameters: per feature (axis 1) or column
        for dtype_name in dtypes:
            dtype = numpy_dtype(dtype_name)
            param_dtype = np.float32 if dtype.itemsize == 2 and not half_params else dtype
            x = rng.standard_normal(shape).astype(dtype)
            residual = rng.standard_normal(shape).astype(dtype)
            dy = rng.standard_normal(shape).astype(dtype)
            gamma = rng.standard_normal(n).astype(param_dtype)
            beta = rng.standard_normal(n).astype(param_dtype)
            for op in ops:
                for t in threads:
                    calls = {}
                    for label, module in (("new", new), ("previous", previous)):
                        try:
                            calls[label] = timed_call(module, op, x, residual, dy, gamma, beta, t)
                        except TypeError:
                            break
                    if len(calls) < 2:
                        continue
                    medians = median_seconds(calls, rounds)
                    label = "x".join(str(d) for d in shape)
                    print(f"{op:22s} {label:11s} {dtype_name:8s} {t:3d} {medians['new'] * 1e6:8.1f}"
                          f" {medians['previous'] * 1e6:12.1f} {medians['new'] / medians['previous']:12.3f}",
                          flush=True)


def timed_call(module, op, x, residual, dy, gamma, beta, threads):
    out = np.empty_like(x)
    if op == "layer_norm":
        return lambda: module.layer_norm(x, gamma, beta, out=out, num_threads=threads)
    if op == "rms_norm":
        return lambda: module.rms_norm(x, gamma, out=out, num_threads=threads)
    if op == "layer_norm_backward":
        _, cache = module.layer_norm_forward(x, gamma, beta)
        return lambda: module.layer_norm_backward(dy, cache, gamma, out=out, num_threads=threads)
    if op == "rms_norm_backward":
        _, cache = module.rms_norm_forward(x, gamma)
        return lambda: module.rms_norm_backward(dy, cache, gamma, out=out, num_threads=threads)
    if op == "add_layer_norm":
        s = np.empty_like(x)
        return lambda: module.add_layer_norm(x, residual, gamma, beta, out=out, sum_out=s,
                                             num_threads=threads)
    if op == "add_rms_norm":
        s = np.empty_like(x)
        return lambda: module.add_rms_norm(x, residual, gamma, out=out, sum_out=s,
                                           num_threads=threads)
    if op.startswith("group_norm"):  # NCHW shapes; 32 groups (fewer if C < 32)
        groups = int(np.gcd(32, x.shape[1]))
        if op == "group_norm":
            return lambda: module.group_norm(x, groups, gamma, beta, out=out, num_threads=threads)
        if op == "group_norm_backward":
            _, cache = module.group_norm_forward(x, groups, gamma, beta)
            return lambda: module.group_norm_backward(dy, cache, gamma, out=out,
                                                      num_threads=threads)
        x_last = np.ascontiguousarray(np.moveaxis(x, 1, -1))
        out_last = np.empty_like(x_last)
        if op == "group_norm_last_backward":
            dy_last = np.ascontiguousarray(np.moveaxis(dy, 1, -1))
            _, cache = module.group_norm_forward(x_last, groups, gamma, beta, channel_axis=-1)
            return lambda: module.group_norm_backward(dy_last, cache, gamma, out=out_last,
                                                      num_threads=threads)
        return lambda: module.group_norm(x_last, groups, gamma, beta, channel_axis=-1,
                                         out=out_last, num_threads=threads)
    axis = 1 if x.ndim > 2 else -1  # NCHW: features on axis 1
    if op in ("batch_norm_train", "batch_norm_eval"):
        mean, var = np.zeros(x.shape[axis]), np.ones(x.shape[axis])
        training = op == "batch_norm_train"
        return lambda: module.batch_norm(x, gamma, beta, mean, var, training=training, axis=axis,
                                         out=out, num_threads=threads)
    if op == "batch_norm_backward":
        _, cache = module.batch_norm_forward(x, gamma, beta, training=True, axis=axis)
        return lambda: module.batch_norm_backward(dy, cache, gamma, out=out, num_threads=threads)
    raise ValueError(op)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--previous", default="fastln_previous",
                        help="the module name of the previous build (default fastln_previous)")
    parser.add_argument("--bits", type=int, metavar="N", help="compare N random cases bit for bit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time", action="store_true", help="interleaved timings")
    parser.add_argument("--shapes", default="1x768,8x768,64x768,512x768,4096x768,4096x4096,32768x1024")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--ops", default="layer_norm,layer_norm_backward,rms_norm,rms_norm_backward,"
                                         "add_layer_norm,add_rms_norm")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--half-params", action="store_true",
                        help="time float16/bfloat16 with gamma and beta in x's format (else float32)")
    parser.add_argument("--instruction-set", help="run both builds' kernels of this variant "
                        "(fastln._kernels.instruction_sets())")
    args = parser.parse_args(argv)
    new = importlib.import_module("fastln")
    previous = importlib.import_module(args.previous)
    if args.instruction_set:
        new._kernels.use_instruction_set(args.instruction_set)
        previous._kernels.use_instruction_set(args.instruction_set)
    print(f"fastln kernels: {new._kernels.instruction_set()}, "
          f"previous: {previous._kernels.instruction_set()}")
    ok = True
    if args.bits:
        ok = compare_bits(new, previous, args.bits, args.seed)
    if args.time:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        compare_times(new, previous, shapes, args.dtypes.split(","),
                      [int(t) for t in args.threads.split(",")], args.ops.split(","), args.rounds,
                      args.half_params)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
