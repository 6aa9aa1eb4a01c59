"""Concurrency (issue 7): the kernels release the GIL, so Python threads run them at once.

- 8 Python threads calling every forward and backward on different data, at the same time and
  over and over, get exactly (bit for bit) the results of the same calls made one after another;
- the kernels really release the GIL (a Python thread keeps running during a long call);
- one large call made from several threads at once, with nested OpenMP enabled and with a
  process-wide thread limit, finishes (no deadlock), gives the serial results, and the process
  never runs more OS threads than the Python threads' teams add up to (no oversubscription);
- a ``multiprocessing`` child started with ``fork`` after the parent used OpenMP computes the
  same results (GNU libgomp's thread pool does not survive a fork: pytorch issue 19163).

Every wait has a timeout, and the scenarios that change the environment or fork run in a child
process, so a hang fails its test instead of blocking the run.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import fastln
from conftest import assert_bitwise_equal, random_input, random_params

N_THREADS = 8
ROUNDS = 3
TIMEOUT = 120  # seconds: far above the few seconds these take, short of blocking CI


# --------------------------------------------------------------------------------------------
# Work items: one forward + backward chain of one operation on its own data
# --------------------------------------------------------------------------------------------

def _work_items(seed):
    """Per thread: calls covering every public function, small (the calling thread only) and
    large (OpenMP teams), float32 and float64, different data for every thread."""
    rng = np.random.default_rng(seed)
    items = []
    for shape, dtype, num_threads in (((7, 33), np.float32, None), ((256, 384), np.float32, 2),
                                      ((3, 5, 40), np.float64, 1), ((200, 512), np.float64, None)):
        x = random_input(rng, shape, dtype)
        residual = random_input(rng, shape, dtype)
        dy = random_input(rng, shape, dtype)
        gamma, beta = random_params(rng, shape[-1:], dtype)
        items.append(dict(x=x, residual=residual, dy=dy, gamma=gamma, beta=beta,
                          num_threads=num_threads))
    return items


def _run(item):
    """Every public function on one item; returns the list of resulting arrays."""
    x, residual, dy = item["x"], item["residual"], item["dy"]
    gamma, beta, nt = item["gamma"], item["beta"], item["num_threads"]
    results = []
    y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=nt)
    results += [y, cache.mean, cache.rstd]
    results += fastln.layer_norm_backward(dy, cache, gamma, num_threads=nt)
    results.append(fastln.layer_norm(x, gamma, beta, num_threads=nt))
    y, cache = fastln.rms_norm_forward(x, gamma, num_threads=nt)
    results += [y, cache.rstd]
    results += fastln.rms_norm_backward(dy, cache, gamma, num_threads=nt)
    results.append(fastln.rms_norm(x, gamma, num_threads=nt))
    y, s, cache = fastln.add_layer_norm_forward(x, residual, gamma, beta, num_threads=nt)
    results += [y, s, cache.mean, cache.rstd]
    results += fastln.add_layer_norm(x, residual, gamma, beta, num_threads=nt)
    y, s, cache = fastln.add_rms_norm_forward(x, residual, gamma, num_threads=nt)
    results += [y, s, cache.rstd]
    results += fastln.add_rms_norm(x, residual, gamma, num_threads=nt)
    running_mean, running_var = np.zeros(x.shape[-1]), np.ones(x.shape[-1])
    y, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                         training=True, num_threads=nt)
    results += [y, cache.mean, cache.rstd, running_mean, running_var]
    results += fastln.batch_norm_backward(dy, cache, gamma, num_threads=nt)
    results.append(fastln.batch_norm(x, gamma, beta, running_mean, running_var,
                                     num_threads=nt))
    return results


def _run_threads(target, n_threads, timeout=TIMEOUT):
    """Start n_threads threads on target(index) at the same moment; join with a timeout."""
    barrier = threading.Barrier(n_threads)
    errors = []

    def body(index):
        try:
            barrier.wait(timeout=timeout)
            target(index)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append((index, exc))

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} thread(s) still running after {timeout} s: deadlock?"
    assert not errors, errors


def test_eight_threads_give_exactly_the_serial_results():
    work = [_work_items(seed) for seed in range(N_THREADS)]
    serial = [[_run(item) for item in items] for items in work]
    concurrent = [[] for _ in range(N_THREADS)]

    def target(index):
        for _ in range(ROUNDS):
            concurrent[index].append([_run(item) for item in work[index]])

    _run_threads(target, N_THREADS)
    for index in range(N_THREADS):
        assert len(concurrent[index]) == ROUNDS
        for round_results in concurrent[index]:
            for item_results, item_serial in zip(round_results, serial[index]):
                assert len(item_results) == len(item_serial)
                for k, (got, want) in enumerate(zip(item_results, item_serial)):
                    assert_bitwise_equal(got, want, err_msg=f"thread {index} result {k}")


def test_threads_sharing_inputs_and_writing_their_own_outputs():
    """All threads read the same x, gamma and cache (read-only sharing) and write their own
    out buffers; nothing they share changes."""
    item = _work_items(99)[1]
    x, dy, gamma, beta = item["x"], item["dy"], item["gamma"], item["beta"]
    x.flags.writeable = False
    y_serial, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=2)
    dx_serial = fastln.layer_norm_backward(dy, cache, gamma, num_threads=2)
    before = [a.copy() for a in (x, dy, gamma, beta, cache.mean, cache.rstd)]
    outs = [np.empty_like(x) for _ in range(N_THREADS)]

    def target(index):
        for _ in range(ROUNDS):
            assert fastln.layer_norm(x, gamma, beta, out=outs[index], num_threads=2) is outs[index]
            assert_bitwise_equal(outs[index], y_serial)
            for got, want in zip(fastln.layer_norm_backward(dy, cache, gamma, num_threads=2),
                                 dx_serial):
                assert_bitwise_equal(got, want)

    _run_threads(target, N_THREADS)
    for a, b in zip((x, dy, gamma, beta, cache.mean, cache.rstd), before):
        assert_bitwise_equal(a, b)


CALLS_FOR_GIL = {
    "layer_norm": lambda x, dy: fastln.layer_norm(x, num_threads=1),
    "layer_norm_backward": lambda x, dy: fastln.layer_norm_backward(
        dy, fastln.layer_norm_forward(x, num_threads=1)[1], num_threads=1),
    "rms_norm": lambda x, dy: fastln.rms_norm(x, num_threads=1),
    "add_rms_norm": lambda x, dy: fastln.add_rms_norm(x, dy, num_threads=1),
    "batch_norm_forward": lambda x, dy: fastln.batch_norm(x, training=True, num_threads=1),
    "batch_norm_backward": lambda x, dy: fastln.batch_norm_backward(
        dy, fastln.batch_norm_forward(x, training=True, num_threads=1)[1], num_threads=1),
}


@pytest.mark.parametrize("name", sorted(CALLS_FOR_GIL))
def test_kernels_release_the_gil(name):
    """A Python thread counting in a loop keeps counting while the main thread is inside a
    long single-threaded kernel call (it could not if the call held the GIL)."""
    x = np.random.default_rng(0).standard_normal((2048, 4096)).astype(np.float32)
    dy = np.ones_like(x)
    CALLS_FOR_GIL[name](x[:8], dy[:8])  # warm up (imports, dispatch)
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=count, daemon=True)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    thread.start()
    try:
        time.sleep(0.01)
        fractions = []
        for _ in range(3):
            before = counter[0]
            start = time.perf_counter()
            CALLS_FOR_GIL[name](x, dy)
            elapsed = time.perf_counter() - start
            during = counter[0] - before
            fractions.append((during, elapsed))
    finally:
        stop.set()
        thread.join(5)
        sys.setswitchinterval(old_interval)
    # The calls take tens of milliseconds: a free-running counter adds hundreds of thousands
    # (the allocations and checks around the kernel hold the GIL only for microseconds).
    best = max(during / max(elapsed, 1e-9) for during, elapsed in fractions)
    assert best > 1e5, f"counter advanced {fractions} during the calls: GIL held?"


# --------------------------------------------------------------------------------------------
# Child-process scenarios: nested OpenMP and a thread limit; fork after OpenMP
# --------------------------------------------------------------------------------------------

NESTED_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    import fastln

    n_py = int(sys.argv[1]); team = int(sys.argv[2])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 2048)).astype(np.float32)
    dy = rng.standard_normal((1024, 2048)).astype(np.float32)

    def work():
        y, cache = fastln.layer_norm_forward(x, num_threads=team)
        dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, num_threads=team)
        b = fastln.batch_norm(x, training=True, num_threads=team)
        r = fastln.rms_norm(x, num_threads=team)
        return [y, dx, dgamma, dbeta, b, r]

    def os_threads():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])

    serial = work()
    baseline = os_threads()
    peak = [0]
    done = threading.Event()

    def monitor():
        while not done.is_set():
            peak[0] = max(peak[0], os_threads())
            time.sleep(0.0005)

    results = [None] * n_py
    barrier = threading.Barrier(n_py)

    def body(i):
        barrier.wait()
        out = None
        for _ in range(5):
            out = work()
        results[i] = out

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=body, args=(i,)) for i in range(n_py)]
    for t in threads: t.start()
    for t in threads: t.join()
    done.set(); watcher.join()
    for i, res in enumerate(results):
        for a, b in zip(res, serial):
            assert a.tobytes() == b.tobytes(), f"thread {i} differs from the serial result"
    print("baseline", baseline, "peak", peak[0], flush=True)
""")


