"""PyTorch's own optimizer test machinery, pointed at hipferry.optim.OffloadAdamW
(used by test_offload_adamw_torch_parity.py).

The oracle is torch's, not ours: the AdamW configurations come from
``torch.testing._internal.common_optimizers`` (``optim_db``'s AdamW
``OptimizerInfo``: ``optim_inputs_func_adamw``, ``optim_error_inputs_func_adamw``,
``_get_optim_inputs_including_global_cliquey_kwargs``), and the tolerances are
the ones PyTorch's test_optim.py (TestOptimRenewed) compares its forloop,
foreach and fused AdamW with: ``assertEqual``'s per-dtype defaults
(``torch.testing`` defaults: float32 rtol 1.3e-6 / atol 1e-5, float64 1e-7 /
1e-7), and for bfloat16/float16 the ``toleranceOverride`` the AdamW
OptimizerInfo declares for ``test_fused_matches_forloop`` (combined with the
defaults by taking the larger of each, as ``TestCase.assertEqual`` does).

Every configuration runs on every engine: the "cuda" list of AdamW inputs (the
CPU ones plus capturable, Tensor lr and Tensor betas ones) also on CPU
parameters, because OffloadAdamW accepts and ignores capturable/foreach/fused.
The torch.optim.AdamW reference always runs its forloop implementation on the
CPU (``reference_kwargs``: capturable/fused/differentiable dropped,
foreach=False), which torch's tests treat as the ground truth."""
import copy
import math

import torch
from torch.nn import Parameter

# common_utils (imported by common_optimizers) calls torch.backends.disable_global_flags() at import;
# undo that so the rest of the test session may still set torch.backends flags.
_FLAGS_WERE_FROZEN = torch.backends.flags_frozen()
from torch.testing._internal import common_optimizers as co  # noqa: E402
from torch.testing._internal.common_device_type import toleranceOverride  # noqa: E402
from torch.testing._comparison import get_tolerances  # noqa: E402

if not _FLAGS_WERE_FROZEN:
    setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)

from offload_adamw_helpers import ENGINES, CpuRemoteOffloadAdamW, offload_adamw_class  # noqa: E402

ADAMW_INFO = next(o for o in co.optim_db if o.optim_cls is torch.optim.AdamW)
# The configuration list of a CUDA device is the CPU list plus the capturable / Tensor lr / Tensor betas
# configs: all of them run on every engine (no tensor is created on the device to build them).
CONFIG_DEVICE = "cuda"
IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")
LOW_PRECISION = (torch.bfloat16, torch.float16)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
OptimizerErrorEnum = co.OptimizerErrorEnum


# ------------------------------------------------------------------ configs
def adamw_inputs(dtype=None):
    """A fresh list of torch's AdamW OptimizerInputs (fresh: Tensor lrs are mutated by schedulers)."""
    return co.optim_inputs_func_adamw(CONFIG_DEVICE, dtype)


CONFIG_DESCS = [i.desc for i in adamw_inputs()]


def adamw_input(index, dtype=None):
    return adamw_inputs(dtype)[index]


def all_inputs(skip=("differentiable",)):
    """Every config with the global-cliquey flags (foreach/fused/differentiable False, then each True)."""
    return co._get_optim_inputs_including_global_cliquey_kwargs(CONFIG_DEVICE, torch.float32, ADAMW_INFO,
                                                                 skip=skip)


def rotating_inputs():
    """Each config once, with the global-cliquey flags False except one (foreach, fused, none) in
    rotation: all_inputs()'s flags at a third of its cost, for the tests that train a module."""
    out = []
    for i, cfg in enumerate(adamw_inputs()):
        kw = dict(copy.deepcopy(cfg.kwargs), foreach=False, fused=False, differentiable=False)
        flag = ("foreach", "fused", None)[i % 3]
        if flag:
            kw[flag] = True
        out.append(co.OptimizerInput(params=None, kwargs=kw, desc=f"{cfg.desc} & {flag}" if flag else cfg.desc))
    return out


def error_inputs(dtype=torch.float32):
    return co.optim_error_inputs_func_adamw("cpu", dtype)


def slug(desc):
    return desc.replace(", ", "_").replace(" & ", "+").replace(" ", "_")


def reference_kwargs(kwargs):
    """torch.optim.AdamW's forloop on the CPU with the same hyperparameters."""
    kw = copy.deepcopy(kwargs)
    for k in ("capturable", "fused", "differentiable"):
        kw.pop(k, None)
    kw["foreach"] = False
    return kw


