"""Every binding of hipferry._C and every op of torch.ops.hipferry, called once
and its result checked. The older torch releases run a subset of the suite
(scripts/dev.sh older-torch, `--subset older-torch` in conftest.py); this module
is in it, so that subset crosses every binding and op under each release. A
binding or op added without an entry here fails
test_every_binding_and_op_has_an_entry."""
import re
from pathlib import Path

import pytest
import torch

import hipferry
from hipferry import _C

ROOT = Path(__file__).resolve().parents[3]
GPU = _C.device_count() > 0


def gpu_or_runtime_error(call):
    """On a GPU: the call's result. Without one: the runtime's clear error (the binding was crossed)."""
    if GPU:
        return call()
    with pytest.raises(_C.RuntimeLayerError, match="hipferry"):
        call()
    return None


def call_pool_bindings():
    pid = _C.create_pinned_pool("pageable", 0, 1, 1 << 30, 1 << 30, 0)
    try:
        with hipferry.PinnedPool() as wrapper:
            t = _C.pool_empty_fast(wrapper._id, (8,), torch.float32, None)
            p = _C.pool_pin_fast(wrapper._id, torch.arange(5.0))
            assert t.shape == (8,) and torch.equal(p, torch.arange(5.0))
            address = t.untyped_storage().data_ptr()
            assert _C.pool_owns(wrapper._id, address) and not _C.pool_owns(wrapper._id, 16)
            assert _C.pool_node_of_block(wrapper._id, address) >= -1
            assert _C.numa_node_of_address(address) >= -1
            _C.pool_record_use(wrapper._id, address, 0, 0)  # (the null stream of GPU 0; no GPU: an event of none)
            default, devices = _C.pool_numa_placement(wrapper._id)
            assert default >= -1 and isinstance(devices, list)
            del t, p
            _C.pool_process_events(wrapper._id)
            stats = _C.pool_stats(wrapper._id)
            assert stats["live_blocks"] == 0 and stats["reserved_bytes"] > 0
            assert _C.pool_trim(wrapper._id) > 0
            _C.pool_check_invariants(wrapper._id)
            assert isinstance(_C.pool_provider(wrapper._id), str)
        assert _C.pool_stats(pid)["capacity"] == 1 << 30
    finally:
        _C.destroy_pinned_pool(pid)
    with pytest.raises(RuntimeError, match="does not exist"):
        _C.pool_stats(pid)
    with pytest.raises(_C.PoolError):
        _C.create_pinned_pool("pageable", 0, 1, 1 << 20, 1 << 20, 1 << 30)  # a reserve beyond the capacity
    return True


def call_transfer_bindings():
    xs = [torch.arange(4.0), torch.arange(3.0)]
    before = _C.transfer_stats()["transfers"]
    pool = hipferry.default_pool()
    t = _C.start_prefetch(xs, "cpu", None, pool._id, False)
    assert isinstance(t, _C.Transfer) and t.num_tensors == 2 and t.nbytes == 28
    results, record = t.wait()
    assert [r.tolist() for r in results] == [x.tolist() for x in xs] and not record
    out, _ = _C.start_offload(xs, torch.bfloat16, pool._id, False).wait()
    assert out[0].dtype == torch.bfloat16
    _C.transfer_drain()
    assert _C.poll_transfer_releases() >= 0
    assert _C.transfer_stats()["transfers"] == before + 2
    assert _C.transfer_batched_copy("").split(" ")[0] in ("kernel", "runtime")  # "" asks without changing
    return True


def call_trace_bindings():
    assert not _C.trace_active()
    _C.trace_start()
    start = _C.trace_now_ns()
    _C.trace_add("probe", "user", "host", start, _C.trace_now_ns(), 0)
    events, chrome = _C.trace_stop()
    assert any(e["name"] == "probe" for e in events) and "probe" in chrome
    return True


def call_optimizer_bindings():
    p, g = torch.ones(10), torch.full((10,), 0.5)
    m, v = torch.zeros(10), torch.zeros(10)
    _C._adamw_step_(p, g, m, v, None, None, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, False, False)
    assert torch.all(p < 1) and torch.all(m > 0)
    streamer = _C.AdamWStreamer(-1, 64, 2)  # host mode: the same pipeline without a GPU
    q = torch.ones(10)
    streamer.step([q], [g], [None], [torch.zeros(10)], [torch.zeros(10)], [None], 1, 0.1, 0.9, 0.999, 1e-8, 0.0,
                  False, False)
    streamer.synchronize()
    assert torch.equal(q, p) and streamer.chunk_numel == 64 and streamer.slots == 2
    assert _C._bits_equal(p, q.clone()) and not _C._bits_equal(p, torch.zeros(10))
    r = torch.ones(10)
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    _C._adamw_step_many_([r], [g], [torch.zeros(10)], [torch.zeros(10)], [None], [None], [1], [hyper], [False])
    assert torch.equal(r, p)
    return True


