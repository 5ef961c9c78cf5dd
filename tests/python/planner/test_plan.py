"""hipferry.plan: bad input before anything runs, the pass leaves the model as it
was, the choice under budgets (a fixed machine), and the optimizer it builds."""
import re

import pytest
import torch
from torch import nn

import hipferry
from hipferry.optim import OffloadAdamW
from hipferry.planner import PlanError
from hipferry.planner import planner as planner_mod

MB = 1 << 20
FAKE_MACHINE = {"dram_triad_gbps": 20.0, "step_s_per_param[torch]": 1.0e-9, "step_s_per_param[host-float32]": 1.0e-9,
                "step_s_per_param[host-8bit]": 2.0e-9, "step_s_per_param[disk-float32]": 6.0e-9,
                "step_s_per_param[disk-8bit]": 4.0e-9, "disk_read_gbps": 1.0, "disk_write_gbps": 1.0,
                "disk_flush_seconds": 0.002, "disk_direct_io": True}


def mlp(width: int = 2048, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


HELD, PASS = 500 * MB, 100 * MB
RETAINED = int(0.15 * PASS)  # allocator_retention: 15% of the pass's growth


@pytest.fixture
def fake_machine(monkeypatch):
    """A fixed machine, and a fixed process: what the process holds and what the pass
    adds are measured on the real machine elsewhere (test_plan_measure.py, bench plan);
    here the choice is a function of the parameters alone."""
    calls = []

    def measure(device, state_dir=None, **kw):
        calls.append((device, state_dir))
        return dict(FAKE_MACHINE)

    def profile(*args, **kw):
        prof = real_profile(*args, **kw)
        prof.pass_host_bytes = PASS
        return prof
    real_profile = planner_mod.profile_model
    monkeypatch.setattr(planner_mod, "measure_machine", measure)
    monkeypatch.setattr(planner_mod, "profile_model", profile)
    monkeypatch.setattr(planner_mod, "rss_bytes", lambda: HELD)
    return calls


def quiet_plan(model, **kw):
    if "batch" not in kw:
        kw["batch"] = torch.randn(8, 2048)
    return hipferry.plan(model, verbose=False, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(host_memory=-1), r"host_memory must be >= 0"),
    (dict(host_memory="lots"), r"host_memory must look like '8GiB'"),
    (dict(gpu_memory=[1]), r"gpu_memory must be a byte count"),
    (dict(disk_budget=-2.5), r"disk_budget must be >= 0"),
    (dict(optimizer="sgd"), r"optimizer must be 'adamw'"),
    (dict(homes=["host-4bit"]), r"homes must be a non-empty list of"),
    (dict(homes=[]), r"homes must be a non-empty list of"),
    (dict(amsgrad="yes"), r"amsgrad must be a bool"),
    (dict(batch=None), r"batch= is required"),
    (dict(state_dir=3), r"state_dir must be a path"),
])
def test_bad_input_is_refused_before_anything_runs(kw, match, fake_machine):
    model = mlp()
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    with pytest.raises((ValueError, TypeError), match=match):
        quiet_plan(model, **kw)
    assert fake_machine == [], "nothing was measured"
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_a_model_without_trainable_parameters_is_refused(fake_machine):
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        quiet_plan(model)
    with pytest.raises(ValueError, match="no trainable parameters"):
        quiet_plan(nn.GELU())
    assert fake_machine == []


def test_a_state_dir_that_is_not_writable_is_refused(tmp_path, fake_machine):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"state_dir .* is not a writable folder"):
        quiet_plan(mlp(), state_dir=str(blocker / "state"))
    assert fake_machine == [] and blocker.read_text() == "not a folder"


def test_the_pass_leaves_gradients_rng_and_mode_as_they_were(fake_machine):
    model = mlp().eval()
    grads = [torch.randn_like(p) for p in model.parameters()]
    kept = [g.clone() for g in grads]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    p = quiet_plan(model, batch=torch.ones(8, 2048))
    assert torch.equal(torch.rand(4), expected_next), "the RNG continues as if plan() never ran"
    assert not model.training
    assert all(q.grad is g and torch.equal(g, k) for q, g, k in zip(model.parameters(), grads, kept))
    assert p.profile.fwd_bwd_seconds > 0 and p.profile.numel == sum(q.numel() for q in model.parameters())


def test_everything_fits_so_nothing_is_offloaded(fake_machine):
    p = quiet_plan(mlp(), host_memory="64GiB")
    assert p.home == "torch"
    text = p.explain()
    assert "chosen: nothing needs offloading" in text and "no state_dir given" in text
    d = p.explain(as_dict=True)
    assert d["chosen"] == "torch" and {c["home"] for c in d["candidates"]} == set(planner_mod.HOMES)
    opt = p.apply(mlp(), lr=1e-3).optimizer
    assert type(opt) is torch.optim.AdamW