def reference_group(group):
    g = reference_kwargs({k: v for k, v in group.items() if k != "params"})
    g["params"] = group["params"]
    return g


# ------------------------------------------------------------------ optimizers
def make_offload(engine, params, **kw):
    """OffloadAdamW on ``engine`` = (device, step_on) as in offload_adamw_helpers.ENGINES; AdamW's own
    defaults (not the helpers' HYPER) and min_offload_numel=0 so that every state lives in the pool."""
    _, step_on = engine
    cls = offload_adamw_class()
    if step_on == "cpu-remote":
        step_on, cls = "cpu", CpuRemoteOffloadAdamW
    kw.setdefault("min_offload_numel", 0)
    return cls(params, step_on=step_on, **kw)


def make_reference(params, kwargs):
    return torch.optim.AdamW(params, **reference_kwargs(kwargs))


def engine_cases(exclude=()):
    """(engine, id, marks) of ENGINES, without the ids in ``exclude``."""
    return [(e.values[0], e.id, e.marks) for e in ENGINES if e.id not in exclude]


# ------------------------------------------------------------------ tolerances
def torch_tolerances(dtype):
    """The tolerances test_optim's test_fused_matches_forloop compares AdamW implementations with:
    torch.testing's defaults for ``dtype``, raised to the AdamW OptimizerInfo's toleranceOverride."""
    rtol, atol = get_tolerances(dtype, rtol=None, atol=None)
    for deco in ADAMW_INFO.decorators:
        if getattr(deco, "test_name", None) != "test_fused_matches_forloop":
            continue
        active = deco.active_if({"dtype": dtype}) if callable(deco.active_if) else deco.active_if
        if not active:
            continue
        for d in deco.decorators:
            if isinstance(d, toleranceOverride) and dtype in d.d:
                rtol, atol = max(rtol, d.d[dtype].rtol), max(atol, d.d[dtype].atol)
    return dict(rtol=rtol, atol=atol)


def assert_close(actual, expected, msg, **tol):
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{msg}: {m}", **tol)


def assert_within_ulp(low, want, what):
    """A bfloat16/float16 tensor within one ulp (of its own format) of float32 values ``want``."""
    got = low.detach().cpu().float()
    want = want.detach().cpu().float()
    mant = MANTISSA_BITS[low.dtype]
    mag = torch.maximum(got.abs(), want.abs()).clamp(min=torch.finfo(low.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - mant)
    bad = (got - want).abs() > ulp
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements more than one {low.dtype} ulp "
                           f"from the float32 reference (max difference {(got - want).abs().max():.3g})")


