"""hipferry.optim.OffloadAdamW: bad input gives a clear error (type and message naming the
argument) and changes nothing: not the parameters, not the optimizer's state, step counts
or hyperparameters, not the pool (no pool memory left behind, the pool still serves).
Covers the constructor, a pool too small for the state, step() with a gradient it cannot
use, load_state_dict() with a state dict that does not match, and add_param_group().
After each rejection training goes on and equals torch.optim.AdamW that never saw it.
GPU variants are skipped without a GPU."""
import copy
import gc
import re

import pytest
import torch

import hipferry
from hipferry.optim import OffloadAdamW
from conftest import requires_gpu

MiB = 2**20
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def make_model(device="cpu", seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(device)


def two_groups(model):
    """weights (decayed) and biases (not): indices 0-2 and 3-5 in a state dict."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def reference_for(params, **hyper):
    """torch.optim.AdamW on clones of `params` (same groups), to follow the same gradients."""
    clones = {p: p.detach().clone().requires_grad_(True) for p in params}
    return torch.optim.AdamW([clones[p] for p in params], **hyper), clones


def pool_usage(pool):
    gc.collect()
    s = pool.stats()
    return s["requested_bytes"], s["live_blocks"]


def snapshot(opt):
    """Everything an optimizer holds: per group its hyperparameters and parameter identities,
    per parameter a copy of its state (tensors cloned, so later changes show)."""
    groups, state = [], []
    for g in opt.param_groups:
        groups.append(({k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]]))
        for p in g["params"]:
            state.append({k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                          for k, v in opt.state.get(p, {}).items()})
    return groups, state


def assert_same_snapshot(before, after):
    (groups_b, state_b), (groups_a, state_a) = before, after
    assert groups_a == groups_b, "param_groups changed"
    assert len(state_a) == len(state_b)
    for i, (a, b) in enumerate(zip(state_a, state_b)):
        assert sorted(a) == sorted(b), f"state of parameter {i}: keys {sorted(b)} -> {sorted(a)}"
        for k in b:
            if torch.is_tensor(b[k]):
                assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and a[k].device == b[k].device
                assert torch.equal(a[k], b[k]), f"state[{i}][{k!r}] changed"
            else:
                assert a[k] == b[k], f"state[{i}][{k!r}] changed"


def dense(t):
    return None if t is None else (t.to_dense() if t.is_sparse else t).detach().clone()


def check_rejected(call, exc, patterns, params, pool, opt=None, strict_pool=True):
    """call() raises exc whose message matches every pattern; afterwards the parameters, their
    gradients, the optimizer (if any) and the pool's memory in use are as before, and the pool serves."""
    params = [p for p in params if p.device.type != "meta"]
    values = [p.detach().clone() for p in params]
    grads = [dense(p.grad) for p in params]
    state = snapshot(opt) if opt is not None else None
    usage = pool_usage(pool)
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    del info  # its traceback holds the frames of the failed call (and whatever they allocated)
    for pattern in patterns:
        assert re.search(pattern, message, re.S), f"{message!r} should match {pattern!r}"
    for i, (p, v, g) in enumerate(zip(params, values, grads)):
        assert torch.equal(p.detach(), v), f"parameter {i} was modified"
        assert (g is None) == (p.grad is None) and (g is None or torch.equal(dense(p.grad), g)), \
            f"gradient of parameter {i} was modified"
    if opt is not None:
        assert_same_snapshot(state, snapshot(opt))
    now = pool_usage(pool)
    if strict_pool:
        assert now == usage, f"pool (requested bytes, live blocks) {usage} -> {now}: memory left behind"
    else:  # GPU: gradient copies started during backward may be dropped, never more held
        assert now[0] <= usage[0] and now[1] <= usage[1], f"pool usage grew {usage} -> {now}"
    pool.check_invariants()
    probe = pool.empty(1000)
    assert pool.stats()["live_blocks"] == now[1] + 1 and probe.fill_(2).sum() == 2000
    del probe
    return message


def grads_for(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


def step_both(opt, ref, clones, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
        clones[p].grad = g.clone()
    opt.step()
    ref.step()


def assert_match_reference(params, clones, what="parameters"):
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach().cpu(), clones[p].detach().cpu(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {i}: {m}")


# --- constructor ----------------------------------------------------------------------

def bad_dtype_case(dtype, names):
    # the bad one is index 2 of group 1: the message names both
    return (lambda m: [{"params": [m[0].weight]}, {"params": [m[0].bias, m[2].weight, torch.zeros(3, dtype=dtype)]}],
            {}, ValueError, [names, r"\b1\b", r"\b2\b"])


def all_params(m):
    return list(m.parameters())


CONSTRUCTOR_CASES = {
    "empty_params": (lambda m: [], {}, ValueError, [r"(?i)empty.*param|param.*empty"]),
    "int64_param": bad_dtype_case(torch.int64, r"int64|Long"),
    "int32_param": bad_dtype_case(torch.int32, r"int32|\bInt\b"),
    "bool_param": bad_dtype_case(torch.bool, r"bool"),
    "meta_device_param": (lambda m: all_params(m) + [torch.nn.Parameter(torch.empty(4, device="meta"))], {},
                          ValueError, [r"meta", r"(?i)cpu|gpu|device", r"\b6\b"]),
    "negative_lr": (all_params, {"lr": -1e-3}, ValueError, [r"\blr\b", r"-0\.001"]),
    "beta1_is_one": (all_params, {"betas": (1.0, 0.999)}, ValueError, [r"(?i)beta", r"1\.0"]),
    "beta2_is_one": (all_params, {"betas": (0.9, 1.0)}, ValueError, [r"(?i)beta", r"1\.0"]),
    "negative_beta1": (all_params, {"betas": (-0.1, 0.999)}, ValueError, [r"(?i)beta", r"-0\.1"]),
    "negative_eps": (all_params, {"eps": -1e-8}, ValueError, [r"\beps\b"]),
    "negative_weight_decay": (all_params, {"weight_decay": -0.1}, ValueError, [r"weight_decay"]),
    "step_on_tpu": (all_params, {"step_on": "tpu"}, ValueError, [r"step_on", r"tpu"]),
    "step_on_gpu_with_cpu_params": (all_params, {"step_on": "gpu"}, ValueError, [r"step_on|GPU|gpu", r"(?i)gpu"]),
    "pool_is_a_string": (all_params, {"pool": "x"}, TypeError, [r"pool", r"PinnedPool|str"]),
    "pool_is_a_tensor": (all_params, {"pool": torch.zeros(3)}, TypeError, [r"pool"]),
    "negative_min_offload_numel": (all_params, {"min_offload_numel": -1}, ValueError, [r"min_offload_numel", r"-1"]),
    "zero_chunk_numel": (all_params, {"chunk_numel": 0}, ValueError, [r"chunk_numel", r"\b0\b"]),
    "one_ring_slot": (all_params, {"ring_slots": 1}, ValueError, [r"ring_slots", r"\b1\b"]),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR_CASES))
def test_constructor_rejects_bad_argument_and_changes_nothing(case, pool):
    build, kwargs, exc, patterns = CONSTRUCTOR_CASES[case]
    model = make_model()
    params = build(model)
    kwargs = {"pool": pool, **kwargs}
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    check_rejected(lambda: OffloadAdamW(params, **kwargs), exc, patterns, flat + list(model.parameters()), pool)


def test_constructor_accepts_boundary_values_and_steps_like_torch(pool):
    """The other side of the checks above: lr = eps = weight_decay = 0-ish boundaries, betas = 0,
    min_offload_numel = 0, chunk_numel = 1, ring_slots = 2 are all valid."""
    params = list(make_model().parameters())
    hyper = dict(lr=1e-2, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    used = pool_usage(pool)[0]
    opt = OffloadAdamW(params, **hyper, min_offload_numel=0, chunk_numel=1, ring_slots=2, pool=pool)
    ref, clones = reference_for(params, **hyper)
    for seed in range(3):
        step_both(opt, ref, clones, params, grads_for(params, seed))
    assert_match_reference(params, clones)
    numel = sum(p.numel() for p in params)
    assert pool_usage(pool)[0] - used >= 2 * 4 * numel, "exp_avg and exp_avg_sq live in the given pool"
    assert opt.step_on == "cpu" and isinstance(opt.step_on_reason, str) and opt.step_on_reason


# --- a pool too small for the state ---------------------------------------------------

def integers_in(message):
    return [int(s.replace(",", "").replace("_", "")) for s in re.findall(r"\d[\d,_]*\d|\d", message)]


@pytest.mark.parametrize("layout", ["one_big_param", "later_param_does_not_fit", "pool_partly_in_use"])
def test_pool_too_small_for_the_state_raises_at_construction(layout):
    quarter_mib = MiB // 4  # float32 elements in 1 MiB
    if layout == "one_big_param":
        capacity, shapes, keep_bytes = 1 * MiB, [(quarter_mib,)], 0  # state: 2 MiB
    elif layout == "later_param_does_not_fit":
        capacity, shapes, keep_bytes = 5 * MiB, [(quarter_mib,), (512, 512), (quarter_mib,)], 0  # 6 MiB
    else:
        capacity, shapes, keep_bytes = 4 * MiB, [(quarter_mib,)], 3 * MiB  # 2 MiB state + 3 MiB in use
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    state_bytes = 2 * 4 * sum(p.numel() for p in params)
    with hipferry.PinnedPool(capacity=capacity) as small:
        keep = small.empty(keep_bytes, dtype=torch.uint8).fill_(7) if keep_bytes else None
        message = check_rejected(lambda: OffloadAdamW(params, pool=small), torch.OutOfMemoryError,
                                 [r"(?i)capacity", r"(?i)bytes"], params, small)
        numbers = integers_in(message)
        assert capacity in numbers, f"the capacity ({capacity}) should be in {message!r}"
        assert any(state_bytes <= n < capacity + state_bytes + keep_bytes + MiB for n in numbers
                   if n != capacity), f"the bytes needed (>= {state_bytes}) should be in {message!r}"
        shortfall = state_bytes - (capacity - keep_bytes)
        assert f"short by {shortfall / MiB:.2f} MiB ({shortfall} bytes)" in message, message
        if keep is not None:
            assert int(keep.sum()) == 7 * keep_bytes, "memory in use in the pool was touched"
        small_model = [torch.nn.Parameter(torch.randn(1000))]  # what fits still works in the small pool
        OffloadAdamW(small_model, pool=small)
    with hipferry.PinnedPool(capacity=64 * MiB) as big:  # and a big enough pool works for the same params
        opt = OffloadAdamW(params, pool=big, **HYPER)
        ref, clones = reference_for(params, **HYPER)
        step_both(opt, ref, clones, params, grads_for(params, 0))
        assert_match_reference(params, clones)
        assert big.stats()["requested_bytes"] >= state_bytes
        del opt
    # last, as it is optional: if the message says how much of the pool is in use, it is right
    in_use = re.search(r"(\d+) bytes\)? in use", message)
    assert in_use is None or int(in_use.group(1)) >= keep_bytes, (
        f"{keep_bytes} bytes of the pool were in use; the message says otherwise: {message!r}")


def test_pool_too_small_for_a_new_param_group():
    with hipferry.PinnedPool(capacity=MiB) as small:
        params = [torch.nn.Parameter(torch.randn(1000))]
        opt = OffloadAdamW(params, pool=small, **HYPER)
        ref, clones = reference_for(params, **HYPER)
        step_both(opt, ref, clones, params, grads_for(params, 1))
        fits, too_big = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(MiB // 4))
        group = {"params": [fits, too_big]}
        message = check_rejected(lambda: opt.add_param_group(group), torch.OutOfMemoryError, [r"(?i)capacity"],  # noqa: F821 (a name deleted further down; the lambda runs before that)
                                 params + [fits, too_big], small, opt)
        assert str(MiB) in message
        assert len(opt.param_groups) == 1 and fits not in opt.state and too_big not in opt.state
        step_both(opt, ref, clones, params, grads_for(params, 2))
        assert_match_reference(params, clones)
        del opt


@requires_gpu
def test_gpu_pool_too_small_for_offloaded_gpu_state():
    params = [torch.nn.Parameter(torch.randn(MiB // 4, device="cuda"))]
    before = params[0].detach().clone()
    with hipferry.PinnedPool(capacity=MiB) as small:
        with pytest.raises(torch.OutOfMemoryError, match=r"(?i)capacity"):
            OffloadAdamW(params, pool=small, min_offload_numel=0)
        gc.collect()
        assert small.stats()["requested_bytes"] == 0
    assert torch.equal(params[0].detach(), before)


# --- at step() ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_sparse_gradient_rejected_at_step_before_any_parameter_changes(device, pool):
    torch.manual_seed(0)
    first, emb, last = torch.nn.Linear(6, 5), torch.nn.Embedding(10, 5, sparse=True), torch.nn.Linear(5, 3)
    for m in (first, emb, last):
        m.to(device)
    params = [*first.parameters(), emb.weight, *last.parameters()]  # the sparse one in the middle
    opt = OffloadAdamW(params, pool=pool, min_offload_numel=0, **HYPER)
    ref, clones = reference_for(params, **HYPER)
    step_both(opt, ref, clones, params, grads_for(params, 1))  # a normal first step: state is not zero

    opt.zero_grad(set_to_none=True)
    x, idx = torch.randn(4, 6, device=device), torch.tensor([1, 3, 3, 7], device=device)
    last(torch.tanh(first(x) + emb(idx))).square().sum().backward()
    assert emb.weight.grad.is_sparse and first.weight.grad is not None and last.weight.grad is not None
    check_rejected(opt.step, ValueError, [r"(?i)sparse"], params, pool, opt, strict_pool=device == "cpu")

    # training goes on with a dense gradient, as if the rejected step never happened
    grads = [dense(p.grad) for p in params]
    step_both(opt, ref, clones, params, grads)
    assert_match_reference(params, clones)
    assert all(int(opt.state[p]["step"]) == 2 for p in params)


# the gradient put in place of parameter 1's (shape (4, 5)), and what the message must say
UNUSABLE_GRADIENTS = {
    "same_numel_transposed_shape": ((5, 4), torch.float32, [r"(?i)grad", r"(?i)shape|size"]),
    "other_numel": ((7,), torch.float32, [r"(?i)grad", r"(?i)shape|size"]),
    # not in the spec's list (shape/device), but rejected with a ValueError all the same, so
    # the rule "nothing is changed" holds for it too (torch.optim.AdamW fails on it as well)
    "float64_dtype": ((4, 5), torch.float64, [r"(?i)grad", r"float64|Double"]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(UNUSABLE_GRADIENTS))
def test_unusable_gradient_rejected_at_step_before_any_parameter_changes(device, case, pool):
    # torch refuses `p.grad = t` with another shape or dtype, but not a later change of the
    # gradient itself (`p.grad.data = ...`, an in-place resize_): that is what step() must catch.
    shape, dtype, patterns = UNUSABLE_GRADIENTS[case]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in [(3, 4), (4, 5), (6,)]]
    opt = OffloadAdamW(params, pool=pool, min_offload_numel=0, **HYPER)
    ref, clones = reference_for(params, **HYPER)
    step_both(opt, ref, clones, params, grads_for(params, 1))

    grads = grads_for(params, 2)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params[1].grad.data = torch.randn(shape, dtype=dtype, device=device)
    assert params[1].grad.shape == shape and params[1].grad.dtype == dtype
    check_rejected(opt.step, ValueError, patterns, params, pool, opt, strict_pool=device == "cpu")

    params[1].grad = grads[1].clone()
    step_both(opt, ref, clones, params, grads)
    assert_match_reference(params, clones)
    assert all(int(opt.state[p]["step"]) == 2 for p in params)


@requires_gpu
def test_gpu_gradient_on_the_wrong_device_rejected_at_step(pool):
    # As above: `p.grad = cpu_tensor` is refused by torch, `p.grad.data = cpu_tensor` is not.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in [(3, 4), (4, 5)]]
    opt = OffloadAdamW(params, pool=pool, min_offload_numel=0, **HYPER)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad.data = torch.randn(4, 5)
    assert params[1].grad.device.type == "cpu"
    check_rejected(opt.step, ValueError, [r"(?i)device"], params, pool, opt, strict_pool=False)


# --- load_state_dict -------------------------------------------------------------------

def drop_a_group(sd):
    sd["param_groups"] = sd["param_groups"][:1]
    for i in (3, 4, 5):
        sd["state"].pop(i, None)


def drop_a_param_from_a_group(sd):
    sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:-1]
    sd["state"].pop(5, None)


def misshape_the_last_exp_avg(sd):
    assert sd["state"][5]["exp_avg"].shape == (3,)
    sd["state"][5]["exp_avg"] = torch.zeros(2, 3)


LOAD_CASES = {
    "one_group_fewer": (drop_a_group, [r"(?i)group", r"\b2\b|\b1\b"]),
    "one_param_fewer_in_a_group": (drop_a_param_from_a_group, [r"(?i)group", r"(?i)param|size"]),
    # names the parameter's index (5) and both shapes
    "exp_avg_of_other_shape": (misshape_the_last_exp_avg, [r"\b5\b", r"exp_avg", r"2,\s*3", r"[\[(]3,?[\])]"]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_load_state_dict_that_does_not_match_changes_nothing(case, device, pool):
    corrupt, patterns = LOAD_CASES[case]
    model = make_model(device)
    params = [p for g in two_groups(model) for p in g["params"]]
    opt = OffloadAdamW(two_groups(model), pool=pool, min_offload_numel=0, **HYPER)
    ref = torch.optim.AdamW([{"params": [p.detach().clone().requires_grad_(True) for p in g["params"]],
                              **{k: v for k, v in g.items() if k != "params"}} for g in two_groups(model)], **HYPER)
    clones = dict(zip(params, [p for g in ref.param_groups for p in g["params"]]))
    step_both(opt, ref, clones, params, grads_for(params, 1))
    saved = copy.deepcopy(opt.state_dict())  # after step 1: loading any of it would show
    step_both(opt, ref, clones, params, grads_for(params, 2))

    bad = copy.deepcopy(saved)
    for g in bad["param_groups"]:
        g["lr"], g["eps"] = 123.0, 0.5  # a partly loaded group would show too
    corrupt(bad)
    check_rejected(lambda: opt.load_state_dict(bad), ValueError, patterns, params, pool, opt)
    assert [g["lr"] for g in opt.param_groups] == [HYPER["lr"]] * 2

    # training goes on as if the load had not been tried
    step_both(opt, ref, clones, params, grads_for(params, 3))
    assert_match_reference(params, clones)
    assert all(int(opt.state[p]["step"]) == 3 for p in params)


# --- add_param_group ------------------------------------------------------------------

ADD_GROUP_CASES = {
    "int8_param": (lambda m, new: [new, torch.zeros(4, dtype=torch.int8)], [r"int8|Char"]),
    "param_already_in_another_group": (lambda m, new: [new, m[2].weight],
                                       [r"(?i)more than one|already|another|twice|duplicate"]),
}


@pytest.mark.parametrize("case", list(ADD_GROUP_CASES))
def test_add_param_group_rejects_and_changes_nothing(case, pool):
    build, patterns = ADD_GROUP_CASES[case]
    model = make_model()
    params = list(model.parameters())
    opt = OffloadAdamW(params, pool=pool, **HYPER)
    ref, clones = reference_for(params, **HYPER)
    step_both(opt, ref, clones, params, grads_for(params, 1))
    new = torch.nn.Parameter(torch.randn(50))
    group = {"params": build(model, new), "lr": 0.5}
    check_rejected(lambda: opt.add_param_group(group), ValueError, patterns, params + [new], pool, opt)
    assert len(opt.param_groups) == 1 and new not in opt.state

    # a valid group is still accepted and stepped, the old ones go on as before
    used = pool_usage(pool)[0]
    opt.add_param_group({"params": [new], "lr": 0.5})
    new_before = new.detach().clone()
    new.grad = torch.ones_like(new)
    step_both(opt, ref, clones, params, grads_for(params, 2))
    assert_match_reference(params, clones)
    assert int(opt.state[new]["step"]) == 1 and not torch.equal(new.detach(), new_before)
    assert pool_usage(pool)[0] - used >= 2 * 4 * new.numel(), "the new group's state lives in the pool"
