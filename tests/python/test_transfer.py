"""hipferry.prefetch / offload and the Transfer handle against the spec
(docs/transfer-engine-plan.md, "The Python API (issue 4)"): exact values,
structure, ordering, lifetimes, bad input. Device-generic tests run on "cpu"
(copies on the transfer worker thread) and on "cuda" when a GPU is present;
results are compared with the CPU reference `src.to(dtype)`. Transfers are
held in flight with `hipferry._C.transfer_worker_sleep(ms)` (and a long
kernel on a GPU), never by timing."""
import gc
import re
import time

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import hipferry
from conftest import gpu_available, requires_gpu
from test_copy_cast import INT_VIEW, PAIRS, inputs_for

MiB = 2**20
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
DIRECTIONS = ["prefetch", "offload"]
SOURCES = ["pageable", "pin", "pool"]
PLAIN_DTYPES = [getattr(torch, n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64",
    "complex128", "uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
STATS_KEYS = ("transfers", "bytes", "packed_batches", "packed_tensors", "staged_chunks", "direct_copies",
              "pending_releases")


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
    hipferry.prefetch(torch.zeros(1), "cpu").synchronize()
    if gpu_available():
        hipferry.prefetch(torch.zeros(1), "cuda").synchronize()
        torch.cuda.synchronize()


def settled(pool):
    """The pool's stats once every transfer has run and its blocks were let go."""
    drain()
    pool.process_events()
    return pool.stats()


def hold(device, ms=200):
    """Keep the transfers started next in flight for about `ms`."""
    hipferry._C.transfer_worker_sleep(ms)
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


# --- values arrive exactly ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=lambda d: str(d)[6:])
def test_plain_copy_every_dtype(device, direction, dtype, pool):
    src = random_tensor((37, 129), dtype, seed=PLAIN_DTYPES.index(dtype))
    t = start(direction, src, device, pool=pool)
    assert t.num_tensors == 1 and t.nbytes == src.nbytes
    assert torch.device(t.device).type == (device if direction == "prefetch" else "cpu")
    out = t.wait()
    check_placement(direction, device, out, src, pool)
    check_same(out, src)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: str(d)[6:])
def test_fused_conversion_bit_exact(device, direction, src_dtype, dst_dtype, pool):
    src = hipferry.pin(inputs_for(src_dtype), pool=pool)  # specials, all 16-bit patterns, random bits
    t = start(direction, src, device, dtype=dst_dtype, pool=pool)
    assert t.nbytes == src.numel() * dst_dtype.itemsize
    out = t.wait()
    check_placement(direction, device, out, src, pool)
    check_converted(out, src, dst_dtype)


def test_structure_is_kept(device, direction, pool):
    ts = [random_tensor((n, 3), torch.float32, seed=n) for n in range(1, 7)]
    tensors = {"w": [ts[0], ts[1]], "t": (ts[2], ts[3]), "s": ts[4], "empty": [], "n": {"x": [ts[5]]}}
    t = start(direction, tensors, device, pool=pool)
    assert t.num_tensors == 6 and t.nbytes == sum(x.nbytes for x in ts)
    out = t.wait()
    assert isinstance(out, dict) and list(out) == list(tensors)
    assert isinstance(out["w"], list) and isinstance(out["t"], tuple) and out["empty"] == []
    assert isinstance(out["n"], dict) and isinstance(out["n"]["x"], list) and len(out["n"]["x"]) == 1
    for got, want in zip(tree_flatten(out)[0], ts):
        check_placement(direction, device, got, want, pool)
        check_same(got, want)
    check_same(start(direction, ts[0], device, pool=pool).wait(), ts[0])  # a single tensor stays one
    as_tuple = start(direction, (ts[1], ts[2]), device, pool=pool).wait()
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
    check_same(as_tuple[1], ts[2])
    for empty in ([], {}, ()):
        e = start(direction, empty, device)
        assert e.num_tensors == 0 and e.nbytes == 0 and e.wait() == empty


def test_views_and_non_contiguous_sources_arrive_contiguous(device):
    big = torch.arange(5000, dtype=torch.float32)
    srcs = [big[3:1000], big.view(50, 100).t(), big[::3], big.view(50, 100)[:, 7:20], big[4321],
            torch.full((1,), 2.5).expand(100), big.view(10, 5, 100).permute(2, 0, 1)]
    t = hipferry.prefetch(srcs, device)
    assert t.nbytes == sum(s.numel() * 4 for s in srcs)
    for got, src in zip(t.wait(), srcs):
        check_placement("prefetch", device, got, src)
        check_same(got, src.contiguous())
    assert torch.equal(big, torch.arange(5000, dtype=torch.float32)), "the source was modified"


def test_size_zero_and_scalars(device, direction, pool):
    srcs = [torch.empty(0), torch.empty(3, 0, 5, dtype=torch.int16), torch.tensor(3.5), torch.tensor(-7)]
    t = start(direction, srcs, device, pool=pool)
    assert t.num_tensors == 4 and t.nbytes == 4 + 8
    out = t.wait()
    for got, src in zip(out, srcs):
        check_placement(direction, device, got, src, pool)
        check_same(got, src)
    scalar = start(direction, torch.tensor(1.25, dtype=torch.float32), device, dtype=torch.bfloat16).wait()
    assert scalar.shape == () and scalar.dtype == torch.bfloat16 and float(scalar) == 1.25


def test_many_small_tensors(device, pool):
    srcs = [hipferry.pin(torch.full((4096,), float(i)), pool=pool) for i in range(1000)]  # 16 KiB each
    before = hipferry.transfer_stats()
    t = hipferry.prefetch(srcs, device, pool=pool)
    out = t.wait()
    assert len(out) == 1000 and t.num_tensors == 1000
    torch.testing.assert_close(torch.stack(out).cpu(), torch.stack(srcs), rtol=0, atol=0)
    d = stats_delta(before)
    assert d["transfers"] == 1 and d["bytes"] == 1000 * 16384, d
    if device == "cuda":
        assert d["packed_tensors"] == 1000 and d["packed_batches"] >= 1, d


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("n", [4096, 10 * MiB], ids=["16KiB", "40MiB"])
def test_sources_of_every_kind(device, kind, n, pool):
    src = make_source(kind, torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32), pool)
    before = hipferry.transfer_stats()
    t = hipferry.prefetch(src, device, pool=pool)
    out = t.wait()
    check_placement("prefetch", device, out, src)
    check_same(out, src)
    d = stats_delta(before)
    assert d["transfers"] == 1 and d["bytes"] == src.nbytes, d
    if device == "cuda" and n > 4096:
        assert d["staged_chunks"] + d["direct_copies"] >= 2, f"40 MiB should be chunked: {d}"


