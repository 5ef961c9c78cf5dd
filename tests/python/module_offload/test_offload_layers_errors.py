"""hipferry.offload_layers: every rejected call raises a clear error (type, and a message
naming the argument) and leaves the model as it was -- the same parameter objects on
the same device with the same values, block forwards not wrapped, outputs equal to an
untouched reference -- and the pool as it was (no host memory kept). Also: offloading
blocks that are already offloaded, and a parameter replaced after offload."""
import re

import pytest
import torch
from torch import nn

import hipferry
from offload_module_helpers import (MLPNet, assert_same, assert_same_grads, assert_same_outputs, make_gpt, make_mlp,
                                    model_and_reference, pool_in_use, snapshot_params, train_step)
from conftest import gpu_available


def check_rejected(call, exc, patterns, model, ref, pool):
    """call() raises exc matching every pattern; the model, its blocks and the pool are unchanged."""
    before = snapshot_params(model)
    buffers = {n: (b.device, b.clone()) for n, b in model.named_buffers()}
    usage = pool_in_use(pool)
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    del info  # its traceback holds the failed call's frames (and what they allocated)
    for pattern in patterns:
        assert re.search(pattern, message, re.S), f"{message!r} should match {pattern!r}"
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (obj, device, dtype, value) in before.items():
        p = after[name]
        assert p is obj, f"{name} was replaced"
        assert p.device == device and p.dtype == dtype, f"{name} moved to {p.device}/{p.dtype}"
        assert_same(p, value, f"{name} after the rejected call")
    for name, b in model.named_buffers():
        assert b.device == buffers[name][0]
        assert_same(b, buffers[name][1], f"buffer {name}")
    for m in model.modules():
        assert "forward" not in m.__dict__ and "_hipferry_offload" not in m.__dict__, f"{type(m).__name__} wrapped"
    assert pool_in_use(pool) == usage, "pool memory left behind"
    pool.check_invariants()
    x = model.example(0, next(model.parameters()).device)
    with torch.no_grad():
        assert_same_outputs(model(x), ref(x), "output after the rejected call")
    return message


@pytest.fixture
def gpt():
    return model_and_reference(make_gpt, "cpu")


@pytest.fixture
def offloaded_gpt(pool):
    """make_gpt's model with its blocks offloaded on the host path, its reference, and the
    handle; undone after the test (a second undo does nothing)."""
    model, ref = model_and_reference(make_gpt, "cpu")
    handle = hipferry.offload_layers(model, pool=pool, device="cpu")
    yield model, ref, handle
    handle.undo()


# ------------------------------------------------------------------ arguments
def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        hipferry.offload_layers([nn.Linear(2, 2), nn.Linear(2, 2)])


