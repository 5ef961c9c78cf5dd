"""The fused AdamW step with 8-bit blockwise moments (hipferry._C._adamw8bit_step_) and its
format (_quantize_blockwise_8bit, _dequantize_blockwise_8bit, _dynamic_map_8bit).

Oracles:
- bitsandbytes (the format's origin): its dynamic maps bit for bit; its CPU quantizer (never
  nearer than hipferry's, which picks the nearest code exactly; within one code where
  bitsandbytes' search is accurate), its dequantizer bit for bit on the same codes;
- the step is, bit for bit, dequantize -> the float32 step (_C._adamw_step_) -> quantize;
- over 100 steps, torch.optim.AdamW within the drift 8-bit moments cause (measured bound);
- bit identity where hipferry owns both sides: the baseline and AVX2 builds (a subprocess
  with HIPFERRY_CPU_ISA=baseline), out of place vs in place, and the GPU kernel vs the CPU
  loop (here on a GPU; tests/cpp/adamw8bit_kernel_test.cpp too)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import hipferry
from hipferry import _C
from conftest import requires_gpu

BLOCK = 256
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def blocks(n):
    return (n + BLOCK - 1) // BLOCK


def zero_state(n, device="cpu"):
    """m, m_absmax, v, v_absmax, max_v, max_v_absmax: all zeros is the zero state (scale 0)."""
    out = []
    for _ in range(3):
        out += [torch.zeros(n, dtype=torch.uint8, device=device), torch.zeros(blocks(n), device=device)]
    return out


def step8(p, g, state, step, amsgrad=False, maximize=False, out=None, **inputs):
    m, ma, v, va, x, xa = state
    _C._adamw8bit_step_(p, g, m, ma, v, va, x if amsgrad else None, xa if amsgrad else None, out, step,
                        amsgrad=amsgrad, maximize=maximize, **HYPER, **inputs)


def bnb_functional():
    F = pytest.importorskip("bitsandbytes.functional")
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch.linspace rounds twice at ATEN_CPU_CAPABILITY=default: bitsandbytes' tables then "
                    "differ in the last bit from every AVX2 machine's (csrc/core/optim/quant8_map.h)")
    return F


@pytest.mark.parametrize("signed", [True, False])
def test_code_tables_are_bitsandbytes_dynamic_maps(signed):
    F = bnb_functional()
    ours = _C._dynamic_map_8bit(signed)
    assert ours.dtype == torch.float32 and ours.shape == (256,)
    assert torch.equal(ours.view(torch.int32), F.create_dynamic_map(signed=signed).view(torch.int32))


@pytest.mark.parametrize("signed", [True, False])
def test_quantizer_is_never_farther_than_bitsandbytes_and_agrees_above_1e_3(signed):
    """bitsandbytes' CPU quantizer (its native binary search) is not always nearest: below
    |x / absmax| ~ 1e-4 it is off by up to several codes, and now and then by one above. So:
    hipferry's code is never farther from x / absmax than bitsandbytes' (up to the rounding
    of y: it divides, hipferry multiplies by the reciprocal), equal for >= 98% of the
    elements with |y| >= 1e-3 and within one code there; and both dequantize a code alike."""
    F = bnb_functional()
    torch.manual_seed(0)
    n = 300_001  # a short last block
    x = torch.randn(n) * torch.logspace(-6, 2, n)[torch.randperm(n)]  # many magnitudes in each block
    if not signed:
        x = x.abs()
    codes, absmax = _C._quantize_blockwise_8bit(x, signed)
    code = F.create_dynamic_map(signed=signed)
    bnb_codes, state = F.quantize_blockwise(x, code=code.clone(), blocksize=BLOCK)
    assert torch.equal(absmax, state.absmax), "the scale is the block's largest magnitude in both"
    y = x.double() / absmax.double().repeat_interleave(BLOCK)[:n]
    ours, theirs = (y - code.double()[codes.long()]).abs(), (y - code.double()[bnb_codes.long()]).abs()
    assert (ours <= theirs + 2**-22 * y.abs()).all()
    diff = (codes.int() - bnb_codes.int()).abs()
    large = y.abs() >= 1e-3
    equal, equal_large = int((diff == 0).sum()), int((diff[large] == 0).sum())
    print(f"signed={signed}: {equal} of {n} codes equal bitsandbytes' ({int((diff == 1).sum())} one apart); "
          f"|y| >= 1e-3: {equal_large} of {int(large.sum())}")
    assert int(diff[large].max()) <= 1 and equal_large >= 0.98 * int(large.sum())
    ours_back = _C._dequantize_blockwise_8bit(bnb_codes, absmax, signed)
    theirs_back = F.dequantize_blockwise(bnb_codes, absmax=absmax, code=code.clone(), blocksize=BLOCK)
    assert torch.equal(ours_back, theirs_back)


def half_code_step(signed, codes):
    """Half the larger gap between the code's entry and its neighbours: the rounding bound."""
    table = _C._dynamic_map_8bit(signed).double()
    gaps = torch.cat([table[1:] - table[:-1], torch.zeros(1)]).double()
    below = torch.cat([torch.zeros(1), gaps[:-1]]).double()
    return torch.maximum(gaps[codes.long()], below[codes.long()]) / 2


