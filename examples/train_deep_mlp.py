"""Train a deep MLP in plain NumPy with and without fastln.nn.LayerNorm, and plot the difference.

The claim under test: normalization keeps the activations between layers well-scaled, so that a
deep network trains stably and is far less sensitive to its initialization and learning rate.
This example puts it to the test: two copies of the same 12-layer tanh MLP (same initial
weights, same batches, same plain SGD and learning rate) learn a synthetic classification task;
one has a LayerNorm between each linear map and its tanh (the "before the activation"
placement, which keeps the input of the nonlinearity centred where saturation hurts most), the
other has not.

The linear layers start as PyTorch's ``nn.Linear`` does (uniform in +-1/sqrt(fan_in)), what most
people get without thinking about it. Through tanh that init shrinks the signal at every layer,
so in the plain network the deep layers see almost nothing and learning barely starts at this
learning rate; with LayerNorm every layer's input is rescaled and the network trains. With an
init scaled for depth (``--init kaiming``: normal with std sqrt(2/fan_in)) the plain network
trains too: normalization removes the need to get that scale right.

The task: 32-dimensional Gaussian inputs labelled with one of 4 classes by a random "teacher"
network; accuracy is measured on held-out points.

Prints a summary, and writes a PNG with the loss curves and the activation scale (RMS) of every
hidden layer at the start and at the end of training (matplotlib; without it the plot is
skipped, and the summary says so).

    python examples/train_deep_mlp.py                      # about 5 s on 2 cores
    python examples/train_deep_mlp.py --depth 4 --steps 100 --out /tmp/mlp.png
"""
import argparse
import os
import sys
import time

if __name__ == "__main__":
    # The matrices here are tiny (128 x 64): BLAS threads cost more than they save, and on a
    # busy machine they can make every step ten times slower. One BLAS thread, unless the
    # environment says otherwise (it must be set before NumPy is imported).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import fastln.nn  # noqa: E402

N_FEATURES = 32
N_CLASSES = 4


# ---------------------------------------------------------------------------------------------
# Data: labels from a random teacher network
# ---------------------------------------------------------------------------------------------

def make_teacher_task(n_train, n_test, rng):
    """(x_train, y_train, x_test, y_test): Gaussian inputs, argmax of a random tanh network."""
    x = rng.standard_normal((n_train + n_test, N_FEATURES)).astype(np.float32)
    hidden = rng.standard_normal((N_FEATURES, 16)) / np.sqrt(N_FEATURES)
    readout = rng.standard_normal((16, N_CLASSES))
    labels = np.argmax(np.tanh(x @ hidden) @ readout, axis=1)
    return x[:n_train], labels[:n_train], x[n_train:], labels[n_train:]


# ---------------------------------------------------------------------------------------------
# The network: (Linear -> [LayerNorm] -> tanh) x depth, then a linear classifier
# ---------------------------------------------------------------------------------------------

class Linear:
    """y = x @ weight + bias."""

    def __init__(self, n_in, n_out, rng, init):
        if init == "torch":  # torch.nn.Linear's default: uniform in +-1/sqrt(fan_in)
            bound = 1.0 / np.sqrt(n_in)
            self.weight = rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32)
            self.bias = rng.uniform(-bound, bound, n_out).astype(np.float32)
        else:  # "kaiming": normal, std sqrt(2 / fan_in), zero bias
            self.weight = (rng.standard_normal((n_in, n_out))
                           * np.sqrt(2.0 / n_in)).astype(np.float32)
            self.bias = np.zeros(n_out, np.float32)
        self.weight_grad = np.zeros_like(self.weight)
        self.bias_grad = np.zeros_like(self.bias)

    def __call__(self, x):
        self.x = x
        return x @ self.weight + self.bias

    def backward(self, dy):
        self.weight_grad += self.x.T @ dy
        self.bias_grad += dy.sum(axis=0)
        return dy @ self.weight.T

    def parameters(self):
        return [self.weight, self.bias]

    def grads(self):
        return [self.weight_grad, self.bias_grad]


