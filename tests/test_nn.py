"""fastln.nn layers: parity with torch.nn (state dicts both ways, forward, backward, modes),
the one-forward-one-backward rule, gradient accumulation, state dicts, files, checks, repr.

The torch tests skip when PyTorch is not installed; everything else runs without it.
"""
import io
import zipfile
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from conftest import HALF

import fastln.nn as nn

try:
    import torch
except ImportError:  # torch is never a requirement
    torch = None

requires_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")

TOLERANCE = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-10, atol=1e-10)}
TORCH_DTYPE = {np.float32: "float32", np.float64: "float64"}


def random(rng, shape, dtype, scale=1.0, offset=0.0):
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def to_torch(state):
    return {key: torch.from_numpy(np.asarray(value)) for key, value in state.items()}


def torch_forward_backward(module, x, dy):
    """y, dx and the parameter gradients of a torch module, as NumPy arrays."""
    x_tensor = torch.tensor(x, requires_grad=True)
    y = module(x_tensor)
    y.backward(torch.tensor(dy))
    grads = {name: param.grad.numpy().copy() for name, param in module.named_parameters()}
    return y.detach().numpy(), x_tensor.grad.numpy(), grads


def assert_matches_torch(layer, reference, x, dy, dtype):
    """A forward and a backward of the layer and of the torch module agree (y and dx); returns
    the layer's y and dx and torch's parameter gradients."""
    y_ref, dx_ref, grads_ref = torch_forward_backward(reference, x, dy)
    y = layer(x)
    dx = layer.backward(dy)
    np.testing.assert_allclose(y, y_ref, **TOLERANCE[dtype])
    np.testing.assert_allclose(dx, dx_ref, **TOLERANCE[dtype])
    return y, dx, grads_ref


def randomize_params(layer, rng):
    for param in layer.parameters():
        param[...] = rng.uniform(0.5, 1.5, param.shape) * rng.choice([-1, 1], param.shape)


# ---------------------------------------------------------------------------------------------
# Parity with torch.nn
# ---------------------------------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("normalized_shape, x_shape", [(16, (5, 16)), ((3, 4), (2, 5, 3, 4))])
@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_matches_torch_both_ways(dtype, normalized_shape, x_shape, affine, bias):
    rng = np.random.default_rng(0)
    reference = torch.nn.LayerNorm(normalized_shape, eps=1e-4, elementwise_affine=affine,
                                   bias=bias, dtype=getattr(torch, TORCH_DTYPE[dtype]))
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.tensor(rng.uniform(-2, 2, tuple(param.shape))))
    layer = nn.LayerNorm(normalized_shape, eps=1e-4, elementwise_affine=affine, bias=bias,
                         dtype=dtype)
    assert list(layer.state_dict()) == list(reference.state_dict())
    layer.load_state_dict(reference.state_dict())  # torch -> fastln, unchanged

    x = random(rng, x_shape, dtype, scale=3.0, offset=1.0)
    dy = random(rng, x_shape, dtype)
    y, dx, grads_ref = assert_matches_torch(layer, reference, x, dy, dtype)
    assert y.dtype == dx.dtype == dtype
    assert set(grads_ref) == set(layer.named_parameters())
    for name, grad in grads_ref.items():
        np.testing.assert_allclose(getattr(layer, name + "_grad"), grad, **TOLERANCE[dtype])

    # fastln -> torch: new parameters here, loaded there, same forward
    randomize_params(layer, rng)
    reference.load_state_dict(to_torch(layer.state_dict()))
    y_ref, _, _ = torch_forward_backward(reference, x, dy)
    np.testing.assert_allclose(layer(x), y_ref, **TOLERANCE[dtype])


