"""What a run leaves behind: a plain-text table, a Markdown table, JSON, a plot.

All of them are made from the report dict that fastln.bench.runner returns, so the table a
reader sees and the JSON a script compares always hold the same numbers. Only the plot needs an
optional library (matplotlib).
"""
import io
import json
import os

COLUMNS = ("op", "shape", "dtype", "threads", "implementation", "time", "IQR", "GB/s",
           "% of copy", "fastln speed-up", "output", "flag")
# Columns that are printed once per case, not on every implementation's row.
CASE_COLUMNS = COLUMNS[:4]
RIGHT_ALIGNED = {"threads", "time", "IQR", "GB/s", "% of copy", "fastln speed-up"}

IMPLEMENTATION_COLORS = {"fastln": "tab:red", "numpy-naive": "tab:gray",
                         "numpy-inplace": "tab:blue", "torch": "tab:orange",
                         "onnxruntime": "tab:green"}

NOTES = (
    "time: median seconds per call; IQR: interquartile range of the samples over the median. "
    "Every implementation of a case runs in the same process, in interleaved rounds.",
    "GB/s: bytes that must move over the median time (forward reads x and writes y; backward "
    "reads dy and x and writes dx); 1 GB = 1e9 bytes.",
    "% of copy: GB/s over this machine's copy bandwidth with the same threads (ordinary stores, "
    "read + write); above 100% the arrays fit in cache.",
    "fastln speed-up: median over rounds of time(implementation) / time(fastln) within a round; "
    "above 1 fastln is faster.",
    "NumPy has no threads of its own: numpy-naive and numpy-inplace run on one thread, are "
    "timed once per shape and dtype, in the same rounds as every thread count, and are shown "
    "at each.",
    "output: new = allocates its output on every call (a large fresh array also costs its "
    "page faults, often as much as the LayerNorm: compare --out-buffer); reused = writes into a "
    "preallocated output (--out-buffer); new (no out=) = the library has no way to reuse one.",
    "flag: the measurement stayed suspect after being taken again (see 'flagged' below): "
    "spread = its rounds disagree, threads = slower with more threads than with fewer. Other "
    "programs on the machine are the usual cause; run again when it is quiet.",
)


def format_seconds(seconds):
    """Three significant digits in the smallest unit that keeps them below 1000."""
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        text = f"{seconds / scale:.3g}"
        if float(text) < 1000:
            return f"{text} {unit}"
    return f"{seconds:.3g} s"


def format_gigabytes_per_second(bytes_per_second):
    value = bytes_per_second / 1e9
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _shape(shape):
    return "x".join(str(n) for n in shape)


def _case_key(record):
    return (record["op"], tuple(record["shape"]), record["dtype"], record["threads"])


def table_rows(report):
    """One list of cell strings per result, in COLUMNS order; case cells only on a case's first."""
    rows, previous_case = [], None
    for record in report["results"]:
        case = _case_key(record)
        first_of_case = case != previous_case
        previous_case = case
        cells = {
            "op": record["op"], "shape": _shape(record["shape"]), "dtype": record["dtype"],
            "threads": str(record["threads"]), "implementation": record["implementation"],
        }
        if record["status"] == "ok":
            median = record["median_s"]
            fraction = record["fraction_of_copy_bandwidth"]
            cells.update({
                "time": format_seconds(median),
                "IQR": f"{(record['q3_s'] - record['q1_s']) / median:.0%}",
                "GB/s": format_gigabytes_per_second(record["bandwidth_bytes_per_second"]),
                "% of copy": "" if fraction is None else f"{fraction:.0%}",
                "fastln speed-up": ("-" if record["implementation"] == "fastln"
                                    else f"{record['fastln_speedup']:.2f}x"),
                "output": record["output"],
                "flag": _flag(record.get("anomaly")),
            })
        else:
            cells.update({"time": "not timed", "output": record["status"].split(":")[0]})
        if not first_of_case:
            for column in CASE_COLUMNS:
                cells[column] = ""
        rows.append([cells.get(column, "") for column in COLUMNS])
    return rows


def _flag(anomaly):
    if not anomaly:
        return ""
    return "threads" if "threads" in anomaly else "spread"


