"""The fused AdamW step (issue 5 groundwork: hipferry._C._adamw_step_) against
torch.optim.AdamW over 100 steps with a scheduler, weight decay, amsgrad and
maximize; mixed precision (bfloat16 params, float32 master); bad input. One
device-generic helper, run on the CPU and (skipped without one) on a GPU.

Oracles that hold on every machine (torch's own CPU kernels differ between
CPU capabilities, so nothing here is bit for bit against torch):
- against torch.optim.AdamW: torch's own tolerances (torch.testing.assert_close
  defaults, what test_optim uses between its for-loop, foreach and fused
  implementations);
- bit identity where hipferry owns both sides: the vectorized builds against
  the baseline build (HIPFERRY_CPU_ISA=baseline / avx2 / avx512, in subprocesses), the GPU
  kernel against the CPU loop (tests/cpp/adamw_kernel_test.cpp);
- the float64 model, a bound in ulps per step: tests/cpp/adamw_cpu_test.cpp."""
import functools
import os
import subprocess
import sys

import pytest
import torch

import hipferry
from hipferry import _C
from hipferry.ops import call_op
from hipferry.torch_private import neg_view
from conftest import requires_gpu

DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def run_both(device, amsgrad, maximize, steps=100, sizes=(1000, 37, 4096), lr=1e-2):
    torch.manual_seed(0)
    params = [torch.randn(n) for n in sizes]
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(ref, lr=lr, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], amsgrad=amsgrad, maximize=maximize)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    mine = [p.to(device) for p in params]
    m, v, vmax = ([torch.zeros_like(p) for p in mine] for _ in range(3))
    for step in range(1, steps + 1):
        grads = [torch.randn_like(p) for p in params]
        group_lr = opt.param_groups[0]["lr"]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        sched.step()
        for i, g in enumerate(grads):
            _C._adamw_step_(mine[i], g.to(device), m[i], v[i], vmax[i] if amsgrad else None, None, step, group_lr,
                            amsgrad=amsgrad, maximize=maximize, **HYPER)
    return [p.cpu() for p in mine], [r.detach() for r in ref], opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True), (True, True)])
def test_hundred_steps_match_torch_adamw(device, amsgrad, maximize):
    mine, ref, opt = run_both(device, amsgrad, maximize)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b)  # torch's float32 tolerances (rtol 1.3e-6, atol 1e-5)
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), "normwise: a few ulps of the largest element"
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert int(state["step"]) == 100


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_params_with_fp32_master_equal_torch_on_fp32_then_cast(device):
    torch.manual_seed(1)
    n = 5000
    master = torch.randn(n)
    ref = master.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-3)
    mine = master.to(device)
    low = master.to(device, torch.bfloat16)
    m, v = torch.zeros_like(mine), torch.zeros_like(mine)
    for step in range(1, 21):
        g = torch.randn(n).to(torch.bfloat16)  # the model's gradient is bfloat16 too
        ref.grad = g.float()
        opt.step()
        _C._adamw_step_(mine, g.to(device), m, v, None, low, step, 1e-3, 0.9, 0.999, 1e-8, 1e-2, False, False)
    want = ref.detach().to(torch.bfloat16)
    assert torch.equal(low.cpu(), mine.cpu().to(torch.bfloat16)), "param_out is the rounded master copy"
    assert ((low.cpu().float() - want.float()).abs() <= want.float().abs() * 2**-7).all(), "at most one bf16 ulp"


def through_the_dispatcher(**kwargs):
    """torch.ops.hipferry.adamw_step_ (what tracing records), its errors raised as hipferry raises them."""
    call_op(functools.partial(torch.ops.hipferry.adamw_step_.default, **kwargs))


# The three ways in: the pybind fast path, the public wrapper, the op (Note [adamw_step_ fast path]).
PATHS = {"_C._adamw_step_": _C._adamw_step_, "hipferry.ops.adamw_step_": hipferry.ops.adamw_step_,
         "torch.ops.hipferry.adamw_step_": through_the_dispatcher}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bad_input_is_rejected_and_nothing_changes(path):
    p, g, m, v = torch.ones(8), torch.ones(8), torch.zeros(8), torch.zeros(8)
    cases = [
        (dict(step=0), "step must be >= 1"),
        (dict(grad=torch.ones(7)), "grad has 7 elements but param has 8"),
        (dict(grad=torch.ones(8, dtype=torch.int32)), "grad has dtype"),
        (dict(exp_avg=torch.zeros(8, dtype=torch.float64)), "exp_avg has dtype"),
        (dict(amsgrad=True), "amsgrad=True needs max_exp_avg_sq"),
        (dict(param=torch.ones(4, 4).t()), "param must be a contiguous dense tensor"),
        (dict(param_in=torch.ones(8)), "exp_avg_in is missing"),
        (dict(param_in=torch.ones(8), exp_avg_in=torch.zeros(8), exp_avg_sq_in=torch.zeros(8),
              max_exp_avg_sq_in=torch.zeros(8)), "max_exp_avg_sq_in is given without amsgrad"),
        (dict(param_in=p, exp_avg_in=torch.zeros(8), exp_avg_sq_in=torch.zeros(8)),
         "param_in overlaps an array the step writes"),
        (dict(exp_avg=neg_view(m)), "exp_avg has torch's negative bit set"),
        (dict(grad=neg_view(g)), "grad has torch's negative bit set"),
        (dict(param=torch.ones(8, dtype=torch.complex64).conj()), "param has dtype torch.complex64"),
    ]
    for change, message in cases:
        args = dict(param=p, grad=g, exp_avg=m, exp_avg_sq=v, max_exp_avg_sq=None, param_out=None, step=1,
                    lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            PATHS[path](**args)
    assert torch.equal(p, torch.ones(8)) and torch.equal(m, torch.zeros(8)) and torch.equal(v, torch.zeros(8))


@pytest.mark.parametrize("amsgrad", [False, True])
def test_out_of_place_step_gives_the_in_place_bits_and_leaves_its_inputs(amsgrad):
    """param_in and the *_in state (the speculative step of overlap="backward")."""
    torch.manual_seed(0)
    n = 1000
    p, g = torch.randn(n), torch.randn(n)
    state = [torch.rand(n) * 1e-2 for _ in range(3)]  # m, v, max_v
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=False)
    inputs = [p.clone()] + [t.clone() for t in state]
    mine = [p.clone()] + [t.clone() for t in state]
    _C._adamw_step_(mine[0], g, mine[1], mine[2], mine[3] if amsgrad else None, None, 3, **hyper)
    outs = [torch.full((n,), float("nan")) for _ in range(4)]
    _C._adamw_step_(outs[0], g, outs[1], outs[2], outs[3] if amsgrad else None, None, 3, **hyper,
                    param_in=inputs[0], exp_avg_in=inputs[1], exp_avg_sq_in=inputs[2],
                    max_exp_avg_sq_in=inputs[3] if amsgrad else None)
    for k in range(4 if amsgrad else 3):
        assert torch.equal(outs[k], mine[k]), k
    assert torch.equal(inputs[0], p) and all(torch.equal(a, b) for a, b in zip(inputs[1:], state))


