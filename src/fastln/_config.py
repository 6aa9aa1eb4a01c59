"""fastln.show_config(): what this build of fastln is and how it was compiled."""
import platform
import sys

import numpy as np

from fastln import _kernels
from fastln._memory import output_cache_info
from fastln._version import __version__


def build_info():
    """The compile-time facts as a dict (also used by the benchmark's JSON)."""
    try:
        from fastln import _build_info
    except ImportError:  # built by something other than setup.py
        compile_args = link_args = None
    else:
        compile_args, link_args = _build_info.COMPILE_ARGS, _build_info.LINK_ARGS
    return {
        "fastln": __version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "openmp": _kernels.openmp_enabled(),
        "instruction_set": _kernels.instruction_set(),
        "default_num_threads": _kernels.default_num_threads(),
        "output_cache_max_bytes": output_cache_info()["max_bytes"],
        "compile_args": compile_args,
        "link_args": link_args,
    }


def show_config(file=None):
    """Print the version, whether OpenMP is on, the default thread count, the output cache's
    cap (fastln.set_output_cache) and the build flags."""
    info = build_info()
    cache_bytes = info["output_cache_max_bytes"]
    cache = f"{cache_bytes / (1 << 20):g} MiB" if cache_bytes else "off"
    lines = [
        f"fastln {info['fastln']} (numpy {info['numpy']}, python {info['python']})",
        f"  platform:            {info['platform']}",
        f"  OpenMP:              {'on' if info['openmp'] else 'off (built without OpenMP)'}",
        f"  kernels:             {info['instruction_set']}",
        f"  default num_threads: {info['default_num_threads']}",
        f"  output cache:        {cache}",
        f"  compile args:        {' '.join(info['compile_args'] or ['unknown'])}",
        f"  link args:           {' '.join(info['link_args'] or []) or '(none)'}",
    ]
    print("\n".join(lines), file=file or sys.stdout)