def _copy_line(report):
    by_stores = {}
    for result in report["copy_bandwidth"]:
        by_stores.setdefault(result["stores"], []).append(
            f"{result['threads']} thread{'s' if result['threads'] > 1 else ''} "
            f"{result['bytes_per_second'] / 1e9:.1f} GB/s")
    buffer_mib = report["copy_bandwidth"][0]["buffer_bytes"] / (1 << 20)
    parts = [f"{stores} stores: {', '.join(values)}" for stores, values in by_stores.items()]
    return (f"copy bandwidth (read + write, 2 x {buffer_mib:.0f} MiB, median): "
            + "; ".join(parts))


def header_lines(report):
    from fastln.bench.machine import summary_line

    described = report["machine"]
    fastln_info = described["fastln"]
    openmp = "on" if fastln_info["openmp"] else "off"
    software = [f"fastln {fastln_info['fastln']} (OpenMP {openmp})",
                f"numpy {described['numpy']}", f"python {described['python']}"]
    software += [f"{name} {version}" for name, version in described["peers"].items()
                 if name not in ("numpy", "onnx")]
    settings = report["settings"]
    rounds = settings["rounds"]
    rounds_text = (f"{rounds} rounds" if isinstance(rounds, int)
                   else f"{rounds[0]}-{rounds[1]} rounds")
    software += wait_policy(report)
    min_calls = settings.get("warmup_min_calls", 1)
    calls = (f" and at least {min_calls} untimed calls" if min_calls > 1
             else " of untimed calls")
    warmup = (f", each after {settings['warmup_seconds'] * 1e3:g} ms{calls} "
              f"(none for calls over {settings['warmup_max_call_seconds'] * 1e3:g} ms)"
              if settings.get("warmup_seconds") else "")
    others = report.get("other_processes_cpus")
    others = (f", other processes busy on {others:.2f} CPUs meanwhile" if others is not None
              else "")
    return [
        f"machine: {summary_line(described)}",
        f"software: {', '.join(software)}",
        _copy_line(report),
        f"command: {report['command'] or '(called from Python)'}",
        f"run: {report['started_at']}, {report['duration_seconds']:.0f} s{others}, "
        f"{rounds_text} of samples >= {settings['min_sample_seconds'] * 1e3:g} ms per "
        f"case{warmup}",
    ]


def wait_policy(report):
    """How idle worker threads waited: the OpenMP variables set (or OpenMP's default), ONNX
    Runtime's spinning."""
    environment = report["machine"]["thread_environment"]
    parts = [f"{name}={environment[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
             if name in environment] or ["OpenMP's default wait policy"]
    onnxruntime = report["settings"].get("onnxruntime_session_config")
    if onnxruntime:
        if onnxruntime.get("session.intra_op.allow_spinning") == "0":
            parts.append("onnxruntime spinning off")
        else:
            parts.append(f"onnxruntime spin "
                         f"{onnxruntime.get('session.intra_op.spin_duration_us', '?')} µs")
    return parts


def _case(record):
    return (f"{record['implementation']} {record['op']} {_shape(record['shape'])} "
            f"{record['dtype']} threads={record['threads']}")


def problem_lines(report):
    lines = [f"{_case(record)}: {record['status']}"
             for record in report["results"] if record["status"] != "ok"]
    lines += [f"skipped {entry['op']} {_shape(entry['shape'])} {entry['dtype']}: "
              f"{entry['reason']}" for entry in report["skipped"]]
    return lines


def flagged_lines(report):
    return [f"{_case(record)}: {record['anomaly']} (measured {record['remeasured'] + 1} times)"
            for record in report["results"] if record.get("anomaly")]


def inexact_lines(report):
    """The peers timed although their batch sums (dgamma, dbeta) differ from fastln's."""
    return [f"{_case(record)}: {record['inexact']}"
            for record in report["results"] if record.get("inexact")]


def closing_sections(report):
    """(title, lines) of the lists after the table, those that have lines."""
    sections = (
        ("not measured", problem_lines(report)),
        ("timed, though their sums over the batch are outside the check's tolerance",
         inexact_lines(report)),
        ("flagged", flagged_lines(report)))
    return [(title, lines) for title, lines in sections if lines]


