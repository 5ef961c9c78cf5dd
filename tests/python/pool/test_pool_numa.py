"""The pinned pool's NUMA placement (PinnedPool(numa_node=...), empty(for_device=)).

This machine has one node, so the placement by device is tested with the
topology read from fake sysfs trees, and with explicit {device: node} maps
whose keys are the node and "unbound" (-1): two free lists that must stay
apart. The C++ side (free lists per node, the reserve, the growth bound
across nodes) is tests/cpp/host_pool_numa_test.cpp.
"""
import pytest
import torch

from conftest import requires_gpu
import hipferry
from hipferry import doctor
from hipferry import pool as pool_module

MiB = 1 << 20
NODE = hipferry._C.numa_nodes()[0]


def sysfs(tmp_path, online, devices):
    (tmp_path / "devices/system/node").mkdir(parents=True)
    (tmp_path / "devices/system/node/online").write_text(online + "\n")
    for bus_id, node in devices.items():
        d = tmp_path / "bus/pci/devices" / bus_id
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return str(tmp_path)


def test_each_gpu_gets_its_own_node_on_a_fake_two_socket_host(tmp_path):
    root = sysfs(tmp_path, "0-1", {"0000:17:00.0": 0, "0000:ca:00.0": 1, "0000:cb:00.0": -1})
    ids = ["0000:CA:00.0", "0000:17:00.0", "0000:cb:00.0", "0000:ff:00.0"]  # as runtimes print them
    assert pool_module.device_numa_nodes(ids, sysfs_root=root) == [1, 0, -1, -1]


def test_one_node_means_nothing_is_bound(tmp_path):
    root = sysfs(tmp_path, "0", {"0000:17:00.0": 0})
    assert pool_module.device_numa_nodes(["0000:17:00.0"], sysfs_root=root) == [-1]


def test_auto_here_binds_only_where_there_is_a_choice():
    with hipferry.PinnedPool(capacity="64MiB") as p:  # numa_node="auto"
        devices = pool_module.device_numa_nodes()
        assert p.numa_placement == {"default": -1, "devices": {d: n for d, n in enumerate(devices) if n >= 0}}
        if len(hipferry._C.numa_nodes()) == 1:
            assert p.numa_placement["devices"] == {}
            t = p.empty(1000, dtype=torch.uint8)
            assert p.numa_node_of(t) == -1
            assert p.stats()["reserved_by_node"] == {-1: p.stats()["reserved_bytes"]}


def test_a_pool_on_a_node_places_its_pages_there():
    with hipferry.PinnedPool(numa_node=NODE, provider="pageable") as p:
        assert p.numa_placement == {"default": NODE, "devices": {}}
        t = p.empty(4 * MiB, dtype=torch.uint8).fill_(1)  # touched: placed
        assert p.numa_node_of(t) == NODE
        where = hipferry._C.numa_node_of_address(t.data_ptr())
        assert where in (NODE, -1), where  # -1: the kernel cannot say (seccomp)
        assert p.stats()["reserved_by_node"] == {NODE: p.stats()["reserved_bytes"]}


def test_placement_by_device_keeps_each_nodes_free_list_apart():
    with hipferry.PinnedPool(numa_node={0: NODE, 2: NODE}, provider="pageable") as p:
        assert p.numa_placement == {"default": -1, "devices": {0: NODE, 2: NODE}}
        for spec in (0, "cuda:2", torch.device("cuda", 2)):
            t = p.empty(1000, dtype=torch.uint8, for_device=spec)
            assert p.numa_node_of(t) == NODE, spec
        unbound = p.empty(1000, dtype=torch.uint8, for_device=1)  # no node for device 1
        assert p.numa_node_of(unbound) == -1
        if hipferry._C.device_count() == 0:  # no current GPU: host-only memory
            assert p.numa_node_of(p.empty(10)) == -1
        # A block freed on one node does not serve the other.
        t = p.empty(4096, dtype=torch.uint8, for_device=0).fill_(1)
        address = t.data_ptr()
        del t
        u = p.empty(4096, dtype=torch.uint8, for_device=1)
        assert u.data_ptr() != address and p.numa_node_of(u) == -1
        misses = p.stats()["cache_misses"]
        v = p.empty(4096, dtype=torch.uint8, for_device=0)
        assert p.numa_node_of(v) == NODE and p.stats()["cache_misses"] == misses, "the node's own cache serves it"
        by_node = p.stats()["reserved_by_node"]
        assert set(by_node) == {-1, NODE} and sum(by_node.values()) == p.stats()["reserved_bytes"]
        p.check_invariants()


