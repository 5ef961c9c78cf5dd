"""hipferry.optim.OffloadAdamW trained side by side with torch.optim.AdamW on a
tiny model (tensors below and above min_offload_numel): 100 steps with an LR
scheduler, weight decay and gradient clipping (torch's clip_grad_norm_ and the
optimizer's own), amsgrad, maximize; bfloat16 params with a float32 master;
parameter groups and add_param_group; every common LR scheduler; zero_grad,
gradient accumulation, closures, params without gradients; skip_nonfinite and
GradScaler; parameters changed in place outside step(). CPU params use the CPU
engine; GPU params (skipped without a GPU) run both engines.

Both optimizers step on the same gradients (SideBySide copies the model's
gradients to the torch reference), and the parameters are compared after every
step within torch's own tolerances (never bit for bit: torch's CPU kernels
differ between CPU capabilities); bfloat16: within one bf16 ulp."""
import math

import pytest
import torch

from offload_adamw_helpers import (ALL_ENGINES, ENGINE_PER_DEVICE, ENGINES, HYPER, SideBySide, assert_close_to_torch,
                                   assert_params_moved, assert_same_state, backward, copy_grads, loss_of,
                                   make_model, offload_adamw, snapshot, state_snapshot, torch_adamw, train, twin)

STEPS = 100
CLIP = 0.8  # the model's gradient norms are 0.7 to 1.2: most steps are clipped, some not


def warmup_cosine(steps, warmup=10):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
    return factor


def onecycle(opt):  # also cycles betas[0] (momentum) in the param groups
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=STEPS)


def hundred_steps_case(engine, *, clip_with_optimizer=False, sched=onecycle, **kw):
    run = SideBySide.create(engine, sched=sched, **kw)
    before = snapshot(run.params)
    run.run(STEPS, clip=CLIP, clip_with_optimizer=clip_with_optimizer)
    assert run.lrs == run.ref_lrs
    assert len({lr[0] for lr in run.lrs}) > 50, "the scheduler moved the learning rate"
    assert_params_moved(before, run.params)
    assert_close_to_torch(run.params, run.ref_params)
    for p, q in zip(run.params, run.ref_params):
        assert int(run.opt.state[p]["step"]) == int(run.ref.state[q]["step"]) == STEPS
    return run


@pytest.mark.parametrize("engine", ALL_ENGINES)
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True)])
def test_hundred_steps_with_onecycle_and_clipping_match_torch_adamw(engine, amsgrad, maximize):
    hundred_steps_case(engine, amsgrad=amsgrad, maximize=maximize)


@pytest.mark.parametrize("engine", ENGINE_PER_DEVICE)
def test_hundred_steps_with_warmup_cosine_lambda_lr_match_torch_adamw(engine):
    hundred_steps_case(engine, sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(STEPS)))


@pytest.mark.parametrize("engine", ENGINES)
def test_own_clip_grad_norm_returns_torchs_total_norm_and_trajectory_matches(engine):
    run = hundred_steps_case(engine, clip_with_optimizer=True)
    assert len(run.norms) == len(run.ref_norms) == STEPS
    assert all(torch.is_tensor(n) and n.dim() == 0 for n in run.norms)
    got = torch.stack([n.float().cpu() for n in run.norms])
    want = torch.stack([n.float().cpu() for n in run.ref_norms])
    assert (want > CLIP).sum() >= 10, "clipping is active on some steps (else the test would not exercise it)"
    assert (want < CLIP).sum() >= 1, "and inactive on others"
    assert ((got - want).abs() <= 1e-6 * want).all(), f"total norms differ: {got[:5]} vs {want[:5]}"