def _speedup(value):
    return f"{value:.2f}x"


def summary_rows(report):
    """(header, rows) of the closing summary: per op and dtype, fastln's median and minimum
    speed-up against each peer implementation."""
    peers = list(dict.fromkeys(entry["implementation"] for entry in report.get("summary", [])))
    cases = {}
    for entry in report.get("summary", []):
        cell = "-"
        if entry["cases"]:
            cell = (f"{_speedup(entry['median_speedup'])} (min {_speedup(entry['min_speedup'])} "
                    f"at {_shape(entry['min_case']['shape'])}, {entry['min_case']['threads']}T)")
        cases.setdefault((entry["op"], entry["dtype"]), {})[entry["implementation"]] = cell
    rows = [[op, dtype] + [cells.get(peer, "") for peer in peers]
            for (op, dtype), cells in cases.items()]
    return ["op", "dtype"] + [f"vs {peer}" for peer in peers], rows


def summary_lines(report):
    """The closing summary, as text lines (nothing when no peer was measured)."""
    header, rows = summary_rows(report)
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    left_out = sum(entry["flagged_cases_left_out"] for entry in report["summary"])
    lines = [f"summary: fastln's speed-up (peer time / fastln time, above 1: fastln faster), "
             f"median over shapes and thread counts (minimum, at that shape and thread count), "
             f"on {report['machine']['cpu_model'] or 'an unknown CPU'}"
             + (f"; {left_out} flagged measurement(s) left out" if left_out else "")]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
              for row in [header] + rows]
    return lines


def format_table(report):
    """The plain-text report printed at the end of a run."""
    rows = table_rows(report)
    widths = [max([len(column)] + [len(row[i]) for row in rows])
              for i, column in enumerate(COLUMNS)]

    def line(cells):
        return "  ".join(cell.rjust(width) if column in RIGHT_ALIGNED else cell.ljust(width)
                         for cell, width, column in zip(cells, widths, COLUMNS)).rstrip()

    out = header_lines(report) + ["", line(COLUMNS), line(["-" * width for width in widths])]
    for index, row in enumerate(rows):
        if index > 0 and row[0]:  # the op cell is filled on a case's first row only
            out.append("")
        out.append(line(row))
    out += [""] + [f"* {note}" for note in NOTES]
    for title, lines in closing_sections(report):
        out += ["", f"{title}:"] + [f"  {line}" for line in lines]
    summary = summary_lines(report)
    if summary:
        out += [""] + summary
    return "\n".join(out) + "\n"


def format_markdown(report):
    """The same table in Markdown, with the machine and the command above it."""
    rows = table_rows(report)
    out = [f"- {line}" for line in header_lines(report)]
    out += ["", "| " + " | ".join(COLUMNS) + " |",
            "|" + "|".join("---:" if column in RIGHT_ALIGNED else "---" for column in COLUMNS)
            + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += [""] + [f"- {note}" for note in NOTES]
    for title, lines in closing_sections(report):
        out += ["", f"{title[0].upper()}{title[1:]}:", ""] + [f"- {line}" for line in lines]
    header, rows = summary_rows(report)
    if rows:
        # A list, not a second table: the results table stays the only one in the file.
        out += ["", "Summary: " + summary_lines(report)[0].split(": ", 1)[1], ""]
        out += [f"- {row[0]} {row[1]}: " + "; ".join(f"{name} {cell}" for name, cell
                                                    in zip(header[2:], row[2:]) if cell)
                for row in rows]
    return "\n".join(out) + "\n"


def _json_default(value):
    # NumPy scalars that slipped into the report.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=_json_default)
        f.write("\n")


def write_markdown(report, path):
    with open(path, "w") as f:
        f.write(format_markdown(report))


def _records(report, op, dtype, threads):
    return [record for record in report["results"]
            if record["op"] == op and record["dtype"] == dtype and record["threads"] == threads
            and record["status"] == "ok"]


def _plot_lines(ax, records, shapes, value):
    """One line per implementation of value(record) by shape."""
    for name in dict.fromkeys(record["implementation"] for record in records):
        points = [(shapes.index(_shape(record["shape"])), value(record))
                  for record in records if record["implementation"] == name]
        points = [(x, y) for x, y in points if y is not None]
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name,
                    color=IMPLEMENTATION_COLORS.get(name),
                    linewidth=2 if name == "fastln" else 1)


