"""overlap="backward" in the ways training uses it (issue 31): optimizers made
and dropped without the cycle collector, GradScaler with scaler.unscale_ and
clipping, parameters that are views of one flat buffer, and DDP through the
GPU parameters' path. Each run is bit-identical to overlap=None
(overlap_twins.Twins) and the counters show the speculations are kept."""
import gc
import threading
import weakref

import pytest
import torch

import hipferry
from hipferry.optim import OffloadAdamW
from offload_adamw_helpers import CpuRemoteOffloadAdamW
from overlap_twins import Twins, backward_then
from test_offload_adamw_overlap import (FIRES, batches, loss_of, make_model, ranks_equal_to_the_plain_run,
                                       requires_gloo)
from test_offload_adamw_overlap_promise import FailingStore

REMOTE = pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
KW = dict(lr=1e-2, weight_decay=0.1, step_on="cpu")


# ----------------------------------------------------------------- 8: a dropped optimizer
def train_then_drop(variant, pool):
    """A few steps of an optimizer that is then dropped with speculations pending; returns
    a weak reference to it and the model (whose hooks must start nothing any more)."""
    model = make_model(torch.float32)
    cls = CpuRemoteOffloadAdamW if variant == "cpu-remote" else OffloadAdamW
    opt = cls(model.parameters(), pool=pool, overlap="backward", **KW)
    if variant == "failing jobs":
        opt._overlap.speculation._store = FailingStore(opt._overlap.speculation._store, fails=5)
    it = backward_then()
    for step in range(3):
        if variant == "amsgrad switched on" and step == 1:
            opt.param_groups[0]["amsgrad"] = True
        it(model, opt, step)
    loss_of(model, batches(torch.float32, 1)[0]).backward()
    return weakref.ref(opt), model


def test_dropped_optimizers_end_their_workers_and_return_their_scratch_without_the_cycle_collector():
    pool = hipferry.PinnedPool(capacity="64MiB")
    gc.collect()
    threads, held = threading.active_count(), pool.stats()["allocated_bytes"]
    gc.disable()
    try:
        for i in range(20):
            variant = ("plain", "cpu-remote", "amsgrad switched on", "failing jobs")[i % 4]
            ref, model = train_then_drop(variant, pool)
            assert ref() is None, f"{variant}: the dropped optimizer is still alive"
            loss_of(model, batches(torch.float32, 1)[0]).backward()  # its hooks start nothing now
            del model
            assert threading.active_count() == threads, f"{variant}: its worker thread still runs"
            assert pool.stats()["allocated_bytes"] == held, f"{variant}: its state or scratch is still in the pool"
    finally:
        gc.enable()


# ----------------------------------------------------------------- 9: GradScaler.unscale_
@REMOTE
def test_grad_scaler_with_unscale_and_clipping_commits_where_clipping_does_not_fire(remote):
    data = batches(torch.float32, 10)
    scalers = {}

    def iteration(model, opt, step):
        scaler = scalers.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        opt.zero_grad()
        scaler.scale(loss_of(model, data[step])).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05 if step in FIRES else 1e6)
        scaler.step(opt)
        scaler.update()
    t = Twins(lambda: make_model(torch.float32), CpuRemoteOffloadAdamW if remote else OffloadAdamW, **KW)
    for _ in range(10):
        t.step(iteration)
    n = len(list(t.model.parameters()))
    # Step 0 learns unscale_'s factor; 1 still speculates without it, then every step where
    # clipping does not fire (2, 4, 5, 7, 8) commits.
    assert t.stats()["committed"] == 5 * n, t.stats()


# ----------------------------------------------------------------- 10: views of one buffer
def make_flat_model():
    """The test transformer with every parameter a view of one flat buffer (as FSDP1's flat
    parameter, or a model built on torch.nn.utils.parameters_to_vector's layout)."""
    model = make_model(torch.float32)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    offset = 0
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(flat[offset:offset + p.numel()].view_as(p)))
            offset += p.numel()
    return model


@REMOTE
def test_parameters_that_are_views_of_one_buffer_speculate_and_commit(remote):
    t = Twins(make_flat_model, CpuRemoteOffloadAdamW if remote else OffloadAdamW, **KW)
    params = list(t.model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    for _ in range(6):
        t.step(backward_then(clip=1e6))
    first = 1 if remote else 0  # (cpu-remote: the first step makes the host working copies)
    assert t.stats()["committed"] == (6 - first) * len(params), t.stats()


# ----------------------------------------------------------------- 11: DDP, GPU parameters' path
@requires_gloo
def test_ddp_through_the_gpu_parameters_path_speculates_from_the_reduced_gradients(tmp_path):
    import distributed_helpers as dh
    dh.spawn(dh.ddp_overlap_worker, dh.free_port(), str(tmp_path), True)
    for plain, overlapped in ranks_equal_to_the_plain_run(tmp_path):
        n = len(plain["params"])
        fired = sum(norm > dh.MAX_NORM for norm in plain["norms"][1:])  # (step 0 makes the host copies)
        assert 0 < fired < dh.STEPS - 1, plain["norms"]
        s = overlapped["stats"]
        assert s["started"] == (dh.STEPS - 1) * n, s
        assert s["committed"] == (dh.STEPS - 1 - fired) * n and s["redone"] == fired * n, s
        reused, made = overlapped["grad_copies"]
        assert reused >= (dh.STEPS - 1 - fired) * n, (reused, made)  # the reduced gradients' copies were used