@requires_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("eps", [1e-5, None])
@pytest.mark.parametrize("normalized_shape, x_shape", [(12, (7, 12)), ((2, 6), (3, 2, 6))])
def test_rms_norm_matches_torch_both_ways(dtype, eps, normalized_shape, x_shape):
    rng = np.random.default_rng(1)
    reference = torch.nn.RMSNorm(normalized_shape, eps=eps,
                                 dtype=getattr(torch, TORCH_DTYPE[dtype]))
    with torch.no_grad():
        reference.weight.copy_(torch.tensor(rng.uniform(-2, 2, tuple(reference.weight.shape))))
    layer = nn.RMSNorm(normalized_shape, eps=eps, dtype=dtype)
    assert list(layer.state_dict()) == ["weight"] == list(reference.state_dict())
    layer.load_state_dict(reference.state_dict())

    x = random(rng, x_shape, dtype, scale=2.0, offset=0.5)
    dy = random(rng, x_shape, dtype)
    _, _, grads_ref = assert_matches_torch(layer, reference, x, dy, dtype)
    np.testing.assert_allclose(layer.weight_grad, grads_ref["weight"], **TOLERANCE[dtype])

    randomize_params(layer, rng)
    reference.load_state_dict(to_torch(layer.state_dict()))
    np.testing.assert_allclose(layer(x), torch_forward_backward(reference, x, dy)[0],
                               **TOLERANCE[dtype])


def torch_batch_norm(num_features, momentum, dtype, **kwargs):
    torch_momentum = None if momentum is None else 1.0 - momentum
    return torch.nn.BatchNorm1d(num_features, eps=1e-5, momentum=torch_momentum,
                                dtype=getattr(torch, TORCH_DTYPE[dtype]), **kwargs)


@requires_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("x_shape, axis", [((16, 5), -1), ((4, 5, 6), 1)])
@pytest.mark.parametrize("momentum", [0.9, 0.7, None])
def test_batch_norm_with_unbiased_running_var_matches_torch_in_both_modes(dtype, x_shape, axis,
                                                                         momentum):
    rng = np.random.default_rng(2)
    n_features = x_shape[axis]
    reference = torch_batch_norm(n_features, momentum, dtype)
    layer = nn.BatchNorm(n_features, momentum=momentum, axis=axis, dtype=dtype,
                         unbiased_running_var=True)
    randomize_params(layer, rng)
    reference.load_state_dict(to_torch(layer.state_dict()))  # fastln -> torch

    for step in range(3):  # training: batch statistics, running statistics follow
        x = random(rng, x_shape, dtype, scale=2.0 + step, offset=step - 1.0)
        dy = random(rng, x_shape, dtype)
        _, _, grads_ref = assert_matches_torch(layer, reference, x, dy, dtype)
    # torch's .grad accumulated over the three backwards, like weight_grad here
    np.testing.assert_allclose(layer.weight_grad, grads_ref["weight"], **TOLERANCE[dtype])
    np.testing.assert_allclose(layer.bias_grad, grads_ref["bias"], **TOLERANCE[dtype])
    for key, value in reference.state_dict().items():
        np.testing.assert_allclose(layer.state_dict()[key], value.numpy(), **TOLERANCE[dtype])
    assert int(layer.num_batches_tracked) == 3

    reference.eval()
    layer.eval()
    x = random(rng, x_shape, dtype, scale=2.0)
    dy = random(rng, x_shape, dtype)
    running_before = layer.state_dict()
    y_ref, dx_ref, _ = torch_forward_backward(reference, x, dy)
    np.testing.assert_allclose(layer(x), y_ref, **TOLERANCE[dtype])
    np.testing.assert_allclose(layer.backward(dy), dx_ref, **TOLERANCE[dtype])
    for key, value in layer.state_dict().items():
        if key not in ("weight", "bias"):
            np.testing.assert_array_equal(value, running_before[key])  # eval changes nothing

    # torch -> fastln: a fresh layer takes torch's trained state and agrees in eval mode
    fresh = nn.BatchNorm(n_features, momentum=momentum, axis=axis, dtype=dtype).eval()
    fresh.load_state_dict(reference.state_dict())
    np.testing.assert_allclose(fresh(x), y_ref, **TOLERANCE[dtype])


