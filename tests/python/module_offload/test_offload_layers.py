"""hipferry.offload_layers: a model whose blocks run from a ring of device slots
computes bit-identically to the same model left alone on the same device --
outputs, gradients (also with the model called twice per step, with gradient
accumulation), parameters over optimizer steps, buffers -- with blocks of
different sizes, weights shared between blocks / with the head / inside a block,
a host dtype, explicit layers, undo(), activation checkpointing and
state_dict round trips. The ring's schedule and counters: test_offload_layers_schedule.py."""
import copy

import pytest
import torch

import hipferry
from hipferry.optim import OffloadAdamW
from offload_module_helpers import (DEVICES, PlacedReference, TiedNet, assert_same, assert_same_buffers,
                                    assert_same_training_steps,
                                    assert_same_grads, assert_same_outputs, assert_same_params, block_param_names,
                                    call, loss_of, make_buffer_net, make_gpt, make_mlp, make_tied,
                                    model_and_reference, padded_bytes, pool_in_use, snapshot_params, train_step)
from conftest import requires_gpu

USES = ("hit", "late", "miss", "reused")


# ------------------------------------------------------------------ outputs and gradients
@pytest.mark.parametrize("device", DEVICES)
def test_eval_outputs_equal(device):
    model, ref = model_and_reference(make_gpt, device)
    model.eval(), ref.eval()
    handle = hipferry.offload_layers(model, device=device)
    for step in range(3):
        x = model.example(step, device)
        assert_same_outputs(model(x), ref(x), f"eval output of call {step}")
    assert all(p.device.type == "cpu" for n, p in model.named_parameters() if n.startswith("blocks."))
    assert handle.stats()["blocks"] == 4


@pytest.fixture(autouse=True)
def every_offload_runs_from_the_ring(monkeypatch):
    """After each test: every offload still in place really ran its blocks from the
    ring (copies and uses counted) and its weights still live in the host buffers --
    so an equality test cannot pass on an offload that did nothing."""
    handles, real = [], hipferry.offload_layers

    def recording(*args, **kwargs):
        handles.append(real(*args, **kwargs))
        return handles[-1]
    monkeypatch.setattr(hipferry, "offload_layers", recording)
    yield
    for h in handles:
        if h.closed:
            continue
        s = h.stats()
        assert s["fetches"] > 0 and s["hits"] + s["late"] + s["misses"] + s["reused"] > 0, s
        for blk in h.blocks:
            for e in blk.entries:
                assert e.param.device.type == "cpu" and e.param.data_ptr() == e.host_ptr, e.name


@pytest.mark.parametrize("device", DEVICES)
def test_train_with_dropout_outputs_and_grads_equal(device):
    model, ref = model_and_reference(make_gpt, device, dropout=0.2)
    handle = hipferry.offload_layers(model, device=device)
    x = model.example(0, device)
    out, ref_out = train_step(model, x, seed=7), train_step(ref, x, seed=7)
    assert_same_outputs(out, ref_out, "train output")
    assert_same_grads(model, ref)
    assert not torch.equal(call(ref, x, seed=8), ref_out), "dropout inactive: seeding proves nothing"
    assert handle.stats()["grad_bytes_moved"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_outputs_equal(device):
    model, ref = model_and_reference(make_gpt, device, dropout=0.2)
    hipferry.offload_layers(model, device=device)
    with torch.no_grad():
        for step in range(3):
            x = model.example(step, device)
            assert_same_outputs(call(model, x, seed=step), call(ref, x, seed=step), f"no_grad output {step}")
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_model_called_twice_per_step(device):
    model, ref = model_and_reference(make_gpt, device, dropout=0.1)
    handle = hipferry.offload_layers(model, device=device)
    x0, x1 = model.example(0, device), model.example(1, device)
    for m in (model, ref):
        loss = loss_of(call(m, x0, seed=1)) + loss_of(call(m, x1, seed=2))
        loss.backward()
    assert_same_grads(model, ref)
    # Each call's weight gradients travel separately and are summed on the host.
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    assert handle.stats()["grad_bytes_moved"] == 2 * block_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_and_post_accumulate_hooks(device):
    model, ref = model_and_reference(make_gpt, device)
    hipferry.offload_layers(model, device=device)
    calls = []
    p = model.blocks[2].fc2.weight
    p.register_post_accumulate_grad_hook(lambda t: calls.append(None if t.grad is None else t.grad.clone()))
    for micro in range(3):  # three backwards into the same .grad, as with micro-batches
        x = model.example(micro, device)
        train_step(model, x), train_step(ref, x)
    assert_same_grads(model, ref)
    assert len(calls) == 3, f"the hook ran {len(calls)} times in 3 backwards, with .grad None: {calls.count(None)}"
    assert calls[-1].device.type == "cpu" and torch.equal(calls[-1], p.grad)
    assert not torch.equal(calls[0], calls[-1]), "the hook saw the accumulated gradient"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["torch", "offload"])