@pytest.mark.parametrize("engine", ENGINES)
def test_own_clip_grad_norm_scales_grads_like_torch_on_identical_gradients(engine):
    device, step_on = engine
    model = make_model(device)
    opt = offload_adamw(model.parameters(), step_on)
    backward(model, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    refs = [torch.zeros_like(g) for g in grads]
    for r, g in zip(refs, grads):
        r.grad = g.clone()
    total = opt.clip_grad_norm_(0.25)
    want = torch.nn.utils.clip_grad_norm_(refs, 0.25)
    assert float(want) > 0.25
    assert float(total) == pytest.approx(float(want), rel=1e-6, abs=0)
    for p, r, g in zip(model.parameters(), refs, grads):
        assert (p.grad - r.grad).abs().max() <= 1e-6 * r.grad.abs().max()
        assert not torch.equal(p.grad, g), "the gradients were scaled in place"
    inf_norm = opt.clip_grad_norm_(1e9, norm_type=float("inf"))
    assert float(inf_norm) == max(float(p.grad.abs().max()) for p in model.parameters())


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_params_with_fp32_master_match_torch_adamw_on_fp32_copy_cast_to_bf16(engine):
    run = SideBySide.create(engine, dtype=torch.bfloat16)
    before = snapshot(run.params)
    run.run(STEPS // 2, before_step=lambda step: [assert_bf16_grad(p) for p in run.params])
    assert_params_moved(before, run.params)
    got = torch.cat([p.detach().cpu().reshape(-1) for p in run.params])
    want = torch.cat([r.detach().cpu().to(torch.bfloat16).reshape(-1) for r in run.ref_params])
    assert got.dtype == torch.bfloat16
    # torch's tolerance for bf16 AdamW (its OptimizerInfo's override), and at most one bf16 ulp: the
    # float32 masters agree within torch's float32 tolerance, so a rounding can fall either way.
    torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=5e-3)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all(), "at most one bf16 ulp"
    for p in run.params:
        master = run.opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and master.shape == p.shape
        assert torch.equal(master.to(p.device).to(torch.bfloat16), p.detach()), "p is the rounded master"
    assert_close_to_torch([run.opt.state[p]["master_param"] for p in run.params], run.ref_params, "masters")


def assert_bf16_grad(p):
    assert p.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("engine", ENGINES)
def test_param_groups_with_different_lr_and_weight_decay_match_torch(engine):
    def groups(m):
        return [dict(params=[m.fc1.weight, m.fc2.weight], lr=2e-3, weight_decay=0.1),
                dict(params=[m.fc1.bias, m.fc2.bias], lr=5e-4, weight_decay=0.0),
                dict(params=list(m.norm.parameters()), lr=1e-3, weight_decay=0.3, betas=(0.8, 0.99))]
    run = SideBySide.create(engine, groups=groups)
    opt = run.opt
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 5e-4, 1e-3]
    assert opt.param_groups[2]["betas"] == (0.8, 0.99) and opt.param_groups[0]["betas"] == HYPER["betas"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.3]
    before = snapshot(run.params)
    run.run(30)
    assert_params_moved(before, run.params)


@pytest.mark.parametrize("engine", ENGINES)
def test_add_param_group_mid_training_matches_torch(engine):
    run = SideBySide.create(engine, groups=lambda m: list(m.fc1.parameters()) + list(m.norm.parameters()))
    model, ref_model = run.model, run.ref_model
    fc2_before = snapshot(model.fc2.parameters())
    run.run(10)
    for a, b in zip(model.fc2.parameters(), fc2_before):
        assert torch.equal(a, b), "fc2 is not in the optimizer yet"
    run.opt.add_param_group(dict(params=list(model.fc2.parameters()), lr=3e-3, weight_decay=0.2))
    run.ref.add_param_group(dict(params=list(ref_model.fc2.parameters()), lr=3e-3, weight_decay=0.2))
    assert len(run.opt.param_groups) == 2
    assert run.opt.param_groups[1]["lr"] == 3e-3 and run.opt.param_groups[1]["eps"] == HYPER["eps"]
    run.run(15, first_step=10)
    assert_params_moved(fc2_before, model.fc2.parameters())
    assert int(run.opt.state[model.fc2.weight]["step"]) == 15
    assert int(run.opt.state[model.fc1.weight]["step"]) == 25


