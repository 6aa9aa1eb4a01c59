"""The peers fastln is compared with: one module each (numpy, torch, onnxruntime), and which of
them are installed.

Each peer module has an IMPLEMENTATIONS dict, {--ops name: (Implementation, ...)}, that
fastln.bench.ops joins to its table of operations; an implementation does all of its peer's
setup in its prepare function. Nothing here or in the peer modules imports torch, onnx or
onnxruntime at module import time: ``fastln bench`` must start and run with NumPy alone, and a
peer that is not selected is never loaded.
"""
import importlib
import importlib.util

# --peers names, in the order the table lists them. "numpy" stands for both NumPy baselines.
PEERS = ("numpy", "torch", "onnxruntime")

# The modules a peer needs (ONNX Runtime also needs `onnx` to build its model in memory).
PEER_MODULES = {
    "numpy": ("numpy",),
    "torch": ("torch",),
    "onnxruntime": ("onnxruntime", "onnx"),
}

INSTALL_HINTS = {
    "torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu",
    "onnxruntime": "pip install onnx onnxruntime",
}


def is_installed(peer):
    """True when every module the peer needs can be imported (checked without importing it)."""
    return all(importlib.util.find_spec(module) is not None for module in PEER_MODULES[peer])


def installed_peers():
    return tuple(peer for peer in PEERS if is_installed(peer))


def peer_versions(peers):
    """{module: version} for the selected peers (imports them: call once they will be used)."""
    versions = {}
    for peer in peers:
        for module_name in PEER_MODULES[peer]:
            module = importlib.import_module(module_name)
            versions[module_name] = getattr(module, "__version__", "unknown")
    return versions
