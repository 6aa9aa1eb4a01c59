"""fastln.torch: drop-in LayerNorm / RMSNorm modules for PyTorch (skipped without torch)."""
import numpy as np
import pytest
from conftest import assert_bitwise_equal

torch = pytest.importorskip("torch")
import fastln  # noqa: E402
import fastln.torch as ft  # noqa: E402

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-11, atol=1e-11)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _grads(module, x, grad_output):
    """Forward and the gradients of x and of every parameter, for grad_output."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    y = module(x)
    y.backward(grad_output)
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in module.named_parameters()}


def _assert_tensors_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, normalized_shape", [((4, 16), (16,)), ((2, 3, 8), (3, 8)),
                                                     ((5, 7, 1, 33), (33,))])
@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_matches_torch(dtype, shape, normalized_shape, affine, bias):
    ours = ft.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=affine, bias=bias,
                        dtype=dtype)
    theirs = torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=affine,
                                bias=bias, dtype=dtype)
    if affine:
        with torch.no_grad():
            ours.weight.normal_()
            if bias:
                ours.bias.normal_()
    theirs.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    grad_output = torch.randn(shape, dtype=dtype)
    y, dx, dparams = _grads(ours, x, grad_output)
    y_t, dx_t, dparams_t = _grads(theirs, x, grad_output)
    _assert_tensors_close(y, y_t, dtype)
    _assert_tensors_close(dx, dx_t, dtype)
    assert dparams.keys() == dparams_t.keys()
    for name in dparams:
        _assert_tensors_close(dparams[name], dparams_t[name], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_matches_torch(dtype, eps):
    ours = ft.RMSNorm((3, 10), eps=eps, dtype=dtype)
    theirs = torch.nn.RMSNorm((3, 10), eps=eps, dtype=dtype)
    with torch.no_grad():
        ours.weight.normal_()
    theirs.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    x = torch.randn(6, 3, 10, dtype=dtype)
    grad_output = torch.randn(6, 3, 10, dtype=dtype)
    y, dx, dparams = _grads(ours, x, grad_output)
    y_t, dx_t, dparams_t = _grads(theirs, x, grad_output)
    _assert_tensors_close(y, y_t, dtype)
    _assert_tensors_close(dx, dx_t, dtype)
    _assert_tensors_close(dparams["weight"], dparams_t["weight"], dtype)


def test_gradcheck_float64():
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w, b: ft.layer_norm(a, (4, 6), w, b), (x, weight, bias))
    assert torch.autograd.gradcheck(lambda a, w: ft.rms_norm(a, (6,), w, eps=1e-5),
                                    (x, weight[0].detach().clone().requires_grad_()))
    assert torch.autograd.gradcheck(lambda a: ft.layer_norm(a, (6,)), (x,))


class _Block(torch.nn.Module):
    """A pre-norm transformer block with both kinds of norm, nested one level down."""

    def __init__(self, width):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))
        self.norm2 = torch.nn.RMSNorm(width)

    def forward(self, x):
        x = x + self.mlp(self.norm1(x))
        return self.norm2(x)


def test_patch_swaps_in_place_and_keeps_everything():
    model = torch.nn.Sequential(_Block(16), _Block(16), torch.nn.LayerNorm(16))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    reference = torch.nn.Sequential(_Block(16), _Block(16), torch.nn.LayerNorm(16))
    reference.load_state_dict(model.state_dict())
    modules_before = list(model.modules())
    params_before = list(model.parameters())
    keys_before = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    assert ft.patch(model) is model
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(ft.LayerNorm) == 3 and kinds.count(ft.RMSNorm) == 2
    assert torch.nn.LayerNorm not in kinds and torch.nn.RMSNorm not in kinds
    assert all(isinstance(m, torch.nn.LayerNorm) for m in model.modules()
               if type(m) is ft.LayerNorm)
    assert list(model.modules()) == modules_before            # the same objects
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert list(model.state_dict()) == keys_before

    x = torch.randn(8, 5, 16)
    grad_output = torch.randn(8, 5, 16)
    y, dx, dparams = _grads(model, x, grad_output)
    y_t, dx_t, dparams_t = _grads(reference, x, grad_output)
    _assert_tensors_close(y, y_t, torch.float32)
    _assert_tensors_close(dx, dx_t, torch.float32)
    for name in dparams:
        torch.testing.assert_close(dparams[name], dparams_t[name], rtol=1e-4, atol=1e-4)
    optimizer.step()  # the optimizer holds the very parameters the patched model uses
    assert not torch.equal(model[2].weight, reference[2].weight)

    assert ft.unpatch(model) is model
    kinds = [type(m) for m in model.modules()]
    assert ft.LayerNorm not in kinds and kinds.count(torch.nn.LayerNorm) == 3


def test_patch_selects_kinds_and_leaves_subclasses_alone():
    class MyNorm(torch.nn.LayerNorm):
        pass

    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.RMSNorm(4), MyNorm(4))
    ft.patch(model, rms_norm=False, num_threads=1)
    assert [type(m) for m in model] == [ft.LayerNorm, torch.nn.RMSNorm, MyNorm]
    assert model[0].num_threads == 1


def test_patch_again_sets_the_threads_of_patched_layers_and_checks_them():
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.GroupNorm(2, 4))
    ft.patch(model)
    ft.patch(model, num_threads=2)
    assert [m.num_threads for m in model] == [2, 2]
    ft.patch(model, group_norm=False, num_threads=1)
    assert [m.num_threads for m in model] == [1, 2]
    for bad in (0, -1, 2.5, "2", True):
        with pytest.raises(ValueError, match="num_threads"):
            ft.patch(model, num_threads=bad)
    assert [m.num_threads for m in model] == [1, 2]


def _address(array):
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_contiguous_tensors_are_not_copied(monkeypatch, dtype):
    """fastln reads the tensor's own memory, and the tensors torch gets back are fastln's output
    arrays themselves (torch.from_numpy: no copy)."""
    seen = {}
    forward, backward = fastln.layer_norm_forward, fastln.layer_norm_backward

    def spy_forward(x, *args, **kwargs):
        seen["x"] = x
        seen["y"], cache = forward(x, *args, **kwargs)
        return seen["y"], cache

    def spy_backward(dy, *args, **kwargs):
        seen["dy"] = dy
        grads = backward(dy, *args, **kwargs)
        seen["dx"] = grads[0]
        return grads

    monkeypatch.setattr(fastln, "layer_norm_forward", spy_forward)
    monkeypatch.setattr(fastln, "layer_norm_backward", spy_backward)
    x = torch.randn(6, 32, dtype=dtype, requires_grad=True)
    y = ft.layer_norm(x, (32,))
    grad_output = torch.randn(6, 32, dtype=dtype)
    y.backward(grad_output)
    assert _address(seen["x"]) == x.data_ptr()
    assert _address(seen["y"]) == y.data_ptr()
    assert _address(seen["dy"]) == grad_output.data_ptr()
    assert _address(seen["dx"]) == x.grad.data_ptr()


def test_helpers_copy_only_when_needed():
    x = torch.randn(6, 32)
    assert np.shares_memory(ft._to_numpy(x), x.numpy())
    strided = x[:, ::2]
    assert not strided.is_contiguous()
    assert not np.shares_memory(ft._to_numpy(strided), x.numpy())
    y = fastln.layer_norm(ft._to_numpy(x))
    assert ft._to_torch(y, x).data_ptr() == _address(y)


def test_non_contiguous_input_gives_the_same_result():
    x = torch.randn(10, 40)[:, ::2]
    norm = ft.LayerNorm(20)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (20,), norm.weight,
                                                                       norm.bias))


def test_in_place_change_before_backward_is_caught():
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    y = ft.layer_norm(h, (8,))
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_no_grad_keeps_no_graph_and_matches():
    norm = ft.LayerNorm(12)
    x = torch.randn(3, 12)
    with torch.no_grad():
        y = norm(x)
    assert y.grad_fn is None
    assert_bitwise_equal(y.numpy(), norm(x).detach().numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tensors(dtype):
    if dtype == torch.bfloat16:
        pytest.importorskip("ml_dtypes")
    norm = ft.LayerNorm(64, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(16, 64).to(dtype).requires_grad_()
    y = norm(x)
    assert y.dtype == dtype
    expected = torch.nn.functional.layer_norm(x.detach().float(), (64,), norm.weight.float(),
                                              norm.bias.float()).to(dtype)
    torch.testing.assert_close(y.detach().float(), expected.float(), rtol=2e-2, atol=2e-2)
    y.sum().backward()
    assert x.grad.dtype == dtype and norm.weight.grad.dtype == dtype


def test_other_devices_fall_back_to_torch():
    x = torch.empty(3, 8, device="meta")
    norm = ft.LayerNorm(8, device="meta")
    y = norm(x)
    assert y.device.type == "meta" and y.shape == (3, 8)
    assert ft.rms_norm(x, (8,)).device.type == "meta"


def test_thread_count_does_not_change_bits():
    x = torch.randn(512, 256)
    grad_output = torch.randn(512, 256)
    results = []
    for n in (1, 2, 3):
        norm = ft.LayerNorm(256, num_threads=n)
        results.append(_grads(norm, x, grad_output))
    for y, dx, dparams in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])
        assert all(torch.equal(dparams[k], results[0][2][k]) for k in dparams)


def test_shape_errors():
    with pytest.raises(ValueError, match="normalized_shape"):
        ft.layer_norm(torch.randn(3, 4), (5,))
    with pytest.raises(ValueError, match="normalized_shape"):
        ft.rms_norm(torch.randn(4), (2, 4))


def test_bfloat16_without_ml_dtypes_goes_through_float32(monkeypatch):
    monkeypatch.setattr(ft, "_bfloat16_numpy_dtype", lambda: None)
    x = torch.randn(8, 32).to(torch.bfloat16).requires_grad_()
    norm = ft.RMSNorm(32, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    expected = fastln.rms_norm(x.detach().float().numpy(), eps=torch.finfo(torch.bfloat16).eps)
    torch.testing.assert_close(y.detach(), torch.from_numpy(expected).to(torch.bfloat16))
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.bfloat16


# --- torch.func ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_torch_func_transforms_work_and_give_torchs_results(kind):
    """Inside vmap / grad / jacrev / jvp the tensors have no memory NumPy could read:
    fastln.torch computes with PyTorch's own functions there (documented in its docstring)."""
    func = torch.func
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    weight = torch.randn(8, dtype=torch.float64)
    if kind == "layer_norm":
        ours = lambda t, w: ft.layer_norm(t, (8,), w, None)  # noqa: E731
        theirs = lambda t, w: torch.nn.functional.layer_norm(t, (8,), w, None)  # noqa: E731
    else:
        ours = lambda t, w: ft.rms_norm(t, (8,), w, eps=1e-5)  # noqa: E731
        theirs = lambda t, w: torch.nn.functional.rms_norm(t, (8,), w, 1e-5)  # noqa: E731
    torch.testing.assert_close(func.vmap(ours, in_dims=(0, None))(x, weight),
                               func.vmap(theirs, in_dims=(0, None))(x, weight))
    loss_ours = lambda t, w: (ours(t, w) ** 3).sum()  # noqa: E731
    loss_theirs = lambda t, w: (theirs(t, w) ** 3).sum()  # noqa: E731
    for argnums in (0, 1):
        torch.testing.assert_close(func.grad(loss_ours, argnums=argnums)(x, weight),
                                   func.grad(loss_theirs, argnums=argnums)(x, weight))
    torch.testing.assert_close(func.jacrev(ours)(x[0, 0], weight),
                               func.jacrev(theirs)(x[0, 0], weight))
    tangent = torch.randn_like(x)
    torch.testing.assert_close(func.jvp(lambda t: ours(t, weight), (x,), (tangent,)),
                               func.jvp(lambda t: theirs(t, weight), (x,), (tangent,)))
    # Outside the transforms fastln computes again (its own autograd node).
    assert "_LayerNormFunction" in type(ft.layer_norm(x.requires_grad_(), (8,)).grad_fn).__name__