def two_groups(m):
    return [dict(params=[m.fc1.weight, m.fc2.weight]),
            dict(params=[m.fc1.bias, m.fc2.bias, *m.norm.parameters()], lr=3e-4)]


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5, 7], gamma=0.3),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8, eta_min=1e-4),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2e-3, 5e-4], total_steps=12),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1 / (1 + s)]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=6),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7)], milestones=[3]),
}


@pytest.mark.parametrize("engine", ENGINE_PER_DEVICE)
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_scheduler_drives_offload_adamw_like_torch_adamw(engine, name):
    run = SideBySide.create(engine, groups=two_groups, sched=SCHEDULERS[name])
    metric = 1.0 if name == "ReduceLROnPlateau" else None  # a metric that never improves: lr drops each step
    run.run(10, plateau_metric=metric)
    assert run.lrs == run.ref_lrs
    assert len({tuple(lr) for lr in run.lrs}) > 2, "the schedule changes the learning rate"
    assert [g["lr"] for g in run.opt.param_groups] == [g["lr"] for g in run.ref.param_groups]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_and_gradient_accumulation_match_torch(engine, set_to_none):
    run = SideBySide.create(engine)
    backward(run.model, 0)
    run.opt.zero_grad(set_to_none=set_to_none)
    for p in run.params:
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()
    before = snapshot(run.params)
    run.run(20, accumulate=2, set_to_none=set_to_none)
    assert_params_moved(before, run.params)


@pytest.mark.parametrize("engine", ENGINES)
def test_accumulated_gradient_is_used_not_the_first_micro_batch(engine):
    """A step on a gradient accumulated from two micro-batches equals torch's step on it, and differs from a
    step on the first micro-batch alone (the CPU engine must copy a gradient changed after its copy started)."""
    device, step_on = engine
    model = make_model(device)
    ref_model, single_model = twin(model), twin(model)
    opt = offload_adamw(model.parameters(), step_on)
    ref, single = torch_adamw(ref_model.parameters()), torch_adamw(single_model.parameters())
    for m, o in ((model, opt), (ref_model, ref)):
        loss_of(m, 0, 0).backward()
        loss_of(m, 0, 1).backward()
        o.step()
    loss_of(single_model, 0, 0).backward()
    single.step()
    assert_close_to_torch(model.parameters(), ref_model.parameters())
    assert not torch.equal(model.fc1.weight.detach().cpu(), single_model.fc1.weight.detach().cpu())


@pytest.mark.parametrize("engine", ENGINES)
def test_closure_step_returns_the_loss_and_matches_torch(engine):
    run = SideBySide.create(engine)
    calls = []
    for step in range(15):
        def closure():
            run.opt.zero_grad()
            loss = loss_of(run.model, step)
            loss.backward()
            calls.append(step)
            return loss

        def ref_closure():
            run.ref.zero_grad()
            loss = loss_of(run.ref_model, step)
            loss.backward()
            copy_grads(run.params, run.ref_params)  # the same gradients as the model's (see SideBySide)
            return loss
        got = run.opt.step(closure)
        want = run.ref.step(ref_closure)
        assert torch.is_tensor(got) and got.requires_grad == want.requires_grad
        got, want = got.item(), want.item()
        assert got == pytest.approx(want, rel=1e-5)
        if step == 0:
            assert got == want, "the first loss is computed from identical params"
        assert_close_to_torch(run.params, run.ref_params, f"parameters after step {step}")
    assert calls == list(range(15))
    assert run.opt.step() is None, "without a closure step() returns None"