def test_training_steps_keep_parameters_equal(device, optimizer):
    if optimizer == "torch":
        make_opt = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    else:
        make_opt = lambda params: OffloadAdamW(params, lr=1e-2, weight_decay=0.1, step_on="cpu", min_offload_numel=64)
    model, ref = model_and_reference(make_gpt, device, dropout=0.1)
    initial = snapshot_params(ref)
    hipferry.offload_layers(model, device=device)
    opt, ref_opt = make_opt(list(model.parameters())), PlacedReference(ref, model, make_opt)
    for step in range(3):
        x = model.example(step, device)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            train_step(m, x, seed=step)
            o.step()
        assert_same_params(model, ref, f"after step {step}:")
    for name, p in ref.named_parameters():
        assert not torch.equal(p.detach(), initial[name][3]), f"{name} did not change: the steps did nothing"
    model.eval(), ref.eval()
    x = model.example(9, device)
    with torch.no_grad():
        assert_same_outputs(model(x), ref(x), "output after training")


# ------------------------------------------------------------------ model shapes
@pytest.mark.parametrize("device", DEVICES)
def test_blocks_of_different_sizes(device):
    model, ref = model_and_reference(make_mlp, device, hidden=(8, 64, 16, 40))
    sizes = [padded_bytes(b) for b in model.blocks]
    handle = hipferry.offload_layers(model, device=device, prefetch=1)
    s = handle.stats()
    assert s["slot_bytes"] == max(sizes) > min(sizes)
    assert s["host_bytes"] == sum(sizes) and s["device_bytes"] == 2 * max(sizes)
    assert_same_training_steps(model, ref, device, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_weights_stay_on_device(device):
    model, ref = model_and_reference(make_tied, device)
    shared = [model.blocks[0].fc1.weight, model.blocks[3].fc1.weight]
    handle = hipferry.offload_layers(model, device=device)
    assert sorted(handle.stats()["resident_shared"]) == sorted([TiedNet.SHARED_BETWEEN_BLOCKS,
                                                               TiedNet.SHARED_WITH_HEAD])
    assert model.blocks[2].fc1.weight is shared[0] and model.head.weight is shared[1]
    for p in shared:
        assert p.device == torch.device(device) or p.device.type == device
    for name, p in model.named_parameters():  # named_parameters lists a shared one once
        if name.startswith("blocks.") and all(p is not s for s in shared):
            assert p.device.type == "cpu", f"{name} was not offloaded"
    assert_same_training_steps(model, ref, device, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_stay_on_device_and_update(device):
    model, ref = model_and_reference(make_buffer_net, device)
    buffers_before = {n: b.clone() for n, b in ref.named_buffers()}
    hipferry.offload_layers(model, device=device)
    for name, b in model.named_buffers():
        assert b.device.type == device, f"buffer {name} on {b.device}"
    assert_same_training_steps(model, ref, device, 3, "train output", also=assert_same_buffers)
    for name, b in ref.named_buffers():
        assert not torch.equal(b, buffers_before[name]), f"buffer {name} was not updated in train mode"
    model.eval(), ref.eval()
    with torch.no_grad():
        x = model.example(5, device)
        assert_same_outputs(model(x), ref(x), "eval output")
    assert_same_buffers(model, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_host_weights(device):
    # Every tensor a multiple of 128 elements: no alignment padding, so bf16 takes exactly half.
    model, ref = model_and_reference(make_mlp, device, d=128, hidden=(128, 128, 128))
    fp32_twin = copy.deepcopy(model)
    names = block_param_names(model)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in names:
                p.copy_(p.to(torch.bfloat16).float())
    handle = hipferry.offload_layers(model, device=device, dtype=torch.bfloat16)
    fp32_handle = hipferry.offload_layers(fp32_twin, device=device)
    assert handle.stats()["host_bytes"] * 2 == fp32_handle.stats()["host_bytes"]
    params = dict(model.named_parameters())
    for n, p in params.items():
        expected = (torch.bfloat16, "cpu") if n in names else (torch.float32, device)
        assert (p.dtype, p.device.type) == expected, f"{n}: {p.dtype} on {p.device}"
    x = model.example(0, device)
    out, ref_out = train_step(model, x), train_step(ref, x)
    assert out.dtype == torch.float32
    assert_same_outputs(out, ref_out, "output with bf16 host weights")
    for n, r in ref.named_parameters():  # host gradients arrive in the host dtype, rounded once
        want = r.grad.to(torch.bfloat16) if n in names else r.grad
        assert_same(params[n].grad, want, f"grad of {n}")
    fp32_handle.undo()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_ring_copies_show_on_the_trace(device, dtype):
    """Every block copy into the ring is a span of hipferry.trace()'s timeline,
    on the ring's own track, with the bytes it wrote (copies, or copy_cast
    kernels from bf16 host weights)."""
    model, _ = model_and_reference(make_mlp, device, d=128, hidden=(128, 128, 128))
    handle = hipferry.offload_layers(model, device=device, dtype=dtype)
    x = model.example(0, device)
    with hipferry.trace() as tr:
        model(x)
        if device == "cuda":
            torch.cuda.synchronize()
    s = handle.stats()
    name = "layer copy" if dtype is None else "layer copy_cast"
    spans = [e for e in tr.events if e["name"] == name]
    assert spans, [e["name"] for e in tr.events]
    assert {e["track"] for e in spans} == {"cpu layer ring worker" if device == "cpu" else "gpu:0 layer ring stream"}
    device_bytes = s["bytes_moved"] * (2 if dtype is not None else 1)  # bf16 host -> float32 slots
    assert sum(e["bytes"] for e in spans) == device_bytes, (s, [e["bytes"] for e in spans])
    handle.undo()


# ------------------------------------------------------------------ explicit layers and undo
@pytest.mark.parametrize("device", DEVICES)
def test_explicit_layers_subset_and_duplicates(device):
    model, ref = model_and_reference(make_gpt, device)
    b = model.blocks
    handle = hipferry.offload_layers(model, device=device, layers=[b[1], b[3], b[1]])
    assert handle.block_names == ["blocks.1", "blocks.3"] and handle.stats()["blocks"] == 2
    for name, p in model.named_parameters():
        offloaded = name.startswith(("blocks.1.", "blocks.3."))
        assert (p.device.type == "cpu") if offloaded else (p.device.type == device), f"{name} on {p.device}"
    x = model.example(0, device)
    assert_same_outputs(train_step(model, x), train_step(ref, x))
    assert_same_grads(model, ref)
    handle.undo()
    whole = hipferry.offload_layers(model, device=device, layers=model.blocks)  # a ModuleList is a list
    assert whole.block_names == [f"blocks.{i}" for i in range(4)]
    whole.undo()


@pytest.mark.parametrize("device", DEVICES)
def test_weight_tied_within_a_block(device):
    model, ref = model_and_reference(make_mlp, device, hidden=(16,) * 4)
    for m in (model, ref):
        for blk in m.blocks:
            blk.fc2.weight = blk.fc1.weight  # square: used twice in the block, its gradient summed
    handle = hipferry.offload_layers(model, device=device)
    assert handle.stats()["resident_shared"] == []
    assert all(blk.fc2.weight is blk.fc1.weight and blk.fc1.weight.device.type == "cpu" for blk in model.blocks)
    assert_same_training_steps(model, ref, device, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_undo_restores_the_model(device, dtype):
    model, ref = model_and_reference(make_gpt, device)
    before = snapshot_params(model)
    pool = hipferry.PinnedPool(capacity="16MiB")
    handle = hipferry.offload_layers(model, device=device, dtype=dtype, pool=pool)
    x = model.example(0, device)
    train_step(model, x)
    host = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    assert pool_in_use(pool)[0] >= handle.stats()["host_bytes"]
    handle.undo()
    assert handle.closed
    for n, p in model.named_parameters():
        obj, dev, dt, _ = before[n]
        assert p is obj and p.device == dev and p.dtype == dt, f"{n}: {p.device}/{p.dtype}"
        assert_same(p, host[n][0].to(device=dev, dtype=dt), f"{n} after undo")
        assert_same(p.grad, host[n][1].to(device=dev, dtype=dt), f"grad of {n} after undo")
    for blk in model.blocks:
        assert "forward" not in blk.__dict__, "the block's forward was not restored"
    handle.undo()  # twice: nothing happens
    assert handle.closed and "undone" in repr(handle)
    model.zero_grad()  # the host gradients may live in the pool; the weights no longer do
    assert pool_in_use(pool) == (0, 0), "undo() kept host buffers of the weights"
    if dtype is None:  # the values went through the host unchanged: the model is the reference again
        assert_same_outputs(train_step(model, x, seed=3), train_step(ref, x, seed=3))
        assert_same_grads(model, ref)
    # Offloading again after undo is allowed.
    again = hipferry.offload_layers(model, device=device)
    assert again.stats()["blocks"] == 4
    again.undo()


@requires_gpu
def test_rest_of_model_moves_to_device_and_back():
    model, _ = model_and_reference(make_buffer_net, "cpu")
    ref = copy.deepcopy(model).cuda()
    handle = hipferry.offload_layers(model, device="cuda")
    assert model.inp.weight.is_cuda and model.head.weight.is_cuda and model.blocks[0].bn.running_mean.is_cuda
    assert model.blocks[0].fc1.weight.device.type == "cpu"
    x = model.example(0, "cuda")
    assert_same_outputs(train_step(model, x), train_step(ref, x), "output")
    assert_same_grads(model, ref)
    handle.undo()
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in model.parameters())


# ------------------------------------------------------------------ composition and invalidation
@pytest.mark.parametrize("device", DEVICES)
def test_activation_checkpointing_around_blocks(device):
    model, ref = model_and_reference(make_gpt, device, checkpoint=True)
    handle = hipferry.offload_layers(model, device=device)
    assert_same_training_steps(model, ref, device, 2)
    # Recomputation in backward runs each block again: more uses than forward alone.
    assert sum(1 for w, _, _ in handle.log if w in USES) > 2 * 4


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device):
    model, ref = model_and_reference(make_gpt, device)
    handle = hipferry.offload_layers(model, device=device)
    x = model.example(0, device)
    with torch.no_grad():
        model(x)  # blocks resident in the ring
        for name, t in model.state_dict().items():
            assert_same(t, ref.state_dict()[name], f"state_dict[{name!r}]")
        for p in ref.parameters():
            p.mul_(0.5)
    model.load_state_dict(ref.state_dict())  # copies into the host tensors: versions change
    assert model.blocks[0].fc1.weight.device.type == "cpu" and handle.stats()["blocks"] == 4
    with torch.no_grad():
        assert_same_outputs(model(x), ref(x), "output after load_state_dict")
