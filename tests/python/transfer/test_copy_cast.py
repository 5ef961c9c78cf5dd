"""hipferry.copy_cast_: bit-identical to torch's .to(dtype) on every backend.

One device-generic checker, thin per-placement wrappers; the GPU ones skip
without a GPU. Every GPU result is compared with the CPU reference (torch).
"""
import subprocess
import sys

import pytest
import torch

import hipferry
from conftest import requires_gpu

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
PAIRS = [(s, d) for s in FLOATS for d in FLOATS]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def special_f32() -> torch.Tensor:
    """Edge values for float32 sources: zeros, infinities, extremes, subnormals,
    exact rounding ties for float16 and bfloat16, overflow thresholds."""
    bits = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x00000001, 0x807FFFFF,  # max, min normal, subnormals
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # bf16 ties (even, odd) and neighbours
        0x3F801000, 0x3F803000, 0x3F800FFF,  # f16 ties
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # f16 max, just below inf threshold, 65520, 65536
        0x7F7F8000, 0x7F7F7FFF,  # bf16 overflow threshold
        0x33000000, 0x33000001, 0x33400000, 0x33C00000, 0x387FE000, 0x38800000,  # f16 subnormal ties / edges
        0x3F800000, 0xBF800000, 0x40490FDB,
    ]
    t = torch.tensor(bits, dtype=torch.int64)
    return t.to(torch.int32).view(torch.float32)  # wraps >= 2^31 to negative ints, same bits


def random_bits(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    iv = INT_VIEW[dtype]
    info = torch.iinfo(iv)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(iv).view(dtype)


def all_16bit(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


def expected(src: torch.Tensor, dst_dtype: torch.dtype) -> torch.Tensor:
    return src.cpu().to(dst_dtype)


def inputs_for(src_dtype: torch.dtype):
    if src_dtype == torch.float32:
        return torch.cat([special_f32(), random_bits(200_003, torch.float32)])
    return torch.cat([all_16bit(src_dtype), random_bits(1001, src_dtype)])


def check_copy_cast(src_dtype, dst_dtype, src_device, dst_device, n=None):
    src = inputs_for(src_dtype) if n is None else (torch.randn(n) * 300).to(src_dtype)
    if src_device == "cuda":
        src = src.cuda()
    elif dst_device == "cuda":
        src = src.pin_memory()
    dst = torch.empty(src.shape, dtype=dst_dtype, device=dst_device,
                      pin_memory=(dst_device == "cpu" and src_device == "cuda"))
    out = hipferry.copy_cast_(dst, src)
    assert out is dst
    if "cuda" in (src_device, dst_device):
        torch.cuda.synchronize()
    want = expected(src, dst_dtype)
    got = dst.cpu()
    nan = torch.isnan(want)
    # Non-NaN: bit-identical to torch.
    gi, wi = got.view(INT_VIEW[dst_dtype]), want.view(INT_VIEW[dst_dtype])
    bad = (gi != wi) & ~nan
    assert not bad.any(), (f"{src_dtype}->{dst_dtype}: {int(bad.sum())} differ, e.g. src "
                           f"{src.cpu()[bad][:3]} got {[hex(int(v)) for v in gi[bad][:3]]} "
                           f"want {[hex(int(v)) for v in wi[bad][:3]]}")
    # NaN: NaN, same sign as the source NaN.
    assert torch.equal(torch.isnan(got), nan)
    if src_dtype != dst_dtype:
        assert torch.equal(torch.signbit(got[nan]), torch.signbit(src.cpu()[nan]))
    else:
        assert torch.equal(gi, src.cpu().view(INT_VIEW[dst_dtype])), "same-dtype copy must keep every bit"
    return dst


# --- CPU ----------------------------------------------------------------------

@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: str(d)[6:])
def test_cpu_bit_identical_to_torch(src_dtype, dst_dtype):
    check_copy_cast(src_dtype, dst_dtype, "cpu", "cpu")


@pytest.mark.parametrize("n", [0, 1, 7, 65_537, 1_000_003])
def test_cpu_sizes(n):
    for s, d in [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)]:
        check_copy_cast(s, d, "cpu", "cpu", n=n)


