"""A small CPU transformer with and without fastln.torch.patch: time per step, same results;
and, with --layers, the LayerNorm module alone at three shapes with the cost of the glue.

    python benchmarks/torch_swap.py                    # defaults: 4 blocks, d=256, 8 x 128 tokens
    python benchmarks/torch_swap.py --threads 1 --blocks 2 --width 512 --repeats 20
    python benchmarks/torch_swap.py --layers           # (1, 768), (1024, 256), (4096, 768)

--layers times torch.nn.LayerNorm and fastln.torch.LayerNorm (float32) in inference_mode and
for forward + backward, interleaved in rounds (medians), and fastln.layer_norm on the tensors'
NumPy views with the same parameters: the module's time minus that call's is the glue, what
fastln.torch adds to fastln (module call, checks, views, wrapping the result).

The model is a pre-norm (GPT-style) stack: x + attention(LayerNorm(x)), x + MLP(LayerNorm(x)),
a final LayerNorm. The same model object is timed as PyTorch built it and after
``fastln.torch.patch(model)`` (which swaps its LayerNorm modules in place), in inference
(``torch.no_grad``) and training (forward + backward) steps, alternating the two versions so
that drift on the machine affects both alike. It also times the LayerNorm layers alone on the
model's activation shape, since they are a small part of a transformer's time. PyTorch and
fastln get the same number of threads.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import fastln
import fastln.torch


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, blocks, width, heads):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(width, heads) for _ in range(blocks)])
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.blocks(x))


def _time(step, repeats):
    step()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def _compare(model, x, repeats, train):
    def step():
        if train:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        else:
            with torch.no_grad():
                model(x)

    results = {"torch": [], "fastln": []}
    for _ in range(repeats):  # alternate, a few steps each
        fastln.torch.unpatch(model)
        results["torch"] += _time(step, 3)
        fastln.torch.patch(model)
        results["fastln"] += _time(step, 3)
    fastln.torch.unpatch(model)
    return {name: statistics.median(t) * 1e3 for name, t in results.items()}


LAYER_SHAPES = ((1, 768), (1024, 256), (4096, 768))


def _interleaved_us(steps, target_seconds=0.002, rounds=15):
    """{name: median microseconds per call}, the steps timed in turn within each round, the
    order rotated from round to round: the step that follows torch's pays for the fresh pages
    of a large output after torch's allocator has given its own back to the system (0.1 ms at
    (4096, 768)), and with a fixed order that was always the same step."""
    calls = {}
    for name, step in steps.items():
        step()
        calls[name] = max(1, int(target_seconds / max(min(_time(step, 3)), 1e-7)))
    samples = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            step = steps[name]
            start = time.perf_counter()
            for _ in range(calls[name]):
                step()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def layer_table(threads):
    """The LayerNorm module alone: inference and forward + backward, torch against fastln."""
    rows = []
    for shape in LAYER_SHAPES:
        width = shape[-1]
        theirs, ours = torch.nn.LayerNorm(width), fastln.torch.LayerNorm(width, num_threads=threads)
        with torch.no_grad():
            theirs.weight.normal_()
            theirs.bias.normal_()
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(shape)
        x_array, weight, bias = x.numpy(), ours.weight.detach().numpy(), ours.bias.detach().numpy()
        with torch.inference_mode():
            inference = _interleaved_us({
                "torch": lambda: theirs(x), "fastln.torch": lambda: ours(x),
                "fastln": lambda: fastln.layer_norm(x_array, weight, bias, 1e-5,
                                                    num_threads=threads)})
        x_grad, grad_output = x.clone().requires_grad_(), torch.randn(shape)
        training = _interleaved_us({
            "torch": lambda: theirs(x_grad).backward(grad_output),
            "fastln.torch": lambda: ours(x_grad).backward(grad_output)})
        rows.append({"shape": list(shape), "inference_us": inference,
                     "forward_backward_us": training,
                     "glue_us": inference["fastln.torch"] - inference["fastln"]})
    return rows


def print_layer_table(rows, threads):
    print(f"LayerNorm modules alone, float32, {threads} thread(s), torch {torch.__version__}; "
          f"medians of interleaved rounds, microseconds per call")
    print(f"{'shape':<12}{'inference: torch':>18}{'fastln.torch':>14}{'speed-up':>10}"
          f"{'glue':>8}{'fwd+bwd: torch':>16}{'fastln.torch':>14}{'speed-up':>10}")
    for row in rows:
        inference, training = row["inference_us"], row["forward_backward_us"]
        print(f"{str(tuple(row['shape'])):<12}{inference['torch']:>18.2f}"
              f"{inference['fastln.torch']:>14.2f}"
              f"{inference['torch'] / inference['fastln.torch']:>9.2f}x{row['glue_us']:>8.2f}"
              f"{training['torch']:>16.1f}{training['fastln.torch']:>14.1f}"
              f"{training['torch'] / training['fastln.torch']:>9.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--layers", action="store_true",
                        help="time the LayerNorm module alone at (1, 768), (1024, 256) and "
                             "(4096, 768), with the glue's cost")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    fastln.set_num_threads(args.threads)
    if args.layers:
        rows = layer_table(args.threads)
        if args.json:
            print(json.dumps({"threads": args.threads, "torch": torch.__version__,
                              "layers": rows}, indent=2))
        else:
            print_layer_table(rows, args.threads)
        return
    model = Model(args.blocks, args.width, args.heads)
    x = torch.randn(args.batch, args.tokens, args.width)

    # Same outputs and gradients with and without the swap (to float32 rounding).
    reference = model(x)
    reference.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fastln.torch.patch(model)
    swapped = model(x)
    swapped.square().mean().backward()
    max_output_diff = (swapped - reference).abs().max().item()
    max_grad_diff = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads))
    fastln.torch.unpatch(model)

    norms = {"torch": torch.nn.LayerNorm(args.width), "fastln": fastln.torch.LayerNorm(args.width)}
    rows = x.reshape(-1, args.width)
    layer = {}
    for name, norm in norms.items():
        with torch.no_grad():
            layer[name] = statistics.median(_time(lambda: norm(rows), 20 * args.repeats)) * 1e3
        grad_rows = rows.clone().requires_grad_()
        grad_output = torch.randn_like(rows)  # contiguous, as inside a model
        layer[name + "_train"] = statistics.median(
            _time(lambda: norm(grad_rows).backward(grad_output), 20 * args.repeats)) * 1e3

    result = {
        "model": f"{args.blocks} pre-norm blocks, d={args.width}, {args.heads} heads, "
                 f"{2 * args.blocks + 1} LayerNorms",
        "input": [args.batch, args.tokens, args.width],
        "threads": args.threads,
        "torch": torch.__version__,
        "inference_ms": _compare(model, x, args.repeats, train=False),
        "train_step_ms": _compare(model, x, args.repeats, train=True),
        "layer_norm_alone_ms": layer,
        "max_abs_output_diff": max_output_diff,
        "max_abs_grad_diff": max_grad_diff,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['model']}; input {tuple(result['input'])}; {args.threads} thread(s); "
          f"torch {torch.__version__}")
    print(f"{'median ms':<34}{'torch':>10}{'fastln':>10}")
    for label, key in (("model, inference (no_grad)", "inference_ms"),
                       ("model, train step (fwd+bwd)", "train_step_ms")):
        print(f"{label:<34}{result[key]['torch']:>10.3f}{result[key]['fastln']:>10.3f}")
    rows_label = f"LayerNorm alone {tuple(rows.shape)}"
    print(f"{rows_label + ', forward':<34}{layer['torch']:>10.3f}{layer['fastln']:>10.3f}")
    print(f"{rows_label + ', fwd+bwd':<34}{layer['torch_train']:>10.3f}"
          f"{layer['fastln_train']:>10.3f}")
    print(f"max |output difference| {max_output_diff:.2e}, max |gradient difference| "
          f"{max_grad_diff:.2e}")


if __name__ == "__main__":
    main()
