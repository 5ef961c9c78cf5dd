"""Transfers: ordering (in flight, in order, never stale after wait()) and lifetimes (sources,
handles and results dropped at any point; no leak)."""
import gc
import subprocess
import sys
import textwrap

import pytest
import torch

from transfer_helpers import *  # noqa: F401,F403 (fixtures and helpers)


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


def run_python(device, body):
    """Runs `body` in a fresh interpreter (a hang or a crash must not take the test run with it)."""
    code = f"import sys, threading, time, torch, hipferry\ndevice = {device!r}\n" + textwrap.dedent(body)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for 60 s (a deadlock?); it printed {e.stdout!r}")


@requires_test_hooks
def test_ready_never_blocks_while_another_thread_waits(device):
    r = run_python(device, """
        hipferry._C._testing.transfer_worker_sleep(3000)
        t = hipferry.prefetch(torch.ones(1 << 20), device)
        inside = threading.Event()
        waiter = threading.Thread(target=lambda: (inside.set(), t.wait()))
        waiter.start()
        inside.wait()
        time.sleep(0.3)
        print("ready while held:", t.ready(), flush=True)  # the worker holds the copy ~2.7 s more
        waiter.join()
        t.synchronize()
        print("ready after:", t.ready(), flush=True)
    """)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stdout} {r.stderr[-2000:]}"
    assert r.stdout.split("\n")[:2] == ["ready while held: False", "ready after: True"], r.stdout


@requires_test_hooks
def test_interpreter_exits_with_transfers_in_flight(device):
    r = run_python(device, """
        pool = hipferry.PinnedPool(capacity="64MiB")
        hipferry._C._testing.transfer_worker_sleep(300)
        kept = hipferry.prefetch(hipferry.pin(torch.ones(1 << 20), pool=pool), device, pool=pool)
        hipferry.prefetch(torch.ones(1 << 20), device)  # dropped at once
        offloaded = hipferry.offload([torch.ones(1000).to(device)], pool=pool)
        print("exiting", flush=True)
    """)
    assert r.returncode == 0 and r.stdout == "exiting\n", f"rc {r.returncode}: {r.stdout} {r.stderr[-2000:]}"


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


@pytest.mark.parametrize("free", ["set_", "storage_resize", "resize_", "del"])
@pytest.mark.parametrize("kind", ["pageable", "pool"])
def test_source_storage_freed_while_the_worker_is_busy(device, kind, free):
    """The engine holds what a queued copy reads through its storage (or its
    data and owner), not through the caller's tensor: the caller may point
    that tensor elsewhere or free its memory at once. Before, `x.set_()` here
    was a use after free (SIGSEGV). The copy delivers what x held at prefetch."""
    if kind == "pool" and free in ("storage_resize", "resize_"):
        pytest.skip("the pool's storages cannot be resized (torch raises for them)")
    r = run_python(device, f"""
        pool = hipferry.PinnedPool(capacity="512MiB")
        big = torch.ones(64 << 20)
        x = torch.full((32 << 20,), 7.)
        if {kind!r} == "pool":
            x = hipferry.pin(x, pool=pool)
        t0 = hipferry.prefetch(big, device)   # the worker is busy with this one
        t1 = hipferry.prefetch(x, device, pool=pool)
        free = {free!r}
        if free == "set_":
            x.set_()
        elif free == "storage_resize":
            x.untyped_storage().resize_(0)
        elif free == "resize_":
            x.resize_(1 << 27)   # a larger storage: the old memory is freed
        else:
            del x
        junk = [torch.full((32 << 20,), -1.) for _ in range(3)]  # reuse what was freed
        y = t1.wait()
        t0.wait()
        print("ok", bool((y == 7).all()), y.numel(), flush=True)
    """)
    assert r.returncode == 0, f"rc {r.returncode} (-11: SIGSEGV): {r.stdout} {r.stderr[-2000:]}"
    assert r.stdout.strip() == f"ok True {32 << 20}", r.stdout


@pytest.mark.parametrize("numel", [1024, 4 * MiB])  # a host copy this small is made before prefetch returns
def test_source_written_after_prefetch_is_copied_as_it_was(device, numel):
    """A pageable source is held copy-on-write: a write by the caller after
    prefetch() copies the caller's side, the transfer reads the old values."""
    x = torch.full((numel,), 3.0)
    hold(device)
    t = hipferry.prefetch(x, device)
    x.add_(1)
    assert torch.equal(t.wait().cpu(), torch.full((numel,), 3.0))
    assert torch.equal(x, torch.full((numel,), 4.0))


