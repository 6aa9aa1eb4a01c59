"""A pre-norm transformer (inference) in NumPy, with fastln's fused residual add + LayerNorm.

Each pre-norm block normalizes the residual stream before each sublayer and adds the sublayer's
output back (the placement of GPT-2 and most LLMs since)::

    h = h + attention(layer_norm_1(h))
    h = h + mlp(layer_norm_2(h))

and the stack ends with a final LayerNorm. Every "add the sublayer's output, then normalize for
the next sublayer" is one call to :func:`fastln.add_layer_norm`, which reads the sublayer output
and the residual stream once, writes the new stream and its normalization once, and folds the
sublayer's output bias into the same pass::

    y, h = fastln.add_layer_norm(out, h, ln.weight, ln.bias, bias=b_out, sum_out=h)

The same stack written with NumPy only (``h = h + (out + b_out)``, then mean, var, normalize,
scale, shift) is timed against it, in the same process, interleaved, with the same attention and
MLP code (the matrix products, which dominate, are NumPy's in both). The outputs are compared.

fastln's OpenMP threads and NumPy's BLAS threads take turns on the same cores; on a machine that
is busy with other work, ``--threads 1`` (or ``OMP_WAIT_POLICY=passive``) can be faster than the
default of one thread per core.

    python examples/prenorm_transformer_block.py               # 10-30 s on 2 cores
    python examples/prenorm_transformer_block.py --layers 1 --seq 16 --d-model 64 --heads 4
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

import fastln
import fastln.nn


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

class Block:
    """The weights of one pre-norm block: two LayerNorms, attention, MLP (4x wide, GELU)."""

    def __init__(self, d_model, n_heads, rng, dtype):
        def matrix(n_in, n_out):
            return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(dtype)

        def vector(n, scale=0.02):
            return (scale * rng.standard_normal(n)).astype(dtype)

        self.n_heads = n_heads
        self.norm_1 = random_layer_norm(d_model, rng, dtype)
        self.w_qkv, self.b_qkv = matrix(d_model, 3 * d_model), vector(3 * d_model)
        self.w_out, self.b_out = matrix(d_model, d_model), vector(d_model)
        self.norm_2 = random_layer_norm(d_model, rng, dtype)
        self.w_up, self.b_up = matrix(d_model, 4 * d_model), vector(4 * d_model)
        self.w_down, self.b_down = matrix(4 * d_model, d_model), vector(d_model)


def random_layer_norm(d_model, rng, dtype):
    """A fastln.nn.LayerNorm with "trained-looking" weight and bias (not just ones and zeros)."""
    norm = fastln.nn.LayerNorm(d_model, dtype=dtype)
    norm.weight[...] = 1.0 + 0.1 * rng.standard_normal(d_model)
    norm.bias[...] = 0.1 * rng.standard_normal(d_model)
    return norm


# ---------------------------------------------------------------------------------------------
# Sublayers (shared by both versions): they return their output WITHOUT its final bias, which
# the add + norm step adds.
# ---------------------------------------------------------------------------------------------

def attention(y, block):
    """Causal multi-head self-attention of y (batch, seq, d_model), before the output bias."""
    batch, seq, d_model = y.shape
    head_dim = d_model // block.n_heads
    qkv = y @ block.w_qkv + block.b_qkv
    qkv = qkv.reshape(batch, seq, 3, block.n_heads, head_dim).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]                  # (batch, heads, seq, head_dim)
    scores = (q @ k.transpose(0, 1, 3, 2)) * np.asarray(1.0 / np.sqrt(head_dim), y.dtype)
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d_model)
    return context @ block.w_out


def gelu(x):
    """GELU, tanh approximation (GPT-2's)."""
    return 0.5 * x * (1.0 + np.tanh(np.asarray(0.7978845608028654, x.dtype)
                                    * (x + np.asarray(0.044715, x.dtype) * x * x * x)))


def mlp(y, block):
    return gelu(y @ block.w_up + block.b_up) @ block.w_down


# ---------------------------------------------------------------------------------------------
# The two ways to add the sublayer output into the residual stream and normalize the result
# ---------------------------------------------------------------------------------------------

def numpy_layer_norm(s, norm):
    mean = s.mean(axis=-1, keepdims=True)
    var = s.var(axis=-1, keepdims=True)
    return (s - mean) / np.sqrt(var + np.asarray(norm.eps, s.dtype)) * norm.weight + norm.bias


def numpy_add_norm(out, h, bias, norm):
    """(y, new h) with NumPy: h + (out + bias), then LayerNorm of it."""
    h = h + (out + bias)
    return numpy_layer_norm(h, norm), h


def fastln_add_norm(out, h, bias, norm, num_threads=None):
    """(y, new h) in one fastln pass; the residual stream h is updated in place."""
    return fastln.add_layer_norm(out, h, norm.weight, norm.bias, norm.eps, bias=bias,
                                 sum_out=h, num_threads=num_threads)


def forward(x, blocks, final_norm, add_norm, first_norm, clock=None):
    """The stack's output for x (batch, seq, d_model); `clock` sums the add + norm seconds."""
    clock = clock if clock is not None else {}
    clock.setdefault("add_norm", 0.0)
    start = time.perf_counter()
    h = x.copy()                       # the residual stream (updated in place by fastln)
    y = first_norm(h, blocks[0].norm_1)
    clock["add_norm"] += time.perf_counter() - start
    for index, block in enumerate(blocks):
        out = attention(y, block)
        start = time.perf_counter()
        y, h = add_norm(out, h, block.b_out, block.norm_2)
        clock["add_norm"] += time.perf_counter() - start
        out = mlp(y, block)
        next_norm = blocks[index + 1].norm_1 if index + 1 < len(blocks) else final_norm
        start = time.perf_counter()
        y, h = add_norm(out, h, block.b_down, next_norm)
        clock["add_norm"] += time.perf_counter() - start
    return y


def numpy_forward(x, blocks, final_norm, clock=None):
    return forward(x, blocks, final_norm, numpy_add_norm, numpy_layer_norm, clock)


def fastln_forward(x, blocks, final_norm, clock=None, num_threads=None):
    def first_norm(h, norm):
        return fastln.layer_norm(h, norm.weight, norm.bias, norm.eps, num_threads=num_threads)

    def add_norm(out, h, bias, norm):
        return fastln_add_norm(out, h, bias, norm, num_threads)

    return forward(x, blocks, final_norm, add_norm, first_norm, clock)


# ---------------------------------------------------------------------------------------------
# Timing and report
# ---------------------------------------------------------------------------------------------

def time_both(x, blocks, final_norm, repeat, num_threads=None):
    """Median seconds of each version (whole forward, and its add + norm steps), interleaved."""
    def run_fastln(x, blocks, final_norm, clock=None):
        return fastln_forward(x, blocks, final_norm, clock, num_threads)

    versions = {"numpy": numpy_forward, "fastln": run_fastln}
    for run in versions.values():  # warm-up: first-touch of buffers, BLAS thread start-up
        run(x, blocks, final_norm)
    totals = {name: [] for name in versions}
    add_norms = {name: [] for name in versions}
    for _ in range(repeat):
        for name, run in versions.items():
            clock = {}
            start = time.perf_counter()
            run(x, blocks, final_norm, clock)
            totals[name].append(time.perf_counter() - start)
            add_norms[name].append(clock["add_norm"])
    return ({name: statistics.median(values) for name, values in totals.items()},
            {name: statistics.median(values) for name, values in add_norms.items()})


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count()


def default_threads():
    """What fastln uses for num_threads=None (OpenMP's default), as 'N (default)'."""
    get_num_threads = getattr(fastln, "get_num_threads", None)
    return f"{get_num_threads()} (default)" if get_num_threads else "default"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Time a pre-norm transformer stack (inference) using fastln's fused "
                    "add + LayerNorm against the same stack in NumPy only.")
    parser.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--d-model", type=int, default=384, help="width (default 384)")
    parser.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed forwards of each version (default 5; the median is shown)")
    parser.add_argument("--threads", type=int, default=None,
                        help="fastln's num_threads (default: OpenMP's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if min(args.batch, args.seq, args.d_model, args.heads, args.layers, args.repeat) < 1:
        parser.error("every size and --repeat must be >= 1")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    blocks = [Block(args.d_model, args.heads, rng, dtype) for _ in range(args.layers)]
    final_norm = random_layer_norm(args.d_model, rng, dtype)
    x = rng.standard_normal((args.batch, args.seq, args.d_model)).astype(dtype)

    reference = numpy_forward(x, blocks, final_norm)
    fused = fastln_forward(x, blocks, final_norm, num_threads=args.threads)
    difference = float(np.max(np.abs(fused.astype(np.float64) - reference)))
    totals, add_norms = time_both(x, blocks, final_norm, args.repeat, args.threads)

    calls = 2 * args.layers  # add + norm steps per forward (plus the first LayerNorm)
    print(f"pre-norm transformer, inference: {args.layers} block(s), batch {args.batch} x "
          f"{args.seq} tokens, d_model {args.d_model}, {args.heads} heads, MLP "
          f"{4 * args.d_model}, {args.dtype}; {usable_cpus()} CPU(s), fastln num_threads="
          f"{args.threads or default_threads()}")
    print(f"outputs agree: max |fastln - numpy| = {difference:.2e}")
    print(f"median of {args.repeat} forwards:")
    print(f"  {'':<26} {'numpy':>11} {'fastln':>11} {'speed-up':>9}")
    print(f"  {'add + LayerNorm steps':<26} {add_norms['numpy'] * 1e3:>9.3f}ms "
          f"{add_norms['fastln'] * 1e3:>9.3f}ms "
          f"{add_norms['numpy'] / add_norms['fastln']:>8.1f}x   ({calls} fused add + norm "
          "and 1 LayerNorm per forward)")
    print(f"  {'whole forward':<26} {totals['numpy'] * 1e3:>9.3f}ms "
          f"{totals['fastln'] * 1e3:>9.3f}ms {totals['numpy'] / totals['fastln']:>8.2f}x")
    share = add_norms["numpy"] / totals["numpy"]
    print(f"add + norm is {share:.0%} of the NumPy forward and "
          f"{add_norms['fastln'] / totals['fastln']:.0%} of the fastln one; the rest is "
          "attention and MLP (matrix products), the same code in both")
    if add_norms["fastln"] > add_norms["numpy"] and args.threads != 1:
        print("note: fastln's add + norm was slower than NumPy's here. Its OpenMP threads share "
              "the cores with the BLAS threads of the matrix products (and with anything else "
              "running); on a busy machine a thread that is not scheduled holds up the others. "
              "Try --threads 1, or OMP_WAIT_POLICY=passive, or OPENBLAS_NUM_THREADS=1.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
