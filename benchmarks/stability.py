"""Do identical runs of `fastln bench` agree? Runs it three times and compares fastln's medians.

    python benchmarks/stability.py                        # three default runs (a few minutes each)
    python benchmarks/stability.py --runs 3 -- --quick    # anything after -- goes to fastln bench
    python benchmarks/stability.py -- --shapes 64x768,4096x768 --peers none

Each run is a fresh `python -m fastln bench ... --json FILE --no-files --no-progress` process.
For every case (op, shape, dtype, thread count) the script takes fastln's median from each run
and reports the ratio of the largest to the smallest; the goal on a quiet machine is that every
ratio stays within --limit (1.5). It also counts the cases each run flagged (measured again and
still suspect) and says how busy other processes kept the machine. Exit status 1 when a ratio is
over the limit, so that it can gate a change.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run_bench(bench_args, path):
    command = [sys.executable, "-m", "fastln", "bench", *bench_args, "--json", path,
               "--no-files", "--no-progress"]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"fastln bench failed ({done.returncode}):\n{done.stderr}")
    with open(path) as f:
        return json.load(f)


def fastln_medians(report):
    return {(r["op"], "x".join(map(str, r["shape"])), r["dtype"], r["threads"]): r["median_s"]
            for r in report["results"]
            if r["implementation"] == "fastln" and r["status"] == "ok"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own_args = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=float, default=1.5,
                        help="largest allowed ratio of one case's slowest to fastest median")
    args = parser.parse_args(own_args)

    reports = []
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.runs):
            report = run_bench(bench_args, os.path.join(scratch, f"run{run}.json"))
            flagged = sum(1 for r in report["results"] if r.get("anomaly"))
            print(f"run {run + 1}: {report['duration_seconds']:.0f} s, other processes busy on "
                  f"{report['other_processes_cpus'] or 0:.2f} CPUs, {flagged} flagged "
                  f"measurement(s)", flush=True)
            reports.append(report)

    runs = [fastln_medians(report) for report in reports]
    cases = [case for case in runs[0] if all(case in medians for medians in runs)]
    ratios = sorted(((max(m[case] for m in runs) / min(m[case] for m in runs), case)
                     for case in cases), reverse=True)
    machine = reports[0]["machine"]
    print(f"\n{machine['cpu_model']}, {machine['usable_cpus']} usable CPUs; fastln's median per "
          f"case in {args.runs} runs, slowest / fastest:")
    for ratio, (op, shape, dtype, threads) in ratios[:10]:
        medians = ", ".join(f"{m[(op, shape, dtype, threads)] * 1e6:.3g}" for m in runs)
        mark = "  over the limit" if ratio > args.limit else ""
        print(f"  {op} {shape} {dtype} {threads}T: {ratio:.2f}x ({medians} µs){mark}")
    over = [case for ratio, case in ratios if ratio > args.limit]
    print(f"\n{len(cases) - len(over)} of {len(cases)} cases within {args.limit}x"
          + (f"; {len(over)} over it" if over else ""))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
