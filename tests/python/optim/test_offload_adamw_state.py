"""hipferry.optim.OffloadAdamW's state: opt.state[p] in torch.optim.AdamW's
format (keys, float32, shapes, a float32 0-dim CPU ``step``; ``master_param``
only for low-precision params), host state in the hipferry pool and counted by
memory_stats(), the engine choice; state_dict()/load_state_dict() round trips
OffloadAdamW <-> torch.optim.AdamW and OffloadAdamW -> OffloadAdamW (also
through torch.save/torch.load, with amsgrad and with a bfloat16 master), and
the param-group keys of the saved dict. CPU params here; GPU params (skipped
without a GPU) with both engines."""
import copy
import io

import pytest
import torch

import hipferry
from offload_adamw_helpers import (ENGINES, MIN_OFFLOAD, SideBySide, assert_close_to_torch, assert_params_moved,
                                   host_state_tensors, make_model, offload_adamw, snapshot, torch_adamw, train,
                                   twin)

TORCH_KEYS = {"step", "exp_avg", "exp_avg_sq"}


def torch_state_keys(amsgrad):
    """The state keys torch.optim.AdamW itself creates (asked, not assumed)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], amsgrad=amsgrad)
    p.grad = torch.ones(3)
    opt.step()
    return set(opt.state[p])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_has_torchs_keys_fp32_shaped_like_param(engine, dtype, amsgrad):
    device, step_on = engine
    model = make_model(device, dtype)
    opt = offload_adamw(model.parameters(), step_on, amsgrad=amsgrad)
    train(model, opt, 2)
    want_keys = torch_state_keys(amsgrad) | ({"master_param"} if dtype != torch.float32 else set())
    assert TORCH_KEYS <= want_keys
    for p in model.parameters():
        st = opt.state[p]
        assert set(st) == want_keys
        step = st["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32 and step.dim() == 0
        assert step.device.type == "cpu" and float(step) == 2.0
        for key in want_keys - {"step"}:
            t = st[key]
            assert t.dtype == torch.float32 and t.shape == p.shape, f"{key}: {t.dtype} {tuple(t.shape)}"
            if p.device.type == "cpu" or p.numel() >= MIN_OFFLOAD:
                assert t.device.type == "cpu", f"{key} of a {p.numel()}-element param is on the host"
            else:
                assert t.device == p.device, f"{key} of a small GPU param stays on the device"
            if t.device.type == "cpu" and p.device.type == "cuda":
                assert t.is_pinned(), f"{key} is in pinned memory"
        assert st["exp_avg"].abs().sum() > 0 and st["exp_avg_sq"].abs().sum() > 0
        if dtype != torch.float32:
            assert torch.equal(st["master_param"].to(p.device).to(dtype), p.detach())


@pytest.mark.parametrize("engine", ENGINES)
def test_host_state_is_counted_by_memory_stats_and_lives_in_the_pool(engine):
    device, step_on = engine
    pool = hipferry.PinnedPool(capacity="64MiB")
    in_use_before = pool.stats()["requested_bytes"]
    model = make_model(device, torch.bfloat16)
    opt = offload_adamw(model.parameters(), step_on, pool=pool, amsgrad=True)
    train(model, opt, 2)
    stats = opt.memory_stats()
    assert set(stats) == {"host_state_bytes", "device_state_bytes", "ring_bytes", "grad_buffer_bytes", "state_format",
                          "host_bytes_per_param"}
    assert stats["state_format"] == "float32"
    host = host_state_tensors(opt)
    assert host, "some state is on the host"
    host_bytes = sum(t.numel() * t.element_size() for t in host)
    assert stats["host_state_bytes"] > 0
    assert stats["host_state_bytes"] == host_bytes
    assert pool.stats()["requested_bytes"] - in_use_before >= host_bytes, "the host state is allocated from the pool"
    if device == "cpu":
        assert stats["device_state_bytes"] == 0
        # 4 tensors (master, exp_avg, exp_avg_sq, max_exp_avg_sq) of float32 per parameter element
        assert host_bytes == 4 * 4 * sum(p.numel() for p in model.parameters())
    else:
        small = sum(p.numel() for p in model.parameters() if p.numel() < MIN_OFFLOAD)
        assert stats["device_state_bytes"] == 4 * 4 * small
        assert all(t.is_pinned() for t in host)
    del opt


def test_default_pool_holds_the_state_when_none_is_given():
    pool = hipferry.default_pool()
    before = pool.stats()["requested_bytes"]
    model = make_model("cpu")
    opt = offload_adamw(model.parameters())
    train(model, opt, 1)
    host_bytes = sum(t.numel() * t.element_size() for t in host_state_tensors(opt))
    assert host_bytes == 2 * 4 * sum(p.numel() for p in model.parameters())
    assert pool.stats()["requested_bytes"] - before >= host_bytes
    assert opt.memory_stats()["host_state_bytes"] == host_bytes


@pytest.mark.parametrize("step_on", ["auto", "cpu"])
def test_cpu_params_use_the_cpu_engine_and_say_why(step_on):
    model = make_model("cpu")
    opt = offload_adamw(model.parameters(), step_on)
    assert opt.step_on == "cpu"
    assert isinstance(opt.step_on_reason, str) and opt.step_on_reason.strip()


@pytest.mark.parametrize("engine", [e for e in ENGINES if e.values[0][0] == "cuda"])
def test_gpu_params_use_the_engine_asked_for(engine):
    device, step_on = engine
    model = make_model(device)
    opt = offload_adamw(model.parameters(), step_on)
    assert opt.step_on == step_on
    assert isinstance(opt.step_on_reason, str) and opt.step_on_reason.strip()


# --- state_dict round trips ---------------------------------------------------------------------------------------


def loaded(opt, sd):
    """``opt.load_state_dict`` of a deep copy of ``sd``, as if it came from a file: torch's load_state_dict
    keeps the ``step`` tensors of the dict, so two optimizers loaded from one in-memory dict would share
    (and both increment) them."""
    opt.load_state_dict(copy.deepcopy(sd))
    return opt


def continue_side_by_side(model, opt, torch_model, torch_opt, first_step, steps=20):
    """Continue OffloadAdamW and torch.optim.AdamW in lockstep on the same gradients (see SideBySide),
    comparing the parameters after every step."""
    before = snapshot(model.parameters())
    SideBySide(model, opt, torch_model, torch_opt).run(steps, first_step=first_step, clip=1.0)
    assert_params_moved(before, model.parameters())
    assert_close_to_torch(model.parameters(), torch_model.parameters())


def continue_both(model_a, opt_a, model_b, opt_b, first_step, steps=20):
    """Continue two OffloadAdamWs independently (same engine, same state: the same trajectory)."""
    before = snapshot(model_a.parameters())
    train(model_a, opt_a, steps, first_step=first_step, clip=1.0)
    train(model_b, opt_b, steps, first_step=first_step, clip=1.0)
    assert_params_moved(before, model_a.parameters())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_offload_state_dict_loads_into_torch_adamw_and_continues_identically(engine, amsgrad):
    device, step_on = engine
    model = make_model(device)
    opt = offload_adamw(model.parameters(), step_on, amsgrad=amsgrad)
    train(model, opt, 15, clip=1.0)
    sd = opt.state_dict()
    params = list(model.parameters())
    for i, st in sd["state"].items():
        for k, v in st.items():
            want = "cpu" if k == "step" or params[i].numel() >= MIN_OFFLOAD else device
            assert v.device.type == want, f"saving never copies state to the device: {k} of param {i} on {v.device}"
    torch_model = twin(model)
    torch_opt = torch_adamw(torch_model.parameters(), amsgrad=amsgrad)
    loaded(torch_opt, sd)
    assert int(torch_opt.state[torch_model.fc1.weight]["step"]) == 15
    if amsgrad:
        assert torch.equal(torch_opt.state[torch_model.fc1.weight]["max_exp_avg_sq"].cpu(),
                           opt.state[model.fc1.weight]["max_exp_avg_sq"].cpu())
    continue_side_by_side(model, opt, torch_model, torch_opt, 15)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_adamw_state_dict_loads_into_offload_adamw_and_continues_identically(engine, amsgrad):
    device, step_on = engine
    torch_model = make_model(device)
    torch_opt = torch_adamw(torch_model.parameters(), amsgrad=amsgrad)
    train(torch_model, torch_opt, 15, clip=1.0)
    model = twin(torch_model)
    opt = offload_adamw(model.parameters(), step_on, amsgrad=amsgrad)
    loaded(opt, torch_opt.state_dict())
    for p, q in zip(model.parameters(), torch_model.parameters()):
        for k, v in torch_opt.state[q].items():
            assert torch.equal(opt.state[p][k].cpu(), v.cpu()), f"state {k!r} loaded as is"
    assert opt.step_on in ("cpu", "gpu")
    continue_side_by_side(model, opt, torch_model, torch_opt, 15)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("through_file", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_offload_state_dict_into_fresh_offload_adamw_continues_bit_identically(engine, through_file, amsgrad,
                                                                                 tmp_path):
    device, step_on = engine
    model = make_model(device)
    opt = offload_adamw(model.parameters(), step_on, amsgrad=amsgrad, lr=5e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    train(model, opt, 12, sched=sched, clip=1.0)
    sd = opt.state_dict()
    if through_file:
        path = tmp_path / "opt.pt"
        torch.save(sd, path)
        sd = torch.load(path, weights_only=True)
    fresh_model = make_model(device, seed=3)
    fresh_model.load_state_dict(model.state_dict())
    fresh = offload_adamw(fresh_model.parameters(), step_on, amsgrad=amsgrad)  # default lr/wd: the dict sets them
    loaded(fresh, sd)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3 * 0.5**2
    assert fresh.param_groups[0]["weight_decay"] == 0.1
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert set(opt.state[p]) == set(fresh.state[q])
        for k in opt.state[p]:
            assert torch.equal(opt.state[p][k].cpu(), fresh.state[q][k].cpu()), k
    continue_both(model, opt, fresh_model, fresh, 12)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q), "the same engine on the same state is bit-identical"


@pytest.mark.parametrize("engine", ENGINES)
def test_state_dict_param_groups_carry_all_of_torch_adamws_keys(engine):
    device, step_on = engine
    model = make_model(device)
    ref_model = twin(model)
    groups = lambda m: [dict(params=[m.fc1.weight]), dict(params=[m.fc1.bias, m.fc2.weight], lr=1e-4)]  # noqa
    opt = offload_adamw(groups(model), step_on)
    ref = torch_adamw(groups(ref_model))
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert len(sd["param_groups"]) == len(ref_sd["param_groups"]) == 2
    for g, rg in zip(sd["param_groups"], ref_sd["param_groups"]):
        assert set(rg) <= set(g), f"missing keys: {set(rg) - set(g)}"
        assert g["params"] == rg["params"]
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert g[key] == rg[key], key
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert [set(g) for g in loaded["param_groups"]] == [set(g) for g in sd["param_groups"]]


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_master_round_trips_exactly_between_offload_adamws(engine, tmp_path):
    device, step_on = engine
    model = make_model(device, torch.bfloat16)
    opt = offload_adamw(model.parameters(), step_on)
    train(model, opt, 10)
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        assert sd["state"][i]["master_param"].dtype == torch.float32
        assert sd["state"][i]["master_param"].device.type == "cpu" or p.numel() < MIN_OFFLOAD
    masters = [opt.state[p]["master_param"].clone() for p in model.parameters()]
    assert any(not torch.equal(m.to(p.device).to(torch.bfloat16).float(), m.to(p.device))
               for m, p in zip(masters, model.parameters())), "the masters carry more than the bf16 params do"
    torch.save(sd, tmp_path / "bf16.pt")
    fresh_model = make_model(device, torch.bfloat16, seed=5)
    fresh_model.load_state_dict(model.state_dict())
    fresh = offload_adamw(fresh_model.parameters(), step_on)
    fresh.load_state_dict(torch.load(tmp_path / "bf16.pt", weights_only=True))
    for m, q in zip(masters, fresh_model.parameters()):
        assert torch.equal(fresh.state[q]["master_param"].cpu(), m.cpu()), "the master is kept, not re-read"
    continue_both(model, opt, fresh_model, fresh, 10)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"].cpu(), fresh.state[q]["master_param"].cpu())


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_state_dict_without_master_takes_the_master_from_the_param(engine):
    device, step_on = engine
    model = make_model(device, torch.bfloat16)
    opt = offload_adamw(model.parameters(), step_on)
    train(model, opt, 4)
    sd = opt.state_dict()
    for st in sd["state"].values():
        del st["master_param"]
    fresh = offload_adamw(model.parameters(), step_on)
    loaded(fresh, sd)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["master_param"].cpu(), p.detach().float().cpu())
        assert torch.equal(fresh.state[p]["exp_avg"].cpu(), opt.state[p]["exp_avg"].cpu())


@pytest.mark.parametrize("engine", ENGINES)
def test_state_dict_of_offload_adamw_is_loadable_before_any_step(engine):
    device, step_on = engine
    model = make_model(device)
    opt = offload_adamw(model.parameters(), step_on)
    ref_model = twin(model)
    ref = torch_adamw(ref_model.parameters())
    loaded(ref, opt.state_dict())
    continue_side_by_side(model, opt, ref_model, ref, 0, steps=5)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("saved_amsgrad,own_amsgrad", [(False, True), (True, False)])
def test_load_state_dict_that_switches_amsgrad_leaves_torchs_keys(engine, saved_amsgrad, own_amsgrad):
    """The loaded dict's amsgrad wins (as in torch.optim.AdamW), and the state then has exactly the keys
    torch.optim.AdamW has with that amsgrad."""
    device, step_on = engine
    model = make_model(device)
    saver = offload_adamw(model.parameters(), step_on, amsgrad=saved_amsgrad)
    train(model, saver, 3)
    sd = saver.state_dict()
    opt = loaded(offload_adamw(model.parameters(), step_on, amsgrad=own_amsgrad), sd)
    ref = loaded(torch_adamw(twin(model).parameters(), amsgrad=own_amsgrad), sd)
    assert opt.param_groups[0]["amsgrad"] == ref.param_groups[0]["amsgrad"] == saved_amsgrad
    ref_keys = set(next(iter(ref.state.values())))
    assert ref_keys == torch_state_keys(saved_amsgrad)
    for p in model.parameters():
        assert set(opt.state[p]) == ref_keys
        for k in ref_keys:
            assert torch.equal(opt.state[p][k].cpu(), saver.state[p][k].cpu()), k