@requires_torch
def test_batch_norm_default_takes_the_biased_batch_variance():
    """Default: running_var takes the biased batch variance (divide by m); torch's the unbiased."""
    rng = np.random.default_rng(3)
    x = random(rng, (8, 3), np.float64, scale=2.0)
    layer = nn.BatchNorm(3, momentum=0.9, dtype=np.float64)
    reference = torch_batch_norm(3, 0.9, np.float64)
    y = layer(x)
    y_ref = reference(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)  # normalization: the same
    np.testing.assert_allclose(layer.running_mean, 0.1 * x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(layer.running_var, 0.9 + 0.1 * x.var(axis=0), rtol=1e-12)
    np.testing.assert_allclose(reference.running_var.numpy(), 0.9 + 0.1 * x.var(axis=0, ddof=1),
                               rtol=1e-12)
    assert not np.allclose(layer.running_var, reference.running_var.numpy())


@requires_torch
@pytest.mark.parametrize("affine, track", [(False, True), (True, False), (False, False)])
def test_batch_norm_options_have_torchs_keys_and_behaviour(affine, track):
    rng = np.random.default_rng(4)
    layer = nn.BatchNorm(4, affine=affine, track_running_stats=track, dtype=np.float64,
                         unbiased_running_var=True)
    reference = torch_batch_norm(4, 0.9, np.float64, affine=affine, track_running_stats=track)
    assert list(layer.state_dict()) == list(reference.state_dict())
    layer.load_state_dict(reference.state_dict())
    for mode in ("train", "eval"):
        getattr(layer, mode)()
        getattr(reference, mode)()
        x = random(rng, (6, 4), np.float64, scale=3.0, offset=2.0)
        dy = random(rng, (6, 4), np.float64)
        y_ref, dx_ref, _ = torch_forward_backward(reference, x, dy)
        np.testing.assert_allclose(layer(x), y_ref, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(layer.backward(dy), dx_ref, rtol=1e-10, atol=1e-10)
    assert len(layer.parameters()) == (2 if affine else 0)


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(6), lambda: nn.RMSNorm(6)])
def test_layer_and_rms_norm_are_identical_in_train_and_eval(make):
    layer = make()
    x = random(np.random.default_rng(5), (4, 6), np.float32, scale=3.0)
    assert layer.training
    y_train = layer(x)
    assert layer.eval() is layer and not layer.training
    np.testing.assert_array_equal(layer(x), y_train)
    assert layer.train() is layer and layer.training


def test_batch_norm_switches_statistics_with_the_mode():
    rng = np.random.default_rng(6)
    layer = nn.BatchNorm(3, momentum=0.5, dtype=np.float64)
    x = random(rng, (10, 3), np.float64, scale=4.0, offset=5.0)
    y_train = layer(x)
    np.testing.assert_allclose(y_train.mean(axis=0), 0.0, atol=1e-12)  # batch statistics
    np.testing.assert_allclose(layer.running_mean, 0.5 * x.mean(axis=0))
    layer.eval()
    y_eval = layer(x)
    expected = (x - layer.running_mean) / np.sqrt(layer.running_var + layer.eps)
    np.testing.assert_allclose(y_eval, expected, rtol=1e-12)
    np.testing.assert_allclose(layer.running_mean, 0.5 * x.mean(axis=0))  # not updated
    assert int(layer.num_batches_tracked) == 1
    layer.reset_running_stats()
    assert np.all(layer.running_mean == 0) and np.all(layer.running_var == 1)
    assert int(layer.num_batches_tracked) == 0


def test_batch_norm_unbiased_needs_two_values_per_feature():
    layer = nn.BatchNorm(3, unbiased_running_var=True)
    with pytest.raises(ValueError, match="more than one value per feature"):
        layer(np.ones((1, 3)))
    assert int(layer.num_batches_tracked) == 0
    y = nn.BatchNorm(3)(np.array([[1.0, 2.0, 3.0]]))  # the biased variance (divide by m) allows it
    np.testing.assert_array_equal(y, 0.0)


# ---------------------------------------------------------------------------------------------
# One forward, one backward; gradients accumulate
# ---------------------------------------------------------------------------------------------

LAYERS = {
    "LayerNorm": lambda: nn.LayerNorm(5),
    "RMSNorm": lambda: nn.RMSNorm(5),
    "BatchNorm": lambda: nn.BatchNorm(5),
}