def call_disk_bindings():
    import tempfile
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert _C._crc32c(data) == 0xE3069283 and isinstance(_C._crc32c_hardware(), bool)
    regions = _C._disk_regions("float32", False, 10)
    assert regions == [4096] * 3
    assert _C._disk_chunk_buffer_bytes("uint8", False, 1 << 18) == (4 + 1 + 1) * (1 << 18) + 2 * 4096
    with tempfile.TemporaryDirectory(dir=".") as d:
        io = _C.DiskIo("threads", 4, 1 << 20)
        files = [io.open(f"{d}/a{i}", True) for i in range(3)]
        for f in files:
            io.reserve(f, 4096)
        window = torch.zeros(2 * _C._disk_chunk_buffer_bytes("float32", False, 1 << 18) + 4096, dtype=torch.uint8)
        window = window[(-window.data_ptr()) % 4096:][:2 * _C._disk_chunk_buffer_bytes("float32", False, 1 << 18)]
        crc = torch.zeros(3, dtype=torch.int32)
        io.run_pass("fill", "float32", False, 1 << 18, window, [dict(numel=10, offsets=[0, 0, 0], write_files=files,
                    crc_out=crc, source=torch.arange(10.0), fill_bytes=[0, 0, 0])])
        out = torch.zeros(10)
        io.run_pass("read", "float32", False, 1 << 18, window, [dict(numel=10, offsets=[0, 0, 0], read_files=files,
                    crc_in=crc, out=out, dests=[])])
        assert torch.equal(out, torch.arange(10.0)) and io.counters()["bytes_written"] == 3 * 4096
        bad = crc.clone()
        bad[1] ^= 1
        with pytest.raises(_C.ChecksumError, match="checksum mismatch"):
            io.run_pass("read", "float32", False, 1 << 18, window, [dict(numel=10, offsets=[0, 0, 0],
                        read_files=files, crc_in=bad, dests=[])])
        io.close()
        check_disk_raw_pass(d)
    return True


def call_8bit_optimizer_bindings():
    p, g = torch.ones(300), torch.full((300,), 0.5)
    codes, absmax = _C._quantize_blockwise_8bit(torch.zeros(300), True)
    v_codes, v_absmax = _C._quantize_blockwise_8bit(torch.zeros(300), False)
    _C._adamw8bit_step_(p, g, codes, absmax, v_codes, v_absmax, None, None, None, 1, 0.1, 0.9, 0.999, 1e-8, 0.0,
                        False, False)
    assert torch.all(p < 1) and torch.all(absmax > 0)
    m = _C._dequantize_blockwise_8bit(codes, absmax, True)
    assert torch.all(m > 0) and _C._dynamic_map_8bit(True)[127] == 0
    return True


def call_speculation_check_bindings():
    a = torch.arange(10.0)
    assert _C._content_hash(a) == _C._content_hash([a.clone()]) != _C._content_hash(a.flip(0))
    modes = _C._thread_fp_modes()
    assert len(modes) == torch.get_num_threads()
    _C._set_thread_fp_modes(modes)
    return True


def call_scheduling_bindings():
    copier = _C.LayerCopier(-1)
    dst, src = torch.zeros(6), torch.arange(6.0)
    ticket = copier.start([dst], [src])
    assert isinstance(ticket, _C.LayerCopyTicket)
    copier.wait(ticket)
    assert copier.done(ticket) and torch.equal(dst, src)
    copier.drain()
    window = _C.InFlightWindow(1 << 20)
    settled = []
    transfer = _C.start_prefetch([src], "cpu", None, hipferry.default_pool()._id, False)
    window.admit(24)
    entry = window.add(transfer, 24, lambda: settled.append(True))
    assert window.entries == 1 and window.bytes == 24 and entry >= 0
    window.drain()
    assert settled == [True] and window.bytes == 0 and window.peak_bytes == 24
    assert not window.withdraw(entry) and window.settle() >= 0 and window.waits >= 0
    return True


