"""overlap="backward" keeps its promise (issue 31): bit-identical to
overlap=None, every parameter, gradient and state tensor compared after every
step (overlap_twins.Twins), where the speculation's inputs change in ways no
version counter shows, where a job fails or finds no room in the pool, where
the user holds views of the state, and under another thread's denormal mode
(Note [speculative step] in hipferry/optim/speculation.py). "cpu-remote": CPU
parameters through the GPU parameters' path (offload_adamw_helpers)."""
import logging

import pytest
import torch

import hipferry
from hipferry.optim import OffloadAdamW
from offload_adamw_helpers import CpuRemoteOffloadAdamW
from overlap_fakes import AdversarialScheduler
from overlap_twins import Twins, backward_then, same_bits
from test_offload_adamw_overlap import batches, loss_of, make_model

REMOTE = pytest.mark.parametrize("remote", [False, True], ids=["cpu", "cpu-remote"])
KW = dict(lr=1e-2, weight_decay=0.1, step_on="cpu")


def twins(remote=False, dtype=torch.float32, **kw):
    return Twins(lambda: make_model(dtype), CpuRemoteOffloadAdamW if remote else OffloadAdamW, **{**KW, **kw})


def first(model, opt):
    p = next(model.parameters())
    return p, opt.state[p]


# ----------------------------------------------------------------- 1: a job's error is a redo
@REMOTE
@pytest.mark.parametrize("how", ["group", "load_state_dict"])
def test_amsgrad_switched_on_mid_training_is_stepped_and_speculated_again(how, remote):
    t = twins(remote)
    it = backward_then(clip=1e6)

    def switch(model, opt, step):
        if how == "group":
            opt.param_groups[0]["amsgrad"] = True
        else:
            sd = opt.state_dict()
            sd["param_groups"][0]["amsgrad"] = True
            opt.load_state_dict(sd)
    for step in range(7):
        if step == 3:
            for model, opt in t.runs:
                switch(model, opt, step)
        t.step(it)
        if step == 4:
            committed = t.stats()["committed"]
    assert t.stats()["failed"] == 0
    assert t.stats()["committed"] - committed == 2 * len(list(t.model.parameters())), t.stats()


class FailingStore:
    """The state store, but its fused step raises the first `fails` times the worker calls it."""

    def __init__(self, store, fails):
        self._store, self.fails = store, fails

    def __getattr__(self, name):
        return getattr(self._store, name)

    def step(self, *args, **kwargs):
        if self.fails:
            self.fails -= 1
            raise RuntimeError("injected failure of a speculative step")
        return self._store.step(*args, **kwargs)


@REMOTE
def test_a_job_that_fails_is_redone_and_logged_and_step_raises_nothing(remote, caplog):
    t = twins(remote)
    speculation = t.opt._overlap.speculation
    speculation._store = FailingStore(speculation._store, fails=3)
    with caplog.at_level(logging.DEBUG, logger="hipferry.optim"):
        for _ in range(4):
            t.step(backward_then(clip=1e6))
    s = t.stats()
    assert s["failed"] == 3 and s["redone"] == 3 and s["committed"] == s["started"] - 3, s
    logged = [r for r in caplog.records
              if r.levelno == logging.DEBUG and r.exc_info and "injected" in str(r.exc_info[1])]
    assert len(logged) == 3


# ----------------------------------------------------------------- 2: no room in the pool
@REMOTE
def test_a_pool_sized_for_the_state_alone_trains_without_overlap(remote):
    cls = CpuRemoteOffloadAdamW if remote else OffloadAdamW
    model = make_model(torch.float32)
    probe = cls(model.parameters(), pool=hipferry.PinnedPool(capacity="64MiB"), **KW)
    for step in range(2):
        backward_then()(model, probe, step)
    need = probe._pool.stats()["peak_allocated_bytes"]  # the state (cpu-remote: host buffers, gradient copies)
    t = Twins(lambda: make_model(torch.float32), cls, lambda: {"pool": hipferry.PinnedPool(capacity=need + 4096)}, **KW)
    for _ in range(4):
        t.step(backward_then())
    s = t.stats()
    n = len(list(t.model.parameters()))
    if not remote:
        assert s["no_room"] == n and s["scratch_bytes"] == 0 and s["committed"] == 0, s
    else:  # the host gradient copies in flight come and go with the copy worker's timing: most parameters find no
        # room (once, in a full run, one of them did); every step still matches the run without overlap (Twins)
        assert s["no_room"] >= n - 1 and s["committed"] <= 4, s


@pytest.mark.parametrize("remote, dtype, per_element", [
    (False, torch.float32, 16), (False, torch.bfloat16, 16), (True, torch.float32, 12), (True, torch.bfloat16, 14)])
def test_the_scratch_takes_what_the_readme_says(remote, dtype, per_element):
    """Pool bytes of scratch per parameter element (docs/optimizer.md; hipferry/optim/scratch.py)."""
    model = make_model(dtype)
    opt = (CpuRemoteOffloadAdamW if remote else OffloadAdamW)(model.parameters(), overlap="backward", **KW)
    for x in batches(dtype, 2):
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
    numel = sum(p.numel() for p in model.parameters())
    state = sum(t.nbytes for st in opt.state.values() for k, t in st.items() if k != "step")
    assert opt.overlap_stats()["scratch_bytes"] == per_element * numel
    assert state == (12 if dtype == torch.bfloat16 else 8) * numel


