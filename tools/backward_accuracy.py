"""How far the float32 backward (LayerNorm and RMSNorm) is from float64 on the same inputs.

    python tools/backward_accuracy.py            # the table of docs/performance.md
    python tools/backward_accuracy.py --module fastln_previous   # a previous build's figures

For each shape, row offset (x = offset + N(0, 1)), dy (N(0, 1); 1 + 0.01 N(0, 1); or y, the
forward's own output, as for a loss of sum(y**2) / 2: with the last two dx is a small
difference of large terms, and with y far smaller than dy) and gamma (none, or N(0, 1)), the
float32 results against a float64 forward and backward of the same float32 values, widened:
  dx       max over rows of max|dx - dx64| / max|dx64| (the row's largest gradient)
  dx/dy    max over rows of max|dx - dx64| / max|dy * gamma| (the row's largest term): the
           float32 write pass's own rounding, about 1e-7 of it whatever dy is
  dgamma   max|dgamma - dgamma64| / max|dgamma64|, and the same for dbeta.
"""
import argparse
import importlib

import numpy as np

SHAPES = ((4096, 7), (2048, 64), (512, 768), (256, 777), (64, 4096), (16, 16384), (32768, 16))
OFFSETS = (0.0, 1e3, 1e4, 1e5)


def errors(module, op, x, dy, gamma):
    forward = getattr(module, f"{op}_forward")
    backward = getattr(module, f"{op}_backward")
    _, cache = forward(x, gamma)
    results = backward(dy, cache, gamma)
    g64 = None if gamma is None else gamma.astype(np.float64)
    _, cache64 = forward(x.astype(np.float64), g64)
    exact = backward(dy.astype(np.float64), cache64, g64)
    dx, dx64 = results[0], exact[0]
    row_error = np.abs(dx - dx64).max(axis=1)
    terms = np.abs(dy.astype(np.float64) * (1.0 if g64 is None else g64)).max(axis=1)
    out = [float((row_error / np.abs(dx64).max(axis=1)).max()), float((row_error / terms).max())]
    for a, a64 in zip(results[1:], exact[1:]):
        out.append(float(np.abs(a - a64).max() / np.abs(a64).max()))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="fastln")
    parser.add_argument("--ops", default="layer_norm,rms_norm")
    args = parser.parse_args()
    module = importlib.import_module(args.module)
    rng = np.random.default_rng(1)
    print(f"{args.module}: worst error relative to the largest float64 value, offsets "
          + " / ".join(f"{o:g}" for o in OFFSETS))
    for op in args.ops.split(","):
        for n_rows, n in SHAPES:
            for dy_kind in ("normal", "1+0.01N", "y"):
                for affine in (False, True):
                    rows = []
                    for offset in OFFSETS:
                        x = (offset + rng.standard_normal((n_rows, n))).astype(np.float32)
                        dy = rng.standard_normal((n_rows, n))
                        if dy_kind == "1+0.01N":
                            dy = 1 + 0.01 * dy
                        dy = dy.astype(np.float32)
                        gamma = rng.standard_normal(n).astype(np.float32) if affine else None
                        if dy_kind == "y":
                            dy = getattr(module, op)(x, gamma)
                        rows.append(errors(module, op, x, dy, gamma))
                    names = ("dx", "dx/dy", "dgamma", "dbeta")[: len(rows[0])]
                    cells = [f"{name} " + " / ".join(f"{r[k]:.1e}" for r in rows)
                             for k, name in enumerate(names)]
                    print(f"{op} {n_rows}x{n} dy {dy_kind} gamma {'yes' if affine else 'no'}: "
                          + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
