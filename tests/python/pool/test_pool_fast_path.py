"""The eager fast path of PinnedPool.empty and hipferry.pin (Note [pool fast
path], csrc/torch/pool_fast_path.cpp): no Python code and no dispatcher call
on the allocation path (counted, not timed), the same tensors as the checked
path through the op, and everything unusual left to the checks and the op."""
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import hipferry
from hipferry import _C
from hipferry.torch_private import neg_view


def base(t):
    return t.untyped_storage().data_ptr()


def python_frames_and_c_calls(fn):
    """(Python functions that ran, C functions called from Python) while `fn` ran."""
    frames, c_calls = [], []

    def profiler(frame, event, arg):
        if event == "call":
            frames.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_code.co_name}")
        elif event == "c_call":
            c_calls.append(getattr(arg, "__name__", repr(arg)))

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [f for f in frames if not f.startswith("test_pool_fast_path.py:")], c_calls


def dispatcher_ops(fn):
    """The ops the dispatcher ran while `fn` ran (torch's profiler sees every op call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


# The Python functions the eager path may run: the wrappers and the eager check.
# (torch.compiler.is_compiling asks torch.jit.is_scripting.)
ALLOWED_FRAMES = {"pool.py:empty", "pool.py:pin", "torch_private.py:eager_dispatch", "__init__.py:is_compiling",
                  "_jit_internal.py:is_scripting"}


def test_pool_empty_and_free_run_no_python_code_and_no_dispatcher_call(pool):
    pool.empty((4096,), dtype=torch.float32)  # the size is cached from here on

    def alloc_free():
        t = pool.empty((4096,), dtype=torch.float32)
        del t

    frames, c_calls = python_frames_and_c_calls(alloc_free)
    assert set(frames) <= ALLOWED_FRAMES, frames
    assert "pool_empty_fast" in c_calls and not any("ops" in c or "stash" in c for c in c_calls), c_calls
    assert dispatcher_ops(alloc_free) == []


def test_the_counts_see_the_op_path():
    # The two counters above can fail: the checked path (what tracing takes) shows the op and its Python.
    with hipferry.PinnedPool() as pool:
        ops = dispatcher_ops(lambda: pool._empty_checked((4096,), torch.float32, None))
        frames, _ = python_frames_and_c_calls(lambda: pool._empty_checked((4096,), torch.float32, None))
    assert any("pool_empty" in name for name in ops), ops
    assert not set(frames) <= ALLOWED_FRAMES, frames


def test_pin_of_a_small_tensor_runs_no_python_code_and_no_dispatcher_call(pool):
    t = torch.randn(4096)
    hipferry.pin(t, pool)
    frames, _ = python_frames_and_c_calls(lambda: hipferry.pin(t, pool))
    assert set(frames) <= ALLOWED_FRAMES, frames
    assert dispatcher_ops(lambda: hipferry.pin(t, pool)) == []


def test_prefetch_of_a_flat_list_skips_pytree():
    xs = [torch.randn(16) for _ in range(8)]
    frames, _ = python_frames_and_c_calls(lambda: hipferry.prefetch(xs, "cpu").wait())
    assert not any("pytree" in f for f in frames), frames
    ys = hipferry.prefetch(tuple(xs), "cpu").wait()
    assert type(ys) is tuple and all(torch.equal(x, y) for x, y in zip(xs, ys))
    zs = hipferry.prefetch(xs, "cpu").wait()
    assert type(zs) is list and all(torch.equal(x, z) for x, z in zip(xs, zs))


SHAPES = st.lists(st.integers(0, 9), min_size=0, max_size=4)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
                          torch.float8_e4m3fn, torch.uint16])


@settings(max_examples=60, deadline=None)
@given(shape=SHAPES, dtype=DTYPES, spelling=st.sampled_from(["ints", "tuple", "list", "Size"]))
def test_the_fast_path_gives_what_the_checked_path_gives(shape, dtype, spelling):
    size = {"ints": tuple(shape), "tuple": (tuple(shape),), "list": (list(shape),),
            "Size": (torch.Size(shape),)}[spelling]
    with hipferry.PinnedPool(capacity="16MiB") as pool:
        fast = _C.pool_empty_fast(pool._id, size, dtype, None)
        assert fast is not None, (size, dtype)
        checked = pool._empty_checked(size, dtype, None)
        for t in (fast, checked):
            assert (t.shape, t.dtype, t.stride(), t.device) == (torch.Size(shape), dtype, checked.stride(),
                                                                torch.device("cpu"))
            if t.numel():
                assert _C.pool_owns(pool._id, base(t))
        assert pool.empty(*size, dtype=dtype).shape == torch.Size(shape)
        del fast, checked
        pool.check_invariants()


@pytest.mark.parametrize("size, dtype, for_device", [
    ((True,), torch.float32, None),                # a bool is not a size
    ((3.0,), torch.float32, None),
    ((-1,), torch.float32, None),
    (([2, "x"],), torch.float32, None),
    ((2,), "float32", None),
    ((2,), torch.qint8, None),
    ((2,), torch.float32, "cuda:0"),               # spellings of a device: the checks resolve them
    ((2,), torch.float32, True),
    ((2,), torch.float32, -1),
    (((2,), 3), torch.float32, None),
])
def test_the_fast_path_leaves_anything_unusual_to_the_checks(pool, size, dtype, for_device):
    before = pool.stats()
    assert _C.pool_empty_fast(pool._id, size, dtype, for_device) is None
    assert pool.stats() == before


def test_a_numpy_size_takes_the_checked_path_and_is_refused_there(pool):
    np = pytest.importorskip("numpy")
    assert _C.pool_empty_fast(pool._id, (np.int64(3),), torch.float32, None) is None
    with pytest.raises(TypeError, match="size must be ints"):
        pool.empty(np.int64(3))


def test_a_closed_pool_is_the_checks_error():
    pool = hipferry.PinnedPool()
    pool.close()
    assert _C.pool_empty_fast(pool._id, (2,), torch.float32, None) is None
    with pytest.raises(RuntimeError, match="pool is closed"):
        pool.empty(2)


def test_a_full_pool_is_out_of_memory_from_the_fast_path_and_loses_nothing():
    with hipferry.PinnedPool(capacity="1MiB") as pool:
        keep = pool.empty(1000)
        keep.fill_(3)
        with pytest.raises(torch.OutOfMemoryError, match="capacity"):
            _C.pool_empty_fast(pool._id, (1 << 20,), torch.float32, None)
        with pytest.raises(torch.OutOfMemoryError, match="capacity"):
            pool.empty(1 << 20)
        assert torch.equal(keep, torch.full((1000,), 3.0))
        pool.check_invariants()


def test_dispatch_modes_and_tracing_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    with hipferry.PinnedPool() as pool:
        with FakeTensorMode():
            t = pool.empty(3, 4)
        assert isinstance(t, FakeTensor) and t.shape == (3, 4)

        def staged(x):
            t = pool.empty(4, dtype=torch.float32)
            t.copy_(x)
            return t * 2

        # fullgraph: tracing must meet the op (with its fake kernel), not the fast call dynamo cannot trace
        compiled = torch.compile(staged, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(torch.arange(4.0)), torch.arange(4.0) * 2)


def make_inputs():
    """Tensors pin must copy as `.clone()` would, each named: the fast path takes some, the checks the rest."""
    x = torch.randn(6, 5)
    c = torch.randn(8, dtype=torch.complex64)
    return {
        "contiguous": x, "bfloat16": x.to(torch.bfloat16), "int": torch.arange(10), "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5), "view with offset": x[2:], "transposed": x.t(), "strided": x[:, ::2],
        "negative view": neg_view(x), "conjugate view": c.conj(), "imag of conj (negative bit)": c.conj().imag,
        "requires grad": x.clone().requires_grad_(True), "parameter": torch.nn.Parameter(x.clone(), False),
        "large (torch's copy)": torch.randn(1 << 17), "bool": x > 0,
    }


@pytest.mark.parametrize("name", list(make_inputs()))
def test_pin_copies_every_kind_of_tensor_exactly(pool, name):
    src = make_inputs()[name]
    out = hipferry.pin(src, pool)
    expect = src.detach().resolve_conj().resolve_neg()
    assert out.shape == src.shape and out.dtype == src.dtype and out.is_contiguous()
    assert torch.equal(out.detach().resolve_conj().resolve_neg(), expect)
    assert not out.is_neg() and not out.is_conj()
    assert out.requires_grad == src.requires_grad  # as out.copy_(src) gives
    if out.numel():
        assert _C.pool_owns(pool._id, base(out))
        assert base(out) != base(src)


def test_pin_of_a_subclass_takes_the_checked_path(pool):
    class Marked(torch.Tensor):
        pass
    src = torch.randn(5).as_subclass(Marked)
    assert _C.pool_pin_fast(pool._id, src) is None
    assert torch.equal(hipferry.pin(src, pool), src.as_subclass(torch.Tensor))


def test_pin_fast_path_leaves_bad_input_to_the_checks(pool):
    assert _C.pool_pin_fast(pool._id, "x") is None
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        hipferry.pin("x", pool)
    before = pool.stats()
    assert _C.pool_pin_fast(pool._id, torch.randn(4).to_sparse()) is None
    assert pool.stats() == before
