"""The examples in examples/, run with small settings: their summaries, their PNG, their claims.

Each is imported from its file and its main(argv) called in-process (fast), and run once as a
script in a subprocess, as the README runs it. No timing is asserted.
"""
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SMALL_MLP = ["--depth", "6", "--width", "32", "--steps", "120", "--train-points", "1000",
             "--test-points", "300"]
SMALL_BLOCK = ["--layers", "2", "--batch", "2", "--seq", "16", "--d-model", "64", "--heads",
               "4", "--repeat", "2"]


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def deep_mlp():
    return load("train_deep_mlp")


@pytest.fixture(scope="module")
def transformer():
    return load("prenorm_transformer_block")


def summary_rows(text):
    """{'plain': [...], 'LayerNorm': [...]}: the columns of the MLP example's summary rows."""
    rows = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ("plain", "LayerNorm"):
            rows[words[0]] = words[1:]
    return rows


# ---------------------------------------------------------------------------------------------
# train_deep_mlp.py
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_deep_mlp_writes_the_png_and_shows_layer_norm_training_where_plain_does_not(
        deep_mlp, tmp_path, capsys):
    png = tmp_path / "mlp.png"
    assert deep_mlp.main(SMALL_MLP + ["--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000

    rows = summary_rows(out)
    assert set(rows) == {"plain", "LayerNorm"}
    plain_loss, layer_norm_loss = float(rows["plain"][0]), float(rows["LayerNorm"][0])
    assert layer_norm_loss < plain_loss - 0.3  # LayerNorm trains the deep MLP better, with these settings
    assert float(rows["LayerNorm"][1].rstrip("%")) > float(rows["plain"][1].rstrip("%"))
    # activation RMS at the end: "smallest .. largest"; LayerNorm's smallest is well-scaled
    plain_smallest, layer_norm_smallest = float(rows["plain"][5]), float(rows["LayerNorm"][5])
    assert layer_norm_smallest > 0.3 > plain_smallest


def test_deep_mlp_without_matplotlib_says_it_skipped_the_plot(deep_mlp, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    png = tmp_path / "mlp.png"
    assert deep_mlp.main(["--depth", "3", "--steps", "5", "--train-points", "200",
                          "--test-points", "50", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed: skipped the plot" in out
    assert set(summary_rows(out)) == {"plain", "LayerNorm"}
    assert not png.exists()


def test_deep_mlp_layers_get_exact_gradients(deep_mlp):
    """The example's hand-written backward (Linear, tanh, fastln LayerNorm) is right."""
    import numpy as np

    model = deep_mlp.MLP(width=6, depth=3, layer_norm=True, init="torch", seed=0)
    for layer in model.layers:  # float64 everywhere for a finite-difference check
        if isinstance(layer, deep_mlp.Linear):
            for name in ("weight", "bias", "weight_grad", "bias_grad"):
                setattr(layer, name, getattr(layer, name).astype(np.float64))
    for index, layer in enumerate(model.layers):
        if not isinstance(layer, deep_mlp.Linear) and layer.parameters():
            replacement = type(layer)(6, dtype=np.float64)
            replacement.weight[...] = 1 + 0.1 * np.arange(6)
            model.layers[index] = replacement
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, deep_mlp.N_FEATURES))
    labels = np.array([0, 1, 2, 3, 0])

    def loss():
        logits, _ = model.forward(x)
        return deep_mlp.cross_entropy(logits, labels)[0]

    logits, _ = model.forward(x)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    dlogits = shifted / shifted.sum(axis=1, keepdims=True)
    dlogits[np.arange(5), labels] -= 1
    model.backward(dlogits / 5)
    first_linear, layer_norm = model.layers[0], model.layers[1]
    for param, grad in ((first_linear.weight, first_linear.weight_grad),
                        (layer_norm.weight, layer_norm.weight_grad),
                        (layer_norm.bias, layer_norm.bias_grad)):
        index = (0,) * param.ndim
        saved = param[index]
        param[index] = saved + 1e-6
        above = loss()
        param[index] = saved - 1e-6
        below = loss()
        param[index] = saved
        assert abs((above - below) / 2e-6 - grad[index]) < 1e-6


def test_deep_mlp_rejects_bad_settings(deep_mlp, capsys):
    with pytest.raises(SystemExit):
        deep_mlp.main(["--depth", "0"])
    assert "--depth" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# prenorm_transformer_block.py
# ---------------------------------------------------------------------------------------------

def test_transformer_block_fused_and_numpy_versions_agree_and_are_timed(transformer, capsys):
    assert transformer.main(SMALL_BLOCK) == 0
    out = capsys.readouterr().out
    difference = float(re.search(r"max \|fastln - numpy\| = (\S+)", out).group(1))
    assert difference < 1e-4
    for row in ("add + LayerNorm steps", "whole forward"):
        match = re.search(rf"{re.escape(row)}\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)x", out)
        assert match, out
        numpy_ms, fastln_ms, speedup = map(float, match.groups())
        assert numpy_ms > 0 and fastln_ms > 0
        assert speedup == pytest.approx(numpy_ms / fastln_ms, rel=0.1, abs=0.05)
    assert "4 fused add + norm and 1 LayerNorm per forward" in out


def test_transformer_block_matches_a_direct_numpy_computation(transformer):
    """The fused forward is the pre-norm stack: checked against a plain re-derivation."""
    import numpy as np

    rng = np.random.default_rng(1)
    blocks = [transformer.Block(32, 4, rng, np.float64) for _ in range(2)]
    final_norm = transformer.random_layer_norm(32, rng, np.float64)
    x = rng.standard_normal((2, 5, 32))

    def layer_norm(s, norm):
        mean = s.mean(-1, keepdims=True)
        return ((s - mean) / np.sqrt(((s - mean) ** 2).mean(-1, keepdims=True) + norm.eps)
                * norm.weight + norm.bias)

    h = x.copy()
    for block in blocks:
        h = h + transformer.attention(layer_norm(h, block.norm_1), block) + block.b_out
        h = h + transformer.mlp(layer_norm(h, block.norm_2), block) + block.b_down
    expected = layer_norm(h, final_norm)
    fused = transformer.fastln_forward(x, blocks, final_norm, num_threads=1)
    np.testing.assert_allclose(fused, expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(transformer.numpy_forward(x, blocks, final_norm), expected,
                               rtol=1e-10, atol=1e-10)
    # causal: the first token's output does not depend on later tokens
    changed = x.copy()
    changed[:, 1:] += 1.0
    np.testing.assert_allclose(transformer.fastln_forward(changed, blocks, final_norm)[:, 0],
                               fused[:, 0], rtol=1e-12)


def test_transformer_block_rejects_bad_settings(transformer, capsys):
    with pytest.raises(SystemExit):
        transformer.main(["--d-model", "30", "--heads", "4"])
    assert "not a multiple of --heads" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# As scripts, the way the README runs them
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script, argv, expected", [
    ("train_deep_mlp.py", ["--depth", "3", "--steps", "10", "--train-points", "300",
                           "--test-points", "50", "--out", "{tmp}/mlp.png"],
     ["LayerNorm", "plain"]),
    ("prenorm_transformer_block.py", SMALL_BLOCK + ["--threads", "1"],
     ["outputs agree", "whole forward", "fastln num_threads=1"]),
])
def test_examples_run_as_scripts(script, argv, expected, tmp_path):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    result = subprocess.run([sys.executable, str(EXAMPLES / script)] + argv,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for text in expected:
        assert text in result.stdout
    if script == "train_deep_mlp.py":
        assert (tmp_path / "mlp.png").exists() == HAVE_MATPLOTLIB
        assert ("skipped the plot" in result.stdout) == (not HAVE_MATPLOTLIB)