def check_disk_raw_pass(d):
    """DiskIo.raw_pass (the disk bench's own reader/writer): bytes written come back, errors are clear."""
    io = _C.DiskIo("threads", 4, 1 << 16)
    f = io.open(f"{d}/raw.dat", True)
    io.reserve(f, 1 << 20)
    window = hipferry.default_pool().empty(4 << 16, dtype=torch.uint8, alignment=4096)
    window.fill_(7)
    io.raw_pass("write", f, 1 << 20, window)
    io.sync(f)
    window.zero_()
    io.raw_pass("read", f, 1 << 20, window)
    assert torch.all(window == 7) and io.counters()["bytes_read"] == io.counters()["bytes_written"] == 1 << 20
    with pytest.raises(ValueError, match="op must be 'read' or 'write'"):
        io.raw_pass("append", f, 4096, window)
    with pytest.raises(OSError):
        io.raw_pass("read", f, 2 << 20, window)  # past the end of the file
    io.close()


def call_platform_bindings():
    info = _C.build_info()
    assert info["tensor_bridge"] in ("pyobject shim", "torch 2.13 THPVariable", "stash op")
    assert _C.cpu_isa() in ("avx512", "avx2", "baseline")
    assert _C.device_count() >= 0 and _C.numa_nodes()
    assert _C.numa_device_nodes([], "/sys") == []
    gpu_or_runtime_error(lambda: _C.device_info(0))
    gpu_or_runtime_error(lambda: _C.check_host_memory(0, 4096, 3))
    return True


def call_ops():
    dst, src = torch.zeros(4, dtype=torch.bfloat16), torch.tensor([1.0, 2.5, -3.0, 1e-3])
    torch.ops.hipferry.copy_cast_.default(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))
    with hipferry.PinnedPool() as pool:
        t = torch.ops.hipferry.pool_empty.default(pool._id, [2, 3], torch.float16, -1)
        assert t.shape == (2, 3) and t.dtype == torch.float16
        torch.library.opcheck(torch.ops.hipferry.pool_empty.default, (pool._id, [3], torch.float32),
                              test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.hipferry.copy_cast_.default, (torch.zeros(3), torch.ones(3)))
    p, g, m, v = torch.ones(10), torch.full((10,), 0.5), torch.zeros(10), torch.zeros(10)
    torch.ops.hipferry.adamw_step_.default(p, g, m, v, None, None, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, False, False)
    assert torch.all(p < 1) and torch.all(m > 0)
    assert torch.ops.hipferry.bits_equal.default(p, p.clone()) is True
    torch.library.opcheck(torch.ops.hipferry.adamw_step_.default,
                          (p, g, m, v, None, None, 2, 0.1, 0.9, 0.999, 1e-8, 0.0, False, False))
    return True


def call_pool_constants():
    # Read by hipferry.pool_args (test_pool_arguments.py checks the values).
    flags = _C.HOST_ALLOC_FLAGS
    assert isinstance(flags, dict) and all(isinstance(v, int) and v > 0 for v in flags.values())
    assert "auto" in _C.HOST_MEMORY_PROVIDERS and _C.RESERVE_GRANULE % 4096 == 0
    return True


# Each binding / op -> the call above that crosses it.
ENTRIES = {
    **dict.fromkeys(["create_pinned_pool", "destroy_pinned_pool", "pool_empty_fast", "pool_pin_fast", "pool_owns",
                     "pool_node_of_block", "numa_node_of_address", "pool_record_use", "pool_numa_placement",
                     "pool_process_events", "pool_stats", "pool_trim", "pool_check_invariants", "pool_provider",
                     "PoolError"], call_pool_bindings),
    **dict.fromkeys(["start_prefetch", "start_offload", "Transfer", "transfer_drain", "poll_transfer_releases",
                     "transfer_stats", "transfer_batched_copy"], call_transfer_bindings),
    **dict.fromkeys(["trace_active", "trace_start", "trace_now_ns", "trace_add", "trace_stop"], call_trace_bindings),
    **dict.fromkeys(["_adamw_step_", "_adamw_step_many_", "AdamWStreamer", "_bits_equal"], call_optimizer_bindings),
    **dict.fromkeys(["DiskIo", "ChecksumError", "_crc32c", "_crc32c_hardware", "_disk_regions",
                     "_disk_chunk_buffer_bytes"], call_disk_bindings),
    **dict.fromkeys(["_adamw8bit_step_", "_quantize_blockwise_8bit", "_dequantize_blockwise_8bit",
                     "_dynamic_map_8bit"], call_8bit_optimizer_bindings),
    **dict.fromkeys(["LayerCopier", "LayerCopyTicket", "InFlightWindow"], call_scheduling_bindings),
    **dict.fromkeys(["_content_hash", "_thread_fp_modes", "_set_thread_fp_modes"], call_speculation_check_bindings),
    **dict.fromkeys(["HOST_ALLOC_FLAGS", "HOST_MEMORY_PROVIDERS", "RESERVE_GRANULE"], call_pool_constants),
    **dict.fromkeys(["build_info", "cpu_isa", "device_count", "numa_nodes", "numa_device_nodes", "device_info",
                     "check_host_memory", "RuntimeLayerError"], call_platform_bindings),
    **dict.fromkeys(["op:copy_cast_", "op:pool_empty", "op:adamw_step_", "op:bits_equal"], call_ops),
}