def _run_child(script, args, env_changes, timeout=TIMEOUT, path=None):
    """Run a Python script (source, or a file at `path`) in a child process with a timeout."""
    env = dict(os.environ)
    env.update(env_changes)
    command = [sys.executable, path] if path else [sys.executable, "-c", script]
    try:
        child = subprocess.run(command + [str(a) for a in args], env=env,
                               capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the child did not finish within {timeout} s (a hang): "
                             f"{(exc.stdout or '')[-1000:]}") from None
    assert child.returncode == 0, (child.returncode, child.stdout[-2000:], child.stderr[-3000:])
    return child.stdout


@pytest.mark.parametrize("env_changes", [
    {"OMP_MAX_ACTIVE_LEVELS": "4", "OMP_NESTED": "true", "OMP_NUM_THREADS": "2"},
    {"OMP_MAX_ACTIVE_LEVELS": "4", "OMP_NUM_THREADS": "3", "OMP_THREAD_LIMIT": "3"},
    {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"},
], ids=["nested", "thread-limit", "active-wait"])
def test_one_large_call_from_several_threads(env_changes):
    """4 Python threads run the same large calls at once, each asking for teams of 3: no
    deadlock (timeout), the serial results bit for bit, and at most 4 teams' worth of OS
    threads (each Python thread's team has its own workers; nothing multiplies)."""
    n_py, team = 4, 3
    out = _run_child(NESTED_SCRIPT, [n_py, team], env_changes)
    words = out.split()
    baseline, peak = int(words[words.index("baseline") + 1]), int(words[words.index("peak") + 1])
    # main thread + monitor + n_py Python threads + (team - 1) workers for each of them, plus
    # the serial call's (team - 1) workers kept by the main thread
    limit = baseline + 1 + n_py * team
    assert peak <= limit, f"{peak} OS threads at once (baseline {baseline}, limit {limit})"


FORK_SCRIPT = textwrap.dedent("""
    import hashlib, multiprocessing as mp, sys
    import numpy as np
    import fastln

    def compute(num_threads):
        rng = np.random.default_rng(1)
        x = rng.standard_normal((512, 4096)).astype(np.float32)
        dy = rng.standard_normal((512, 4096)).astype(np.float32)
        y, cache = fastln.layer_norm_forward(x, num_threads=num_threads)
        dx = fastln.layer_norm_backward(dy, cache, num_threads=num_threads)
        b = fastln.batch_norm(x, training=True, num_threads=num_threads)
        r = fastln.add_rms_norm(x, dy, num_threads=num_threads)
        # the family's fast paths read their own module's thread cap
        y_rms, cache_rms = fastln.rms_norm_forward(x, num_threads=num_threads)
        dx_rms = fastln.rms_norm_backward(dy, cache_rms, num_threads=num_threads)
        digest = hashlib.sha256()
        for a in [y, *dx, b, *r, y_rms, *dx_rms]:
            digest.update(a.tobytes())
        return digest.hexdigest()

    def child(queue, num_threads):
        queue.put(compute(num_threads))

    if __name__ == "__main__":
        parent = compute(2)          # the parent's OpenMP team exists now
        assert compute(None) == parent
        ctx = mp.get_context(sys.argv[1])
        for num_threads in (2, None, 1):
            queue = ctx.Queue()
            process = ctx.Process(target=child, args=(queue, num_threads))
            process.start()
            process.join(10)  # the work takes well under a second
            if process.is_alive():
                process.kill()
                raise SystemExit(f"the {sys.argv[1]} child hung (num_threads={num_threads})")
            assert process.exitcode == 0, process.exitcode
            assert queue.get(timeout=10) == parent, "the child computed something else"
        print("ok", flush=True)
""")


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_child_after_the_parent_used_openmp(start_method, tmp_path):
    """The parent runs OpenMP teams, then starts children with `start_method` that compute the
    same thing (num_threads 2, default and 1). 'fork' is the pain point; 'spawn' and
    'forkserver' are the usual workarounds and must work too. A script file, because 'spawn'
    re-imports the main module."""
    script = tmp_path / "fork_scenario.py"
    script.write_text(FORK_SCRIPT)
    out = _run_child(None, [start_method], {}, timeout=TIMEOUT, path=str(script))
    assert out.strip().endswith("ok")


SMALL_STACK_CHILD = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import fastln
    stack_size = int(sys.argv[1])
    rng = np.random.default_rng(0)
    calls = []
    for dtype in (np.float32, np.float16, np.float64):
        x = rng.standard_normal((3, 768)).astype(dtype)
        dy = rng.standard_normal((3, 768)).astype(dtype)
        for forward, backward in ((fastln.layer_norm_forward, fastln.layer_norm_backward),
                                  (fastln.rms_norm_forward, fastln.rms_norm_backward)):
            calls.append((backward, dy, forward(x)[1]))
    results = {}
    def body():
        results["thread"] = [backward(dy, cache) for backward, dy, cache in calls]
    threading.stack_size(stack_size)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    serial = [backward(dy, cache) for backward, dy, cache in calls]
    for got, want in zip(results["thread"], serial):
        for a, b in zip(got, want):
            assert a.tobytes() == b.tobytes()
    print("ok", flush=True)
""")


@pytest.mark.parametrize("stack_size", [32768, 40960])
def test_backwards_run_in_threads_with_the_smallest_stacks(stack_size):
    """Python lets a thread run on a 32 KiB stack (threading.stack_size): a row backward's
    partial sums must not live in its frame (a 32 KiB array there overflowed such stacks)."""
    assert _run_child(SMALL_STACK_CHILD, [stack_size], {}).strip().endswith("ok")