# ----------------------------------------------------------------- 3, 5, 6: writes no version shows
def write_state(how):
    def write(model, opt, step):
        if step in (2, 4):
            p, st = first(model, opt)
            if how == "exp_avg.data":
                st["exp_avg"].data.mul_(0.5)
            elif how == "exp_avg_sq numpy":
                st["exp_avg_sq"].numpy()[:] *= 4
            else:
                st["master_param"].data.add_(0.01)
    return write


@REMOTE
@pytest.mark.parametrize("how, dtype", [("exp_avg.data", torch.float32), ("exp_avg_sq numpy", torch.float32),
                                        ("master_param.data", torch.bfloat16)])
def test_state_written_through_data_or_numpy_between_backward_and_step_is_taken(how, dtype, remote):
    t = twins(remote, dtype)
    for _ in range(6):
        t.step(backward_then(write_state(how), clip=1e6))
    assert t.stats()["redone"] == 2 and t.stats()["committed"] > 0, t.stats()


def test_backward_returns_only_after_its_jobs_read_what_they_read():
    """Code after backward may write anything: no job is left to read it (the torn reads of issue 31)."""
    model = make_model(torch.float32)
    opt = OffloadAdamW(model.parameters(), overlap="backward", **KW)
    scheduler = opt._overlap.speculation.scheduler = AdversarialScheduler("last moment")
    for x in batches(torch.float32, 3):
        loss_of(model, x).backward()
        assert scheduler.pending == [], "jobs left to run after backward returned"
        opt.step()
        opt.zero_grad()
    assert opt.overlap_stats()["committed"] > 0


def write_param(how):
    def write(model, opt, step):
        p = next(model.parameters())
        if how == "p.data.copy_" and step in (1, 3):
            p.data.copy_(p.data * 0.5 + 0.01)
        elif how == "p.data = t twice, same address":
            old = p.data
            p.data = torch.zeros_like(old)  # a first new tensor, then the old memory back, written:
            old.mul_(0.5).add_(0.01)        # version, address and strides as before (what the allocator
            p.data = old                    # does often when it hands out a freed block again)
        elif how == "p.data = t twice":
            p.data = p.data * 0.5
            p.data = p.data + 0.01
    return write


UNSEEN_WRITES = [(how, dtype, remote) for how in ("p.data.copy_", "p.data = t twice, same address")
                 for dtype in (torch.float32, torch.bfloat16) for remote in (False, True)]
# Where the allocator decides whether the address comes back, a run without overlap reads a master or
# host copy again or not (param_key) as its addresses fall: only a float32 CPU parameter, which the
# step reads itself, has one right answer.
UNSEEN_WRITES.append(("p.data = t twice", torch.float32, False))


@pytest.mark.parametrize("how, dtype, remote", UNSEEN_WRITES)
def test_a_parameter_written_unseen_by_its_version_is_stepped_as_without_overlap(how, dtype, remote):
    t = twins(remote, dtype)
    for _ in range(6):
        t.step(backward_then(write_param(how), clip=1e6))
    assert t.stats()["committed"] > 0


# ----------------------------------------------------------------- 4: views of the state
@REMOTE
def test_views_of_the_state_the_user_holds_stay_the_state(remote):
    t = twins(remote)
    p, st = first(t.model, t.opt)
    view, array, alias = st["exp_avg"][:5], st["exp_avg_sq"].numpy(), st["exp_avg"].data
    seen = {}

    def check_untouched(model, opt, step):  # after backward: the speculations ran, nothing may have changed
        if opt is t.opt and seen:
            assert same_bits(view, seen["view"]) and (array == seen["array"]).all(), f"step {step}"  # noqa: F821 (a name deleted further down; the lambda runs before that)
    for step in range(5):
        t.step(backward_then(check_untouched, clip=1e6))
        assert same_bits(view, st["exp_avg"][:5]) and same_bits(alias, st["exp_avg"])
        assert (array == st["exp_avg_sq"].numpy()).all()
        seen = {"view": view.clone(), "array": array.copy()}
    s = t.stats()
    assert s["committed"] > 0 and s["copied_commits"] >= 2 * 4, s  # (m and v of the first parameter)
    del view, array, alias
    copied = s["copied_commits"]
    for _ in range(2):
        t.step(backward_then(clip=1e6))
    assert t.stats()["copied_commits"] == copied, "nothing holds the state any more: commits swap again"


# ----------------------------------------------------------------- 7: the stepping thread's state
@pytest.mark.parametrize("change", ["flush denormal", "flush denormal, then one thread"])
def test_the_worker_steps_under_the_stepping_threads_denormal_mode_and_thread_count(change):
    numel = 3 * (1 << 15) + 5  # several chunks of the fused step's parallel loop
    if not torch.set_flush_denormal(False):
        pytest.skip("torch.set_flush_denormal is not supported on this CPU")

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(1, numel, bias=False))
    scale = torch.randn(numel) * 1e-20  # gradients ~1e-20: exp_avg_sq ~1e-43, a denormal

    def iteration(model, opt, step):
        opt.zero_grad()
        (model[0].weight[:, 0] * scale).sum().backward()
        opt.step()
    threads = torch.get_num_threads()
    t = Twins(make, lr=1e-3)
    try:
        for step in range(7):
            if step == 2:
                torch.set_flush_denormal(True)
            if step == 4 and change.endswith("one thread"):
                torch.set_num_threads(1)
            t.step(iteration)
            if step == 1:
                v = t.opt.state[t.model[0].weight]["exp_avg_sq"]
                assert ((v != 0) & (v.abs() < torch.finfo(torch.float32).tiny)).any(), "no denormal to flush"
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert t.stats()["committed"] >= 5, t.stats()