def _peaks(p) -> dict:
    return {c.home: c.host_need for c in p.candidates}


def test_a_budget_below_float32_state_picks_8bit_and_says_why(fake_machine):
    ample = quiet_plan(mlp(), host_memory="64GiB")
    peaks = _peaks(ample)
    assert peaks["host-8bit"] < peaks["host-float32"] <= peaks["torch"]
    budget = (peaks["host-8bit"] + peaks["host-float32"]) // 2
    p = quiet_plan(mlp(), host_memory=budget)
    assert p.home == "host-8bit"
    row = {c.home: c for c in p.candidates}
    assert not row["torch"].fits and re.search(r"refused: host \d+\.\d+ GB > \d+\.\d+ GB", row["torch"].why)
    model = mlp()
    opt = p.apply(model, lr=1e-3).optimizer
    assert isinstance(opt, OffloadAdamW)
    model(torch.randn(8, 2048)).square().mean().backward()
    opt.step()
    assert opt.memory_stats()["state_format"] == "uint8"
    with pytest.raises(ValueError, match=r"home must be one of the candidates that fit"):
        p.apply(model, home="torch")


def test_only_the_disk_fits_with_a_state_dir_and_its_window_shrinks_to_the_budget(tmp_path, fake_machine):
    ample = quiet_plan(mlp(), host_memory="64GiB", state_dir=str(tmp_path / "s"))
    assert _peaks(ample)["host-8bit"] > HELD + PASS + RETAINED + 105 * MB  # (the 8-bit state, 34 MB, and the margin)
    budget = HELD + PASS + RETAINED + 100 * MB  # a shrunk window fits, the 8-bit state in RAM does not
    p = quiet_plan(mlp(), host_memory=budget, state_dir=str(tmp_path / "s"))
    assert p.home == "disk-8bit"
    chosen = p.chosen
    assert chosen.host_need <= budget and "disk window shrunk to" in chosen.why
    model = mlp()
    opt = p.apply(model, lr=1e-3).optimizer
    model(torch.randn(8, 2048)).square().mean().backward()
    opt.step()
    stats = opt.memory_stats()
    assert stats["state_format"] == "disk-uint8" and stats["disk_window_bytes"] == chosen.parts["window_bytes"]
    assert stats["disk_state_bytes"] == chosen.disk_bytes


def test_no_fit_names_the_smallest_budget_that_works(tmp_path, fake_machine):
    with pytest.raises(PlanError, match="a state_dir= on a disk would let the state leave RAM"):
        quiet_plan(mlp(), host_memory=1000)
    with pytest.raises(PlanError) as e:
        quiet_plan(mlp(), host_memory=1000, state_dir=str(tmp_path / "s"))
    m = re.search(r"The smallest host_memory that works is (\d+\.\d+) GB, with the state in (\S+)", str(e.value))
    assert m, str(e.value)
    budget, home = int(float(m.group(1)) * 1e9) + 1_000_000, m.group(2)  # (the message rounds to the MB)
    p = quiet_plan(mlp(), host_memory=budget, state_dir=str(tmp_path / "s"))
    assert p.home == home


def test_homes_restricts_the_candidates(fake_machine):
    p = quiet_plan(mlp(), host_memory="64GiB", homes=["host-float32", "host-8bit"])
    assert [c.home for c in p.candidates] == ["host-float32", "host-8bit"]
    assert p.home == "host-float32"  # the fake machine: float32 state steps twice as fast


def test_the_host_peak_adds_what_the_allocator_keeps_beyond_the_pass(fake_machine):
    """pass + state + RETAINED_FRACTION of the pass; on a GPU model nothing is added."""
    p = quiet_plan(mlp(), host_memory="64GiB")
    host = {c.home: c for c in p.candidates}["host-float32"]
    state = 2 * 4 * sum(q.numel() for q in mlp().parameters())  # m and v in float32 (float32 parameters: no master)
    assert planner_mod.RETAINED_FRACTION == 0.15
    assert host.host_peak == HELD + PASS + RETAINED + state and host.parts["allocator_bytes"] == RETAINED
    prof = planner_mod.ModelProfile(device=torch.device("cuda"), trainable=[(1 << 20, torch.float32)], frozen_bytes=0,
                                    fwd_bwd_seconds=0.1, pass_host_bytes=PASS)
    assert planner_mod.allocator_retention(prof) == 0