_TRAJECTORY = """
import sys, torch, hipferry
from hipferry import _C
torch.manual_seed(3)
n = 4099
p, p16 = torch.randn(n), torch.randn(n).bfloat16()
master = p16.float()
m, v, vmax, m2, v2 = (torch.zeros(n) for _ in range(5))
for step in range(1, 31):
    g, g16 = torch.randn(n), torch.randn(n).bfloat16()
    _C._adamw_step_(p, g, m, v, vmax, None, step, 1e-2, 0.9, 0.999, 1e-8, 0.05, True, step % 2 == 0)
    _C._adamw_step_(master, g16, m2, v2, None, p16, step, 1e-3, 0.8, 0.99, 1e-6, 0.0, False, False)
h = torch.empty(n, dtype=torch.float16)
hipferry.copy_cast_(h, p)
# NaNs of both signs, quiet and signalling, with assorted payloads, and infinities in every array
# (Note [one NaN]: every NaN the step writes is 0x7fc00000, in every build).
special = torch.tensor([0x7fc00000, 0xffc00000, 0x7fc00001, 0xffffffff, 0x7f800001, 0xff800123, 0x7f800000,
                        0xff800000, 0], dtype=torch.int64).to(torch.int32).view(torch.float32)
special16 = torch.tensor([0x7fc0, 0xffc1, 0x7f81, 0xff80, 0x7f80], dtype=torch.int32).to(torch.int16)
def salted(t, table):
    t = t.clone()
    at = torch.randint(0, 4, t.shape).eq(0)
    t.view(table.dtype)[at] = table[torch.randint(0, len(table), (int(at.sum()),))]
    return t
nan_out = [salted(t, special) for t in (p, m, v, vmax)] + [torch.empty(n, dtype=torch.bfloat16)]
nan_grad = salted(torch.randn(n).bfloat16(), special16.view(torch.bfloat16))
_C._adamw_step_(nan_out[0], nan_grad, nan_out[1], nan_out[2], nan_out[3], nan_out[4], 31, 1e-2, 0.9, 0.999, 1e-8,
                0.05, True, False)
_C._adamw_step_(master, salted(g, special), m2, v2, None, p16, 31, 1e-3, 0.8, 0.99, 1e-6, 0.0, False, True)
torch.save(dict(isa=_C.cpu_isa(), out=[p, m, v, vmax, master, m2, v2, p16, h] + nan_out), sys.argv[1])
"""
_ISAS = ("baseline", "avx2", "avx512")


def test_every_build_gives_the_baseline_bits_nans_included(tmp_path):
    """The same AdamW trajectory (float32 with amsgrad and maximize; bf16 params with a float32
    master), float16 conversion, and a step over NaNs and infinities in every array, with the CPU
    loops forced to each build this CPU runs (baseline, avx2, avx512): bit-identical (hipferry owns
    every side; no FMA in the element code, one canonical NaN)."""
    best = hipferry.build_info()["cpu_isa_best"]
    results = {}
    for isa in _ISAS[:_ISAS.index(best) + 1]:
        out = tmp_path / f"{isa}.pt"
        env = dict(os.environ, HIPFERRY_CPU_ISA=isa)
        subprocess.run([sys.executable, "-c", _TRAJECTORY, str(out)], env=env, check=True, timeout=120)
        results[isa] = torch.load(out)
        assert results[isa]["isa"] == isa
    nans = results["baseline"]["out"][9:13]
    found = torch.cat([t.view(torch.int32)[t.isnan()] for t in nans])
    assert len(found) > 1000 and found.eq(0x7fc00000).all(), "every NaN written is the canonical one"
    for isa, result in results.items():
        for i, (a, b) in enumerate(zip(results["baseline"]["out"], result["out"])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i}: {isa} != baseline"


def test_a_bad_cpu_isa_fails_at_import_in_one_sentence():
    env = dict(os.environ, HIPFERRY_CPU_ISA="avx9000")
    r = subprocess.run([sys.executable, "-c", "import hipferry"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "HIPFERRY_CPU_ISA must be auto, baseline, avx2 or avx512, got 'avx9000'" in r.stderr