def test_capacity_error_is_not_raised_for_memory_of_completed_transfers(device):
    """A dropped handle's results go back to the pool once its copy completed;
    an allocation over the capacity collects them first (before, the block
    came back only when a later transfer call polled: a false OutOfMemoryError)."""
    r = run_python(device, """
        pool = hipferry.PinnedPool(capacity="8MiB")
        big = torch.ones(64 << 20)
        t0 = hipferry.prefetch(big, device)
        t = hipferry.offload(torch.randn(1 << 20).to(device), pool=pool)  # 4 MiB result from the pool
        del t
        time.sleep(1)
        x = pool.empty(5 << 18)  # 5 MiB: fits only once the 4 MiB block is back
        print("ok", x.numel(), pool.stats()["reclaims"], flush=True)
        t0.wait()
    """)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stdout} {r.stderr[-2000:]}"
    assert r.stdout.split() == ["ok", str(5 << 18), "1"], r.stdout


def test_handle_dropped_without_waiting(device, pool):
    drain()
    pending = hipferry.transfer_stats()["pending_releases"]
    hold(device)
    t = hipferry.prefetch(hipferry.pin(torch.ones(MiB), pool=pool), device, pool=pool)
    assert not t.ready()
    del t
    gc.collect()
    assert hipferry.transfer_stats()["pending_releases"] >= pending
    later = hipferry.prefetch(torch.arange(WORKER_ELEMENTS), device)  # queued behind it
    later.synchronize()
    assert pending_releases_after_polling(pending) == pending
    assert torch.equal(later.wait().cpu(), torch.arange(WORKER_ELEMENTS))


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
    # 200 iterations of 2 x 1 MiB would leak ~400 MiB: far more than the capacity.
    with hipferry.PinnedPool(capacity="64MiB") as p:
        start_stats = p.stats()
        for half in range(2):
            for i in range(100):
                if i % 10 == 0:
                    hold(device, 5)
                src = hipferry.pin(torch.full((WORKER_ELEMENTS,), float(i)), pool=p)
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
            assert s["waiting_blocks"] == 0 and s["reserved_bytes"] <= 64 * MiB
            p.check_invariants()


@requires_test_hooks
def test_forked_child_refuses_the_parents_transfer_and_copies_on_its_own():
    r = run_python("cpu", """
        import os
        import numpy as np
        src = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: a worker task
        src1 = src + 1  # before the fork: torch's OpenMP pool does not survive one (libgomp)
        hipferry._C._testing.transfer_worker_sleep(300)
        inherited = hipferry.prefetch(src, "cpu")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                inherited.wait()
                code = 3
            except RuntimeError as e:
                code = 0 if "started before the process forked" in str(e) else 4
            if code == 0:
                mine = hipferry.prefetch(src1, "cpu").wait()  # the child's own engine and worker
                code = 0 if np.array_equal(mine.numpy(), src1.numpy()) else 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("child", os.WEXITSTATUS(status), flush=True)
        print("parent", torch.equal(inherited.wait(), src), flush=True)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["child", "0", "parent", "True"], r.stdout


def test_in_flight_window_bounds_transfers_and_settles_them_oldest_first(device):
    """hipferry._C.InFlightWindow (the scheduler's bound, used by
    offload_layers' gradient sink) over real transfers: admit() settles what
    completed, waits for the oldest while the next would not fit, and runs
    each entry's callback once, in order."""
    from hipferry import _C
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        _C.InFlightWindow(0)
    nbytes = WORKER_ELEMENTS * 4
    window, settled, handles = _C.InFlightWindow(2 * nbytes), [], []
    hold(device, 100)
    for i in range(5):
        window.admit(nbytes)
        assert window.bytes + nbytes <= 2 * nbytes, "the bound holds once admitted"
        t = hipferry.prefetch(torch.full((WORKER_ELEMENTS,), float(i)), device)
        handles.append(t)
        window.add(t._native, nbytes, lambda i=i: settled.append(i))
    assert window.waits >= 1, "the first transfers were held in flight: admit had to wait"
    window.drain()
    assert settled == list(range(5)) and window.bytes == 0 and window.peak_bytes == 2 * nbytes
    for i, t in enumerate(handles):
        assert torch.equal(t.wait().cpu(), torch.full((WORKER_ELEMENTS,), float(i)))

    def boom():
        raise KeyError("from the callback")
    t = hipferry.prefetch(torch.ones(8), device)
    window.add(t._native, 8, boom)
    with pytest.raises(KeyError, match="from the callback"):
        window.drain()
    assert window.entries == 0, "the entry was settled all the same"
