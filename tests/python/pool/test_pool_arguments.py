"""hipferry.PinnedPool, default_pool(), pin() and record_use(): bad arguments are
rejected with an error naming the argument and what was expected, leaving the
pool as it was; the default pool's configuration; the constants from _C."""
import pytest
import torch

import hipferry
from hipferry import pool as pool_module
from pool_helpers import pool  # noqa: F401 (the fixture)

MiB = 2**20


@pytest.mark.parametrize("size, exc, match", [
    ((-1,), ValueError, "size must be >= 0"),
    ((3, -2), ValueError, "index 1"),
    ((2**40, 2**40), RuntimeError, "2\\^50"),
    ((1.5,), TypeError, "size must be ints"),
])
def test_bad_sizes_are_rejected_and_pool_survives(pool, size, exc, match):
    keep = pool.empty(100).fill_(1)
    with pytest.raises(exc, match=match):
        pool.empty(*size)
    pool.check_invariants()
    assert float(keep.sum()) == 100 and pool.stats()["live_blocks"] == 1


def test_absurd_request_beyond_capacity_is_out_of_memory(pool):
    with pytest.raises(torch.OutOfMemoryError, match="capacity"):
        pool.empty(2**40, dtype=torch.uint8)
    pool.check_invariants()


def test_bad_dtypes_are_rejected(pool):
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        pool.empty(3, dtype="float32")
    with pytest.raises(ValueError, match="quantized"):
        pool.empty(3, dtype=torch.qint8)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(capacity=100), ValueError, "at least 256"),
    (dict(capacity="lots"), ValueError, "capacity must look like"),
    (dict(capacity=-5), ValueError, "capacity must be >= 0"),
    (dict(capacity="1MiB", reserve="2MiB"), ValueError, "reserve"),
    (dict(provider="cuda"), ValueError, "provider must be one of"),
    (dict(register_threads=0), ValueError, "register_threads"),
    (dict(coherent="yes"), ValueError, "coherent"),
    (dict(max_cached=[1]), TypeError, "max_cached"),
    # Found by test_public_api_fuzz.py: the hipHostMalloc flags took any value by its truth.
    (dict(portable="no"), TypeError, "portable must be True or False, got 'no'"),
    (dict(mapped=0), TypeError, "mapped must be True or False, got 0"),
    (dict(numa_user=None), TypeError, "numa_user must be True or False"),
    (dict(write_combined="false"), TypeError, "write_combined must be True or False"),
    (dict(coherent=0), ValueError, "coherent must be None, True or False, got 0"),  # was taken as None
])
def test_bad_pool_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        hipferry.PinnedPool(**kwargs)


def test_record_use_checks_its_arguments(pool):
    t = pool.empty(16)
    pool.record_use(t)  # default stream: fine with or without a GPU
    pool.record_use(pool.empty(0))
    with pytest.raises(ValueError, match="allocated from this pool"):
        pool.record_use(torch.zeros(16))
    pool.record_use(t[4:])  # a view shares the block
    other = hipferry.PinnedPool()
    with pytest.raises(ValueError, match="allocated from this pool"):
        other.record_use(t)
    other.close()
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        pool.record_use(t, stream="default")


def test_default_pool_configuration(monkeypatch):
    assert pool_module.parse_pool_config("capacity=8GiB, max_cached=1GiB,provider=register,coherent=false") == {
        "capacity": "8GiB", "max_cached": "1GiB", "provider": "register", "coherent": False}
    with pytest.raises(ValueError, match="unknown key 'size'"):
        pool_module.parse_pool_config("size=3")
    with pytest.raises(ValueError, match="key=value"):
        pool_module.parse_pool_config("capacity")
    assert pool_module.parse_bytes("1.5GB", "x") == 1_500_000_000 and pool_module.parse_bytes("2KiB", "x") == 2048
    hipferry.default_pool()  # exists now
    with pytest.raises(RuntimeError, match="already exists"):
        hipferry.configure_default_pool(capacity="1GiB")
    monkeypatch.setattr(pool_module, "_default_pool", None)
    monkeypatch.setattr(pool_module, "_default_config", None)
    monkeypatch.setenv("HIPFERRY_PINNED_POOL", "capacity=32MiB")
    assert hipferry.default_pool().capacity == 32 * MiB
    monkeypatch.setattr(pool_module, "_default_pool", None)
    with pytest.raises(TypeError, match="unknown arguments"):
        hipferry.configure_default_pool(size=3)
    hipferry.configure_default_pool(capacity="48MiB")
    assert hipferry.default_pool().capacity == 48 * MiB
    hipferry.default_pool().close()