def test_modules_under_functional_call_and_grad():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.RMSNorm(8)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                    torch.nn.RMSNorm(8)).double()
    reference.load_state_dict(model.state_dict())
    ft.patch(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    params = dict(model.named_parameters())

    def loss(module):
        return lambda p: torch.func.functional_call(module, p, (x,)).square().sum()

    ours = torch.func.grad(loss(model))(params)
    theirs = torch.func.grad(loss(reference))(dict(reference.named_parameters()))
    for name in params:
        torch.testing.assert_close(ours[name], theirs[name])


# --- the modules' parameter views ---------------------------------------------------------------

def test_parameter_views_follow_every_change_of_the_parameters():
    import copy
    import pickle

    norm = ft.LayerNorm(8)
    x = torch.randn(3, 8)

    def expected():
        return torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias).detach()

    with torch.no_grad():
        torch.testing.assert_close(norm(x), expected())
        norm.weight.mul_(2.0)                                   # in place: seen through the view
        torch.testing.assert_close(norm(x), expected())
        norm.weight = torch.nn.Parameter(torch.randn(8))        # a new Parameter
        torch.testing.assert_close(norm(x), expected())
        norm.bias.data = torch.randn(8)                         # new storage, same Parameter
        torch.testing.assert_close(norm(x), expected())
        norm.double()                                           # new dtype
        x = x.double()
        torch.testing.assert_close(norm(x), expected())
    assert "_fastln_views" in norm.__dict__
    assert "_fastln_views" not in copy.deepcopy(norm).__dict__
    assert "_fastln_views" not in pickle.loads(pickle.dumps(norm)).__dict__
    model = ft.unpatch(torch.nn.Sequential(norm))
    assert "_fastln_views" not in model[0].__dict__


