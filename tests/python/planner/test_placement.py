"""GPU placements in hipferry.plan: streamed blocks and offloaded activations.

No GPU here, so the GPU is a fake: the model's own blocks and a measured CPU
pass, with the device figures of a pass set by the test and a fixed link. What
a placement moves is checked against offload_layers' and offload_activations'
own counters; the choice and the refusal against the budgets; and Plan.apply
builds the placement for real (offload_layers runs its ring on the CPU)."""
import re
from dataclasses import replace

import pytest
import torch
from torch import nn

import hipferry
from hipferry.module_offload import offload_activations, offload_layers
from hipferry.optim import OffloadAdamW
from hipferry.planner import PlanError, planner as planner_mod
from hipferry.planner.placement import ACTIVATIONS_IN_FLIGHT, Placement, placement_cost
from hipferry.planner.profile import block_sizes, profile_model

MB = 1 << 20
LINK = {"link_h2d_gbps": 20.0, "link_d2h_gbps": 20.0}
MACHINE = {"dram_triad_gbps": 20.0, "step_s_per_param[torch]": 1.0e-9, "step_s_per_param[host-float32]": 1.0e-9,
           "step_s_per_param[host-8bit]": 2.0e-9, **LINK}


def blocks_model(depth: int = 8, width: int = 512) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), *[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                                    for _ in range(depth - 1)])


BATCH = torch.randn(1024, 512)


def gpu_profile(model, saved=400 * MB, fwd_bwd=0.05):
    """The model's real blocks and CPU pass, as if on a GPU: the weights resident
    (device_held), a pass that adds the gradients and `saved` bytes of activations."""
    prof = profile_model(model, BATCH)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return replace(prof, device=torch.device("cuda"), device_held=weights, pass_device_bytes=weights + saved,
                   saved_bytes=saved, fwd_bwd_seconds=fwd_bwd)


@pytest.fixture
def fake_gpu(monkeypatch):
    made = {}

    def profile(model, batch, loss_fn=None, **kw):
        made["profile"] = gpu_profile(model, **made.get("kw", {}))
        return made["profile"]
    monkeypatch.setattr(planner_mod, "measure_machine", lambda device, state_dir=None, **kw: dict(MACHINE))
    monkeypatch.setattr(planner_mod, "profile_model", profile)
    return made


def plan(model, **kw):
    kw.setdefault("homes", ["torch", "host-float32", "host-8bit"])
    return hipferry.plan(model, batch=BATCH, host_memory="64GiB", verbose=False, **kw)


def test_the_profile_counts_the_blocks_and_activations_that_offload_layers_and_activations_would_move():
    model = blocks_model()
    prof = profile_model(model, BATCH)
    sizes = block_sizes(model)
    handle = offload_layers(blocks_model(), prefetch=1, device="cpu")
    try:
        st = handle.stats()
        assert sum(b.host_bytes for b in sizes) == st["host_bytes"] and len(sizes) == st["blocks"] == 8
        assert max(b.slot_bytes for b in sizes) == st["slot_bytes"]
        assert all(b.trainable_bytes == b.host_bytes for b in sizes)  # float32, all training
    finally:
        handle.undo()
    acts = offload_activations()
    with acts:
        loss = model(BATCH).square().mean()
    loss.backward()
    assert prof.blocks == sizes and prof.saved_bytes == acts.stats()["offloaded_bytes"] > 0


@pytest.mark.parametrize("stream,prefetch", [(1, 0), (2, 1), (3, 2), (5, 1), (8, 2), (8, 1)])
def test_the_bytes_a_placement_moves_are_what_the_ring_moves(stream, prefetch):
    """The oracle is offload_layers itself (its ring on the CPU): bytes in, gradients out, ring size."""
    model = blocks_model()
    cost = placement_cost(gpu_profile(model), Placement(stream, prefetch), 20.0, 20.0)
    blocks = [b.module for b in hipferry.module_offload.plan_blocks(model, list(model), None)[0]]
    handle = offload_layers(model, layers=blocks[8 - stream:], prefetch=prefetch, device="cpu")
    try:
        for _ in range(3):
            model(BATCH).square().mean().backward()
        st = handle.stats()
        assert st["bytes_moved"] == 3 * cost.h2d_bytes and st["grad_bytes_moved"] == 3 * cost.d2h_bytes
        assert st["device_bytes"] == cost.ring_bytes
    finally:
        handle.undo()