def test_pin_rejects_bad_input(pool):
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        hipferry.pin([1, 2, 3])
    with pytest.raises(ValueError, match="strided"):
        hipferry.pin(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="pool must be"):
        hipferry.pin(torch.ones(3), pool="default")
    with pytest.raises(RuntimeError, match="2\\^50|OutOfMemory|capacity"):
        hipferry.pin(torch.ones(1).expand(2**40), pool=pool)
    pool.check_invariants()


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized / nested tensors: "deprecated", "prototype"
def test_pin_rejects_nested_and_quantized_naming_tensor(pool):
    # Found by test_public_api_fuzz.py: a nested tensor gave torch's "Internal error: NestedTensorImpl doesn't
    # support sizes", a quantized one an error about PinnedPool.empty's dtype argument, which pin has not.
    before = pool.stats()["allocated_bytes"]
    with pytest.raises(ValueError, match="hipferry.pin: tensor is a nested tensor; expected a plain"):
        hipferry.pin(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), pool=pool)
    with pytest.raises(ValueError, match=r"hipferry.pin: tensor is quantized \(torch.qint8\); expected a plain"):
        hipferry.pin(torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), pool=pool)
    pool.check_invariants()
    assert pool.stats()["allocated_bytes"] == before


@pytest.mark.parametrize("kw", [dict(capacity=2**64), dict(max_cached=2**64), dict(capacity=None, reserve=2**64)])
def test_pool_sizes_beyond_64_bits_are_a_clear_error(kw):
    name = next(k for k, v in kw.items() if v is not None)
    with pytest.raises(ValueError, match=rf"{name} must be at most 2\*\*64 - 1 bytes"):
        hipferry.PinnedPool(**kw)


def test_reserve_over_capacity_names_the_rounded_reserve():
    with pytest.raises(ValueError, match=r"reserve \(100 bytes, 65536 once rounded up to the pool's 64 KiB "
                                         r"segment granule\) must not exceed capacity \(256 bytes\)"):
        hipferry.PinnedPool(capacity=256, reserve=100)


def test_empty_of_a_dimension_beyond_int64_is_a_clear_error(pool):
    with pytest.raises(ValueError, match=r"size must be at most 2\*\*63 - 1 in every dimension, "
                                         r"got 9223372036854775808 at index 0"):
        pool.empty(2**63)
    with pytest.raises(RuntimeError, match="more than 2\\^50 elements"):
        pool.empty(2**62, 4)


def test_zero_element_tensors_may_have_huge_other_dimensions(pool):
    before = pool.stats()["allocated_bytes"]
    t = pool.empty(2**31, 2**31, 0)
    assert t.shape == (2**31, 2**31, 0) and t.numel() == 0
    assert pool.stats()["allocated_bytes"] == before


def test_record_use_rejects_a_stream_that_is_not_one_on_every_machine(pool):
    t = pool.empty(8)
    with pytest.raises(TypeError, match=r"stream must be a torch.cuda.Stream or None, got str"):
        pool.record_use(t, stream="s")


def test_record_use_checks_the_stream_for_every_tensor():
    # Issue 33: an empty tensor (which owns no block) skipped the stream check.
    with hipferry.PinnedPool(capacity="1MiB") as p:
        for t in (p.empty(0), p.empty(16)):
            for stream in (3, "s"):
                with pytest.raises(TypeError, match="record_use: stream must be a torch.cuda.Stream"):
                    p.record_use(t, stream=stream)
        p.record_use(p.empty(0))  # stream=None: still fine


def test_resolve_pool():
    from hipferry.pool import resolve_pool
    assert resolve_pool(None, "api") is hipferry.default_pool()
    with hipferry.PinnedPool(capacity="1MiB") as p:
        assert resolve_pool(p, "api") is p
    with pytest.raises(RuntimeError, match="^my.api: the pool is closed"):
        resolve_pool(p, "my.api")
    with pytest.raises(TypeError, match="^my.api: pool must be a hipferry.PinnedPool or None, got str"):
        resolve_pool("pool", "my.api")


def test_pool_constants_are_the_native_modules():
    from hipferry import _C, pool_args
    assert pool_args.PROVIDERS == tuple(_C.HOST_MEMORY_PROVIDERS) == ("auto", "host_alloc", "register", "pageable")
    assert pool_args.RESERVE_GRANULE == _C.RESERVE_GRANULE == 64 << 10
    flags = _C.HOST_ALLOC_FLAGS
    assert flags == {"portable": 0x1, "mapped": 0x2, "write_combined": 0x4, "numa_user": 0x20000000,
                     "coherent": 0x40000000, "non_coherent": 0x80000000}  # HIP's hipHostMalloc values
    assert pool_args.host_alloc_flags(True, True, None, False, False) == 0x3
    assert pool_args.host_alloc_flags(False, False, False, True, True) == 0x80000000 | 0x20000000 | 0x4
    assert pool_args.host_alloc_flags(False, True, True, False, False) == 0x40000002
    with pytest.raises(ValueError, match="provider must be one of"):
        hipferry.PinnedPool(provider="nope")
    with pytest.raises(ValueError, match="rounded up to the pool's 64 KiB segment granule"):
        hipferry.PinnedPool(capacity=1000, reserve=900)