@pytest.mark.parametrize("engine", ENGINES)
def test_params_without_grad_are_skipped_like_torch(engine):
    run = SideBySide.create(engine)
    model, opt = run.model, run.opt
    run.run(3)
    frozen = [model.fc2.weight, model.norm.bias]
    frozen_before = snapshot(frozen)
    state_before = state_snapshot(opt)

    def drop_frozen_grads(step):
        for p in frozen:
            p.grad = None
    run.run(5, first_step=3, before_step=drop_frozen_grads)
    for a, b in zip(frozen, frozen_before):
        assert torch.equal(a, b), "a param with grad None is not changed (no weight decay either)"
    state_after = state_snapshot(opt)
    for i in [i for i, p in enumerate(run.params) if any(p is f for f in frozen)]:
        assert state_after[i].keys() == state_before[i].keys()
        for k, v in state_after[i].items():
            assert torch.equal(v.cpu(), state_before[i][k].cpu()), f"state {k!r} of a param with grad None changed"
    assert int(opt.state[model.fc2.weight]["step"]) == 3 and int(opt.state[model.fc1.weight]["step"]) == 8


@pytest.mark.parametrize("engine", ENGINES)
def test_param_that_never_had_a_grad_is_untouched(engine):
    run = SideBySide.create(engine)
    for m in (run.model, run.ref_model):
        m.fc2.requires_grad_(False)
    before = snapshot(run.model.fc2.parameters())
    run.run(5)
    for a, b in zip(run.model.fc2.parameters(), before):
        assert torch.equal(a, b)
        st = run.opt.state.get(a, {})
        assert "step" not in st or int(st["step"]) == 0
    assert int(run.opt.state[run.model.fc1.weight]["step"]) == 5


def poison(param, value):
    with torch.no_grad():
        param.grad.view(-1)[3] = value


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["fc1.weight", "fc2.bias"])  # above / below min_offload_numel
def test_skip_nonfinite_step_changes_nothing_and_next_step_is_torchs(engine, where):
    run = SideBySide.create(engine, offload_kw=dict(skip_nonfinite=True))
    model, opt = run.model, run.opt
    run.run(4)
    assert opt.skipped_steps == 0 and opt.last_step_skipped is False
    target = model.get_parameter(where)
    for n, bad in enumerate([float("inf"), float("nan"), float("-inf")], start=1):
        params_before, state_before = snapshot(model.parameters()), state_snapshot(opt)
        opt.zero_grad()
        backward(model, 100 + n)
        poison(target, bad)
        opt.step()
        assert opt.skipped_steps == n and opt.last_step_skipped is True
        for a, b in zip(model.parameters(), params_before):
            assert torch.equal(a, b), f"a step with a {bad} gradient changed a parameter"
        assert_same_state(state_snapshot(opt), state_before)
    run.run(6, first_step=4)  # torch never saw the skipped steps
    assert opt.skipped_steps == 3 and opt.last_step_skipped is False
    assert int(opt.state[target]["step"]) == 10


@pytest.mark.parametrize("engine", ENGINES)
def test_a_write_before_a_skipped_step_reaches_the_master(engine):
    """p.data = t on a bfloat16 parameter, then a step skipped for a non-finite gradient:
    the float32 master follows the write at once (found by the fuzzer with
    p.data = p.data.t(): the master kept the old values until the next step that ran)."""
    device, step_on = engine
    model = make_model(device, torch.bfloat16)
    opt = offload_adamw(model.parameters(), step_on, skip_nonfinite=True, min_offload_numel=0)
    train(model, opt, 1)
    w = model.fc1.weight
    w.data = w.data.flip(0)  # other values, same shape
    opt.zero_grad()
    backward(model, 1)
    poison(model.fc2.bias, float("inf"))
    opt.step()
    assert opt.last_step_skipped
    master = opt.state[w]["master_param"]
    assert torch.equal(master.to(w.dtype).cpu(), w.detach().cpu()), "the master missed the write"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_write_to_a_parameter_without_a_gradient_reaches_the_master(engine):
    """p.data = t on a bfloat16 parameter that then has no gradient: step() does not step it,
    and its float32 master follows the write all the same (found by the fuzzer with
    p.data = p.data.t() and the gradient set to None: the master kept the old layout)."""
    device, step_on = engine
    model = make_model(device, torch.bfloat16)
    opt = offload_adamw(model.parameters(), step_on, min_offload_numel=0)
    train(model, opt, 1)
    w = model.fc1.weight
    w.data = w.data.flip(0)  # other values, same shape
    opt.zero_grad()
    backward(model, 1)
    w.grad = None
    before = opt.state[w]["step"].clone()
    opt.step()
    assert torch.equal(opt.state[w]["step"], before), "a parameter without a gradient was stepped"
    master = opt.state[w]["master_param"]
    assert torch.equal(master.to(w.dtype).cpu(), w.detach().cpu()), "the master missed the write"