def _module_and_input(kind):
    torch.manual_seed(0)
    if kind == "layer_norm":
        module, x = ft.LayerNorm(8), torch.randn(3, 8)
    elif kind == "rms_norm":
        module, x = ft.RMSNorm(8), torch.randn(3, 8)
    else:
        module, x = ft.GroupNorm(2, 8), torch.randn(3, 8, 5)
    with torch.no_grad():
        module.weight.normal_()
        if kind != "rms_norm":
            module.bias.normal_()
    return module, x


def _torch_reference(kind, module, x, weight, bias):
    """PyTorch's own function of the module's kind, in float64, as float32."""
    x64 = x.double()
    weight = None if weight is None else weight.double()
    bias = None if bias is None else bias.double()
    if kind == "layer_norm":
        y = torch.nn.functional.layer_norm(x64, (8,), weight, bias, module.eps)
    elif kind == "rms_norm":
        y = torch.nn.functional.rms_norm(x64, (8,), weight, module.eps)
    else:
        y = torch.nn.functional.group_norm(x64, 2, weight, bias, module.eps)
    return y.float()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
@pytest.mark.parametrize("how", ["prune", "parametrize", "weight_norm"])
def test_parametrized_weights_are_used(kind, how):
    """prune, parametrize and weight_norm take the weight out of _parameters and compute it:
    forward and the gradients of the real parameters must use the computed weight."""
    import torch.nn.utils.parametrize
    import torch.nn.utils.prune

    module, x = _module_and_input(kind)
    if how == "prune":
        torch.nn.utils.prune.l1_unstructured(module, "weight", amount=0.5)
        real = module.weight_orig
    elif how == "parametrize":
        class Doubled(torch.nn.Module):
            def forward(self, weight):
                return 2.0 * weight
        torch.nn.utils.parametrize.register_parametrization(module, "weight", Doubled())
        real = module.parametrizations.weight.original
    else:
        with pytest.warns(FutureWarning):
            torch.nn.utils.weight_norm(module, "weight", dim=0)
        real = module.weight_v
    bias = None if kind == "rms_norm" else module.bias
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            y = module(x)
            exact = _torch_reference(kind, module, x, module.weight, bias).detach()
            torch.testing.assert_close(y.detach(), exact, rtol=0, atol=1e-5)
    y.square().sum().backward()
    reference = real.detach().clone().requires_grad_(True)
    theirs = {"prune": lambda w: w * module.weight_mask, "parametrize": lambda w: 2.0 * w,
              "weight_norm": lambda v: torch._weight_norm(v, module.weight_g.detach(), 0)}[how]
    # float32 gradients against the float64 function's: within float32's rounding
    bias = None if bias is None else bias.detach()
    _torch_reference(kind, module, x, theirs(reference), bias).double().square().sum().backward()
    torch.testing.assert_close(real.grad, reference.grad.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
def test_tracing_records_pytorch_ops_not_a_constant(kind):
    """torch.jit.trace (also under no_grad, where the inference shortcut would otherwise run)
    must record a graph that computes from its input: fastln hands traced calls to PyTorch."""
    module, x = _module_and_input(kind)
    other = 3.0 * torch.randn_like(x) + 1.0
    module.eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, (x,))
        torch.testing.assert_close(traced(other), module(other), rtol=1e-5, atol=1e-5)
    traced = torch.jit.trace(module, (x,), check_trace=False)
    torch.testing.assert_close(traced(other).detach(), module(other).detach(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
def test_fx_tracing_and_tensor_subclasses_go_to_pytorch(kind):
    module, x = _module_and_input(kind)
    graph_module = torch.fx.symbolic_trace(module)
    torch.testing.assert_close(graph_module(x).detach(), module(x).detach())

    class Logged(torch.Tensor):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            Logged.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            Logged.calls = 0
            y = module(x.as_subclass(Logged))
            assert type(y) is Logged and Logged.calls > 0  # as torch.nn's modules do
            torch.testing.assert_close(y.as_subclass(torch.Tensor).detach(), module(x).detach())


def test_group_norm_of_a_transposed_3d_input_is_contiguous():
    """PyTorch has no channels-last format for 3-D tensors and returns their result
    contiguous; so does fastln (a (N, L, C) tensor transposed is not computed in place)."""
    x = torch.randn(2, 5, 6).transpose(1, 2)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            y = ft.GroupNorm(3, 6)(x)
            assert y.is_contiguous()
            torch.testing.assert_close(y.view(2, -1).detach(),
                                       torch.nn.GroupNorm(3, 6)(x).view(2, -1).detach())
    x4 = torch.randn(2, 6, 3, 4).contiguous(memory_format=torch.channels_last)
    assert ft.GroupNorm(3, 6)(x4).is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("make, shape", [
    (lambda: ft.LayerNorm(0), (3, 0)), (lambda: ft.RMSNorm(0), (3, 0)),
    (lambda: ft.GroupNorm(2, 4), (2, 4, 0)), (lambda: ft.LayerNorm(4), (0, 4)),
], ids=["layer_norm-empty-row", "rms_norm-empty-row", "group_norm-empty-group",
        "layer_norm-empty-batch"])
def test_empty_inputs_give_empty_results_as_in_pytorch(make, shape):
    module = make()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            x = torch.randn(shape, requires_grad=grad)
            y = module(x)
            assert y.shape == x.shape
            if grad:
                y.sum().backward()
                assert x.grad.shape == x.shape


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
def test_parameters_that_are_copied_follow_in_place_updates(kind):
    # Non-contiguous parameters cannot be viewed, only copied: a copy kept between calls would
    # miss the updates below, which change neither the pointers nor (param.data.add_) the
    # version counters.
    norm, x = _module_and_input(kind)
    norm.weight = torch.nn.Parameter(torch.randn(8, 2)[:, 0])
    if kind != "rms_norm":
        norm.bias = torch.nn.Parameter(torch.randn(3, 8).t()[:, 1])

    def check():  # against float64: PyTorch's float32 GroupNorm is the less exact of the two
        bias = None if kind == "rms_norm" else norm.bias
        exact = _torch_reference(kind, norm, x, norm.weight, bias).detach()
        tolerance = {"rtol": 0.0, "atol": 1e-6 * exact.abs().max().item()}
        with torch.no_grad():
            torch.testing.assert_close(norm(x), exact, **tolerance)
        torch.testing.assert_close(norm(x).detach(), exact, **tolerance)  # the autograd path

    check()
    with torch.no_grad():
        norm.weight.mul_(2.0)
    check()
    norm.weight.data.add_(1.0)
    check()
    if kind != "rms_norm":
        with torch.no_grad():
            norm.bias.add_(3.0)
        check()
    optimizer = torch.optim.SGD(norm.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        norm(x).square().sum().backward()
        optimizer.step()
        check()


def test_rms_module_views_and_training_step():
    norm = ft.RMSNorm(8, eps=1e-6)
    reference = torch.nn.RMSNorm(8, eps=1e-6)
    optimizer = torch.optim.SGD(norm.parameters(), lr=0.5)
    x = torch.randn(4, 8)
    for _ in range(3):  # the optimizer's in-place steps must be seen by the next call
        reference.load_state_dict(norm.state_dict())
        y, y_reference = norm(x), reference(x)
        torch.testing.assert_close(y, y_reference)
        optimizer.zero_grad()
        y.square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "group_norm"])
def test_a_second_derivative_raises_instead_of_being_zero(kind):
    """fastln has no double backward. once_differentiable's error node hung off detached
    copies, so torch.autograd.grad(..., inputs) never reached it: the second derivative came
    back None (zeros with materialize_grads) and gradgradcheck reported a Jacobian mismatch.
    Every differentiation through the gradients raises now; first derivatives are unchanged."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    func = getattr(ft, kind)
    if kind == "group_norm":  # x as (N, C, 1), one group of its 5 channels
        def func(a, _, b, group_norm=ft.group_norm):
            return group_norm(a.reshape(3, 5, 1), 1, b).reshape(3, 5)
    plain = torch.autograd.grad((func(x, (5,), w) ** 3).sum(), (x, w))
    gx, gw = torch.autograd.grad((func(x, (5,), w) ** 3).sum(), (x, w), create_graph=True)
    for got, expected in zip((gx, gw), plain):
        assert_bitwise_equal(got.detach().numpy(), expected.numpy(), "first derivative")
    for second in (lambda: torch.autograd.grad(gx.sum(), (x, w), allow_unused=True),
                   lambda: torch.autograd.grad((gw ** 2).sum(), (w,), allow_unused=True),
                   lambda: (gx.sum() + gw.sum()).backward()):
        with pytest.raises(RuntimeError, match="fastln.torch has no double backward"):
            second()
    with pytest.raises(RuntimeError, match="fastln.torch has no double backward"):
        torch.autograd.gradgradcheck(lambda a, b: func(a, (5,), b), (x, w))


# --- inference calls read the tensor's memory in place --------------------------------------

def _bits(tensor):
    """A tensor's bytes as NumPy sees them (bfloat16 through int16)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _general_layer_norm(x, norm):
    """What fastln's NumPy API gives for the module's call, on a copy of x's values."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # the parameter type
    weight = None if norm.weight is None else norm.weight.detach().to(wide)
    bias = None if getattr(norm, "bias", None) is None else norm.bias.detach().to(wide)
    values = x.detach().float().numpy() if x.dtype in (torch.float16, torch.bfloat16) \
        else x.detach().numpy().copy()
    arrays = [None if p is None else p.numpy() for p in (weight, bias)]
    if isinstance(norm, torch.nn.RMSNorm):
        eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
        y = fastln.rms_norm(values, arrays[0], eps)
    else:
        y = fastln.layer_norm(values, arrays[0], arrays[1], norm.eps)
    return torch.from_numpy(y).to(x.dtype)  # rounded once to x's format, as the kernels do


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 768), (3, 5, 33), (40,), (2, 1, 4096)])
@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_plain", "rms_norm"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_calls_give_the_general_paths_bits(dtype, shape, kind, mode):
    """The in-place read of an inference call: the same bits as fastln's NumPy API on the same
    values (half precision: the float32 computation rounded once), for modules in every
    storage type, with and without parameters, and for every thread count."""
    n = shape[-1]
    if kind == "rms_norm":
        norm = ft.RMSNorm(n, dtype=dtype)
    else:
        norm = ft.LayerNorm(n, elementwise_affine=kind == "layer_norm", dtype=dtype)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1e3).to(dtype)
    expected = _general_layer_norm(x, norm)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    for threads in (1, 2):
        norm.num_threads = threads
        with context:
            y = norm(x)
        assert y.dtype == dtype and y.shape == x.shape and y.grad_fn is None
        assert_bitwise_equal(_bits(y), _bits(expected), f"{threads} threads")


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_inference_calls_do_not_go_through_numpy(monkeypatch, kind):
    """A contiguous CPU tensor is read where it lies, without fastln's NumPy API (the functional
    forms too)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(fastln, kind, refuse)
    x = torch.randn(4, 24)
    norm = ft.LayerNorm(24) if kind == "layer_norm" else ft.RMSNorm(24)
    with torch.no_grad():
        norm(x)
        getattr(ft, kind)(x, (24,))