def declared_ops():
    text = (ROOT / "csrc/torch/ops.cpp").read_text()
    return {f"op:{name}" for name in re.findall(r'm\.def\(\s*"(\w+)\(', text)}


def test_every_binding_and_op_has_an_entry():
    bindings = {n for n in dir(_C) if not n.startswith("__") and n != "_testing"}  # (_testing: test builds only)
    assert "op:pool_empty" in declared_ops(), "the schema parse must find the ops"
    missing = (bindings | declared_ops()) - set(ENTRIES)
    stale = set(ENTRIES) - bindings - declared_ops()
    assert not missing, f"bindings / ops without an entry in test_bindings.ENTRIES: {sorted(missing)}"
    assert not stale, f"entries for bindings / ops that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize("call", sorted(set(ENTRIES.values()), key=lambda f: f.__name__), ids=lambda f: f.__name__)
def test_each_binding_and_op_is_crossed(call):
    assert call() is True


def test_the_older_torch_subset_covers_every_module_and_every_opcheck(request):
    from conftest import collected_items, older_torch_subset
    everything = collected_items(request.config)  # what this run collected, before any --subset
    subset = older_torch_subset(everything)
    slow_only = {m for m in {item.path.name for item in everything}
                 if all(item.get_closest_marker("slow") for item in everything if item.path.name == m)}
    modules = {item.path.name for item in everything} - slow_only  # (a module of slow tests only is left out)
    assert {item.path.name for item in subset} == modules, "every collected test module runs in the subset"
    assert {item.nodeid for item in everything if "opcheck" in item.name} <= {item.nodeid for item in subset}
    assert {item.nodeid for item in everything if item.path.name == "test_bindings.py"} <= \
        {item.nodeid for item in subset}
    if len(modules) > 10:  # a run of the whole suite: the subset is a small part of it
        assert len(subset) < len(everything) / 4, (len(subset), len(everything))


def test_the_cpu_build_subset_keeps_every_module_and_all_of_the_runtime_folders(request):
    from conftest import CPU_BUILD_FOLDERS, collected_items, cpu_build_subset, older_torch_subset
    everything = collected_items(request.config)
    subset = {item.nodeid for item in cpu_build_subset(everything)}
    assert {item.nodeid for item in older_torch_subset(everything)} <= subset
    runtime = {item.nodeid for item in everything if item.path.parent.name in CPU_BUILD_FOLDERS}
    assert runtime <= subset
    assert subset == {item.nodeid for item in older_torch_subset(everything)} | runtime


def test_transfer_errors_name_sources_as_the_caller_says():
    pool_id = hipferry.default_pool().native_id
    xs = [torch.arange(4.0), torch.arange(3.0).to_sparse()]  # the second is not strided
    with pytest.raises(ValueError, match=r"^hipferry.prefetch: tensors\[1\] has layout"):
        _C.start_prefetch(xs, "cpu", None, pool_id, False)
    asked = []

    def names(i):
        asked.append(i)
        return f"batch['ids'][{i}]"

    with pytest.raises(ValueError, match=r"^hipferry.offload: batch\['ids'\]\[1\] has layout"):
        _C.start_offload(xs, None, pool_id, False, source_names=names)
    assert asked == [1], "asked only for the source that failed its check"
    _C.start_prefetch(xs[:1], "cpu", None, pool_id, False, source_names=names).wait()
    assert asked == [1], "a transfer that starts asks for no names"

    def broken(i):
        raise KeyError(i)

    with pytest.raises(ValueError, match=r"^hipferry.prefetch: tensors\[1\] has layout"):  # its own names then
        _C.start_prefetch(xs, "cpu", None, pool_id, False, source_names=broken)