@pytest.mark.parametrize("value, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_bad_prefetch(gpt, pool, value, exc):
    model, ref = gpt
    check_rejected(lambda: hipferry.offload_layers(model, prefetch=value, pool=pool, device="cpu"), exc,
                   ["prefetch", re.escape(repr(value))], model, ref, pool)


@pytest.mark.parametrize("value, exc, pattern", [("bfloat16", TypeError, "dtype must be a torch.dtype"),
                                                  (torch.float64, ValueError, r"dtype=torch.float64 cannot hold"),
                                                  (torch.int8, ValueError, r"dtype=torch.int8 cannot hold")])
def test_bad_dtype(gpt, pool, value, exc, pattern):
    model, ref = gpt
    check_rejected(lambda: hipferry.offload_layers(model, dtype=value, pool=pool, device="cpu"), exc, [pattern],
                   model, ref, pool)


@pytest.mark.parametrize("value", ["pinned", 64 << 20, torch.empty(3)])
def test_bad_pool(gpt, pool, value):
    model, ref = gpt
    check_rejected(lambda: hipferry.offload_layers(model, pool=value, device="cpu"), TypeError,
                   ["pool must be a hipferry.PinnedPool"], model, ref, pool)


def test_closed_pool(gpt, pool):
    model, ref = gpt
    closed = hipferry.PinnedPool(capacity="1MiB")
    closed.close()
    check_rejected(lambda: hipferry.offload_layers(model, pool=closed, device="cpu"), RuntimeError,
                   ["pool is closed"], model, ref, pool)


@pytest.mark.parametrize("value", ["tpu", "not a device", "meta", 1.5])
def test_bad_device(gpt, pool, value):
    model, ref = gpt
    check_rejected(lambda: hipferry.offload_layers(model, device=value, pool=pool), ValueError,
                   ["device", re.escape(str(value))],
                   model, ref, pool)


@pytest.mark.skipif(gpu_available(), reason="needs a machine without a GPU")
def test_gpu_device_without_gpu(gpt, pool):
    model, ref = gpt
    check_rejected(lambda: hipferry.offload_layers(model, device="cuda", pool=pool), ValueError,
                   ["device cuda", "no GPU"], model, ref, pool)


# ------------------------------------------------------------------ what to offload
class NoList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc2(self.fc1(x))

    example = MLPNet.example
    n_in, batch = 8, 4


class ParamlessList(NoList):
    def __init__(self):
        super().__init__()
        self.acts = nn.ModuleList([nn.Tanh(), nn.ReLU(), nn.Tanh()])

    def forward(self, x):
        x = self.fc1(x)
        for a in self.acts:
            x = a(x)
        return self.fc2(x)


@pytest.mark.parametrize("factory", [NoList, ParamlessList])
def test_nothing_to_offload(pool, factory):
    model, ref = model_and_reference(factory, "cpu")
    check_rejected(lambda: hipferry.offload_layers(model, pool=pool, device="cpu"), ValueError,
                   ["nothing to offload", "layers="], model, ref, pool)


def test_blocks_with_only_shared_params(pool):
    model, ref = model_and_reference(make_mlp, "cpu", hidden=(32, 32))
    for m in (model, ref):  # block 0 holds weights only through ties with the rest of the model
        m.blocks[0].fc1.weight, m.blocks[0].fc1.bias = m.blocks[1].fc1.weight, m.blocks[1].fc1.bias
        m.blocks[0].fc2.weight, m.blocks[0].fc2.bias = m.blocks[1].fc2.weight, m.blocks[1].fc2.bias
    check_rejected(lambda: hipferry.offload_layers(model, layers=[model.blocks[0]], pool=pool, device="cpu"),
                   ValueError, ["nothing to offload", r"shared with the rest of the model: .*blocks\.0\.fc2\.bias"],
                   model, ref, pool)


def _outsider(model):
    return [model.blocks[0], nn.Linear(16, 16)]


@pytest.mark.parametrize("layers, exc, pattern", [
    (lambda m: _outsider(m), ValueError, r"layers\[1\] \(Linear\) is not a submodule of model"),
    (lambda m: [m], ValueError, r"layers\[0\] is the model itself"),
    (lambda m: [m.blocks[0], m.blocks[0].fc1], ValueError, r"'blocks\.0\.fc1' inside 'blocks\.0'"),
    (lambda m: [], ValueError, "layers is empty"),
    (lambda m: [m.blocks[0], "blocks.1"], TypeError, r"layers\[1\] is a str"),
    (lambda m: m.blocks[0], TypeError, "single GPTBlock"),
    (lambda m: 3, TypeError, "layers must be a list"),
])
def test_bad_layers(gpt, pool, layers, exc, pattern):
    model, ref = gpt
    check_rejected(lambda: hipferry.offload_layers(model, layers=layers(model), pool=pool, device="cpu"), exc,
                   [pattern], model, ref, pool)


def test_pool_too_small(pool):
    model, ref = model_and_reference(make_mlp, "cpu", d=512, hidden=(512, 512, 512))  # ~6.3 MB of blocks
    need = sum(p.numel() * 4 for p in model.blocks.parameters())
    assert need > 4 << 20
    small = hipferry.PinnedPool(capacity="4MiB")
    message = check_rejected(lambda: hipferry.offload_layers(model, pool=small, device="cpu"),
                             torch.OutOfMemoryError, [r"need (\d+) bytes", "capacity 4194304"], model, ref, small)
    needed = int(re.search(r"need (\d+) bytes", message).group(1))
    assert need <= needed < need + 3 * 4 * 256, f"reported {needed} bytes for {need} bytes of weights"
    assert pool_in_use(small) == (0, 0)
    small.close()


# ------------------------------------------------------------------ after offload
def test_offloading_the_same_blocks_twice(pool, offloaded_gpt):
    model, ref, handle = offloaded_gpt
    before = snapshot_params(model)
    usage = pool_in_use(pool)
    hooks = [(list(b._forward_pre_hooks), list(b._forward_hooks)) for b in model.blocks]
    with pytest.raises(ValueError, match=r"layers\[0\] \(GPTBlock\) is already offloaded"):
        hipferry.offload_layers(model, pool=pool, device="cpu")
    with pytest.raises(ValueError, match=r"layers\[1\] \(GPTBlock\) is already offloaded"):
        hipferry.offload_layers(model, layers=[model.head, model.blocks[2]], pool=pool, device="cpu")
    assert pool_in_use(pool) == usage
    for name, (obj, device, dtype, value) in before.items():
        p = dict(model.named_parameters())[name]
        assert p is obj and p.device == device and p.dtype == dtype
        assert_same(p, value, name)
    assert [(list(b._forward_pre_hooks), list(b._forward_hooks)) for b in model.blocks] == hooks
    x = model.example(0)
    with torch.no_grad():
        assert_same_outputs(model(x), ref(x))
    handle.undo()
    again = hipferry.offload_layers(model, pool=pool, device="cpu")  # fine after undo
    again.undo()


def test_parameter_replaced_after_offload(offloaded_gpt):
    model, _, handle = offloaded_gpt
    p = model.blocks[1].fc2.weight
    p.data = p.data.clone()  # what model.to(...) does to every parameter
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.fc2\.weight' was moved or replaced.*undo\(\)"):
        model(model.example(0))
    handle.undo()


def test_weight_modified_between_forward_and_backward(offloaded_gpt):
    model, _, handle = offloaded_gpt
    loss = model(model.example(0)).square().mean()
    with torch.no_grad():
        model.blocks[2].fc1.weight.add_(1.0)  # as an optimizer step before backward would
    with pytest.raises(RuntimeError, match=r"block 'blocks\.2'.*modified in place after forward"):
        loss.backward()
    del loss
    handle.undo()


def test_training_continues_after_a_failed_backward(offloaded_gpt):
    # A backward that raised must not break the next ones: their block gradients still arrive.
    model, ref, _ = offloaded_gpt
    loss = model(model.example(0)).square().mean()
    with torch.no_grad():
        for m in (model, ref):
            m.blocks[1].fc1.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after forward"):
        loss.backward()
    del loss
    model.zero_grad()
    x = model.example(1)
    train_step(model, x), train_step(ref, x)
    assert_same_grads(model, ref)


def test_exception_inside_a_block_leaves_the_model_working(offloaded_gpt):
    model, ref, _ = offloaded_gpt
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError):
        model.blocks[1](torch.zeros(2, 3, 5))  # wrong width: fails inside the block
    assert all(p is params[n] for n, p in model.named_parameters())  # the host parameters are back in place
    assert all(p.device.type == "cpu" for p in model.blocks.parameters())
    x = model.example(0)
    train_step(model, x), train_step(ref, x)
    assert_same_grads(model, ref)


def test_undo_between_forward_and_backward(offloaded_gpt):
    model, _, handle = offloaded_gpt
    loss = model(model.example(0)).square().mean()
    handle.undo()
    with pytest.raises(RuntimeError, match=r"backward needs weights of block 'blocks\.\d'.*undone after forward"):
        loss.backward()
