"""OffloadAdamW(state_dtype=torch.uint8) on torch's own AdamW inputs
(``common_optimizers.optim_db``: every AdamW configuration: weight decay,
amsgrad, maximize, Tensor lr and betas, capturable/foreach/fused flags), the
same 8-step trajectory as test_offload_adamw_torch_parity.py (a step without
gradients, a parameter frozen for two steps; plain and strided layouts:
channels_last and transposed parameters get 8-bit state with their own
strides, views with gaps keep float32 state), against
torch.optim.AdamW's for-loop with float32 state. Every parameter gets 8-bit
state here (min_8bit_numel=0).

Tolerances, widened only where the quantization needs it:
- parameters: atol = 0.05 * lr * steps (+ torch's own). A step of Adam moves
  an element by lr * m_hat / (sqrt(v_hat) + eps), whose size is about lr; the
  8-bit moments change m_hat / sqrt(v_hat) by a few percent of its size (the
  dynamic map's spacing is under 2% of the block's largest value above 1/16
  of it, finer below), so the parameters drift apart by a few percent of lr
  per step at most. Measured: at most 0.011 * lr * steps over every config
  ('maximize').
- the moments: dequantized, against torch's float32 moments, within
  steps / 16 of their block's largest magnitude: every step rounds the moments
  to the map once more, and the exponential average keeps those roundings
  (measured: at most 0.026 * steps of the scale).
- step counts and keys are torch's exactly.
"""
import copy

import pytest
import torch

from hipferry.optim import OffloadAdamW
from hipferry.optim.int8_store import BLOCK, dequantized
from hipferry.optim.layout import memory_flat
from torch_optim_parity_helpers import (CONFIG_DESCS, adamw_input, make_reference, slug, trajectory_grads,
                                        trajectory_params)

STEPS = 8


def lr_of(kwargs) -> float:
    return float(kwargs.get("lr", 1e-3))


def run(kwargs, layout):
    params = trajectory_params(layout, device="cpu", dtype=torch.float32)
    ref_params = trajectory_params(layout, device="cpu", dtype=torch.float32)
    opt = OffloadAdamW(params, state_dtype=torch.uint8, min_8bit_numel=0, **copy.deepcopy(kwargs))
    ref = make_reference(ref_params, kwargs)
    worst = 0.0
    for i in range(STEPS):
        trajectory_grads(i, opt, ref, params, ref_params)
        opt.step()
        ref.step()
        worst = max(worst, compare(opt, params, ref, ref_params, lr_of(kwargs), i + 1, f"after step {i}"))
    return worst


def compare(opt, params, ref, ref_params, lr, steps, what) -> float:
    worst, lr_steps = 0.0, lr * steps
    for k, (p, r) in enumerate(zip(params, ref_params)):
        where = f"{what}, param {k} {tuple(p.shape)}"
        diff = (p.detach() - r.detach()).abs().max().item()
        worst = max(worst, diff / lr_steps)
        torch.testing.assert_close(p.detach(), r.detach(), atol=0.05 * lr_steps + 1e-5, rtol=1.3e-6,
                                   msg=lambda m: f"{where}: {m}")
        ref_st, st = ref.state.get(r, {}), opt.state.get(p, {})
        if not ref_st:
            continue
        assert set(ref_st) <= set(st), f"{where}: state keys {sorted(st)} lack some of torch's {sorted(ref_st)}"
        assert float(st["step"]) == float(ref_st["step"]) and st["step"].dtype == ref_st["step"].dtype, where
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key not in ref_st:
                continue
            if memory_flat(p) is None:  # a view with gaps keeps float32 state (no flat walk to cut into blocks)
                assert st[key].dtype == torch.float32 and "exp_avg_absmax" not in st, where
                continue
            assert st[key].dtype == torch.uint8, f"{where}: {key} is {st[key].dtype}, 8-bit state expected"
            absmax = st[f"{key}_absmax"]
            have = dequantized(st[key], absmax, key)
            bound = torch.empty_strided(have.shape, have.stride())  # blocks run over the memory order
            memory_flat(bound).copy_(absmax.repeat_interleave(BLOCK)[: have.numel()])
            err = (have - ref_st[key]).abs()
            assert (err <= bound * steps / 16 + 1e-12).all(), (
                f"{where}: {key} off by {float((err / bound.clamp(min=1e-30)).max()):.3f} of its block's scale")
    return worst


CASES = [pytest.param(i, layout, id=f"{layout}-{slug(d)}") for i, d in enumerate(CONFIG_DESCS)
         for layout in ("plain", "strided")]


@pytest.mark.parametrize("index,layout", CASES)
def test_8bit_state_follows_torch_adamw(index, layout):
    run(adamw_input(index, torch.float32).kwargs, layout)