def test_a_frozen_block_streams_without_gradients():
    model = blocks_model()
    for p in model[3].parameters():
        p.requires_grad_(False)
    sizes = block_sizes(model)
    assert sizes[3].trainable_bytes == 0 < sizes[3].host_bytes and sizes[4].trainable_bytes == sizes[4].host_bytes


def test_the_cost_of_a_placement():
    prof = gpu_profile(blocks_model())
    block, slot = prof.blocks[-1].host_bytes, prof.blocks[-1].slot_bytes
    none = placement_cost(prof, Placement(), 20.0, 10.0)
    assert none.device_saved == 0 and none.host_added == 0 and none.pass_seconds == prof.fwd_bwd_seconds
    five = placement_cost(prof, Placement(stream=5, prefetch=2), 20.0, 10.0)
    assert five.device_saved == 5 * 2 * block - 3 * slot and five.host_added == 10 * block
    # in for forward, again for backward but for the 3 still in the ring; gradients out once;
    # the first fetch is not hidden
    assert five.h2d_bytes == (5 + 2) * block and five.d2h_bytes == 5 * block
    assert five.copy_seconds == max(7 * block / 20e9, 5 * block / 10e9)
    assert five.pass_seconds == max(prof.fwd_bwd_seconds, five.copy_seconds) + slot / 20e9
    three = placement_cost(prof, Placement(stream=3, prefetch=2), 20.0, 10.0)
    two_slots = placement_cost(prof, Placement(stream=3, prefetch=1), 20.0, 10.0)
    assert two_slots.device_saved == three.device_saved + slot
    acts = placement_cost(prof, Placement(activations=True), 20.0, 10.0)
    assert acts.device_saved == 0 and acts.host_added == prof.saved_bytes  # all of it fits in flight
    big = replace(prof, saved_bytes=2048 * MB)
    acts = placement_cost(big, Placement(activations=True), 20.0, 10.0)
    assert acts.device_saved == 2048 * MB - ACTIVATIONS_IN_FLIGHT and acts.copy_seconds == 2048 * MB / 10e9
    slow = placement_cost(prof, Placement(stream=8, prefetch=2), 0.001, 0.001)
    assert slow.pass_seconds > 100 * prof.fwd_bwd_seconds  # a slow link is seen in the step


def test_when_everything_fits_on_the_gpu_nothing_is_streamed_or_offloaded(fake_gpu):
    p = plan(blocks_model(), gpu_memory="64GiB")
    assert [c.placement for c in p.candidates] == [Placement()] * 3
    assert p.chosen.label == "torch" and "nothing needs offloading" in p.chosen.why


def test_a_short_gpu_budget_streams_the_fewest_blocks_that_fit(fake_gpu):
    fake_gpu["kw"] = {"saved": 0}  # nothing to offload but weights
    model = blocks_model()
    ample = plan(model, gpu_memory="64GiB")
    need = {c.home: c.device_peak for c in ample.candidates}
    budget = need["host-float32"] - 5 * MB  # each block frees about 2 MB (weights and gradients)
    p = plan(model, gpu_memory=budget)
    streams = [c for c in p.candidates if c.placement.stream]
    assert {c.home for c in streams} == {"host-float32", "host-8bit"}  # torch's state stays on the device
    assert p.chosen.placement.stream > 0 and p.chosen.device_peak <= budget and p.chosen.fits
    k, home = p.chosen.placement, p.chosen.home
    fewer = planner_mod._estimate(home, p.profile, p.machine, 0, False, p.disk, replace(k, stream=k.stream - 1))
    assert fewer.device_peak > budget, "one block fewer would not fit: the fewest were streamed"
    assert k.prefetch == 2 and f"+stream {k.stream}/8 (3 slots)" in p.explain()
    assert [c.label for c in p.candidates if not c.fits] == ["torch", "host-float32", "host-8bit"]


def test_activations_offloaded_alone_keep_torchs_optimizer_on_the_gpu(fake_gpu):
    fake_gpu["kw"] = {"saved": 2048 * MB}
    model = blocks_model()
    need = plan(model, gpu_memory="64GiB").candidates[0].device_peak
    p = plan(model, gpu_memory=need - 1024 * MB)
    torch_acts = next(c for c in p.candidates if c.home == "torch" and c.placement.activations)
    assert torch_acts.placement.stream == 0 and torch_acts.fits
    assert p.chosen is torch_acts, p.explain()  # fewest offloads, and the fastest here
    assert "fwd_bwd_with_copies" in p.chosen.parts


