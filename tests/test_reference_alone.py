"""fastln.reference stands alone: it imports no compiled fastln module, so it works (and can be
compared against) even where the kernels cannot be loaded."""
import subprocess
import sys

BLOCKED = r"""
import importlib.abc, importlib.machinery, sys

class BlockCompiled(importlib.abc.MetaPathFinder):
    # Refuse every extension module of fastln, as a broken build would.
    def find_spec(self, name, path=None, target=None):
        if not name.startswith("fastln."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            raise ImportError(f"blocked compiled module {name}")
        return None

sys.meta_path.insert(0, BlockCompiled())

import numpy as np
import fastln.reference as ref

x = np.array([[10.0, 20.0, 60.0], [1.0, 2.0, 4.0]])
y, cache = ref.layer_norm_forward(x, eps=0.0)
dx, dgamma, dbeta = ref.layer_norm_backward(np.ones_like(y), cache)
assert np.allclose(y[0], [-0.9258201, -0.4629100, 1.3887301]), y
assert np.abs(dx).max() < 1e-12 and (dbeta == 2).all()
y_rms, _ = ref.rms_norm_forward(x, eps=0.0)
ref.batch_norm(x, training=True)
ref.add_layer_norm(x, x)
loaded = sorted(name for name, module in sys.modules.items()
                if name.startswith("fastln") and isinstance(
                    getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader))
assert not loaded, loaded
import fastln
try:
    fastln.layer_norm(x)
except ImportError as error:
    assert "fastln.reference works without them" in str(error), error
else:
    raise AssertionError("fastln.layer_norm ran without its kernels")
print("ok")
"""


def test_reference_computes_with_every_compiled_module_blocked():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