def _layer_norm_of_values(x, norm):
    return torch.nn.functional.layer_norm(x.detach().clone().resolve_neg(), (x.shape[-1],),
                                          norm.weight, norm.bias, norm.eps)


@pytest.mark.parametrize("make", ["negative_view", "zero_tensor", "offset_slice", "strided",
                                  "expanded", "empty_batch", "parameter"])
def test_inference_calls_on_unusual_tensors(make):
    """Tensors whose memory does not hold their values as a contiguous row-major block (a lazy
    negation, a ZeroTensor without memory, strided and expanded views) or that are not plain
    tensors take the general path and give the right values; a contiguous slice is read at its
    own offset."""
    norm = ft.LayerNorm(16)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    base = torch.randn(6, 16)
    x = {"negative_view": lambda: torch._neg_view(base),
         "zero_tensor": lambda: torch._efficientzerotensor((3, 16)),
         "offset_slice": lambda: base[2:5],
         "strided": lambda: torch.randn(6, 32)[:, ::2],
         "expanded": lambda: base[:1].expand(4, 16),
         "empty_batch": lambda: torch.empty(0, 16),
         "parameter": lambda: torch.nn.Parameter(base.clone(), requires_grad=False)}[make]()
    with torch.no_grad():
        y = norm(x)
        expected = _layer_norm_of_values(x, norm)
    assert y.shape == x.shape
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_inference_calls_check_the_width_and_threads():
    """A width that is not the module's and a bad thread count still raise as before."""
    with torch.no_grad():
        with pytest.raises((ValueError, RuntimeError)):
            ft.LayerNorm(8)(torch.randn(2, 9))
        with pytest.raises(ValueError, match="num_threads"):
            ft.LayerNorm(8, num_threads=0)(torch.randn(2, 8))