# --- ordering --------------------------------------------------------------------------

def test_in_flight_then_in_order_then_waited_once(device):
    a, b = torch.arange(1 << 20, dtype=torch.int32), -torch.arange(1 << 20, dtype=torch.int32)
    hold(device)
    t1, t2 = hipferry.prefetch(a, device), hipferry.prefetch(b, device)
    assert not t1.ready() and not t2.ready(), "held in flight by transfer_worker_sleep"
    out2 = t2.wait()
    if device == "cpu":
        assert t2.ready(), "wait() for a host result blocks until the copy ran"
    else:
        t2.synchronize()
    assert t1.ready(), "the earlier transfer completes first"
    check_same(out2, b)
    check_same(t1.wait(), a)
    with pytest.raises(RuntimeError, match="already waited"):
        t2.wait()


def test_consumer_after_wait_never_sees_stale_data(device, pool):
    base = torch.arange(10 * MiB, dtype=torch.int32)  # 40 MiB, every element distinct
    for k in range(3):
        src = hipferry.pin(base + k, pool=pool)
        hold(device, 50)
        out = hipferry.prefetch(src, device, pool=pool).wait()
        del src
        consumed = out + 0  # a kernel on the current stream right after wait()
        assert torch.equal(consumed.cpu(), base + k), f"round {k}: stale or partial data"


# --- lifetime --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pageable", "pool"])
def test_source_deleted_while_in_flight(device, kind, pool):
    n = 2 * MiB
    src = make_source(kind, torch.arange(n, dtype=torch.float32), pool)
    addr = storage(src)
    hold(device)
    t = hipferry.prefetch(src, device, pool=pool)
    del src
    gc.collect()
    if kind == "pool":
        other = pool.empty(n)
        assert storage(other) != addr, "the source's block was reused while a copy from it was queued"
    else:
        other = [torch.empty(n) for _ in range(4)]
    tree_map(lambda x: x.fill_(-1), other)
    check_same(t.wait(), torch.arange(n, dtype=torch.float32))