@settings(max_examples=60, deadline=None)
@example(data=np.array([1e-44, 0, -3e-45, 1e-45], dtype=np.float32), signed=True)  # 1 / scale overflows
@example(data=np.array([3e38, -1e38, 1.0, 0], dtype=np.float32), signed=False)  # 1 / scale is subnormal
@example(data=np.array([-9.51e-43], dtype=np.float32), signed=True)  # the product rounds in the subnormal range
@given(data=hnp.arrays(np.float32, st.integers(1, 900),
                       elements=st.floats(-2.0**100, 2.0**100, width=32, allow_nan=False, allow_infinity=False)),
       signed=st.booleans())
def test_round_trip_is_within_half_a_code_step(data, signed):
    x = torch.from_numpy(data.copy())
    if not signed:
        x = x.abs()
    codes, absmax = _C._quantize_blockwise_8bit(x, signed)
    back = _C._dequantize_blockwise_8bit(codes, absmax, signed)
    scale = absmax.repeat_interleave(BLOCK)[: x.numel()].double()
    want = torch.stack([x[i:i + BLOCK].abs().max() for i in range(0, x.numel(), BLOCK)])
    assert torch.equal(absmax, want)
    # the bound on y = x / scale, plus the roundings of the reciprocal, of y and of the product; a
    # product in float32's subnormal range rounds to a multiple of 2**-149 instead (absolute error)
    bound = (half_code_step(signed, codes) + 4 * 2**-24) * scale + 2**-149
    assert ((back.double() - x.double()).abs() <= bound).all()


def test_special_blocks():
    x = torch.full((1000,), 0.25)
    x[:256] = 0  # all zero
    x[300] = float("nan")  # a non-finite value: its whole block is NaN on the way back
    x[600] = -3e30  # a huge one: the rest of its block flushes to 0
    codes, absmax = _C._quantize_blockwise_8bit(x, True)
    back = _C._dequantize_blockwise_8bit(codes, absmax, True)
    zero_code = int((_C._dynamic_map_8bit(True) == 0).nonzero())
    assert absmax[0] == 0 and (codes[:256] == zero_code).all() and torch.equal(back[:256], torch.zeros(256))
    assert absmax[1].isnan() and back[256:512].isnan().all()
    assert absmax[2] == 3e30 and codes[600] == 0 and (back[512:768][back[512:768] != back[600]] == 0).all()
    assert (back[768:] == 0.25).all()


def test_step_is_dequantize_float32_step_quantize_bit_for_bit():
    torch.manual_seed(1)
    n = 5000
    p, g = torch.randn(n), torch.randn(n).bfloat16()
    m_codes, m_scale = _C._quantize_blockwise_8bit(torch.randn(n) * 1e-3, True)
    v_codes, v_scale = _C._quantize_blockwise_8bit(torch.rand(n) * 1e-5, False)
    p16 = torch.empty(n, dtype=torch.bfloat16)
    state = [m_codes.clone(), m_scale.clone(), v_codes.clone(), v_scale.clone(), None, None]
    mine = p.clone()
    step8(mine, g, state, 4, out=p16)
    m = _C._dequantize_blockwise_8bit(m_codes, m_scale, True)
    v = _C._dequantize_blockwise_8bit(v_codes, v_scale, False)
    ref, ref16 = p.clone(), torch.empty(n, dtype=torch.bfloat16)
    _C._adamw_step_(ref, g, m, v, None, ref16, 4, amsgrad=False, maximize=False, **HYPER)
    assert torch.equal(mine, ref) and torch.equal(p16, ref16)
    for got, want in zip(state[:4], _C._quantize_blockwise_8bit(m, True) + _C._quantize_blockwise_8bit(v, False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_hundred_steps_stay_near_torch_adamw(amsgrad, maximize):
    """The drift 8-bit moments cause: per element at most a quarter of the steps' total size
    (lr * steps), on average under 1% of it (measured: 16% and 0.5% at worst). A wrong
    formula or a lost scale drifts by whole steps; the float32 step stays within 1e-6."""
    torch.manual_seed(0)
    n, steps, lr = 20_000, 100, HYPER["lr"]
    p0 = torch.randn(n)
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=lr, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], amsgrad=amsgrad, maximize=maximize)
    mine, state = p0.clone(), zero_state(n)
    for t in range(1, steps + 1):
        g = torch.randn(n) * (1 + torch.arange(n) % 7)
        ref.grad = g.clone()
        opt.step()
        step8(mine, g, state, t, amsgrad=amsgrad, maximize=maximize)
        if t == 1:  # from the zero state the first step is the float32 step's
            torch.testing.assert_close(mine, ref.detach())
    drift = (mine - ref.detach()).abs() / (lr * steps)
    assert drift.max() <= 0.25 and drift.mean() <= 0.01


