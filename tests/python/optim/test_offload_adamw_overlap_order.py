"""The order of OffloadAdamW(overlap="backward"), proven on one thread without
a GPU (issue 26): its speculative jobs run in adversarial orders
(AdversarialScheduler) and every copy between "device" and host lands as late
as a device may let it, or earlier at random (DeferredCopies; CPU parameters
through the `cpu-remote` seam stand in for GPU ones). Asserted, against the
same run without overlap and without fakes:
- every forward reads the parameters the serial run's forward read (so no
  forward ran before its update landed: the fakes land copies back only
  when an event is waited for or the next forward starts);
- no copy's source is written while the copy is in flight;
- after 8 steps parameters and state are bit-identical.
Two mutations show the checks can fail: a forward that does not wait for the
copies back reads stale parameters, and a backward that returns before its
speculative jobs finish lets clipping write a gradient mid-copy."""
import contextlib
import random

import pytest
import torch

from hipferry.optim import OffloadAdamW
from hipferry.optim.speculation import BackwardSpeculation
from offload_adamw_helpers import CpuRemoteOffloadAdamW
from overlap_fakes import AdversarialScheduler, DeferredCopies
from test_offload_adamw_overlap import FIRES, assert_same, batches, loss_of, make_model

STEPS = 8
SCENARIOS = ["clipping", "micro-batches", "grad scaler inf"]


def run(overlap, dtype=torch.float32, *, remote=True, scenario="clipping", policy=None, seed=0,
        forward_waits=True):
    """`STEPS` steps; returns (what every forward read, model, optimizer, fake copies or None)."""
    model = make_model(dtype)
    cls = CpuRemoteOffloadAdamW if remote else OffloadAdamW
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, overlap=overlap, step_on="cpu", min_offload_numel=0)
    copies = None
    if policy is not None:
        rng = random.Random(seed)
        copies = DeferredCopies(rng if policy == "random" else None)
        opt._grad_copies.copies = copies
        if opt._overlap is not None:
            opt._overlap.speculation.scheduler = AdversarialScheduler(policy, rng, between_jobs=copies.land_some)
    reads = []

    def before_forward(module, args):
        if copies is not None and forward_waits:
            copies.drain()  # stream order: the copies queued before the forward run before its kernels
        reads.append([p.detach().clone() for p in module.parameters()])
    model.register_forward_pre_hook(before_forward)
    micro = 2 if scenario == "micro-batches" else 1
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scenario == "grad scaler inf" else None
    data = batches(dtype, STEPS * micro)
    for step in range(STEPS):
        for k in range(micro):
            with opt.accumulating() if k < micro - 1 else contextlib.nullcontext():
                loss = loss_of(model, data[step * micro + k]) / micro
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            if step == 5:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05 if step in FIRES else 1e6)
            opt.step()
        opt.zero_grad()
    opt.synchronize()  # (waits on the last step's events: the fake's copies land)
    if copies is not None:
        copies.drain()
    return reads, model, opt, copies


def assert_same_run(reference, candidate):
    want, ref_model, ref_opt, _ = reference
    got, model, opt, copies = candidate
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"forward {i} read other parameters"
    assert_same(ref_model, ref_opt, model, opt)
    assert copies.violations == []


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(dtype, remote, scenario):
        key = (dtype, remote, scenario)
        if key not in cache:
            cache[key] = run(None, dtype, remote=remote, scenario=scenario)
        return cache[key]
    return get


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("policy", ["now", "last moment", "reversed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
def test_adversarial_job_orders_and_late_copies_change_nothing(references, dtype, policy, scenario):
    result = run("backward", dtype, scenario=scenario, policy=policy)
    assert_same_run(references(dtype, True, scenario), result)
    _, _, opt, copies = result
    stats = opt.overlap_stats()
    assert opt._overlap.speculation.scheduler.ran > 0 and copies.landed > 0
    assert stats["committed"] > 0 and stats["redone"] > 0


@pytest.mark.parametrize("policy", ["now", "last moment", "reversed"])
def test_cpu_parameters_in_adversarial_job_orders(references, policy):
    result = run("backward", remote=False, policy=policy)
    assert_same_run(references(torch.float32, False, "clipping"), result)
    assert result[2].overlap_stats()["redone"] > 0


def test_without_overlap_the_late_copies_change_nothing_either(references):
    result = run(None, policy="last moment")
    assert_same_run(references(torch.float32, True, "clipping"), result)
    assert result[3].landed > 0


@pytest.mark.parametrize("seed", range(6))
def test_random_job_orders_and_random_landings(references, seed):
    scenario = SCENARIOS[seed % len(SCENARIOS)]
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    result = run("backward", dtype, scenario=scenario, policy="random", seed=seed)
    assert_same_run(references(dtype, True, scenario), result)


def test_a_forward_that_does_not_wait_for_the_copies_back_is_caught(references):
    got, *_ = run("backward", policy="last moment", forward_waits=False)
    want = references(torch.float32, True, "clipping")[0]
    stale = [i for i, (a, b) in enumerate(zip(want, got)) if not all(torch.equal(x, y) for x, y in zip(a, b))]
    assert stale, "the fake copies back landed before the forward without being waited for"


def test_a_backward_that_returns_before_its_jobs_is_caught(monkeypatch):
    monkeypatch.setattr(BackwardSpeculation, "_wait_for_jobs", lambda self: None)
    *_, copies = run("backward", policy="last moment")
    assert "a gradient was written while its copy to the host was in flight" in copies.violations