def test_handle_dropped_without_waiting(device, pool):
    drain()
    pending = hipferry.transfer_stats()["pending_releases"]
    hold(device)
    t = hipferry.prefetch(hipferry.pin(torch.ones(MiB), pool=pool), device, pool=pool)
    assert not t.ready()
    del t
    gc.collect()
    assert hipferry.transfer_stats()["pending_releases"] >= pending
    later = hipferry.prefetch(torch.arange(100), device)
    later.synchronize()
    deadline = time.monotonic() + 30  # releases may be noticed at the next poll
    while hipferry.transfer_stats()["pending_releases"] != pending and time.monotonic() < deadline:
        later.ready()
        time.sleep(0.01)
    assert hipferry.transfer_stats()["pending_releases"] == pending
    assert torch.equal(later.wait().cpu(), torch.arange(100))


def test_results_deleted_right_after_wait(device, pool):
    out = hipferry.prefetch(torch.ones(MiB), device, pool=pool).wait()
    del out
    fresh = torch.full((MiB,), -1.0, device=device)  # may reuse the freed memory: the copy must be done
    assert torch.equal(fresh.cpu(), torch.full((MiB,), -1.0))
    start_bytes = settled(pool)["allocated_bytes"]
    res = hipferry.offload([torch.ones(1000).to(device), torch.ones(77).to(device)], pool=pool).wait()
    assert pool.stats()["allocated_bytes"] > start_bytes
    del res
    gc.collect()
    assert settled(pool)["allocated_bytes"] == start_bytes, "offload results give their pool blocks back"


def test_no_leak_over_many_iterations(device):
    # 200 iterations of 2 x 64 KiB would leak ~25 MiB: more than the capacity.
    with hipferry.PinnedPool(capacity="16MiB") as p:
        start_stats = p.stats()
        for half in range(2):
            for i in range(100):
                if i % 10 == 0:
                    hold(device, 5)
                src = hipferry.pin(torch.full((16384,), float(i)), pool=p)
                if i % 4 == 3:
                    t = hipferry.offload(src.to(device), pool=p)
                else:
                    t = hipferry.prefetch(src, device, pool=p)
                if i % 4 == 1:
                    del t  # dropped unwaited
                    continue
                del src  # deleted before the copy completed
                out = t.wait()
                if i % 8 == 0:
                    assert float(out[-1]) == float(i)
                del t, out
            s = settled(p)
            assert s["live_blocks"] == start_stats["live_blocks"], f"half {half}: {s}"
            assert s["allocated_bytes"] == start_stats["allocated_bytes"], f"half {half}: {s}"
            assert s["waiting_blocks"] == 0 and s["reserved_bytes"] <= 16 * MiB
            p.check_invariants()


# --- bad input: clear errors, nothing modified -----------------------------------------

def check_rejected(call, exc, patterns, srcs):
    before = [s.clone() for s in srcs]
    transfers = hipferry.transfer_stats()["transfers"]
    with pytest.raises(exc) as info:
        call()
    for p in patterns:
        assert re.search(p, str(info.value), re.S), f"{str(info.value)!r} should match {p!r}"
    assert hipferry.transfer_stats()["transfers"] == transfers, "a rejected call started a transfer"
    for s, b in zip(srcs, before):
        assert torch.equal(s, b)


BAD_DEVICES = ["cuda:99", "tpu", -1, 99, "cuda:-1"] + ([] if gpu_available() else ["cuda", "cuda:0", 0])


@pytest.mark.parametrize("bad", BAD_DEVICES, ids=str)
def test_device_that_does_not_exist(bad):
    src = torch.ones(8)
    check_rejected(lambda: hipferry.prefetch(src, bad), ValueError,
                   [r"device", re.escape(str(bad).split(":")[-1])], [src])


