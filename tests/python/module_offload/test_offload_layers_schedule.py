"""hipferry.offload_layers: the ring's schedule and counters (Note [layer ring]) seen
through handle.log and handle.stats(): blocks copied ahead in call order (two
ahead with prefetch=2), in reverse for backward, in the order of the last call;
slots reused; one slot and demand copies with prefetch=0; a ring that holds every
block copies nothing after the first pass; bytes moved per copy. And when a
resident copy is refreshed: after an in-place update (version bump) by itself,
after a write through .data only with invalidate(). Outputs are checked against
an unmodified reference on the same device throughout."""
import copy

import pytest
import torch

import hipferry
from offload_module_helpers import (DEVICES, assert_same_grads, assert_same_outputs, loss_of, make_mlp,
                                    model_and_reference, padded_bytes, train_step)

USES = ("hit", "late", "miss", "reused")
FETCHES = ("fetch", "prefetch")


def uses_of(log):
    """(position in the log, block) of every use event."""
    return [(i, b) for i, (what, b, _) in enumerate(log) if what in USES]


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_runs_two_blocks_ahead_and_reuses_slots(device):
    model, ref = model_and_reference(make_mlp, device, hidden=(32,) * 6)
    handle = hipferry.offload_layers(model, device=device, prefetch=2)
    s0 = handle.stats()
    assert s0["ring_slots"] == 3 and s0["prefetch"] == 2
    assert s0["slot_bytes"] == padded_bytes(model.blocks[0])
    assert s0["device_bytes"] == 3 * s0["slot_bytes"]
    assert s0["host_bytes"] == 6 * s0["slot_bytes"]
    block_bytes = s0["host_bytes"] // 6
    x = model.example(0, device)
    with torch.no_grad():
        model(x)
        first = len(handle.log)
        s1 = handle.stats()
        assert_same_outputs(model(x), ref(x))
    s2 = handle.stats()
    log = handle.log
    second = log[first:]
    assert [b for _, b in uses_of(second)] == list(range(6))
    assert {w for w, _, _ in second if w in USES} <= {"hit", "late"}, f"second pass: {second}"
    assert s2["misses"] == 0 and s2["hits"] + s2["late"] == 12
    # While block k-2 is used, block k is copied in: its prefetch lies between the uses of k-2 and k-1.
    uses = uses_of(log)
    prefetched_at = {}
    for i, (what, b, _) in enumerate(log):
        assert what != "fetch", f"a demand fetch in a predicted pass: {log}"
        if what == "prefetch":
            prefetched_at.setdefault(b, []).append(i)
    for j, (pos, b) in enumerate(uses):
        before = [i for i in prefetched_at[b] if i < pos]
        assert before, f"use #{j} of block {b} was not prefetched: {log}"
        if j % 6 >= 2:  # (the first two of each call are prefetched when the model call starts)
            assert uses[j - 2][0] < before[-1] < uses[j - 1][0], f"block {b} not fetched 2 ahead: {log}"
        else:
            assert [w for w, _, _ in log[before[-1] - 1:before[-1]]] != ["fetch"], log
    fetched = [b for w, b, _ in second if w in FETCHES]
    assert sorted(fetched) == list(range(6)), "a steady pass copies every block once (ring of 3 < 6 blocks)"
    assert s2["bytes_moved"] - s1["bytes_moved"] == len(fetched) * block_bytes
    assert s2["fetches"] - s1["fetches"] == s2["prefetches"] - s1["prefetches"] == len(fetched)
    assert s2["slot_reuses"] > s1["slot_reuses"] > 0
    assert s2["device_bytes"] == s2["ring_slots"] * s2["slot_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_zero_uses_one_slot_on_demand(device):
    model, ref = model_and_reference(make_mlp, device, hidden=(32,) * 6)
    handle = hipferry.offload_layers(model, device=device, prefetch=0)
    x = model.example(0, device)
    with torch.no_grad():
        for _ in range(2):
            assert_same_outputs(model(x), ref(x))
    s = handle.stats()
    assert s["ring_slots"] == 1 and s["device_bytes"] == s["slot_bytes"]
    assert s["prefetches"] == 0 and s["hits"] == s["late"] == 0
    assert s["misses"] + s["reused"] == 12 and s["stalls"] == s["misses"] > 0
    assert all(w in ("fetch", "miss", "reused") for w, _, _ in handle.log), handle.log
    assert {slot for _, _, slot in handle.log} == {0}


@pytest.mark.parametrize("device", DEVICES)
def test_backward_fetches_blocks_in_reverse(device):
    model, ref = model_and_reference(make_mlp, device, hidden=(32,) * 6)
    handle = hipferry.offload_layers(model, device=device, prefetch=2)
    x = model.example(0, device)
    loss = loss_of(model(x))
    after_forward = len(handle.log)
    loss.backward()
    train_step(ref, x)
    assert_same_grads(model, ref)
    backward = handle.log[after_forward:]
    fetched = [b for w, b, _ in backward if w in FETCHES]
    used = [b for w, b, _ in backward if w in USES]
    assert fetched and fetched == sorted(fetched, reverse=True) and len(set(fetched)) == len(fetched), backward
    assert used == sorted(used, reverse=True) and set(used) == set(range(6)), backward
    assert all(w != "fetch" and w != "miss" for w, _, _ in backward), f"backward was not predicted: {backward}"


@pytest.mark.parametrize("device", DEVICES)
def test_ring_holding_every_block_copies_each_block_once_per_call(device):
    # Every model call starts from fresh copies (host weights may have changed in
    # ways no version shows); within the call each block is copied once.
    model, ref = model_and_reference(make_mlp, device, hidden=(32,) * 4)
    handle = hipferry.offload_layers(model, device=device, prefetch=10)
    x = model.example(0, device)
    with torch.no_grad():
        model(x)
        first = handle.stats()
        for _ in range(2):
            assert_same_outputs(model(x), ref(x))
    s = handle.stats()
    assert s["ring_slots"] == 4 and first["fetches"] == 4 and first["passes"] == 1
    assert s["fetches"] == 12 and s["bytes_moved"] == 3 * first["bytes_moved"] == 3 * s["host_bytes"]
    assert s["passes"] == 3 and s["reused"] == 0 and s["misses"] == 0


class Reversed(torch.nn.Module):
    """Runs its blocks last to first: the prediction learns the order from a call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        x = self.inner.inp(x)
        for blk in reversed(self.inner.blocks):
            x = blk(x)
        return self.inner.head(x)


@pytest.mark.parametrize("device", DEVICES)
def test_prediction_follows_the_call_order(device):
    inner, _ = model_and_reference(make_mlp, device, hidden=(32,) * 6)
    model, ref = Reversed(inner), Reversed(copy.deepcopy(inner))
    handle = hipferry.offload_layers(model, device=device)
    x = inner.example(0, device)
    with torch.no_grad():
        model(x)
        first = len(handle.log)
        for _ in range(2):
            assert_same_outputs(model(x), ref(x))
    later = handle.log[first:]
    assert [b for _, b in uses_of(later)] == [5, 4, 3, 2, 1, 0] * 2
    assert all(w in ("hit", "late", "prefetch") for w, _, _ in later), later


@pytest.mark.parametrize("device", DEVICES)
def test_write_through_data_between_calls_is_seen(device):
    # A ring that holds every block: block 0 is still resident after the call, so a
    # stale copy would be used -- unless every model call starts from fresh copies.
    model, ref = model_and_reference(make_mlp, device, hidden=(32,) * 6)
    handle = hipferry.offload_layers(model, device=device, prefetch=6)
    x = model.example(0, device)
    with torch.no_grad():
        model(x)
        assert 0 in handle.ring.resident
        version = model.blocks[0].fc1.weight._version
        for m in (model, ref):
            m.blocks[0].fc1.weight.data.mul_(-2.0)  # .data: no version bump
        assert model.blocks[0].fc1.weight._version == version
        assert_same_outputs(model(x), ref(x), "output after a write through .data")
        # Through an inner module and a block alone, too.
        for m in (model, ref):
            m.blocks[1].fc1.weight.data.mul_(-2.0)
        assert_same_outputs(model.blocks[1](model.inp(x)), ref.blocks[1](ref.inp(x)), "a block called alone")
        handle.invalidate()  # "I changed the weights": harmless at any time
        assert_same_outputs(model(x), ref(x), "output after invalidate()")


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_weight_update_is_seen(device):
    # A write through the parameter itself bumps its version: no invalidate() needed.
    model, ref = model_and_reference(make_mlp, device, hidden=(32,) * 6)
    _handle = hipferry.offload_layers(model, device=device)  # (kept alive for the test)
    x = model.example(0, device)
    with torch.no_grad():
        model(x)
        for m in (model, ref):
            m.blocks[0].fc1.weight.mul_(-2.0)
        assert_same_outputs(model(x), ref(x), "output after an in-place update")