@pytest.mark.parametrize("name", LAYERS)
def test_backward_without_forward_or_twice_is_a_clear_error(name):
    layer = LAYERS[name]()
    x = random(np.random.default_rng(7), (4, 5), np.float32)
    with pytest.raises(RuntimeError, match=rf"{name}\.backward\(\) called before any forward"):
        layer.backward(np.ones((4, 5), np.float32))
    layer(x)
    layer.backward(np.ones((4, 5), np.float32))
    with pytest.raises(RuntimeError, match="already called for the last forward"):
        layer.backward(np.ones((4, 5), np.float32))
    layer(x)  # a new forward allows a new backward
    assert layer.backward(np.ones((4, 5), np.float32)).shape == (4, 5)


@pytest.mark.parametrize("name", LAYERS)
def test_a_bad_dy_does_not_use_up_the_forward(name):
    layer = LAYERS[name]()
    layer(np.ones((4, 5)) * np.arange(5))
    with pytest.raises(ValueError, match=r"dy has shape \(4, 4\)"):
        layer.backward(np.ones((4, 4)))
    assert layer.backward(np.ones((4, 5))).shape == (4, 5)


@pytest.mark.parametrize("name", LAYERS)
def test_gradients_accumulate_until_zero_grad(name):
    rng = np.random.default_rng(8)
    layer = LAYERS[name]()
    grads = layer.grads()
    assert len(grads) == len(layer.parameters()) > 0
    assert all(np.all(grad == 0) for grad in grads)
    x1, x2 = random(rng, (6, 5), np.float32), random(rng, (6, 5), np.float32)
    dy1, dy2 = random(rng, (6, 5), np.float32), random(rng, (6, 5), np.float32)
    layer(x1)
    layer.backward(dy1)
    first = [grad.copy() for grad in layer.grads()]
    layer(x2)
    layer.backward(dy2)
    both = [grad.copy() for grad in layer.grads()]

    single = LAYERS[name]()
    single(x2)
    single.backward(dy2)
    for total, one, two in zip(both, first, single.grads()):
        np.testing.assert_allclose(total, one + two, rtol=1e-6, atol=1e-6)
        assert np.any(two != 0)
    layer.zero_grad()
    for grad, before in zip(layer.grads(), grads):
        assert grad is before and np.all(grad == 0)  # zeroed in place


def test_parameters_are_the_live_arrays_and_an_sgd_step_changes_the_layer():
    layer = nn.LayerNorm(4)
    x = np.array([[1.0, 2.0, 3.0, 10.0]], np.float32)
    assert layer.parameters()[0] is layer.weight and layer.grads()[1] is layer.bias_grad
    assert list(layer.named_parameters()) == ["weight", "bias"]
    layer(x)
    layer.backward(np.ones((1, 4), np.float32))
    for param, grad in zip(layer.parameters(), layer.grads()):
        param -= 0.5 * grad
    np.testing.assert_array_equal(layer.bias, -0.5 * np.ones(4))
    assert not np.array_equal(layer(x), nn.LayerNorm(4)(x))


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def test_inputs_are_converted_to_the_layers_dtype():
    layer = nn.LayerNorm(3)
    y = layer(np.array([[10, 20, 60]]))  # integers, float64 below: computed in float32
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, [[-0.9258201, -0.46291006, 1.3887302]], rtol=1e-5)
    assert layer.backward(np.ones((1, 3))).dtype == np.float32
    assert nn.LayerNorm(3, dtype=np.float64)(np.ones((2, 3), np.float32)).dtype == np.float64
    assert nn.RMSNorm(3, dtype=None).dtype == np.float32  # None: the default, as in torch
    with pytest.raises(TypeError, match="x has dtype complex128"):
        layer(np.ones((1, 3), complex))


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(4), lambda: nn.RMSNorm(4),
                                  lambda: nn.BatchNorm(4), lambda: nn.GroupNorm(1, 3),
                                  lambda: nn.InstanceNorm(3)],
                         ids=["LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm"])
def test_half_inputs_are_converted_like_any_other(make, half):
    """float16 and bfloat16 x and dy are converted to the layer's dtype, as integers are: the
    same results as their float32 values (every half value is one)."""
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((5, 3, 4)).astype(half) for _ in range(2))
    layer, twin = make(), make()
    y, y32 = layer(x), twin(x.astype(np.float32))
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, y32)
    np.testing.assert_array_equal(layer.backward(dy), twin.backward(dy.astype(np.float32)))