@pytest.mark.parametrize("src_dtype,dtype,names", [
    (torch.int32, torch.float16, r"(int32|Int)\b.*(float16|Half)|(float16|Half).*(int32|Int)\b"),
    (torch.float32, torch.int8, r"(float32|Float)\b.*(int8|Char)|(int8|Char).*(float32|Float)\b"),
    (torch.float64, torch.float32, r"(float64|Double).*(float32|Float)|(float32|Float).*(float64|Double)"),
])
def test_dtype_that_cannot_be_converted(direction, src_dtype, dtype, names):
    srcs = [torch.ones(4), torch.arange(4).to(src_dtype)]  # the first alone would be fine
    check_rejected(lambda: start(direction, srcs, "cpu", dtype=dtype), ValueError, [r"dtype", names], srcs)


def test_non_tensor_leaf_names_its_place(direction):
    ok = torch.ones(3)
    check_rejected(lambda: start(direction, {"a": ok, "b": [ok, 3]}, "cpu"), TypeError, [r"b.*1", r"[Tt]ensor"], [ok])
    check_rejected(lambda: start(direction, "weights", "cpu"), TypeError, [r"[Tt]ensor"], [])


def test_sparse_rejected(direction):
    dense = torch.eye(3)
    check_rejected(lambda: start(direction, [dense, dense.to_sparse()], "cpu"), ValueError,
                   [r"sparse|strided|layout"], [dense])


def test_handle_after_a_failed_copy(device):
    with hipferry.PinnedPool(capacity="1MiB") as small:
        keep = small.empty(1000).fill_(3)
        src = torch.arange(MiB, dtype=torch.float32).to(device)  # 4 MiB: cannot fit the pool
        try:
            t = hipferry.offload(src, pool=small)
        except RuntimeError as e:  # rejected at the call: fine too
            assert "capacity" in str(e)
        else:
            for call in (t.synchronize, t.wait, t.wait, t.synchronize):
                with pytest.raises(RuntimeError, match="capacity"):
                    call()
            del t
        drain()
        assert torch.equal(src.cpu(), torch.arange(MiB, dtype=torch.float32)), "the source was modified"
        small.check_invariants()
        assert small.stats()["live_blocks"] == 1 and float(keep.sum()) == 3000
        ok = hipferry.offload(torch.ones(100).to(device), pool=small).wait()  # the pool still serves
        assert torch.equal(ok, torch.ones(100))


# --- GPU only -----------------------------------------------------------------------

@requires_gpu
def test_gpu_mixed_or_wrong_side_devices_rejected():
    h, d = torch.ones(4), torch.ones(4, device="cuda")
    check_rejected(lambda: hipferry.prefetch([h, d], "cuda"), ValueError, [r"device"], [h, d])
    check_rejected(lambda: hipferry.offload({"h": h, "d": d}), ValueError, [r"device"], [h, d])
    check_rejected(lambda: hipferry.prefetch(d, "cuda"), ValueError, [r"device|cpu|host"], [d])


@requires_gpu
@pytest.mark.parametrize("n", [4096, 4 * MiB], ids=["packed", "chunked"])
def test_gpu_prefetch_sees_values_a_kernel_is_still_writing(n, pool):
    values = torch.arange(n, dtype=torch.float32, device="cuda")
    host = pool.empty(n).fill_(-1)
    torch.cuda._sleep(100_000_000)  # the write below runs well after prefetch() returned
    host.copy_(values, non_blocking=True)
    out = hipferry.prefetch(host, "cuda", pool=pool).wait()
    assert torch.equal(out.cpu(), torch.arange(n, dtype=torch.float32))


@requires_gpu
def test_gpu_wait_orders_a_side_stream():
    srcs = [hipferry.pin(torch.full((4096,), float(i))) for i in range(64)]
    side = torch.cuda.Stream()
    hold("cuda", 100)  # packing waits on the worker: the copy lands late
    t = hipferry.prefetch(srcs, "cuda")
    with torch.cuda.stream(side):
        out = t.wait()  # the side stream waits, not the host
        consumed = torch.stack(out) * 1  # kernel on the side stream
    side.synchronize()
    assert torch.equal(consumed.cpu(), torch.stack(srcs))


@requires_gpu
def test_gpu_fused_bf16_prefetch_equals_torch():
    src = hipferry.pin(torch.randn(1 << 22) * 300)
    out = hipferry.prefetch(src, "cuda", dtype=torch.bfloat16).wait()
    want = src.to("cuda", torch.bfloat16)
    assert torch.equal(out.view(torch.int16).cpu(), want.view(torch.int16).cpu())
    check_converted(out, src, torch.bfloat16)
