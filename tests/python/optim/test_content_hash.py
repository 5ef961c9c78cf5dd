"""The commit checks of OffloadAdamW's speculative step (Note [speculative step]
in hipferry/optim/speculation.py) in C++: hipferry._C._content_hash, the
fingerprint a commit compares, and _thread_fp_modes / _set_thread_fp_modes,
the denormal mode of each intra-op thread the worker reproduces."""
import threading

import pytest
import torch

from hipferry import _C

BLOCK = 1 << 16  # bytes hashed apart (csrc/torch/content_hash.cpp)


@pytest.mark.parametrize("numel", [0, 1, 7, 16, 17, BLOCK // 4, BLOCK // 4 + 1, (1 << 20) + 3])
def test_any_one_flipped_bit_changes_the_hash(numel):
    a = torch.randn(numel)
    h = _C._content_hash(a)
    assert h == _C._content_hash(a.clone()) and 0 <= h < 1 << 64
    for pos in sorted({0, numel // 3, numel // 2, numel - 1}) if numel else []:
        for bit in (0, 17, 31):
            b = a.clone()
            b.view(torch.int32)[pos] ^= 1 << bit
            assert _C._content_hash(b) != h, (pos, bit)


def test_the_hash_depends_on_where_each_byte_is():
    a = torch.randn(BLOCK // 2 + 10)
    seen = {_C._content_hash(a)}
    for i, j in ((0, 1), (3, 11), (5, BLOCK // 8 + 5)):  # two words of one stripe, of one block, of two blocks
        s = a.clone()
        words = s.view(torch.int64)
        words[[i, j]] = words[[j, i]]
        seen.add(_C._content_hash(s))
    ones, zeros = torch.ones(BLOCK // 4), torch.zeros(BLOCK // 4)  # two whole blocks, swapped
    seen |= {_C._content_hash(torch.cat([ones, zeros])), _C._content_hash(torch.cat([zeros, ones]))}
    assert len(seen) == 6


def test_a_sequence_hashes_each_tensor_in_order_with_its_length():
    a, b = torch.randn(100), torch.randn(50)
    h = _C._content_hash([a, b])
    assert h == _C._content_hash((a.clone(), b.clone()))
    assert h != _C._content_hash([b, a]) and h != _C._content_hash(torch.cat([a, b]))
    assert _C._content_hash([a[:60], a[60:]]) != _C._content_hash([a[:40], a[40:]])
    assert _C._content_hash([]) == _C._content_hash([])
    assert _C._content_hash(a) == _C._content_hash(a.view(torch.int32)), "bytes, not values"


def test_the_hash_is_the_same_for_any_number_of_threads():
    a = torch.randn((8 << 20) + 11)
    threads = torch.get_num_threads()
    try:
        hashes = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            hashes.add(_C._content_hash(a))
    finally:
        torch.set_num_threads(threads)
    assert len(hashes) == 1


def test_the_hash_rejects_what_it_cannot_hash():
    a = torch.randn(4, 4)
    with pytest.raises(ValueError, match="t must be a contiguous dense CPU tensor"):
        _C._content_hash(a.t())
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a contiguous dense CPU tensor"):
        _C._content_hash([a, a.t()])
    with pytest.raises(TypeError):
        _C._content_hash([a, 3])


def test_thread_fp_modes_are_read_per_thread_and_set_on_another_threads_team():
    if not torch.set_flush_denormal(False):
        pytest.skip("torch.set_flush_denormal is not supported on this CPU")
    n = torch.get_num_threads()
    assert _C._thread_fp_modes()[0] == 0
    try:
        torch.set_flush_denormal(True)
        modes = _C._thread_fp_modes()
        assert len(modes) == n and modes[0] != 0  # (the calling thread; its team keeps what it had)
    finally:
        torch.set_flush_denormal(False)
    wanted = [modes[0]] * n  # every thread of another thread's team flushes
    seen = {}

    def worker():
        seen["before"] = _C._thread_fp_modes()
        _C._set_thread_fp_modes(wanted)
        seen["after"] = _C._thread_fp_modes()
        tiny = torch.full((1 << 17,), 1e-39)  # a denormal float32, in every chunk of the loop below
        seen["flushed"] = bool((tiny * 0.5 == 0).all())
        _C._set_thread_fp_modes([0] * n)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["before"] == [0] * n and seen["after"] == wanted and seen["flushed"]
    with pytest.raises(ValueError, match="expected one mode per thread"):
        _C._set_thread_fp_modes([0] * (n + 1))


def test_the_hash_is_pinned():
    """The same value in every build of the loop (baseline, AVX2: HIPFERRY_CPU_ISA; CI runs both)
    and every run: a fingerprint taken on the worker is compared with one taken at step()."""
    assert [_C._content_hash(torch.arange(n, dtype=torch.int32)) for n in (0, 1, 17, 70000)] == [
        10239837792198629075, 8964929163001647267, 1011378660384674853, 5793901196549893190]
    assert _C._content_hash([torch.arange(5.0), torch.arange(3.0)]) == 118856599110679276