def test_input_shape_is_checked_against_the_layer():
    with pytest.raises(ValueError, match=r"normalized_shape=\(3, 4\) expects x of shape "
                                         r"\(\.\.\., 3, 4\), got shape \(2, 4, 3\)"):
        nn.LayerNorm((3, 4))(np.ones((2, 4, 3)))
    with pytest.raises(ValueError, match=r"expects x of shape \(\.\.\., 8\), got shape \(\)"):
        nn.RMSNorm(8)(np.float32(1.0))
    with pytest.raises(ValueError, match=r"BatchNorm\(4\) expects x.shape\[-1\] = 4"):
        nn.BatchNorm(4)(np.ones((3, 5)))
    with pytest.raises(ValueError, match=r"BatchNorm\(5\) expects x.shape\[1\] = 5"):
        nn.BatchNorm(5, axis=1)(np.ones((3, 4, 5)))
    with pytest.raises(ValueError, match="axis=2 needs x with at least 3 dimension"):
        nn.BatchNorm(5, axis=2)(np.ones((3, 5)))


@pytest.mark.parametrize("call, error, message", [
    (lambda: nn.LayerNorm(0), ValueError, "normalized_shape"),
    (lambda: nn.LayerNorm(()), ValueError, "normalized_shape"),
    (lambda: nn.LayerNorm("8"), TypeError, "normalized_shape"),
    (lambda: nn.LayerNorm(8, eps=-1.0), ValueError, "eps"),
    (lambda: nn.LayerNorm(8, dtype=np.float16), TypeError, "dtype must be float32 or float64"),
    (lambda: nn.LayerNorm(8, elementwise_affine=1), TypeError, "elementwise_affine"),
    (lambda: nn.LayerNorm(8, num_threads=0), ValueError, "num_threads"),
    (lambda: nn.RMSNorm(8, dtype="int32"), TypeError, "dtype"),
    (lambda: nn.BatchNorm(0), ValueError, "num_features"),
    (lambda: nn.BatchNorm(4, momentum=1.5), ValueError, "momentum"),
    (lambda: nn.BatchNorm(4, axis=1.0), TypeError, "axis"),
    (lambda: nn.BatchNorm(4, affine="yes"), TypeError, "affine"),
    # numbers of every kind: never an OverflowError, never a bool taken as 1
    (lambda: nn.LayerNorm(768, eps=10**400), ValueError, "^eps must be a finite number"),
    (lambda: nn.RMSNorm(8, eps=Fraction(10**400, 3)), ValueError, "^eps must be"),
    (lambda: nn.BatchNorm(4, eps=Decimal("1e400")), ValueError, "^eps must be"),
    (lambda: nn.BatchNorm(4, momentum=10**400), ValueError, "^momentum must be in"),
    (lambda: nn.BatchNorm(4, momentum=Fraction(-1, 10**400)), ValueError, "^momentum"),
    (lambda: nn.BatchNorm(4, axis=True), TypeError, "^axis must be an int, got a bool"),
    (lambda: nn.BatchNorm(True), TypeError, "^num_features must be an int, got a bool"),
    (lambda: nn.BatchNorm(10**400), ValueError, "^num_features .* is too large"),
    (lambda: nn.LayerNorm((True, 3)), TypeError, "^normalized_shape .*not bools"),
    (lambda: nn.LayerNorm(10**400), ValueError, "^normalized_shape .* is too large"),
    (lambda: nn.RMSNorm((2**40, 2**40)), ValueError, "^normalized_shape .* is too large"),
    (lambda: nn.LayerNorm(8, num_threads=-10**5000), ValueError, "^num_threads"),
])
def test_constructor_arguments_are_checked(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# State dicts and files
# ---------------------------------------------------------------------------------------------

def trained_batch_norm():
    layer = nn.BatchNorm(3)
    randomize_params(layer, np.random.default_rng(9))
    layer(random(np.random.default_rng(10), (8, 3), np.float32, scale=2.0, offset=1.0))
    return layer


@pytest.mark.parametrize("suffix", [".npz", ""])
def test_save_and_load_round_trip(tmp_path, suffix):
    layer = trained_batch_norm()
    path = tmp_path / f"bn{suffix}"
    layer.save(path)
    assert (tmp_path / "bn.npz").exists()
    fresh = nn.BatchNorm(3)
    assert fresh.load(path) is fresh
    for key, value in layer.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[key], value)
        assert fresh.state_dict()[key].dtype == value.dtype
    assert int(fresh.num_batches_tracked) == 1
    x = random(np.random.default_rng(11), (4, 3), np.float32)
    np.testing.assert_array_equal(fresh.eval()(x), layer.eval()(x))
    with np.load(tmp_path / "bn.npz") as archive:  # a plain .npz of the state dict
        assert sorted(archive.files) == sorted(layer.state_dict())