def test_cpu_nan_rule():
    src = torch.tensor([0x7F800001, 0xFF812345, 0x7FC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    bf = hipferry.copy_cast_(torch.empty(3, dtype=torch.bfloat16), src).view(torch.int16)
    f16 = hipferry.copy_cast_(torch.empty(3, dtype=torch.float16), src).view(torch.int16)
    assert [v & 0xFFFF for v in bf.tolist()] == [0x7FC0, 0xFFC1, 0x7FC0]
    assert [v & 0xFFFF for v in f16.tolist()] == [0x7E00, 0xFE09, 0x7E00]


def test_cpu_same_dtype_any_dtype_and_views():
    base = torch.arange(100, dtype=torch.int64)
    dst = torch.zeros(40, dtype=torch.int64)
    hipferry.copy_cast_(dst, base[10:50])  # contiguous view with an offset
    assert torch.equal(dst, base[10:50])
    m = torch.randn(64, 33)
    d2 = torch.empty(64, 33, dtype=torch.bfloat16)
    hipferry.copy_cast_(d2, m)
    assert torch.equal(d2.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))


@pytest.mark.slow
def test_cpu_large_int64_indexing():
    # More than 2^31 elements: int64 indexing in the CPU kernel.
    n = (1 << 31) + 17
    src = torch.empty(n, dtype=torch.bfloat16)
    src[:8] = torch.tensor([1.5, -2.0, 3.0, 0.0, float("inf"), -1e-40, 7.0, 8.0])
    src[-8:] = torch.tensor([9.0, 10.0, -11.0, 12.5, 13.0, 14.0, 15.0, 65504.0])
    dst = torch.empty(n, dtype=torch.float16)
    hipferry.copy_cast_(dst, src)
    assert torch.equal(dst[:8].view(torch.int16), src[:8].to(torch.float16).view(torch.int16))
    assert torch.equal(dst[-8:].view(torch.int16), src[-8:].to(torch.float16).view(torch.int16))


# --- bad input: clear error, dst untouched -----------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: (torch.zeros(4, 3), torch.ones(3, 4)), r"dst has shape \[4, 3\] but src has shape \[3, 4\]"),
    (lambda: (torch.zeros(4, dtype=torch.float16), torch.ones(4, dtype=torch.int32)),
     r"cannot convert src dtype torch.int32 to dst dtype torch.float16"),
    (lambda: (torch.zeros(4, 4), torch.ones(4, 4).t()), r"src must be contiguous"),
    (lambda: (torch.zeros(4, 4).t(), torch.ones(4, 4)), r"dst must be contiguous"),
    (lambda: (torch.zeros(4, dtype=torch.float64), torch.ones(4)),
     r"cannot convert src dtype torch.float32 to dst dtype torch.float64"),
])
def test_bad_input_is_rejected_and_dst_untouched(make, match):
    dst, src = make()
    before = dst.clone()
    with pytest.raises(RuntimeError, match=match):
        hipferry.copy_cast_(dst, src)
    assert torch.equal(dst, before)
    assert torch.equal(src, make()[1])  # the source is never modified either


def test_overlap_rejected():
    buf = torch.arange(8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="share memory"):
        hipferry.copy_cast_(buf[1:5], buf[0:4])
    assert torch.equal(buf, torch.arange(8, dtype=torch.float32))


def test_non_tensor_arguments():
    with pytest.raises(TypeError, match="dst must be a torch.Tensor"):
        hipferry.copy_cast_([1.0], torch.ones(1))
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        hipferry.copy_cast_(torch.ones(1), 1.0)


def test_sparse_rejected():
    dst = torch.zeros(3)
    with pytest.raises(ValueError, match="src must be a strided"):
        hipferry.copy_cast_(dst, torch.ones(3).to_sparse())
    assert torch.equal(dst, torch.zeros(3))


def quantized():
    return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


def nested():
    return torch.nested.nested_tensor([torch.randn(4), torch.randn(4)])


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized / nested tensors: "deprecated", "prototype"
@pytest.mark.parametrize("make,what", [(quantized, "is quantized"), (nested, "is a nested tensor")],
                         ids=["quantized", "nested"])
@pytest.mark.parametrize("side", ["dst", "src"])
def test_quantized_and_nested_rejected_naming_the_side(make, what, side):
    odd, plain = make(), torch.zeros(4)
    odd_before = odd.int_repr().clone() if odd.is_quantized else odd.values().clone()
    dst, src = (odd, plain) if side == "dst" else (plain, odd)
    with pytest.raises(ValueError, match=rf"copy_cast_: {side} {what}\b.*; expected a plain"):
        hipferry.copy_cast_(dst, src)
    assert torch.equal(plain, torch.zeros(4))
    assert torch.equal(odd.int_repr() if odd.is_quantized else odd.values(), odd_before)