@pytest.mark.parametrize("engine", ENGINE_PER_DEVICE)
def test_without_skip_nonfinite_the_counters_stay_zero(engine):
    device, step_on = engine
    model = make_model(device)
    opt = offload_adamw(model.parameters(), step_on)
    before = snapshot(model.parameters())
    train(model, opt, 2)
    assert_params_moved(before, model.parameters())
    assert opt.skipped_steps == 0 and opt.last_step_skipped is False


def grad_scaler(device):
    try:
        return torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.amp.GradScaler({device!r}) is not available: {exc}")


@pytest.mark.parametrize("engine", ENGINES)
def test_grad_scaler_with_offload_adamw_matches_grad_scaler_with_torch_adamw(engine):
    run = SideBySide.create(engine)
    device = engine[0]
    scaler, ref_scaler = grad_scaler(device), grad_scaler(device)
    scales = []
    for step in range(12):
        run.opt.zero_grad()
        run.ref.zero_grad()
        scaler.scale(loss_of(run.model, step)).backward()
        ref_scaler.scale(loss_of(run.ref_model, step)).backward()
        if step == 5:  # an overflow: both scalers skip this step and halve the scale
            poison(run.model.fc1.weight, float("inf"))
        copy_grads(run.params, run.ref_params)  # the same (scaled) gradients, see SideBySide
        scaler.step(run.opt)
        ref_scaler.step(run.ref)
        scaler.update()
        ref_scaler.update()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
        assert_close_to_torch(run.params, run.ref_params, f"parameters after step {step}")
    assert all(a == b for a, b in scales)
    assert scales[5][0] < scales[4][0], "the overflow lowered the scale"
    assert scales[2][0] > 2.0**10, "the scale grew"
    assert int(run.opt.state[run.model.fc1.weight]["step"]) == 11
    assert int(run.ref.state[run.ref_model.fc1.weight]["step"]) == 11


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("how", ["load_state_dict", "add_"])
def test_param_changed_in_place_outside_step_is_picked_up(engine, how):
    run = SideBySide.create(engine)
    other = make_model(engine[0], seed=7).state_dict()
    run.run(5)
    for m in (run.model, run.ref_model):
        if how == "load_state_dict":
            m.load_state_dict(other)
        else:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1)
    changed = snapshot(run.params)
    run.run(5, first_step=5)
    for a, b in zip(run.params, changed):
        assert (a - b).abs().max() < 0.2, "the steps started from the changed value"


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_param_changed_in_place_resets_the_master(engine):
    run = SideBySide.create(engine, dtype=torch.bfloat16)
    run.run(3)
    with torch.no_grad():
        for p, r in zip(run.params, run.ref_params):
            p.add_(1)
            r.copy_(p.float())  # the master is re-read from the changed bf16 value
    run.run(1, first_step=3)
    for p, r in zip(run.params, run.ref_params):
        master = run.opt.state[p]["master_param"]
        assert (master.cpu() - r.detach().cpu()).abs().max() <= 1e-6 * r.detach().abs().max()
        assert torch.equal(master.to(p.device).to(torch.bfloat16), p.detach())