def test_state_dict_returns_copies_and_load_writes_into_the_existing_arrays():
    layer = nn.LayerNorm(3)
    weight = layer.weight
    state = layer.state_dict()
    state["weight"][...] = 7.0
    assert np.all(layer.weight == 1.0)
    layer.load_state_dict(state)
    assert layer.weight is weight and np.all(weight == 7.0)
    state["weight"][...] = 9.0
    assert np.all(layer.weight == 7.0)


def test_load_state_dict_checks_shapes_dtypes_and_keys_before_changing_anything():
    layer = nn.BatchNorm(3)
    good = trained_batch_norm().state_dict()
    before = layer.state_dict()

    def unchanged():
        return all(np.array_equal(value, before[key]) for key, value in
                   layer.state_dict().items())

    bad_shape = dict(good, running_var=np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"state_dict\['running_var'\] has shape \(4,\), but "
                                         r"BatchNorm.running_var has shape \(3,\)"):
        layer.load_state_dict(bad_shape)
    assert unchanged()
    bad_dtype = dict(good, bias=good["bias"].astype(np.float64))
    with pytest.raises(TypeError, match=r"state_dict\['bias'\] has dtype float64, which does "
                                        "not convert to BatchNorm.bias's float32"):
        layer.load_state_dict(bad_dtype)
    assert unchanged()
    with pytest.raises(TypeError, match="num_batches_tracked"):
        layer.load_state_dict(dict(good, num_batches_tracked=np.float32(1.0)))
    with pytest.raises(TypeError, match=r"state_dict\['weight'\] has dtype <U1"):
        layer.load_state_dict(dict(good, weight=np.array(["a", "b", "c"])))
    missing = {key: value for key, value in good.items() if key != "running_mean"}
    with pytest.raises(KeyError, match="missing key.*'running_mean'"):
        layer.load_state_dict(missing)
    with pytest.raises(KeyError, match="unexpected key.*'extra'"):
        layer.load_state_dict(dict(good, extra=np.zeros(3)))
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        layer.load_state_dict([("weight", np.ones(3))])
    assert unchanged()

    result = layer.load_state_dict(dict(missing, extra=np.zeros(3)), strict=False)
    assert result.missing_keys == ["running_mean"] and result.unexpected_keys == ["extra"]
    np.testing.assert_array_equal(layer.running_var, good["running_var"])
    np.testing.assert_array_equal(layer.running_mean, before["running_mean"])

    wider = nn.LayerNorm(3, dtype=np.float64)  # float32 -> float64 loses nothing: accepted
    wider.load_state_dict({"weight": np.full(3, 0.5, np.float32), "bias": np.zeros(3, int)})
    np.testing.assert_array_equal(wider.weight, 0.5)


def test_repr_says_what_the_layer_is():
    assert repr(nn.LayerNorm(8)) == ("LayerNorm((8,), eps=1e-05, elementwise_affine=True, "
                                     "bias=True, dtype=float32)")
    assert repr(nn.LayerNorm((2, 3), eps=1e-6, bias=False, dtype=np.float64)) == (
        "LayerNorm((2, 3), eps=1e-06, elementwise_affine=True, bias=False, dtype=float64)")
    assert repr(nn.RMSNorm(4, elementwise_affine=False)) == (
        "RMSNorm((4,), eps=1e-05, elementwise_affine=False, dtype=float32)")
    assert repr(nn.BatchNorm(16).eval()) == (
        "BatchNorm(16, eps=1e-05, momentum=0.9, axis=-1, affine=True, "
        "track_running_stats=True, dtype=float32, training=False)")
    assert "unbiased_running_var=True" in repr(nn.BatchNorm(2, unbiased_running_var=True))