class Tanh:
    def __call__(self, x):
        self.y = np.tanh(x)
        return self.y

    def backward(self, dy):
        return dy * (1.0 - self.y * self.y)

    def parameters(self):
        return []

    def grads(self):
        return []


class MLP:
    """`depth` hidden layers of `width` units; `layer_norm` puts a LayerNorm before each tanh."""

    def __init__(self, width, depth, layer_norm, init, seed):
        rng = np.random.default_rng(seed)  # the same seed gives both networks the same Linears
        self.layers = []
        self.hidden_outputs = set()  # positions in self.layers of each hidden layer's output
        n_in = N_FEATURES
        for _ in range(depth):
            self.layers.append(Linear(n_in, width, rng, init))
            if layer_norm:
                self.layers.append(fastln.nn.LayerNorm(width))
            self.layers.append(Tanh())
            self.hidden_outputs.add(len(self.layers) - 1)
            n_in = width
        self.layers.append(Linear(n_in, N_CLASSES, rng, init))

    def forward(self, x):
        """The logits, and the RMS of every hidden layer's output."""
        scales = []
        for position, layer in enumerate(self.layers):
            x = layer(x)
            if position in self.hidden_outputs:
                scales.append(float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))))
        return x, scales

    def backward(self, dlogits):
        for layer in reversed(self.layers):
            dlogits = layer.backward(dlogits)

    def sgd_step(self, lr):
        for layer in self.layers:
            for param, grad in zip(layer.parameters(), layer.grads()):
                param -= lr * grad
                grad[...] = 0


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy, and its gradient with respect to the logits."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    dlogits = np.exp(log_probs)
    dlogits[rows, labels] -= 1.0
    return -log_probs[rows, labels].mean(), (dlogits / len(labels)).astype(np.float32)


def train(model, data, steps, batch_size, lr, seed):
    """Plain SGD on random batches; the loss history, activation scales, test accuracy, time."""
    x_train, y_train, x_test, y_test = data
    rng = np.random.default_rng(seed)  # the same batches for both networks
    _, initial_scales = model.forward(x_train)
    losses = []
    diverged_at = None
    start = time.perf_counter()
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(steps):
            batch = rng.choice(len(x_train), batch_size, replace=False)
            logits, _ = model.forward(x_train[batch])
            loss, dlogits = cross_entropy(logits, y_train[batch])
            if not np.isfinite(loss):
                diverged_at = step
                break
            losses.append(loss)
            model.backward(dlogits)
            model.sgd_step(lr)
        seconds = time.perf_counter() - start
        _, final_scales = model.forward(x_train)
        logits, _ = model.forward(x_test)
    return {"losses": np.array(losses), "initial_scales": initial_scales,
            "final_scales": final_scales, "diverged_at": diverged_at, "seconds": seconds,
            "test_accuracy": float(np.mean(np.argmax(logits, axis=1) == y_test))}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def moving_average(values, window):
    if len(values) < window:
        return np.arange(len(values)), values
    return (np.arange(window - 1, len(values)),
            np.convolve(values, np.ones(window) / window, mode="valid"))


