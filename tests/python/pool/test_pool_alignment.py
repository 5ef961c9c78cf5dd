"""PinnedPool.empty(..., alignment=4096): page-aligned storage of whole pages
(O_DIRECT's buffers), through the fast path and through the op; a bad
alignment is refused, naming the argument, before the pool changes."""
import os
import re

import pytest
import torch

import hipferry
from pool_helpers import pool  # noqa: F401  (the 256 MiB pool fixture, checked and closed after each test)

PAGE = 4096


def sizes():
    # Byte counts around every kind of block: below and at 256, around a page,
    # size-class steps, the small/medium limit (1 MiB) and own segments (16 MiB).
    edges = [1, 255, 256, 257, 1000, 4095, 4096, 4097, 8191, 12 * 1024 + 1, 65535, 2**20 - 1, 2**20, 2**20 + 1,
             3 * 2**20 + 5, 16 * 2**20 + 1]
    return edges + [int(1.37**k) for k in range(2, 52)]


def test_page_aligned_storage_for_many_sizes_among_256_aligned_ones(pool):
    live = []
    for n in sizes():
        # A 256-aligned neighbour first: free space then starts off a page.
        live.append(pool.empty(100, dtype=torch.uint8))
        t = pool.empty(n, dtype=torch.uint8, alignment=PAGE)
        assert t.data_ptr() % PAGE == 0, n
        assert t.numel() == n and t.is_contiguous()
        t.fill_(n % 251)
        live.append(t)
    for t in live[1::2]:
        assert int(t[0]) == int(t[-1]) == t.numel() % 251  # no block overlapped another
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in live)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
    pool.check_invariants()
    stats = pool.stats()
    assert stats["requested_bytes"] == sum(t.numel() for t in live)
    del live, t
    stats = pool.stats()
    assert stats["allocated_bytes"] == 0 and stats["cached_free_bytes"] == stats["reserved_bytes"]
    assert pool.trim() == stats["reserved_bytes"]  # every segment one free block again: heads merged back


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (3, 5)), (torch.bfloat16, (1025,)),
                                          (torch.float64, (7, 9, 11)), (torch.int8, (4097,))])
def test_page_aligned_through_the_op_and_the_fast_path_alike(pool, dtype, shape):
    fast = pool.empty(*shape, dtype=dtype, alignment=PAGE)
    checked = pool._empty_checked(shape, dtype, None, PAGE)  # the op, as tracing and dispatch modes take it
    direct = torch.ops.hipferry.pool_empty.default(pool._id, list(shape), dtype, -1, PAGE)
    for t in (fast, checked, direct):
        assert t.data_ptr() % PAGE == 0 and t.shape == shape and t.dtype == dtype
        assert hipferry._C.pool_owns(pool._id, t.untyped_storage().data_ptr())


def test_the_default_alignment_is_256(pool):
    ptrs = [pool.empty(100, dtype=torch.uint8).data_ptr() for _ in range(3)]
    keep = [pool.empty(100, dtype=torch.uint8) for _ in range(20)]
    assert all(t.data_ptr() % 256 == 0 for t in keep) and all(p % 256 == 0 for p in ptrs)
    assert any(t.data_ptr() % PAGE != 0 for t in keep)  # 256-byte blocks sit side by side
    assert pool.empty(3, alignment=256).data_ptr() % 256 == 0


@pytest.mark.parametrize("alignment", [0, 1, 64, 128, 255, 512, 2048, 4097, 8192, 2**21, -4096, True, 4096.0, "4096",
                                       None])
def test_a_bad_alignment_is_refused_naming_it_and_changes_nothing(pool, alignment):
    keep = pool.empty(100).fill_(1)
    before = pool.stats()
    with pytest.raises(ValueError, match=r"hipferry.PinnedPool.empty: alignment must be 256 \(the default\) or "
                                         r"4096 .*got " + re.escape(repr(alignment)) + "$"):
        pool.empty(10, alignment=alignment)
    after = pool.stats()
    for key in ("live_blocks", "requested_bytes", "allocated_bytes", "reserved_bytes", "cache_hits",
                "cache_misses"):
        assert after[key] == before[key], key
    pool.check_invariants()
    assert float(keep.sum()) == 100


def test_the_op_refuses_a_bad_alignment_too(pool):
    with pytest.raises(RuntimeError, match="alignment 512 is not supported; expected 256 .* or 4096"):
        torch.ops.hipferry.pool_empty.default(pool._id, [10], torch.float32, -1, 512)
    assert pool.stats()["live_blocks"] == 0


def test_o_direct_reads_into_a_page_aligned_tensor(pool, tmp_path):
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        pytest.skip("no O_DIRECT on this platform")
    data = bytes(range(256)) * 64  # 4 pages
    path = tmp_path / "pages.bin"
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as e:  # tmpfs and some overlay filesystems refuse O_DIRECT
        pytest.skip(f"O_DIRECT not supported here: {e}")
    try:
        t = pool.empty(len(data), dtype=torch.uint8, alignment=PAGE)
        view = memoryview(t.numpy())
        assert os.readv(fd, [view]) == len(data)
    finally:
        os.close(fd)
    assert bytes(t.numpy()) == data