@pytest.mark.parametrize("meta_side", ["dst", "src"])
@pytest.mark.parametrize("call", [hipferry.copy_cast_, torch.ops.hipferry.copy_cast_.default],
                         ids=["hipferry", "torch.ops"])
def test_meta_on_one_side_only_rejected(meta_side, call):
    # The Meta key wins dispatch when either side is meta: without a check the fake kernel "succeeds" and
    # nothing is written (dst real) or read (src real).
    real = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    meta = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    other = "src" if meta_side == "dst" else "dst"
    with pytest.raises(RuntimeError, match=rf"{meta_side} is on the meta device but {other} is on cpu"):
        call(meta, real) if meta_side == "dst" else call(real.to(torch.bfloat16), meta)
    assert torch.equal(real, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    dst = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="meta device"):
        call(dst, torch.empty(2, 3, device="meta"))
    assert torch.equal(dst, torch.zeros(2, 3))


def test_fake_tensors_check_shapes_and_dtypes_on_the_device_they_stand_for():
    # torch.compile's FakeTensors report cpu (not meta): the fake kernel accepts them, and checks shapes.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        dst, src = torch.empty(3, 4, dtype=torch.bfloat16), torch.empty(3, 4)
        assert dst.device.type == "cpu"
        assert hipferry.copy_cast_(dst, src) is dst
        with pytest.raises(RuntimeError, match="expected equal shapes"):
            hipferry.copy_cast_(dst, torch.empty(4, 3))
        with pytest.raises(RuntimeError, match="meta device"):
            hipferry.copy_cast_(dst, torch.empty(3, 4, device="meta"))


# --- tensors with torch's conjugate / negative bit ----------------------------

MATH_BIT_CASES = {
    "neg f32->bf16": (lambda t: torch._neg_view(t), torch.float32, torch.bfloat16),
    "neg bf16->f16": (lambda t: torch._neg_view(t), torch.bfloat16, torch.float16),
    "conj c64": (lambda t: t.conj(), torch.complex64, torch.complex64),
    "neg conj c64": (lambda t: torch._neg_view(t.conj()), torch.complex64, torch.complex64),
}


@pytest.mark.parametrize("case", sorted(MATH_BIT_CASES))
@pytest.mark.parametrize("call", [hipferry.copy_cast_, torch.ops.hipferry.copy_cast_.default],
                         ids=["hipferry", "torch.ops"])
def test_dst_and_src_with_conjugate_or_negative_bit_give_torch_values(case, call):
    view, src_dtype, dst_dtype = MATH_BIT_CASES[case]
    g = torch.Generator().manual_seed(1)
    src = (torch.randn(257, generator=g, dtype=torch.complex64 if src_dtype.is_complex else torch.float32) * 300)
    src = src.to(src_dtype)
    base = torch.zeros(257, dtype=dst_dtype)
    call(view(base), src)  # writing v into a view with the bit stores conj(v) / -v in base
    assert torch.equal(view(base), src.to(dst_dtype))
    plain = torch.zeros(257, dtype=dst_dtype)
    call(plain, view(src.clone()))  # a source with the bit: its values, not its raw memory
    assert torch.equal(plain, view(src).to(dst_dtype))