def plot(results, args, path):
    """The PNG: smoothed loss curves, and activation RMS by layer at the start and the end."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"plain": "tab:red", "LayerNorm": "tab:blue"}
    window = max(1, args.steps // 40)
    for name, result in results.items():
        label = name
        if result["diverged_at"] is not None:
            label += f" (diverged at step {result['diverged_at']})"
        ax_loss.plot(*moving_average(result["losses"], window), color=colors[name], label=label)
        layers = np.arange(1, len(result["initial_scales"]) + 1)
        ax_scale.plot(layers, result["initial_scales"], "o--", color=colors[name], alpha=0.5,
                      label=f"{name}, start")
        final = np.array(result["final_scales"])
        finite = np.isfinite(final)
        ax_scale.plot(layers[finite], final[finite], "o-", color=colors[name],
                      label=f"{name}, end")
    ax_loss.axhline(np.log(N_CLASSES), color="gray", linestyle=":", label="chance (log 4)")
    ax_loss.set_xlabel("SGD step")
    ax_loss.set_ylabel(f"training loss (moving mean of {window} steps)")
    ax_loss.set_title(f"{args.depth}-layer tanh MLP, plain SGD, learning rate {args.lr:g}")
    ax_loss.legend()
    ax_scale.set_yscale("log")
    ax_scale.set_xlabel("hidden layer")
    ax_scale.set_ylabel("RMS of the layer's output")
    ax_scale.set_title("activation scale by depth")
    ax_scale.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scale_range(scales):
    scales = np.array(scales)
    if not np.all(np.isfinite(scales)):
        return "not finite"
    return f"{scales.min():.3g} .. {scales.max():.3g}"


def print_summary(results):
    print(f"{'':<10} {'final loss':>10} {'test accuracy':>14} {'activation RMS, start':>22} "
          f"{'activation RMS, end':>20} {'train time':>11}")
    for name, result in results.items():
        losses = result["losses"]
        if result["diverged_at"] is not None:
            final = f"diverged at step {result['diverged_at']}"
        else:
            final = f"{losses[-max(1, len(losses) // 20):].mean():.4f}"  # last 5% of the steps
        print(f"{name:<10} {final:>10} {result['test_accuracy']:>14.1%} "
              f"{scale_range(result['initial_scales']):>22} "
              f"{scale_range(result['final_scales']):>20} {result['seconds']:>10.2f}s")
    print(f"(chance: loss {np.log(N_CLASSES):.4f}, accuracy about {1 / N_CLASSES:.0%}; "
          "activation RMS: smallest .. largest over the hidden layers)")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Train a deep tanh MLP with and without fastln.nn.LayerNorm; print a "
                    "summary and plot the loss curves and per-layer activation scale.")
    parser.add_argument("--depth", type=int, default=12, help="hidden layers (default 12)")
    parser.add_argument("--width", type=int, default=64, help="units per layer (default 64)")
    parser.add_argument("--steps", type=int, default=1000, help="SGD steps (default 1000)")
    parser.add_argument("--batch-size", type=int, default=128, help="(default 128)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument("--init", choices=("torch", "kaiming"), default="torch",
                        help="weight init of the linear layers (default: torch.nn.Linear's)")
    parser.add_argument("--train-points", type=int, default=20000, help="(default 20000)")
    parser.add_argument("--test-points", type=int, default=2000, help="(default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="deep_mlp.png", help="the PNG (default deep_mlp.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    if min(args.depth, args.width, args.steps, args.batch_size, args.test_points) < 1:
        parser.error("--depth, --width, --steps, --batch-size and --test-points must be >= 1")
    if args.train_points < args.batch_size:
        parser.error("--train-points must be at least --batch-size")
    return args


def main(argv=None):
    args = parse_args(argv)
    data = make_teacher_task(args.train_points, args.test_points,
                             np.random.default_rng(args.seed))
    print(f"{args.depth} hidden layers of {args.width} tanh units, init {args.init}, plain SGD "
          f"with learning rate {args.lr:g}, {args.steps} steps of {args.batch_size}, float32; "
          f"task: {N_CLASSES} classes of {N_FEATURES}-d points from a random teacher network")
    results = {}
    for name, layer_norm in (("plain", False), ("LayerNorm", True)):
        model = MLP(args.width, args.depth, layer_norm, args.init, seed=args.seed + 1)
        results[name] = train(model, data, args.steps, args.batch_size, args.lr,
                              seed=args.seed + 2)
    print_summary(results)

    if args.no_plot:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: skipped the plot (pip install matplotlib)")
        return 0
    plot(results, args, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