# ---------------------------------------------------------------------------------------------
# num_batches_tracked and atomic forwards (issue: a uint64 count >= 2**63 loaded as a negative
# number; the next forward with momentum=None raised ZeroDivisionError or froze the running
# statistics; int64 max made the forward raise after running_mean was updated)
# ---------------------------------------------------------------------------------------------

def _state_unchanged(layer, before):
    after = layer.state_dict()
    return all(after[key].dtype == value.dtype and np.array_equal(after[key], value)
               for key, value in before.items())


@pytest.mark.parametrize("count", [np.uint64(2**63), np.uint64(2**64 - 1), np.int64(-1),
                                   np.array(-(2**63)), np.array(2**63, dtype=np.uint64)])
def test_load_state_dict_refuses_a_count_beyond_int64(count):
    layer = trained_batch_norm()
    before = layer.state_dict()
    with pytest.raises(ValueError, match=r"^state_dict\['num_batches_tracked'\] must be a count"):
        layer.load_state_dict(dict(before, num_batches_tracked=count))
    assert _state_unchanged(layer, before)


@pytest.mark.parametrize("count", [0, 7, 2**63 - 2, 2**63 - 1])
def test_load_state_dict_takes_every_int64_count_of_any_integer_dtype(count):
    layer = nn.BatchNorm(3)
    layer.load_state_dict(dict(layer.state_dict(), num_batches_tracked=np.uint64(count)))
    assert layer.num_batches_tracked.dtype == np.int64 and int(layer.num_batches_tracked) == count


@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("unbiased", [False, True])
def test_a_forward_that_cannot_count_its_batch_changes_nothing(momentum, unbiased):
    layer = nn.BatchNorm(3, momentum=momentum, unbiased_running_var=unbiased)
    x = random(np.random.default_rng(12), (8, 3), np.float32, scale=2.0)
    layer.load_state_dict(dict(layer.state_dict(), num_batches_tracked=np.int64(2**63 - 1)))
    before = layer.state_dict()
    with pytest.raises(RuntimeError, match="num_batches_tracked is 9223372036854775807"):
        layer(x)
    assert _state_unchanged(layer, before)
    layer.eval()(x)  # evaluation counts nothing: still fine
    layer.train().num_batches_tracked[...] = -1  # a count set by hand, not loaded
    with pytest.raises(RuntimeError, match="num_batches_tracked is -1"):
        layer(x)
    layer.num_batches_tracked[...] = 2**63 - 2  # one batch left: the forward completes
    layer(x)
    assert int(layer.num_batches_tracked) == 2**63 - 1
    assert np.all(np.isfinite(layer.running_mean)) and np.all(layer.running_var > 0)


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("frozen", ["running_mean", "running_var"])
def test_a_forward_with_a_read_only_running_statistic_changes_nothing(unbiased, frozen):
    layer = trained_batch_norm()
    layer.unbiased_running_var = unbiased
    getattr(layer, frozen).flags.writeable = False
    before = layer.state_dict()
    with pytest.raises(ValueError, match=f"{frozen} is read-only"):
        layer(random(np.random.default_rng(13), (8, 3), np.float32))
    assert _state_unchanged(layer, before)


def test_load_state_dict_into_a_read_only_array_changes_nothing():
    layer = trained_batch_norm()
    layer.running_var.flags.writeable = False
    before = layer.state_dict()
    new = {key: value + 1 for key, value in before.items()}
    with pytest.raises(ValueError, match="BatchNorm.running_var is read-only"):
        layer.load_state_dict(new)
    assert _state_unchanged(layer, before)