@pytest.mark.parametrize("numa_node,exc,pattern", [
    (99, ValueError, r"numa_node is 99, not an online NUMA node; this host has node\(s\) \["),
    ("0", ValueError, r"numa_node must be 'auto', None, a node number or a dict \{device: node\}, got '0'"),
    (True, TypeError, "numa_node must be 'auto', None, a node number"),
    (1.0, TypeError, "numa_node must be 'auto', None, a node number"),
    ({0: 99}, ValueError, r"numa_node\[0\] is 99, not an online NUMA node"),
    ({0: "0"}, TypeError, r"numa_node\[0\] must be an int, got '0'"),
    ({-1: 0}, TypeError, r"numa_node keys must be device indices \(ints from 0\), got -1"),
    ({"cuda:0": 0}, TypeError, r"numa_node keys must be device indices"),
])
def test_numa_node_is_checked(numa_node, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hipferry.PinnedPool(numa_node=numa_node)


@pytest.mark.parametrize("for_device,exc,pattern", [
    ("cpu", ValueError, "for_device must name a GPU, got cpu"),
    (torch.device("cpu"), ValueError, "for_device must name a GPU, got cpu"),
    (-2, ValueError, "for_device must be a GPU index from 0, got -2"),
    (1 << 20, ValueError, "for_device must be a GPU index from 0"),
    (True, TypeError, "for_device must be a GPU index, 'cuda:N', a torch.device or None, got True"),
    (1.5, TypeError, "for_device must be a GPU index"),
    ("cuda:x", TypeError, "for_device must be a GPU index"),
])
def test_for_device_is_checked_before_anything_is_allocated(for_device, exc, pattern):
    with hipferry.PinnedPool(capacity="64MiB", numa_node={0: NODE}) as p:
        keep = p.empty(100, dtype=torch.uint8, for_device=0).fill_(7)
        before = p.stats()
        with pytest.raises(exc, match=pattern):
            p.empty(1000, for_device=for_device)
        after = p.stats()
        for k in ("requested_bytes", "reserved_bytes", "live_blocks", "cache_hits", "cache_misses"):
            assert after[k] == before[k], k
        assert bool((keep == 7).all())
        p.check_invariants()


def test_the_op_checks_for_device_too(pool):
    with pytest.raises(RuntimeError, match=r"for_device -5 is not a device index; expected -1 \(the current GPU\)"):
        torch.ops.hipferry.pool_empty.default(pool._id, [4], torch.float32, -5)


def test_pool_empty_with_for_device_passes_opcheck(pool):
    torch.library.opcheck(torch.ops.hipferry.pool_empty.default, (pool._id, [3, 4], torch.float32, 0),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_numa_node_of_refuses_what_is_not_a_pool_block(pool):
    with pytest.raises(ValueError, match="numa_node_of: t must be a non-empty tensor allocated from this pool"):
        pool.numa_node_of(torch.ones(3))
    with pytest.raises(TypeError, match="numa_node_of: t must be a torch.Tensor, got list"):
        pool.numa_node_of([1])


@pytest.mark.parametrize("text,expected", [("numa_node=auto", {"numa_node": "auto"}),
                                           ("numa_node=none", {"numa_node": None}),
                                           ("numa_node=0", {"numa_node": 0})])
def test_the_environment_names_a_placement(text, expected):
    assert pool_module.parse_pool_config(text) == expected


def test_the_environment_rejects_a_bad_placement():
    with pytest.raises(ValueError, match="numa_node must be auto, none or a node number, got 'x'"):
        pool_module.parse_pool_config("numa_node=x")


@pytest.mark.parametrize("config,says", [
    ({"numa_node": None}, "binds no node"),
    ({"numa_node": NODE}, f"pages come from node {NODE}"),
    ({"numa_node": {1: NODE}}, f"each GPU pages from its node (GPU 1 -> node {NODE}), host-only memory unbound"),
    ({"numa_node": {1: 99}}, "numa_node is invalid"),
])
def test_doctor_describes_the_default_pools_placement(monkeypatch, config, says):
    monkeypatch.setattr(pool_module, "_default_config", config)
    assert says in doctor._default_pool_placement(hipferry._C)


@requires_gpu
def test_offloaded_results_come_from_the_source_gpus_node():
    with hipferry.PinnedPool(numa_node={0: NODE}) as p:
        x = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
        h = hipferry.offload(x, pool=p).wait()
        assert p.numa_node_of(h) == NODE
        torch.testing.assert_close(h, x.cpu(), rtol=0, atol=0)
        with torch.cuda.device(0):  # for_device=None: the current GPU
            assert p.numa_node_of(p.empty(100)) == NODE
