"""hipferry.host_memory: the default pool's budget from /proc/meminfo and the
process's cgroup (v2 and v1), read from fake trees; and the default pool
taking it as its capacity, with a capacity error that says which bound hit."""
import os

import pytest
import torch

import hipferry
from hipferry import host_memory
from hipferry import pool as pool_module

GiB = 1 << 30


def tree(tmp_path, meminfo_kb=None, cgroup_line=None, files=None):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    cg.mkdir()
    if meminfo_kb is not None:
        (proc / "meminfo").write_text("".join(f"{k}:    {v} kB\n" for k, v in meminfo_kb.items()))
    if cgroup_line is not None:
        (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in (files or {}).items():
        p = cg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(proc), str(cg)


def test_machine_without_a_cgroup_limit(tmp_path):
    proc, cg = tree(tmp_path, {"MemTotal": 32 * 1024**2, "MemAvailable": 20 * 1024**2}, "0::/user.slice",
                    {"user.slice/memory.max": "max\n"})
    mem = host_memory.read_host_memory(proc, cg)
    assert (mem.total, mem.available, mem.cgroup_limit) == (32 * GiB, 20 * GiB, None)
    budget, why = host_memory.default_budget(mem)
    assert budget == 10 * GiB and "MemAvailable" in why


def test_cgroup_v2_limit_on_an_ancestor_binds(tmp_path):
    proc, cg = tree(tmp_path, {"MemTotal": 64 * 1024**2, "MemAvailable": 60 * 1024**2}, "0::/kubepods/pod1/ctr",
                    {"kubepods/pod1/ctr/memory.max": "max", "kubepods/pod1/ctr/memory.current": "1",
                     "kubepods/pod1/memory.max": str(8 * GiB), "kubepods/pod1/memory.current": str(2 * GiB),
                     "kubepods/memory.max": str(16 * GiB), "kubepods/memory.current": str(2 * GiB)})
    mem = host_memory.read_host_memory(proc, cg)
    assert mem.cgroup_limit == 8 * GiB and mem.cgroup_room == 6 * GiB
    assert mem.cgroup_path.endswith(os.path.join("kubepods", "pod1", "memory.max"))
    budget, why = host_memory.default_budget(mem)
    assert budget == 3 * GiB and "cgroup" in why and "pod1" in why


def test_cgroup_v1_memory_controller(tmp_path):
    proc, cg = tree(tmp_path, {"MemTotal": 64 * 1024**2, "MemAvailable": 60 * 1024**2},
                    "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc",
                    {"memory/docker/abc/memory.limit_in_bytes": str(4 * GiB),
                     "memory/docker/abc/memory.usage_in_bytes": str(1 * GiB),
                     "memory/memory.limit_in_bytes": str(2**63 - 4096)})  # v1's "no limit" at the root
    mem = host_memory.read_host_memory(proc, cg)
    assert (mem.cgroup_limit, mem.cgroup_room) == (4 * GiB, 3 * GiB)
    assert host_memory.default_budget(mem)[0] == 3 * GiB // 2


def test_nothing_readable_means_no_budget(tmp_path):
    proc, cg = tree(tmp_path)
    budget, why = host_memory.default_budget(host_memory.read_host_memory(proc, cg))
    assert budget is None and "could be read" in why


def test_this_machine_has_a_budget():
    budget, why = host_memory.default_budget()
    assert budget is not None and 0 < budget < host_memory.read_host_memory().total, why


@pytest.fixture
def fresh_default_pool(monkeypatch):
    """The default pool made anew inside the test, and the previous one restored after."""
    old_pool, old_config = pool_module._default_pool, pool_module._default_config
    monkeypatch.setattr(pool_module, "_default_pool", None)
    monkeypatch.setattr(pool_module, "_default_config", None)
    monkeypatch.delenv(pool_module.ENV_VAR, raising=False)
    yield
    made = pool_module._default_pool
    if made is not None and made is not old_pool:
        made.close()
    pool_module._default_pool, pool_module._default_config = old_pool, old_config


def test_the_default_pool_is_bounded_by_the_budget_and_says_so(fresh_default_pool, monkeypatch):
    monkeypatch.setattr(pool_module, "default_budget", lambda: (8 << 20, "50% of the memory available (test)"))
    p = hipferry.default_pool()
    assert p.capacity == 8 << 20
    with pytest.raises(torch.OutOfMemoryError, match=r"default pool's budget, 50% of the memory available \(test\); "
                                                     r"raise it with HIPFERRY_PINNED_POOL=capacity="):
        p.empty(16 << 20, dtype=torch.uint8)
    p.check_invariants()


def test_an_explicit_capacity_or_none_overrides_the_budget(fresh_default_pool, monkeypatch):
    monkeypatch.setattr(pool_module, "default_budget", lambda: (8 << 20, "test"))
    monkeypatch.setenv(pool_module.ENV_VAR, "capacity=none")
    assert hipferry.default_pool().capacity is None
