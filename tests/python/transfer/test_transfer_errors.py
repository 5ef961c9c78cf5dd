"""Transfers: bad input gives clear errors and changes nothing; GPU-only checks (mixed devices,
ordering against kernels still running, side streams, fused bf16)."""
import os
import re
import subprocess
import sys
from collections import UserDict

import pytest
import torch

from transfer_helpers import *  # noqa: F401,F403 (fixtures and helpers)


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


BAD_DEVICES = ["cuda:99", "tpu", -1, 99, "cuda:-1"]
BAD_DEVICES += [] if gpu_available() else ["cuda", "cuda:0", 0, torch.device("cuda")]  # no GPU here


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


def test_bad_leaf_in_a_mapping_names_its_place(direction):
    # Mappings that pytree does not know (a tokenizer's output is a UserDict) are walked
    # like dicts: a bad leaf in one is named by its keys, and nothing starts.
    ok = torch.ones(3)
    check_rejected(lambda: start(direction, UserDict(a=ok, b={"c": [ok, "text"]}), "cpu"), TypeError,
                   [re.escape("tensors['b']['c'][1] is of type str; expected a tensor"), r"Mapping"], [ok])
    check_rejected(lambda: start(direction, [ok, UserDict(ids=ok, mask=ok.to_sparse())], "cpu"), ValueError,
                   [re.escape("tensors[1]['mask'] has layout")], [ok])


def test_error_names_the_right_place_in_a_nested_structure():
    good, bad = torch.ones(2), torch.ones(2).to_sparse()
    with pytest.raises(ValueError) as e:
        hipferry.prefetch([[good, good], [good, bad]], "cpu")
    assert "tensors[1][1] has layout" in str(e.value), str(e.value)


def test_sparse_rejected(direction):
    dense = torch.eye(3)
    check_rejected(lambda: start(direction, [dense, dense.to_sparse()], "cpu"), ValueError,
                   [r"sparse|strided|layout"], [dense])


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors: "prototype"
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensor_rejected_naming_its_place(direction, layout):
    # Found by test_public_api_fuzz.py: a nested tensor (strided layout) stopped at torch's
    # "Internal error: NestedTensorImpl doesn't support sizes", naming nothing.
    dense = torch.ones(3)
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    check_rejected(lambda: start(direction, {"w": [dense, nt]}, "cpu"), ValueError,
                   [r"tensors\['w'\]\[1\] is a nested tensor; expected plain dense tensors"], [dense])


def test_bad_pool_and_dtype_arguments(direction):
    src = torch.ones(3)
    check_rejected(lambda: start(direction, src, "cpu", pool="default"), TypeError, [r"pool"], [src])
    check_rejected(lambda: start(direction, src, "cpu", dtype="float16"), TypeError, [r"dtype"], [src])
    closed = hipferry.PinnedPool()
    closed.close()
    check_rejected(lambda: start(direction, src, "cpu", pool=closed), RuntimeError, [r"closed"], [src])


@pytest.mark.parametrize("device,how", [("cpu", "offload"), pytest.param("cuda", "offload", marks=requires_gpu),
                                        pytest.param("cuda", "prefetch pageable", marks=requires_gpu)])
def test_handle_after_a_failed_copy(device, how):
    # A pool too small for 4 MiB: offload's results (at the call), or the staging of a pageable
    # prefetch (on the worker, so the error surfaces at wait()).
    with hipferry.PinnedPool(capacity="1MiB") as small:
        keep = small.empty(1000).fill_(3)
        src = torch.arange(MiB, dtype=torch.float32)
        src = src.to(device) if how == "offload" else src
        try:
            if how == "offload":
                t = hipferry.offload(src, pool=small)
            else:
                t = hipferry.prefetch(src, device, pool=small)
        except RuntimeError as e:  # rejected at the call: fine too
            assert "capacity" in str(e)
        else:
            for call in (t.synchronize, t.wait, t.wait, t.synchronize):
                with pytest.raises(RuntimeError, match="capacity"):
                    call()
            del t
        drain()
        assert torch.equal(src.cpu(), torch.arange(MiB, dtype=torch.float32)), "the source was modified"
        assert settled(small)["live_blocks"] == 1 and float(keep.sum()) == 3000
        small.check_invariants()
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
@pytest.mark.parametrize("n", [4096, 4 * MiB], ids=["small", "large"])
def test_gpu_prefetch_sees_values_a_kernel_is_still_writing(n, pool):
    values = torch.arange(n, dtype=torch.float32, device="cuda")
    host = pool.empty(n).fill_(-1)
    torch.cuda._sleep(100_000_000)  # the write below runs well after prefetch() returned
    host.copy_(values, non_blocking=True)
    out = hipferry.prefetch(host, "cuda", pool=pool).wait()
    assert torch.equal(out.cpu(), torch.arange(n, dtype=torch.float32))


@requires_gpu
@pytest.mark.parametrize("n", [4096, 4 * MiB], ids=["inline", "worker"])
def test_gpu_host_copy_of_pinned_memory_waits_for_a_queued_device_to_host_copy(n, pool):
    """device="cpu" reads pinned memory on the host: it must wait for the
    current stream's queued copy into it (the calling thread or the worker waits)."""
    values = torch.arange(n, dtype=torch.float32, device="cuda")
    host = pool.empty(n).fill_(-1)
    torch.cuda._sleep(100_000_000)
    host.copy_(values, non_blocking=True)
    out = hipferry.prefetch(host, "cpu", pool=pool).wait()
    assert torch.equal(out, torch.arange(n, dtype=torch.float32))


@requires_gpu
def test_gpu_wait_orders_a_side_stream():
    srcs = [hipferry.pin(torch.full((4096,), float(i))) for i in range(64)]
    side = torch.cuda.Stream()
    hold("cuda", 100)  # a long kernel before: the copy lands late
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


def test_configure_transfers_checks_its_argument_and_keeps_the_setting():
    before = hipferry.configure_transfers()
    assert before["batched_copy"].startswith(("kernel", "runtime")), before
    with pytest.raises(ValueError, match="batched_copy must be 'kernel' or 'runtime', got 'dma'"):
        hipferry.configure_transfers(batched_copy="dma")
    assert hipferry.configure_transfers() == before
    try:
        assert hipferry.configure_transfers(batched_copy="kernel") == {"batched_copy": "kernel"}
    finally:
        hipferry.configure_transfers(batched_copy=before["batched_copy"].split(" ")[0])


def test_bad_batched_copy_environment_variable_is_a_clear_error():
    code = "import torch, hipferry\nhipferry.prefetch(torch.ones(4), 'cpu')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HIPFERRY_BATCHED_COPY": "fast"})
    assert r.returncode != 0 and "HIPFERRY_BATCHED_COPY='fast'; expected 'kernel' or 'runtime'" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code + "\nprint(hipferry.configure_transfers())"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HIPFERRY_BATCHED_COPY": "runtime"})
    assert r.returncode == 0 and "'batched_copy': 'runtime'" in r.stdout, r.stderr