def test_the_choice_prefers_less_offloading_within_ten_percent_and_the_fastest_beyond(fake_gpu):
    prof = gpu_profile(blocks_model())
    make = planner_mod.Candidate
    a = make("host-float32", 1, 1, 0, 1.00, placement=Placement(stream=2, prefetch=2))
    b = make("host-float32", 1, 1, 0, 1.05, placement=Placement())
    budgets = {"host_memory": None, "gpu_memory": None, "disk": None}
    assert planner_mod.choose([a, b], budgets, None) is b and "offloading less" in b.why
    c = make("host-float32", 1, 1, 0, 1.20, placement=Placement())
    assert planner_mod.choose([a, c], budgets, None) is a
    assert prof.blocks  # (the profile the fakes share)


def test_no_gpu_budget_that_fits_names_the_smallest_and_replanning_with_it_fits(fake_gpu):
    fake_gpu["kw"] = {"saved": 2048 * MB}
    model = blocks_model()
    with pytest.raises(PlanError, match=r"smallest gpu_memory that works is ([\d.]+) GB, with (\S+)") as e:
        plan(model, gpu_memory=1 * MB)
    gb, label = re.search(r"smallest gpu_memory that works is ([\d.]+) GB, with (\S+)", str(e.value)).groups()
    p = plan(model, gpu_memory=int(float(gb) * 1e9) + 1 * MB)
    assert p.chosen.fits and p.chosen.home == label and p.chosen.placement.stream == 8
    assert p.chosen.placement.activations  # the least device memory: everything offloaded


def test_apply_streams_the_chosen_blocks_and_gives_an_activation_context(fake_gpu):
    fake_gpu["kw"] = {"saved": 2048 * MB}
    model = blocks_model()
    ample = plan(model, gpu_memory="64GiB")
    # activations offloaded free all but what is in flight; then 3 MB more: blocks
    budget = next(c for c in ample.candidates if c.home == "host-float32").device_peak - (2048 + 3) * MB \
        + ACTIVATIONS_IN_FLIGHT
    p = plan(model, gpu_memory=budget, homes=["host-float32"])
    k = p.chosen.placement
    assert k.stream and k.activations, p.explain()
    before = [q.detach().clone() for q in model.parameters()]
    applied = p.apply(model, lr=1e-2)
    try:
        st = applied.layers.stats()
        assert st["blocks"] == k.stream and st["ring_slots"] == k.prefetch + 1
        assert applied.layers.block_names == [str(i) for i in range(8 - k.stream, 8)]
        assert isinstance(applied.optimizer, OffloadAdamW) and applied.placement == k
        with applied.activations:
            loss = model(BATCH).square().mean()
        loss.backward()
        applied.optimizer.step()
        assert applied.activations.stats()["offloaded_bytes"] > 0
        assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    finally:
        applied.layers.undo()


def test_on_the_cpu_no_placement_is_tried(monkeypatch):
    monkeypatch.setattr(planner_mod, "measure_machine", lambda device, state_dir=None, **kw: dict(MACHINE))
    p = plan(blocks_model(), gpu_memory=1)  # no GPU: the GPU budget has nothing to limit
    assert all(c.placement == Placement() and c.device_peak == 0 for c in p.candidates)


def test_a_bad_optimizer_argument_leaves_the_model_as_it_was(fake_gpu):
    fake_gpu["kw"] = {"saved": 0}
    model = blocks_model()
    budget = next(c for c in plan(model, gpu_memory="64GiB").candidates if c.home == "host-float32").device_peak
    p = plan(model, gpu_memory=budget - 5 * MB, homes=["host-float32"])
    assert p.chosen.placement.stream
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(ValueError, match="Invalid learning rate"):
        p.apply(model, lr=-1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    applied = p.apply(model, lr=1e-2)  # the blocks are free to stream: nothing was left offloaded
    try:
        assert applied.layers.stats()["blocks"] == p.chosen.placement.stream
    finally:
        applied.layers.undo()
