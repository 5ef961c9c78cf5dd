"""The CPU engine's batched in-place step (issue 31): every parameter that steps
straight from its own memory goes through ONE C++ call
(hipferry.ops.adamw_step_many_), the rest (float64, committed speculations,
parameters whose strides differ from their state's) through their own path,
in order. Bit identity against the per-parameter path (both sides are
hipferry's), and adamw_step_many_'s checks: all items checked before any is
changed, on the fast path and through the dispatcher."""
import re

import pytest
import torch

import hipferry
from hipferry import _C, ops
from hipferry.optim import OffloadAdamW
from hipferry.torch_private import neg_view, tensor_version

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)


def mixed_params(seed: int) -> list:
    """Parameters of every kind the in-place engine meets: float32 contiguous and transposed
    (dense: state with its strides), bf16 / fp16 (float32 master), complex64, float64, a
    slice with gaps (not dense: a working copy), and a single element."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(12, 11, generator=g)
    return [torch.nn.Parameter(t) for t in (
        torch.randn(33, 17, generator=g),
        torch.randn(16, 24, generator=g).t(),
        torch.randn(300, generator=g).to(torch.bfloat16),
        torch.randn(7, 9, generator=g).to(torch.float16),
        torch.randn(5, 6, dtype=torch.complex64, generator=g),
        torch.randn(40, dtype=torch.float64, generator=g),
        base[:, ::2],
        torch.randn(1, generator=g),
        torch.randn(4, 50, generator=g),
    )]


def groups(params: list) -> list:
    """The parameters split over groups with amsgrad, maximize and weight_decay variants."""
    return [{"params": params[0:3], "weight_decay": 0.0},
            {"params": params[3:6], "amsgrad": True, "lr": 3e-3},
            {"params": params[6:], "maximize": True, "weight_decay": 0.2, "betas": (0.8, 0.99)}]


def set_grads(params: list, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = torch.view_as_real(a) if a.is_complex() else a, torch.view_as_real(b) if b.is_complex() else b
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), what


class CountedMany:
    """Counts _C._adamw_step_many_ calls and the elements each stepped."""

    def __init__(self, monkeypatch):
        self.calls = []
        inner = _C._adamw_step_many_

        def many(params, *rest):
            self.calls.append([p.numel() for p in params])
            return inner(params, *rest)
        monkeypatch.setattr(_C, "_adamw_step_many_", many)


def test_batched_step_is_bit_identical_to_the_per_parameter_path(monkeypatch):
    counted = CountedMany(monkeypatch)
    ps_batched, ps_single = mixed_params(0), mixed_params(0)
    opt_batched, opt_single = OffloadAdamW(groups(ps_batched)), OffloadAdamW(groups(ps_single))
    opt_single._in_place.batched = False
    assert opt_batched._in_place.batched
    for step in range(1, 6):
        if step == 3:  # strides that differ from the state's: this parameter takes its working-copy path
            for ps in (ps_batched, ps_single):
                ps[8].data = ps[8].data.t().contiguous().t()
        if step == 4:  # a write outside step() to a bf16 parameter: adopted as the master (adopt_out)
            for ps in (ps_batched, ps_single):
                ps[2].data[::7] = 0.25
        set_grads(ps_batched, step)
        set_grads(ps_single, step)
        ps_batched[0].grad = ps_batched[0].grad.t().contiguous().t()  # a gradient with strides of its own
        calls_before = len(counted.calls)
        opt_batched.step()
        opt_single.step()
        assert len(counted.calls) == calls_before + 2  # float64 and the slice end the first run
        for i, (a, b) in enumerate(zip(ps_batched, ps_single)):
            assert_bits_equal(a.detach(), b.detach(), f"step {step}: params[{i}]")
            for key, t in opt_single.state[b].items():
                assert_bits_equal(opt_batched.state[a][key], t, f"step {step}: state of params[{i}][{key!r}]")
    batched = {n for call in counted.calls for n in call}
    assert 40 not in batched  # float64: torch ops, per parameter
    assert ps_batched[6].numel() not in batched  # the slice with gaps (72 elements): its working copy
    assert counted.calls[0] == [p.numel() * (2 if p.is_complex() else 1) for p in ps_batched[:5]]
    assert counted.calls[1] == [ps_batched[7].numel(), ps_batched[8].numel()]
    assert counted.calls[-1] == [ps_batched[7].numel()]  # ps[8]'s strides now differ from its state's
    assert all(tensor_version(p) == tensor_version(q) for p, q in zip(ps_batched, ps_single))


def test_a_trace_shows_each_parameter_of_a_batch(monkeypatch):
    counted = CountedMany(monkeypatch)
    ps = mixed_params(1)[:3]
    opt = OffloadAdamW(ps)
    set_grads(ps, 1)
    with hipferry.trace() as tr:
        opt.step()
    steps = [e for e in tr.events if e["track"] == "OffloadAdamW step"]
    assert len(steps) == 3 and counted.calls == []
    opt.step()
    assert len(counted.calls) == 1


def many_args(n_items: int = 3, n: int = 29) -> tuple:
    g = torch.Generator().manual_seed(n)
    items = [[torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
              torch.rand(n, generator=g) * 1e-3] for _ in range(n_items)]
    params, grads, ms, vs = (list(x) for x in zip(*items))
    outs = [None, torch.empty(n, dtype=torch.bfloat16), None][:n_items] + [None] * max(0, n_items - 3)
    mxs = [None, None, vs[2] * 2][:n_items] + [None] * max(0, n_items - 3)
    hypers = [HYPER, dict(HYPER, maximize=True), dict(HYPER, amsgrad=True, weight_decay=0.0)][:n_items]
    hypers += [HYPER] * max(0, n_items - 3)
    return params, grads, ms, vs, mxs, outs, [3] * n_items, hypers, [False] * n_items


def clone_args(args: tuple) -> tuple:
    return tuple([t.clone() if isinstance(t, torch.Tensor) else t for t in lst] for lst in args)


def call_many(args, path: str, monkeypatch) -> None:
    """ops.adamw_step_many_ on its fast path, or as under tracing and dispatch modes (the op per item)."""
    if path == "dispatcher":
        monkeypatch.setattr(ops, "_fast_path", lambda: False)
    try:
        ops.adamw_step_many_(*args)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("path", ["fast path", "dispatcher"])
def test_adamw_step_many_is_adamw_step_per_item(path, monkeypatch):
    args = many_args()
    expected = clone_args(args)
    for i in range(3):
        ops.adamw_step_(*(lst[i] for lst in expected[:7]), **expected[7][i], adopt_out=expected[8][i])
    call_many(args, path, monkeypatch)
    for lst, ref in zip(args[:6], expected[:6]):
        for t, r in zip(lst, ref):
            if t is not None:
                assert_bits_equal(t, r, path)


BAD = {
    "grad with fewer elements": (lambda a: a[1].__setitem__(2, torch.zeros(5)),
                                 ValueError, "item 2: grad has 5 elements but param has 29"),
    "float64 exp_avg": (lambda a: a[2].__setitem__(2, a[2][2].double()), ValueError, "item 2: exp_avg has dtype"),
    "amsgrad without max_exp_avg_sq": (lambda a: a[4].__setitem__(2, None), ValueError,
                                       "item 2: amsgrad=True needs max_exp_avg_sq"),
    "step 0": (lambda a: a[6].__setitem__(2, 0), ValueError, "item 2: step must be >= 1"),
    "adopt_out without param_out": (lambda a: a[8].__setitem__(2, True), ValueError,
                                    "item 2: adopt_out=True needs param_out"),
    "negative bit": (lambda a: a[3].__setitem__(2, neg_view(a[3][2])), ValueError,
                     "exp_avg_sqs[2] has torch's negative bit set"),
    "one step too few": (lambda a: a[6].pop(), ValueError, "steps has 2 entries but params has 3"),
}


@pytest.mark.parametrize("path", ["fast path", "dispatcher"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_adamw_step_many_checks_every_item_before_changing_any(case, path, monkeypatch):
    args = [list(lst) for lst in many_args()]
    spoil, kind, words = BAD[case]
    spoil(args)
    before = clone_args(tuple(args))
    with pytest.raises(kind, match=re.escape(words)):
        call_many(args, path, monkeypatch)
    for lst, ref in zip(args[:6], before[:6]):  # items 0 and 1 are fine, and unchanged too
        for t, r in zip(lst, ref):
            if isinstance(t, torch.Tensor):
                assert_bits_equal(t.resolve_neg(), r.resolve_neg(), case)


@pytest.mark.parametrize("bad, words", [
    (lambda a: a.__setitem__(7, [HYPER, {"lr": 1e-3}, HYPER]), "hypers\\[1\\] has no 'beta1'"),
    (lambda a: a.__setitem__(7, [HYPER, dict(HYPER, amsgrad=1), HYPER]), "hypers\\[1\\]\\['amsgrad'\\] is a int"),
    (lambda a: a.__setitem__(6, (3, 3, 3)), "steps is a tuple; expected a list"),
])
def test_adamw_step_many_fast_path_names_a_bad_list_entry(bad, words):
    args = [list(lst) for lst in many_args()]
    bad(args)
    with pytest.raises((TypeError, ValueError), match=words):
        _C._adamw_step_many_(*args)