def _hooked_calls(norm, x):
    """The module's output under each kind of hook Module.__call__ runs."""
    results = {}
    handle = norm.register_forward_hook(lambda module, args, out: out * 2)
    results["forward_hook"] = norm(x)
    handle.remove()
    handle = norm.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    results["forward_pre_hook"] = norm(x)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out + 5)
    try:
        results["global_forward_hook"] = norm(x)
    finally:
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: (args[0] * 3,))
    try:
        results["global_forward_pre_hook"] = norm(x)
    finally:
        handle.remove()
    results["plain"] = norm(x)
    return results


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "patched"])
def test_inference_shortcut_keeps_every_hook(kind):
    """The inference shortcut past Module.__call__ is taken only when that call would do nothing
    but forward: module and global hooks still run, with fastln computing the result."""
    n = 16
    norm = {"layer_norm": lambda: ft.LayerNorm(n), "rms_norm": lambda: ft.RMSNorm(n),
            "patched": lambda: ft.patch(torch.nn.LayerNorm(n))}[kind]()
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x = torch.randn(3, n)
    with torch.inference_mode():
        results = _hooked_calls(norm, x)
        plain = norm.forward(x)
        torch.testing.assert_close(results["forward_hook"], plain * 2)
        torch.testing.assert_close(results["forward_pre_hook"], norm.forward(x + 1))
        torch.testing.assert_close(results["global_forward_hook"], plain + 5)
        torch.testing.assert_close(results["global_forward_pre_hook"], norm.forward(x * 3))
        assert_bitwise_equal(results["plain"].numpy(), plain.numpy(), "no hooks")


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_inference_shortcut_is_taken_only_without_hooks(monkeypatch, kind):
    """A hook-free inference call never enters Module.__call__; a call with a hook, with grad
    enabled, or with extra arguments does."""
    entered = []
    module_call = torch.nn.Module.__call__

    def counting_call(module, *args, **kwargs):
        entered.append(len(args))
        return module_call(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", counting_call)
    norm = ft.LayerNorm(8) if kind == "layer_norm" else ft.RMSNorm(8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        norm(x)
        assert entered == []
        handle = norm.register_forward_hook(lambda module, args, out: None)
        norm(x)
        handle.remove()
        assert entered == [1]
    norm(x)  # grad enabled: the autograd path
    assert entered == [1, 1]
    with torch.no_grad(), pytest.raises(TypeError):
        norm(x, x)  # forward takes one input: Module.__call__ raises as torch's modules do
    assert entered == [1, 1, 2]


def test_inference_shortcut_under_torch_compile():
    """Compiled modules (torch.compile and Module.compile) still give fastln's results."""
    norm = ft.LayerNorm(16)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = norm(x)
        compiled = torch.compile(norm, backend="eager")
        torch.testing.assert_close(compiled(x), expected)
        norm.compile(backend="eager")
        torch.testing.assert_close(norm(x), expected)
