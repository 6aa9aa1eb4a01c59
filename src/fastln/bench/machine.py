"""A description of the machine a benchmark ran on, so that two runs can be compared.

Everything is read from /proc and /sys on Linux, with portable fallbacks (os, platform) where
those files do not exist; a fact that cannot be found is None, never a guess.
"""
import os
import platform
import sys

import numpy as np

from fastln._config import build_info

# Instruction sets worth knowing for vectorized kernels (x86 flags; "asimd"/"sve" on Arm).
INSTRUCTION_SETS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                    "avx512_fp16", "asimd", "sve")

# Environment variables that change how many threads things use.
THREAD_ENVIRONMENT = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                      "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

MIB = 1 << 20


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpuinfo():
    """(model name, set of flags, number of physical cores) from /proc/cpuinfo."""
    text = _read("/proc/cpuinfo")
    if text is None:
        return platform.processor() or None, set(), None
    model, flags, cores = None, set(), set()
    physical_id = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("model name", "Model", "cpu model") and model is None:
            model = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    return model or platform.processor() or None, flags, len(cores) or None


def usable_cpus():
    """CPUs this process may run on (its affinity mask; os.cpu_count() where unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _size_in_bytes(text):
    text = text.strip().upper()
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * factor
    return int(text)


def caches():
    """[{level, type, bytes}] of cpu0's caches from sysfs (empty where unavailable)."""
    found = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return found
    for entry in entries:
        if not entry.startswith("index"):
            continue
        level = _read(os.path.join(base, entry, "level"))
        kind = _read(os.path.join(base, entry, "type"))
        size = _read(os.path.join(base, entry, "size"))
        if level and size:
            found.append({"level": int(level), "type": (kind or "").strip(),
                          "bytes": _size_in_bytes(size)})
    return found


def last_level_cache_bytes():
    """Size of the largest data/unified cache, or None when it cannot be found."""
    sizes = [cache["bytes"] for cache in caches() if cache["type"] != "Instruction"]
    if sizes:
        return max(sizes)
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError, AttributeError):
            continue
        if size and size > 0:
            return size
    return None


def memory_bytes():
    """(total, available) physical memory in bytes, None where unknown."""
    text = _read("/proc/meminfo")
    values = {}
    if text:
        for line in text.splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024
    total = values.get("MemTotal")
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = None
    return total, values.get("MemAvailable", total)


def describe_machine(peer_versions=None):
    """Everything a reader needs to place a run: CPU, cores, caches, memory, software."""
    model, flags, physical_cores = _cpuinfo()
    total_memory, available_memory = memory_bytes()
    return {
        "cpu_model": model,
        "architecture": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores,
        "usable_cpus": usable_cpus(),
        "virtual_machine": "hypervisor" in flags,
        # Empty when /proc/cpuinfo is unreadable: unknown, not "none of them".
        "instruction_sets": {name: name in flags for name in INSTRUCTION_SETS} if flags else {},
        "caches": caches(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "memory_total_bytes": total_memory,
        "memory_available_bytes": available_memory,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "fastln": build_info(),
        "peers": dict(peer_versions or {}),
        # Other work on the machine: a load near the core count means shared cores, and
        # multi-threaded timings that wait for them.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "thread_environment": {name: os.environ[name] for name in THREAD_ENVIRONMENT
                               if name in os.environ},
    }


def busy_cpu_seconds():
    """(CPU seconds every process has used, CPU seconds this process has used) so far, or None
    where /proc/stat is not there. The difference of two readings over the wall time between
    them is how many CPUs other processes kept busy meanwhile."""
    text = _read("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    ticks = [int(value) for value in text.split("\n", 1)[0].split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system


def other_processes_cpus(start, end, seconds):
    """CPUs kept busy by other processes between two busy_cpu_seconds() readings."""
    if start is None or end is None or seconds <= 0:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / seconds)


def summary_line(machine):
    """One line for the table header: CPU, cores, instruction sets."""
    isa = " ".join(name for name in ("avx2", "avx512f", "asimd", "sve")
                   if machine["instruction_sets"].get(name))
    cores = machine["physical_cores"] or machine["logical_cpus"]
    parts = [machine["cpu_model"] or "unknown CPU",
             f"{cores} cores, {machine['usable_cpus']} usable"]
    if isa:
        parts.append(isa)
    if machine["last_level_cache_bytes"]:
        parts.append(f"LLC {machine['last_level_cache_bytes'] / MIB:.0f} MiB")
    if machine["virtual_machine"]:
        parts.append("virtual machine")
    if machine.get("load_average"):
        parts.append(f"load average {machine['load_average'][0]:.2f} at start")
    return ", ".join(parts)