@pytest.mark.parametrize("amsgrad", [False, True])
def test_out_of_place_step_gives_the_in_place_bits_and_leaves_its_inputs(amsgrad):
    torch.manual_seed(2)
    n = 1000
    p, g = torch.randn(n), torch.randn(n)
    state = zero_state(n)
    step8(p, g, state, 1, amsgrad=amsgrad)  # a state that is not all zero
    inputs = [p.clone()] + [t.clone() for t in state]
    in_place = [p.clone()] + [t.clone() for t in state]
    step8(in_place[0], g, in_place[1:], 2, amsgrad=amsgrad)
    outs = [torch.full((n,), float("nan"))] + [torch.full_like(t, 7) for t in state]
    names = ["exp_avg_in", "exp_avg_absmax_in", "exp_avg_sq_in", "exp_avg_sq_absmax_in", "max_exp_avg_sq_in",
             "max_exp_avg_sq_absmax_in"]
    kw = {k: t for k, t in zip(names, inputs[1:]) if amsgrad or not k.startswith("max")}
    step8(outs[0], g, outs[1:], 2, amsgrad=amsgrad, param_in=inputs[0], **kw)
    for k in range(7 if amsgrad else 5):
        assert torch.equal(outs[k], in_place[k]), k
    assert torch.equal(inputs[0], p) and all(torch.equal(a, b) for a, b in zip(inputs[1:], state))


def test_bad_input_is_rejected_and_nothing_changes():
    n = 300
    p, g = torch.ones(n), torch.ones(n)
    m, ma, v, va = torch.zeros(n, dtype=torch.uint8), torch.zeros(2), torch.zeros(n, dtype=torch.uint8), torch.zeros(2)
    u8 = dict(dtype=torch.uint8)
    ins = dict(param_in=torch.ones(n), exp_avg_in=torch.zeros(n, **u8), exp_avg_absmax_in=torch.zeros(2),
               exp_avg_sq_in=torch.zeros(n, **u8), exp_avg_sq_absmax_in=torch.zeros(2))
    cases = [
        (dict(step=0), "step must be >= 1"),
        (dict(param=torch.ones(n, device="meta")), "param is on meta; expected the CPU or a GPU"),
        (dict(param=torch.ones(n, dtype=torch.float64)), "param has dtype torch.float64; expected torch.float32"),
        (dict(grad=torch.ones(299)), r"grad has 299 elements; expected 300 \(as many as param\)"),
        (dict(grad=torch.ones(n, dtype=torch.int32)), "grad has dtype torch.int32"),
        (dict(exp_avg=torch.zeros(n)), "exp_avg has dtype torch.float32; expected torch.uint8"),
        (dict(exp_avg_sq=torch.zeros(n + 1, **u8)), "exp_avg_sq has 301 elements; expected 300"),
        (dict(exp_avg_absmax=torch.zeros(1)), r"exp_avg_absmax has 1 elements; expected 2 \(one scale per block"),
        (dict(exp_avg_sq_absmax=torch.zeros(2, dtype=torch.float16)), "exp_avg_sq_absmax has dtype torch.float16"),
        (dict(exp_avg=torch.zeros(2, n, **u8).t()), "exp_avg must be a contiguous dense tensor"),
        (dict(amsgrad=True), "amsgrad=True needs max_exp_avg_sq and max_exp_avg_sq_absmax"),
        (dict(amsgrad=True, max_exp_avg_sq=torch.zeros(n, **u8), max_exp_avg_sq_absmax=torch.zeros(3)),
         "max_exp_avg_sq_absmax has 3 elements; expected 2"),
        (dict(param_out=torch.ones(n, dtype=torch.int8)), "param_out has dtype torch.int8"),
        (dict(grad=p), "grad overlaps param, which the step writes"),
        (dict(exp_avg_sq_absmax=ma), "exp_avg_sq_absmax overlaps exp_avg_absmax"),
        (dict(param_out=p), "param_out overlaps param"),
        (dict(param_in=torch.ones(n)), "exp_avg_in is missing"),
        (dict(ins, max_exp_avg_sq_in=torch.zeros(n, **u8)), "max_exp_avg_sq_in is given without amsgrad"),
        (dict(ins, exp_avg_absmax_in=torch.zeros(3)), "exp_avg_absmax_in has 3 elements; expected 2"),
        (dict(ins, exp_avg_in=m), "exp_avg_in overlaps exp_avg, which the step writes"),
    ]
    for change, message in cases:
        args = dict(param=p, grad=g, exp_avg=m, exp_avg_absmax=ma, exp_avg_sq=v, exp_avg_sq_absmax=va,
                    max_exp_avg_sq=None, max_exp_avg_sq_absmax=None, param_out=None, step=1, amsgrad=False,
                    maximize=False, **HYPER)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            _C._adamw8bit_step_(**args)
    assert torch.equal(p, torch.ones(n)) and not m.any() and not v.any() and not ma.any() and not va.any()


