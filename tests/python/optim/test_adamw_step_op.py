"""hipferry::adamw_step_ and hipferry::bits_equal as torch ops: torch's op
checker, the fake kernels (FakeTensorMode, meta tensors, torch.compile), the
lazy negative / conjugate bits, and the pybind fast path (Note [adamw_step_
fast path] in csrc/torch/adamw_step.cpp) against the dispatcher path: the same
bits and the same errors. The step's arithmetic is tested in
test_adamw_step.py."""
import pytest
import torch

import hipferry
from hipferry import _C, ops
from hipferry.torch_private import neg_view
from conftest import requires_gpu

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
STEP = torch.ops.hipferry.adamw_step_.default
BITS_EQUAL = torch.ops.hipferry.bits_equal.default


def step_args(device="cpu", n=37, amsgrad=False, grad_dtype=torch.float32, out_dtype=None, from_inputs=False,
              step=3, maximize=False, adopt_out=False):
    """Positional arguments of adamw_step_ in schema order."""
    g = torch.Generator().manual_seed(n)
    f32 = [torch.randn(n, generator=g).to(device) for _ in range(4)]
    param, grad, m, v = f32[0], f32[1].to(grad_dtype), f32[2] * 1e-2, f32[3].abs() * 1e-3
    mx = v * 2 if amsgrad else None
    out = torch.empty(n, dtype=out_dtype, device=device) if out_dtype is not None else None
    args = [param, grad, m, v, mx, out, step, *HYPER.values(), amsgrad, maximize]
    if from_inputs:
        args += [param.clone(), m.clone(), v.clone(), mx.clone() if amsgrad else None]
    if adopt_out:  # param_out holds the parameter: the rounded param, some elements written since
        out.copy_(param)
        out[::3] = 1.5
        args += [None, None, None, None, True]
    return args


CASES = {
    "plain": {},
    "amsgrad bf16 grad bf16 out": dict(amsgrad=True, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16),
    "f16 out maximize": dict(out_dtype=torch.float16, maximize=True),
    "out of place": dict(from_inputs=True),
    "out of place amsgrad": dict(from_inputs=True, amsgrad=True),
    "bf16 out adopts writes": dict(out_dtype=torch.bfloat16, adopt_out=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_adamw_step_opcheck_cpu(case):
    torch.library.opcheck(STEP, step_args(**CASES[case]))


@requires_gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_adamw_step_opcheck_gpu(case):
    torch.library.opcheck(STEP, step_args("cuda", **CASES[case]))


# A bool that depends on the data cannot be traced by AOTAutograd (torch's own aten.equal fails
# test_aot_dispatch_dynamic the same way): the op's other checks.
BITS_EQUAL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("same", [True, False])
def test_bits_equal_opcheck_cpu(same):
    a = torch.randn(1000)
    b = a.clone() if same else torch.randn(1000)
    torch.library.opcheck(BITS_EQUAL, (a, b), test_utils=BITS_EQUAL_CHECKS)
    assert BITS_EQUAL(a, b) is same and ops.bits_equal(a, b) is same and _C._bits_equal(a, b) is same


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fast_path_and_the_dispatcher_give_the_same_bits(case):
    fast, slow = step_args(**CASES[case]), step_args(**CASES[case])
    _C._adamw_step_(*fast)
    STEP(*slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i


def test_the_wrapper_takes_the_op_under_a_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    args = step_args()
    with Record() as mode:
        ops.adamw_step_(*args)
        assert ops.bits_equal(args[0], args[0].clone())
    assert STEP in mode.seen and BITS_EQUAL in mode.seen


def test_fake_tensors_and_meta_tensors_check_like_the_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        args = [torch.empty(8), torch.empty(8, dtype=torch.bfloat16), torch.empty(8), torch.empty(8), None, None, 1,
                *HYPER.values(), False, False]
        ops.adamw_step_(*args)
        with pytest.raises(ValueError, match="grad has 7 elements but param has 8"):
            ops.adamw_step_(args[0], torch.empty(7), *args[2:])
        with pytest.raises(ValueError, match="exp_avg_in is missing"):
            ops.adamw_step_(*args, param_in=torch.empty(8))
    meta = [torch.empty(8, device="meta") for _ in range(4)]
    STEP(*meta, None, None, 1, *HYPER.values(), False, False)
    with pytest.raises(ValueError, match="amsgrad=True needs max_exp_avg_sq"):
        ops.call_op(STEP, *meta, None, None, 1, *HYPER.values(), True, False)
    with pytest.raises(ValueError, match="exp_avg_sq has dtype torch.float16; expected float32"):
        ops.call_op(STEP, *meta[:3], meta[3].half(), None, None, 1, *HYPER.values(), False, False)


def test_torch_compile_records_the_step_and_gives_the_eager_bits():
    def train_step(p, g, m, v, step):
        ops.adamw_step_(p, g * 2, m, v, None, None, step, **HYPER, amsgrad=False, maximize=False)
        return p + 1

    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    eager_args, compiled_args = step_args()[:4], step_args()[:4]
    for step in (1, 2):
        want = train_step(*eager_args, step)
        got = compiled(*compiled_args, step)
        assert torch.equal(got, want)
    for a, b in zip(eager_args, compiled_args):
        assert torch.equal(a, b)


def test_bits_equal_under_torch_compile_breaks_the_graph_and_answers():
    def commit(a, b):
        return a * 2 if ops.bits_equal(a, b) else a * 3

    compiled = torch.compile(commit, backend="aot_eager")
    a = torch.randn(100)
    assert torch.equal(compiled(a, a.clone()), a * 2) and torch.equal(compiled(a, a + 1), a * 3)


@pytest.mark.parametrize("call", ["fast", "op"])
def test_lazy_bits_are_refused_by_bits_equal_on_both_paths(call):
    f = _C._bits_equal if call == "fast" else (lambda a, b: ops.call_op(BITS_EQUAL, a, b))
    a = torch.randn(8)
    with pytest.raises(ValueError, match="b has torch's negative bit set"):
        f(a, neg_view(a))
    c = torch.randn(8, dtype=torch.complex64)
    with pytest.raises(ValueError, match="a has torch's conjugate bit set"):
        f(c.conj(), c)


def test_a_negative_view_written_in_place_through_the_op_does_not_corrupt_memory():
    # torch's MathBitsFallback corrupts the heap for a mutated argument of an op returning nothing
    # (test_copy_cast.py): the op's Negative kernel refuses the view before the fallback could run.
    for _ in range(500):
        args = step_args(n=3)
        args[0] = neg_view(args[0])
        with pytest.raises(ValueError, match="param has torch.s negative bit set"):
            STEP(*args)


def test_bits_equal_rejects_gpu_tensors_naming_the_argument():
    if not hipferry.device_count():
        pytest.skip("needs a GPU visible to hipferry")
    with pytest.raises(ValueError, match="a must be a contiguous dense CPU tensor"):
        ops.bits_equal(torch.zeros(4, device="cuda"), torch.zeros(4))