# ------------------------------------------------------------------ parameters and gradients
def make_param(base_shape, *, device, dtype, view=None, values_dtype=None, seed=0, memory_format=None):
    """A Parameter from seeded float32 values rounded through ``values_dtype`` (so a float32 twin of a
    bf16 parameter holds the same values), cast to ``dtype`` on ``device``, optionally a view of it
    (non-contiguous parameters) or in ``memory_format``."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(base_shape, generator=gen, dtype=torch.float32)
    if values_dtype is not None:
        t = t.to(values_dtype)
    t = t.to(device=device, dtype=dtype)
    if memory_format is not None:
        t = t.contiguous(memory_format=memory_format)
    if view is not None:
        t = view(t)
    return Parameter(t)


# name -> (base shape, view, memory format); "plain": contiguous tensors of several ranks incl. a 0-dim one
PLAIN_SPECS = [("weight", (6, 5), None, None), ("bias", (6,), None, None), ("scalar", (), None, None),
               ("conv", (3, 4, 2, 2), None, None)]
STRIDED_SPECS = PLAIN_SPECS + [
    ("noncontiguous", (6, 5, 2), lambda t: t[..., 0], None),          # strides (10, 2): not dense
    ("channels_last", (3, 4, 3, 2), None, torch.channels_last),
    ("transposed", (5, 6), lambda t: t.t(), None),
]


def trajectory_params(layout, *, device, dtype, values_dtype=None):
    specs = STRIDED_SPECS if layout == "strided" else PLAIN_SPECS
    return [make_param(shape, device=device, dtype=dtype, view=view, values_dtype=values_dtype, seed=10 + k,
                       memory_format=mf) for k, (_, shape, view, mf) in enumerate(specs)]


def step_grads(step, params):
    """Seeded float32 gradients of step ``step`` for ``params`` (on CPU)."""
    out = []
    for k, p in enumerate(params):
        gen = torch.Generator().manual_seed(1000 * step + k)
        out.append(torch.randn(p.shape, generator=gen, dtype=torch.float32))
    return out


TRAJECTORY_FROZEN = 1  # the parameter frozen in steps 3 and 4 of a trajectory


def trajectory_grads(i, opt, ref, params, ref_params):
    """Step `i` of the trajectories of test_optim's _compare_between: zero_grad on both sides,
    parameter TRAJECTORY_FROZEN frozen in steps 3-4, no gradients at all in step 2 (step() is a
    no-op), else the same seeded gradients on both sides."""
    opt.zero_grad()
    ref.zero_grad()
    for k, (p, r) in enumerate(zip(params, ref_params)):
        frozen = k == TRAJECTORY_FROZEN and 3 <= i < 5
        p.requires_grad_(not frozen)
        r.requires_grad_(not frozen)
    if i != 2:
        backward_with(params, step_grads(i, params))
        copy_grads(params, ref_params)


def backward_with(params, grads):
    """loss = sum((p * g).sum()): backward gives each parameter (that requires grad) gradient g exactly,
    through autograd (so the post-accumulate-grad hooks of the CPU engine's GPU path fire)."""
    terms = [(p * g.to(device=p.device, dtype=p.dtype)).sum().float() for p, g in zip(params, grads)
             if p.requires_grad]
    if terms:
        torch.stack(terms).sum().backward()


def copy_grads(params, ref_params):
    for p, r in zip(params, ref_params):
        r.grad = None if p.grad is None else p.grad.detach().to(device=r.device, dtype=r.dtype, copy=True)


def flat_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


# ------------------------------------------------------------------ comparisons
def compare_with_reference(opt, params, ref, ref_params, dtype, what, tol=None):
    """OffloadAdamW's parameters and state against torch.optim.AdamW's (torch's tolerances for the
    parameters' dtype; low precision: the float32 twin, within one ulp and within the OptimizerInfo's
    override, and the float32 master/moments with float32 tolerances)."""
    for k, (p, r) in enumerate(zip(params, ref_params)):
        where = f"{what}, param {k} {tuple(p.shape)}"
        got = p.detach().cpu()
        if dtype in LOW_PRECISION:
            assert_close(got.float(), r.detach(), f"{where} (vs the float32 twin)", **(tol or torch_tolerances(dtype)))
            assert_within_ulp(got, r, where)
        else:
            assert_close(got, r.detach(), where, **(tol or {}))
        ref_st, st = ref.state.get(r, {}), opt.state.get(p, {})
        if not ref_st:
            continue  # torch has no state for a parameter that never had a gradient
        for key in ref_st:
            assert key in st, f"{where}: state lacks {key!r} (has {sorted(st)})"
            want, have = ref_st[key], st[key]
            if key == "step":
                assert torch.is_tensor(have), f"{where}: state['step'] is {type(have).__name__}, torch's a tensor"
                assert have.dtype == want.dtype, f"{where}: state['step'] is {have.dtype}, torch's {want.dtype}"
                assert float(have) == float(want), f"{where}: step {float(have)} vs torch's {float(want)}"
            else:
                assert_close(have.detach().cpu().to(want.dtype), want.detach(), f"{where}: state {key!r}",
                             **(tol or {}))
        if dtype in LOW_PRECISION:
            assert "master_param" in st, f"{where}: a {dtype} parameter has no float32 master_param"
            assert_close(st["master_param"].detach().cpu(), r.detach(), f"{where}: master_param", **(tol or {}))


def assert_nested_equal(a, b, path="state_dict", **tol):
    """Structural equality of state dicts (tensors with assert_close, the rest with ==)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert_close(a.detach().cpu(), b.detach().cpu(), path, **tol)
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: dict vs {type(b).__name__}"
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_nested_equal(a[k], b[k], f"{path}[{k!r}]", **tol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{path}[{i}]", **tol)
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        assert math.isnan(b), f"{path}: {a!r} vs {b!r}"
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"


def without_param_names(state_dict):
    sd = copy.deepcopy(state_dict)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def public_attrs(obj):
    return {k for k in obj.__dict__ if not k.startswith("_")}


def check_each_config(configs, fn):
    """Runs fn(config) for every config (as unittest's subTest would) and fails with all failures."""
    failures = []
    for cfg in configs:
        try:
            fn(cfg)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            msg = " ".join(str(e).split())
            failures.append(f"[{cfg.desc}] {type(e).__name__}: {msg[:400]}")
    if failures:
        raise AssertionError(f"{len(failures)} of {len(configs)} configs failed:\n" + "\n".join(failures))