def write_plot(report, path):
    """Per (op, dtype) a row of panels, for each thread count: fastln's speed-up against each
    peer by shape (peer time / fastln time, 1 = parity, above it fastln is faster), then every
    implementation's effective bandwidth with the copy bandwidth as horizontal lines. Needs
    matplotlib (the `bench` extra)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    from matplotlib.ticker import FuncFormatter, LogLocator

    settings = report["settings"]
    shapes = [_shape(shape) for shape in settings["shapes"]]
    measured = {(record["op"], record["dtype"]) for record in report["results"]}
    rows = [(op, dtype) for op in settings["ops"] for dtype in settings["dtypes"]
            if (op, dtype) in measured]
    n_columns = 2 * len(settings["threads"])
    # At least 11 inches wide, so that the title and the legend fit a single thread count.
    figure = Figure(figsize=(max(4.0 * n_columns, 11.0), 3.4 * max(len(rows), 1) + 1.2),
                    layout="constrained")
    axes = figure.subplots(max(len(rows), 1), n_columns, squeeze=False)
    times = FuncFormatter(lambda value, _: f"{value:g}x")
    for row, (op, dtype) in enumerate(rows):
        for column, threads in enumerate(settings["threads"]):
            records = _records(report, op, dtype, threads)
            label = f"{op}, {dtype}, {threads} thread{'s' if threads > 1 else ''}"
            speedup, bandwidth = axes[row][2 * column], axes[row][2 * column + 1]
            _plot_lines(speedup, [r for r in records if r["implementation"] != "fastln"],
                        shapes, lambda record: record["fastln_speedup"])
            speedup.axhline(1.0, color="tab:red", linewidth=2, label="parity (fastln)")
            speedup.set_yscale("log")
            speedup.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            speedup.yaxis.set_major_formatter(times)
            speedup.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
            speedup.set_title(f"fastln speed-up: {label}", fontsize=9)
            _plot_lines(bandwidth, records, shapes,
                        lambda record: record["bandwidth_bytes_per_second"] / 1e9)
            for result in report["copy_bandwidth"]:
                if result["threads"] == threads:
                    ordinary = result["stores"] == "ordinary"
                    bandwidth.axhline(result["bytes_per_second"] / 1e9, color="black",
                                      linestyle="--" if ordinary else ":", linewidth=1,
                                      label="copy" if ordinary else "copy, non-temporal stores")
            bandwidth.set_yscale("log")
            bandwidth.set_title(f"GB/s: {label}", fontsize=9)
            for ax in (speedup, bandwidth):
                ax.set_xticks(range(len(shapes)), shapes, rotation=45, ha="right", fontsize=8)
                ax.grid(True, which="both", alpha=0.3)
            if column == 0:
                speedup.set_ylabel("peer time / fastln time")
                bandwidth.set_ylabel("effective GB/s")
    legend = {}  # label -> handle, over every panel (onnxruntime has no backward line)
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        figure.legend(list(legend.values()), list(legend), loc="outside lower center",
                      ncols=min(len(legend), 2 * n_columns + 1))
    described = report["machine"]
    figure.suptitle(f"fastln bench on {described['cpu_model']} "
                    f"({described['usable_cpus']} usable CPUs)\nspeed-up against each peer "
                    f"(peer time / fastln time, 1x = parity) and bandwidth, by shape")
    # Rendered in memory, then written by Python: matplotlib's PNG writer does not report a
    # failed write (a full disk, /dev/full), and it appends ".png" to a name without a suffix.
    image = io.BytesIO()
    figure.savefig(image, dpi=100, format=plot_format(path))
    with open(path, "wb") as f:
        f.write(image.getvalue())


def plot_format(path):
    """The image format of a plot file, from its suffix: png when it has none."""
    return os.path.splitext(os.fspath(path))[1][1:].lower() or "png"