def test_negative_view_copied_onto_itself_does_not_corrupt_memory():
    # torch's MathBitsFallback, for a mutated argument of an op returning nothing, wrote past the end of the
    # dispatcher stack: "malloc(): unsorted double linked list corrupted" within a few hundred calls. Run in a
    # subprocess, so that a regression is a failure, not the end of the test session.
    code = ("import torch, hipferry\n"
            "for i in range(3000):\n"
            "    x = torch._neg_view(torch.randn(3))\n"
            "    want = x.clone()\n"
            "    torch.ops.hipferry.copy_cast_(x, x)\n"
            "    hipferry.copy_cast_(x, x)\n"
            "    assert torch.equal(x, want)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_math_bits_keep_the_contiguity_rule():
    # The bit moves from dst to src, which is then materialized (a contiguous copy): the rule is checked first.
    with pytest.raises(RuntimeError, match="src must be contiguous"):
        hipferry.copy_cast_(torch._neg_view(torch.zeros(4, 4)), torch.ones(4, 4).t())
    with pytest.raises(RuntimeError, match=r"cannot convert src dtype torch.bool to dst dtype torch.float32"):
        hipferry.copy_cast_(torch._neg_view(torch.zeros(4)), torch.ones(4, dtype=torch.bool))


def test_math_bits_on_meta_fake_and_compiled_tensors():
    # With the fake kernel the fallback said "Expected Tensor but got None".
    hipferry.copy_cast_(torch._neg_view(torch.empty(3, device="meta")), torch.empty(3, device="meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        hipferry.copy_cast_(torch.empty(3, dtype=torch.complex64).conj(), torch.empty(3, dtype=torch.complex64))

    def step(out, x):
        hipferry.copy_cast_(torch._neg_view(out), x * 2)
        return out

    x = torch.randn(100)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(torch.zeros(100, dtype=torch.bfloat16), x)
    assert torch.equal(got, step(torch.zeros(100, dtype=torch.bfloat16), x))


# --- torch integration ------------------------------------------------------

@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_opcheck_cpu(src_dtype, dst_dtype):
    src = torch.randn(37).to(src_dtype)
    dst = torch.empty(37, dtype=dst_dtype)
    torch.library.opcheck(torch.ops.hipferry.copy_cast_.default, (dst, src))


def test_meta_kernel_checks_shapes():
    dst = torch.empty(3, 4, dtype=torch.bfloat16, device="meta")
    torch.ops.hipferry.copy_cast_(dst, torch.empty(3, 4, device="meta"))
    with pytest.raises(RuntimeError, match="expected equal shapes"):
        torch.ops.hipferry.copy_cast_(dst, torch.empty(4, 3, device="meta"))
    # What the real kernels reject, the meta kernel rejects too (it ran through, before).
    with pytest.raises(RuntimeError, match="src must be contiguous"):
        torch.ops.hipferry.copy_cast_(dst, torch.empty(4, 3, device="meta").t())
    with pytest.raises(RuntimeError, match="dst must be contiguous"):
        torch.ops.hipferry.copy_cast_(torch.empty(4, 3, device="meta").t(), torch.empty(3, 4, device="meta"))


def test_torch_compile():
    def step(x, out):
        y = x * 2
        hipferry.copy_cast_(out, y)
        return out.float() + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(1000)
    out_c = torch.empty(1000, dtype=torch.bfloat16)
    out_e = torch.empty(1000, dtype=torch.bfloat16)
    assert torch.equal(compiled(x, out_c), step(x, out_e))
    assert torch.equal(out_c.view(torch.int16), out_e.view(torch.int16))


# --- GPU (skipped without one) -----------------------------------------------

@requires_gpu
@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("placement", ["h2d", "d2h", "d2d"])
def test_gpu_bit_identical_to_cpu_reference(src_dtype, dst_dtype, placement):
    src_dev, dst_dev = {"h2d": ("cpu", "cuda"), "d2h": ("cuda", "cpu"), "d2d": ("cuda", "cuda")}[placement]
    check_copy_cast(src_dtype, dst_dtype, src_dev, dst_dev)


@requires_gpu
@pytest.mark.parametrize("n", [0, 1, 7, 1_000_003])
def test_gpu_sizes(n):
    check_copy_cast(torch.float32, torch.bfloat16, "cpu", "cuda", n=n)
    check_copy_cast(torch.float32, torch.float16, "cuda", "cpu", n=n)


@requires_gpu
def test_gpu_runs_on_the_current_stream():
    # A long kernel on a side stream writes src; copy_cast_ on that stream must see it.
    s = torch.cuda.Stream()
    src = torch.zeros(1 << 22, device="cuda")
    dst = torch.empty(1 << 22, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(s):
        for _ in range(20):
            src.add_(1.0)
        hipferry.copy_cast_(dst, src)
    s.synchronize()
    assert torch.equal(dst.float(), torch.full_like(src, 20.0))


@requires_gpu
def test_gpu_pageable_host_rejected_and_dst_untouched():
    dst = torch.zeros(16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="src is pageable host memory"):
        hipferry.copy_cast_(dst, torch.ones(16))
    assert torch.equal(dst, torch.zeros_like(dst))
    with pytest.raises(RuntimeError, match="dst is pageable host memory"):
        hipferry.copy_cast_(torch.zeros(16), torch.ones(16, device="cuda"))


@requires_gpu
def test_gpu_wrong_device_rejected():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    dst = torch.zeros(4, device="cuda:1")
    with pytest.raises(RuntimeError, match="not|current device"):
        hipferry.copy_cast_(dst, torch.ones(4, device="cuda:0"))


@requires_gpu
def test_gpu_opcheck():
    src = torch.randn(37, device="cuda")
    dst = torch.empty(37, dtype=torch.float16, device="cuda")
    torch.library.opcheck(torch.ops.hipferry.copy_cast_.default, (dst, src))