def test_load_reads_the_file_save_wrote_not_a_stale_one_beside_it(tmp_path):
    """save(p) writes p.npz; load(p) read a file named p when there was one."""
    saved, stale = trained_batch_norm(), nn.BatchNorm(3)
    path = tmp_path / "model"
    saved.save(path)
    with open(path, "wb") as file:  # an older archive under the bare name
        np.savez(file, **stale.state_dict())
    fresh = nn.BatchNorm(3).load(path)
    assert _state_unchanged(fresh, saved.state_dict())
    assert _state_unchanged(nn.BatchNorm(3).load(str(path)), saved.state_dict())
    (tmp_path / "model.npz").unlink()  # only the bare name left: that is what load reads
    assert _state_unchanged(nn.BatchNorm(3).load(path), stale.state_dict())


@requires_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("make", ["LayerNorm", "RMSNorm", "BatchNorm"])
def test_a_bfloat16_state_dict_loads(make, dtype):
    """A bfloat16 torch model's state dict (NumPy has no bfloat16): every bfloat16 is a float32,
    so it loads without loss into float32 and float64 layers, torch tensors and ml_dtypes
    arrays alike."""
    torch_layer = getattr(torch.nn, {"BatchNorm": "BatchNorm1d"}.get(make, make))(6)
    with torch.no_grad():
        for tensor in torch_layer.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape) * 3 + 0.1)
    torch_layer = torch_layer.to(torch.bfloat16)
    layer = getattr(nn, make)(6, dtype=dtype)
    layer.load_state_dict(torch_layer.state_dict())
    for key, tensor in torch_layer.state_dict().items():
        np.testing.assert_array_equal(layer.state_dict()[key], tensor.float().numpy())
    ml_dtypes = pytest.importorskip("ml_dtypes")
    as_numpy = {key: tensor.float().numpy().astype(ml_dtypes.bfloat16)
                if tensor.is_floating_point() else tensor.numpy()
                for key, tensor in torch_layer.state_dict().items()}
    again = getattr(nn, make)(6, dtype=dtype)
    again.load_state_dict(as_numpy)
    assert _state_unchanged(again, layer.state_dict())


def test_load_of_a_file_that_is_not_a_saved_state_dict_is_a_clear_error(tmp_path):
    npy, junk, zipped, objects = (tmp_path / name for name in ("one.npy", "junk.npz",
                                                               "zip.npz", "objects.npz"))
    np.save(npy, np.ones(3))
    junk.write_bytes(b"not numpy at all")
    zipped.write_bytes(b"PK\x03\x04 but not a zip archive")
    np.savez(objects, weight=np.array([None] * 3, dtype=object), bias=np.zeros(3))
    layer = nn.LayerNorm(3)
    before = layer.state_dict()
    for path, detail in ((npy, "a single array"), (junk, ""), (zipped, "zip"),
                         (objects, "entry 'weight'")):
        with pytest.raises(ValueError, match="is not an .npz archive written by save()") as info:
            layer.load(path)
        assert detail in str(info.value)
        assert _state_unchanged(layer, before)
    with pytest.raises(FileNotFoundError):
        layer.load(tmp_path / "missing")


def _forged_npz(path, entries):
    """An .npz whose entries are headers declaring (10**11,) float32 arrays (373 GiB) and
    holding no data, beside real arrays."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,), }"
    header = header.ljust(117) + b"\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, value in entries.items():
            if value is None:
                archive.writestr(name + ".npy", b"\x93NUMPY\x01\x00" + b"v\x00" + header)
            else:
                buffer = io.BytesIO()
                np.save(buffer, value)
                archive.writestr(name + ".npy", buffer.getvalue())


def test_load_of_an_entry_declaring_a_huge_array_reads_no_data(tmp_path):
    """NumPy allocates what an entry's header declares before reading its data: a forged
    (10**11,) entry made load() raise MemoryError (or, when it fits, allocate gigabytes).
    The header's shape is now checked against the layer first; an unexpected entry is refused
    by name without being read."""
    layer = nn.LayerNorm(3)
    before = layer.state_dict()
    _forged_npz(tmp_path / "weight.npz", {"weight": None, "bias": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"state_dict\['weight'\] has shape \(100000000000,\)"):
        layer.load(tmp_path / "weight.npz")
    _forged_npz(tmp_path / "extra.npz", {**before, "extra": None})
    with pytest.raises(KeyError, match="unexpected key"):
        layer.load(tmp_path / "extra.npz")
    assert _state_unchanged(layer, before)