def test_quantize_and_dequantize_reject_bad_input():
    x = torch.randn(1000)
    with pytest.raises(ValueError, match="x has dtype torch.float64; expected torch.float32"):
        _C._quantize_blockwise_8bit(x.double(), True)
    with pytest.raises(ValueError, match=r"absmax has 3 elements; expected 4"):
        _C._quantize_blockwise_8bit(x, True, absmax=torch.zeros(3))
    with pytest.raises(ValueError, match="x is on meta; expected the CPU"):
        _C._quantize_blockwise_8bit(x.to("meta"), True)
    codes, absmax = _C._quantize_blockwise_8bit(x, False)
    with pytest.raises(ValueError, match="codes has dtype torch.float32; expected torch.uint8"):
        _C._dequantize_blockwise_8bit(x, absmax, False)
    with pytest.raises(ValueError, match="out has 999 elements; expected 1000"):
        _C._dequantize_blockwise_8bit(codes, absmax, False, out=torch.empty(999))
    out = torch.empty(1000)
    assert _C._dequantize_blockwise_8bit(codes, absmax, False, out=out) is not None
    assert torch.equal(out, _C._dequantize_blockwise_8bit(codes, absmax, False))


_TRAJECTORY = """
import sys, torch
from hipferry import _C
torch.manual_seed(3)
n = 4099
p, g16 = torch.randn(n), None
state = [torch.zeros(n, dtype=torch.uint8), torch.zeros(17)] * 3
state = [t.clone() for t in state]
out16 = torch.empty(n, dtype=torch.bfloat16)
for step in range(1, 21):
    g = torch.randn(n).bfloat16()
    _C._adamw8bit_step_(p, g, *state, out16, step, 1e-2, 0.9, 0.999, 1e-8, 0.05, True, step % 2 == 0)
q = _C._quantize_blockwise_8bit(torch.randn(n) * torch.logspace(-8, 1, n), True)
torch.save(dict(isa=_C.cpu_isa(), out=[p, out16, *state, *q]), sys.argv[1])
"""


def test_vectorized_and_baseline_builds_give_the_same_bits(tmp_path):
    results = {}
    for isa in ("baseline", "auto"):
        out = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", _TRAJECTORY, str(out)], env=dict(os.environ, HIPFERRY_CPU_ISA=isa),
                       check=True, timeout=120)
        results[isa] = torch.load(out)
    assert results["baseline"]["isa"] == "baseline"
    assert results["auto"]["isa"] == hipferry.build_info()["cpu_isa_best"]
    for i, (a, b) in enumerate(zip(results["baseline"]["out"], results["auto"]["out"])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs between builds"


@requires_gpu
@pytest.mark.parametrize("amsgrad", [False, True])
def test_gpu_step_gives_the_cpu_bits(amsgrad):
    torch.manual_seed(4)
    n = 100_003
    p, g = torch.randn(n), torch.randn(n).bfloat16()
    cpu_state = zero_state(n)
    gpu_p, gpu_state = p.cuda(), [t.cuda() for t in cpu_state]
    out_cpu, out_gpu = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for t in range(1, 6):
        step8(p, g, cpu_state, t, amsgrad=amsgrad, maximize=True, out=out_cpu)
        step8(gpu_p, g.cuda(), gpu_state, t, amsgrad=amsgrad, maximize=True, out=out_gpu)
    torch.cuda.synchronize()
    assert torch.equal(gpu_p.cpu(), p) and torch.equal(out_gpu.cpu(), out_cpu)
    for a, b in zip(gpu_state, cpu_state):
        assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
