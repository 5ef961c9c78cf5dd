"""Shared helpers of the OffloadAdamW tests (test_offload_adamw*.py): the
device/engine parametrization ("cpu" params here; "cuda" params with both
engines when a GPU is present), a tiny Linear-LayerNorm-GELU-Linear model whose
tensors lie both below and above ``min_offload_numel`` (MIN_OFFLOAD),
deterministic batches, SideBySide (OffloadAdamW and torch.optim.AdamW driven in
lockstep on the same gradients) and the comparison against torch.optim.AdamW.

Tolerances: against torch.optim.AdamW, torch's own (assert_close_to_torch).
torch is not bit-identical to itself across CPU capabilities, so nothing here
compares bit for bit with it; bit identity is asserted only where hipferry
computes both sides (one engine against the other, GPU against CPU)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import requires_gpu

MIN_OFFLOAD = 256  # the model's two Linear weights (2304 and 960 elements) are above it, the rest below
IN_FEATURES, HIDDEN, OUT_FEATURES, BATCH = 24, 96, 10, 32
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)

# (parameter device, step_on): CPU params use the CPU engine, "auto" picks it (step_on="cpu" is the same engine:
# ALL_ENGINES adds it for the main trajectory test only); GPU params run both engines.
# "cpu-remote": CPU params through the CPU engine's GPU-parameter path (gradient copies started in
# backward hooks, host working copies, copies back; CpuRemoteOffloadAdamW below),
# so that path runs without a GPU too.
ENGINES = [pytest.param(("cpu", "auto"), id="cpu-auto"),
           pytest.param(("cpu", "cpu-remote"), id="cpu-remote"),
           pytest.param(("cuda", "cpu"), id="cuda-cpu", marks=requires_gpu),
           pytest.param(("cuda", "gpu"), id="cuda-gpu", marks=requires_gpu)]
ALL_ENGINES = ENGINES[:1] + [pytest.param(("cpu", "cpu"), id="cpu-cpu")] + ENGINES[1:]
# One engine per device, for the tests whose subject is not the engine.
ENGINE_PER_DEVICE = [pytest.param(("cpu", "auto"), id="cpu-auto"),
                     pytest.param(("cuda", "gpu"), id="cuda-gpu", marks=requires_gpu)]


def offload_adamw_class():
    from hipferry.optim import OffloadAdamW
    return OffloadAdamW


class CpuRemoteOffloadAdamW(offload_adamw_class()):
    """OffloadAdamW that treats CPU parameters as living elsewhere than their
    state, as GPU parameters do: the remote paths (backward hooks, host working
    copies, copies back) run on machines without a GPU. A test class, not an
    option of the optimizer."""

    def _is_remote(self, p):
        return True


class TinyNet(nn.Module):
    """Linear(24, 96) -> LayerNorm(96) -> GELU -> Linear(96, 10): 3562 parameters in six tensors
    of 2304, 96, 96, 96, 960 and 10 elements."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT_FEATURES)
        with torch.no_grad():  # LayerNorm starts at ones/zeros: make its tensors distinct so updates are visible
            self.norm.weight.add_(0.1 * torch.randn(HIDDEN))
            self.norm.bias.add_(0.1 * torch.randn(HIDDEN))

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def make_model(device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return TinyNet().to(device=device, dtype=dtype)


def twin(model, device=None, dtype=None):
    """A deep copy of ``model`` (optionally moved/cast), parameters bit-identical up to the cast."""
    other = copy.deepcopy(model)
    if device is not None or dtype is not None:
        other = other.to(device=device, dtype=dtype)
    return other


def batch(step, micro=0, device="cpu", dtype=torch.float32):
    """The inputs and targets of training step ``step`` (micro-batch ``micro``): the same on every run."""
    gen = torch.Generator().manual_seed(10_000 + 17 * step + micro)
    x = torch.randn(BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(BATCH, OUT_FEATURES, generator=gen)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def loss_of(model, step, micro=0):
    p = next(model.parameters())
    x, y = batch(step, micro, p.device, p.dtype)
    return F.mse_loss(model(x).float(), y.float())


def backward(model, step, accumulate=1):
    """Gradients of step ``step`` (summed over ``accumulate`` micro-batches); returns the last loss."""
    for micro in range(accumulate):
        loss = loss_of(model, step, micro) / accumulate
        loss.backward()
    return loss


def train(model, opt, steps, *, first_step=0, sched=None, clip=None, accumulate=1, set_to_none=True):
    """Run ``steps`` training steps of one model: zero_grad, backward, optional torch clip_grad_norm_,
    step, scheduler step. Returns the per-step learning rates of the groups."""
    lrs = []
    for step in range(first_step, first_step + steps):
        opt.zero_grad(set_to_none=set_to_none)
        backward(model, step, accumulate)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
    return lrs


def copy_grads(params, ref_params):
    """Gives each reference param the gradient of its counterpart (moved/cast to the reference's device/dtype)."""
    for p, r in zip(params, ref_params):
        r.grad = None if p.grad is None else p.grad.detach().to(device=r.device, dtype=r.dtype, copy=True)


class SideBySide:
    """OffloadAdamW on ``model`` and torch.optim.AdamW on ``ref_model`` (float32) driven in lockstep.

    Every step the model's gradients (after accumulation, before clipping) are copied to the reference
    params: a difference of an ulp between the two trajectories then does not feed back into the
    gradients (on a real model it would, and after a few dozen steps most elements would differ by
    an ulp or more, which says nothing about the optimizer). Each side clips its own gradients (the
    model with torch's clip_grad_norm_ or ``opt.clip_grad_norm_``, the reference with torch's), each
    side runs its own LR scheduler, and after every step the fp32 params are compared (``check``)."""

    def __init__(self, model, opt, ref_model, ref, sched=None, ref_sched=None, check=True):
        self.model, self.opt, self.ref_model, self.ref = model, opt, ref_model, ref
        self.ref_params = list(ref_model.parameters())
        self.sched, self.ref_sched, self.check = sched, ref_sched, check
        self.lrs, self.ref_lrs, self.norms, self.ref_norms = [], [], [], []

    @classmethod
    def create(cls, engine, *, dtype=torch.float32, groups=None, sched=None, offload_kw=None, **kw):
        """A model of ``dtype`` on the engine's device with OffloadAdamW, and its float32 twin with
        torch.optim.AdamW; ``groups(model)`` gives the param groups, ``sched(opt)`` an LR scheduler, ``kw``
        hyperparameters of both, ``offload_kw`` OffloadAdamW-only arguments."""
        device, step_on = engine
        groups = groups or (lambda m: list(m.parameters()))
        model = make_model(device, dtype)
        ref_model = twin(model, dtype=torch.float32)
        opt = offload_adamw(groups(model), step_on, **kw, **(offload_kw or {}))
        ref = torch_adamw(groups(ref_model), **kw)
        return cls(model, opt, ref_model, ref, sched and sched(opt), sched and sched(ref),
                   check=dtype == torch.float32)

    @property
    def params(self):
        return list(self.model.parameters())

    def run(self, steps, *, first_step=0, clip=None, clip_with_optimizer=False, accumulate=1, set_to_none=True,
            plateau_metric=None, before_step=None):
        for step in range(first_step, first_step + steps):
            self.opt.zero_grad(set_to_none=set_to_none)
            self.ref.zero_grad(set_to_none=set_to_none)
            backward(self.model, step, accumulate)
            if before_step is not None:
                before_step(step)
            copy_grads(self.params, self.ref_params)
            if clip is not None:
                if clip_with_optimizer:
                    self.norms.append(self.opt.clip_grad_norm_(clip))
                else:
                    self.norms.append(torch.nn.utils.clip_grad_norm_(self.params, clip))
                self.ref_norms.append(torch.nn.utils.clip_grad_norm_(self.ref_params, clip))
            self.lrs.append([g["lr"] for g in self.opt.param_groups])
            self.ref_lrs.append([g["lr"] for g in self.ref.param_groups])
            self.opt.step()
            self.ref.step()
            for sched in (self.sched, self.ref_sched):
                if sched is not None:
                    sched.step(plateau_metric) if plateau_metric is not None else sched.step()
            if self.check:
                assert_close_to_torch(self.params, self.ref_params, f"parameters after step {step}")
        return self


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


def assert_close_to_torch(got, want, what="parameters"):
    """fp32 tensors from OffloadAdamW vs torch.optim.AdamW, within torch's own tolerances: the
    torch.testing.assert_close defaults (float32: rtol 1.3e-6, atol 1e-5), which torch's test_optim
    uses between its for-loop, foreach and fused AdamW. Never bit for bit: torch's CPU kernels differ
    between CPU capabilities (AVX2, AVX-512, default), and its CUDA kernel fuses addcmul/addcdiv."""
    got, want = list(got), list(want)
    assert len(got) == len(want) and got
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.detach().cpu(), b.detach().cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}[{i}]: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert torch.isfinite(a).all(), f"{what}[{i}] is not finite"
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def assert_params_moved(before, after):
    """Guards a comparison against a no-op implementation: every tensor changed."""
    for i, (a, b) in enumerate(zip(before, after)):
        assert not torch.equal(a.detach().cpu(), b.detach().cpu()), f"parameter {i} did not change"


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def state_snapshot(opt):
    """{param index: {key: clone}} of the optimizer state, for 'nothing changed' checks."""
    params = [p for g in opt.param_groups for p in g["params"]]
    out = {}
    for i, p in enumerate(params):
        out[i] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in opt.state.get(p, {}).items()}
    return out


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), f"param {i}: keys {sorted(a[i])} vs {sorted(b[i])}"
        for k in a[i]:
            x, y = a[i][k], b[i][k]
            if torch.is_tensor(x):
                assert torch.equal(x.cpu(), y.cpu()), f"param {i}: state {k!r} changed"
            else:
                assert x == y, f"param {i}: state {k!r} changed"


def torch_adamw(params, **kw):
    args = dict(HYPER)
    args.update(kw)
    return torch.optim.AdamW(params, **args)


def offload_adamw(params, step_on="auto", **kw):
    cls = offload_adamw_class()
    if step_on == "cpu-remote":
        step_on, cls = "cpu", CpuRemoteOffloadAdamW
    args = dict(HYPER, min_offload_numel=MIN_OFFLOAD, step_on=step_on)
    args.update(kw)
    return cls(params, **args)


def host_state_tensors(opt):
    """The optimizer's per-parameter state tensors that live on the host (``step`` excluded)."""
    return [v for st in opt.state.values() for k, v in st.items()
            if k != "step" and torch.is_tensor(v) and v.device.type == "cpu"]
