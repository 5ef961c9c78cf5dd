"""Shared fixtures and helpers of the transfer tests (test_transfer_*.py): the
device-generic fixtures ("cpu" here, "cuda" when a GPU is present), ways to
hold transfers in flight, and checks against the CPU reference."""
import time

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401 (re-exported)

import hipferry
from conftest import gpu_available, requires_gpu, requires_test_hooks, installed_test_hooks  # noqa: F401 (re-exported)
from test_copy_cast import INT_VIEW, PAIRS, inputs_for  # noqa: F401 (re-exported)

MiB = 2**20
WORKER_ELEMENTS = MiB // 4  # float32: 1 MiB, above the 256 KiB that the CPU path copies on the calling thread
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
DIRECTIONS = ["prefetch", "offload"]
SOURCES = ["pageable", "pin", "pool"]
PLAIN_DTYPES = [getattr(torch, n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64",
    "complex128", "uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
STATS_KEYS = ("transfers", "bytes", "packed_batches", "packed_tensors", "runtime_batches", "staged_chunks",
              "direct_copies", "pending_releases")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=DIRECTIONS)
def direction(request):
    return request.param


@pytest.fixture
def pool():
    p = hipferry.PinnedPool(capacity="512MiB")
    yield p
    drain()
    p.check_invariants()
    p.close()


# --- helpers ------------------------------------------------------------------------

def drain():
    """Everything queued before has run: the worker is serial, a GPU is synchronized."""
    hipferry.prefetch(torch.zeros(WORKER_ELEMENTS), "cpu").synchronize()
    if gpu_available():
        hipferry.prefetch(torch.zeros(1), "cuda").synchronize()
        torch.cuda.synchronize()


def pending_releases_after_polling(until):
    """transfer_stats()["pending_releases"] once it equals `until` (or after 30 s)."""
    deadline = time.monotonic() + 30  # dropped handles' holdings go at the engine's next poll
    while hipferry.transfer_stats()["pending_releases"] != until and time.monotonic() < deadline:
        time.sleep(0.01)
    return hipferry.transfer_stats()["pending_releases"]


def settled(pool):
    """The pool's stats once every transfer has run and what it held was let go."""
    drain()
    pending_releases_after_polling(0)
    pool.process_events()
    return pool.stats()


def hold(device, ms=200):
    """Keep the transfers started next in flight for about `ms`."""
    hooks = installed_test_hooks()
    if hooks is None:
        pytest.skip("holding transfers in flight needs the test hooks (HIPFERRY_TEST_HOOKS=ON)")
    hooks.transfer_worker_sleep(ms)
    if device == "cuda":
        torch.cuda._sleep(ms * 2_000_000)  # the copy is ordered after the current stream's work


def storage(t):
    return t.untyped_storage().data_ptr()


def as_bytes(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def make_source(kind, t, pool):
    return {"pageable": lambda: t, "pin": lambda: hipferry.pin(t), "pool": lambda: hipferry.pin(t, pool=pool)}[kind]()


def start(direction, tensors, device, **kw):
    """prefetch host -> `device`, or offload `device` -> host (sources moved to `device` first)."""
    if direction == "prefetch":
        return hipferry.prefetch(tensors, device, **kw)
    return hipferry.offload(tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tensors), **kw)


def check_same(got, want):
    """Same dtype, shape and every byte (NaN payloads included)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(as_bytes(got), as_bytes(want)), f"{want.dtype} {tuple(want.shape)}: values differ"


def check_converted(got, src, dtype):
    """Bit-identical to src.to(dtype); NaN by copy_cast_'s rule (a NaN of the same sign)."""
    want, got, src = src.cpu().to(dtype), got.cpu(), src.cpu()
    assert got.dtype == dtype and got.shape == src.shape
    nan = torch.isnan(want)
    gi, wi = got.view(INT_VIEW[dtype]), want.view(INT_VIEW[dtype])
    bad = (gi != wi) & ~nan
    assert not bad.any(), (f"{src.dtype}->{dtype}: {int(bad.sum())} differ, e.g. src {src[bad][:3]} "
                           f"got {[hex(int(v)) for v in gi[bad][:3]]} want {[hex(int(v)) for v in wi[bad][:3]]}")
    assert torch.equal(torch.isnan(got), nan)
    if src.dtype == dtype:
        assert torch.equal(gi, src.view(INT_VIEW[dtype]))
    else:
        assert torch.equal(torch.signbit(got[nan]), torch.signbit(src[nan]))


def check_result(direction, device, out, src, pool=None, want=None):
    """Every byte equals `want` (default: the source), and the result is where the spec puts it."""
    check_same(out, src if want is None else want)
    check_placement(direction, device, out, src, pool)


def check_placement(direction, device, out, src, pool=None):
    """prefetch: a new contiguous tensor on `device`; offload: a CPU tensor in the pool."""
    assert out.is_contiguous() and out.shape == src.shape
    if direction == "prefetch":
        assert out.device.type == torch.device(device).type
        if device == "cpu" and src.numel() > 0:
            assert storage(out) != storage(src), "prefetch to cpu must return a copy, not the source"
    else:
        assert out.device.type == "cpu"
        if out.numel() > 0:
            assert hipferry._C.pool_owns((pool or hipferry.default_pool())._id, storage(out))
        if device == "cuda":
            assert out.is_pinned()


def stats_delta(before):
    now = hipferry.transfer_stats()
    assert set(STATS_KEYS) <= set(now), sorted(now)
    return {k: now[k] - before[k] for k in STATS_KEYS}
