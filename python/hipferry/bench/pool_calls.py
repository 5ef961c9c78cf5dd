"""Part of suite `pool`: what one call costs from Python, made as a training script makes it.

- alloc+free from Python: ``pool.empty((n,), dtype=torch.float32)`` and its
  tensor dropped, against ``torch.empty`` of the same arguments (the
  baseline); beside them the stages of the path (Note [pool fast path]): the
  core allocator and the tensor made in C++ (test hooks only), the fast call
  ``_C.pool_empty_fast`` itself, and the path pool.empty took before it, its
  Python checks and the op ``torch.ops.hipferry.pool_empty`` through the
  dispatcher (what tracing still takes).
- pin: ``hipferry.pin(t, pool)`` against ``t.pin_memory()`` on a GPU; without
  one against ``torch.empty_like(t).copy_(t)`` (pin_memory's own two steps,
  in ordinary memory), with ``t.clone()`` beside it.
- prefetch of 64 small tensors: ``hipferry.prefetch(ts, dev).wait()`` against
  ``[t.to(dev, non_blocking=True, copy=True) for t in ts]`` (a synchronize
  after each on a GPU).

Each contender runs a batch of calls per round; rounds are interleaved and
each contender's best round is kept (CPU timings swing from run to run).
"""
import time

import torch

from .harness import best_of_interleaved
from .. import _C
from ..pool import PinnedPool, pin
from ..transfer import prefetch

KiB = 1 << 10


def _per_call(fn, calls):
    """A timer for best_of_interleaved: seconds per call over a batch of `calls`."""
    def timed():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    return timed


def _race(contenders, calls, rounds):
    return best_of_interleaved({k: _per_call(f, calls) for k, f in contenders.items()}, rounds)


def _rows(rows, measure, nbytes, best, baseline):
    for name, secs in best.items():
        rows.append({"measure": measure, "bytes": nbytes, "contender": name, "value": secs * 1e9, "unit": "ns/call",
                     "baseline": baseline, "vs_baseline": best[baseline] / secs,
                     "ratio_to_baseline": secs / best[baseline]})


def _core_stage(kind, pool_id, nbytes):
    """A C++-timed stage (test hooks) as a per-call function for the race: the
    hook times `iterations` pairs in C++; this returns their mean per call."""
    hook = _C._testing.pool_bench_alloc_free

    def run():
        return sum(hook(kind, pool_id, nbytes, 100)) / 100 * 1e-9
    return run


def alloc_free_from_python(ctx, rows, gpu):
    calls, rounds = (2000, 5) if ctx.quick else (20000, max(7, ctx.repeats))
    numel = 4096
    nbytes = numel * 4
    pool = PinnedPool()
    pool_id = pool.native_id
    op = torch.ops.hipferry.pool_empty.default
    size = (numel,)
    base = "torch.empty((n,), dtype=float32)"
    public = "pool.empty((n,), dtype=float32)"
    contenders = {
        base: lambda: torch.empty(size, dtype=torch.float32),
        public: lambda: pool.empty(size, dtype=torch.float32),
        "stage: _C.pool_empty_fast (the fast call alone)": lambda: _C.pool_empty_fast(pool_id, size, torch.float32,
                                                                                      None),
        "before: pool.empty's checks + the op (dispatcher)": lambda: pool._empty_checked(size, torch.float32, None),
        "stage: the op torch.ops.hipferry.pool_empty alone": lambda: op(pool_id, [numel], torch.float32, -1),
    }
    hooks = getattr(_C, "_testing", None)
    ctx.progress("pool", 1, 3, f"from Python: alloc+free of {nbytes} B, {len(contenders)} contenders")
    best = _race(contenders, calls, rounds)
    if hooks is not None:  # C++-timed stages: the allocator, and the tensor around its block
        for kind, name in (("pool_core", "stage: core allocator (C++)"),
                           ("pool_tensor", "stage: + tensor from_blob with the pool's deleter (C++)")):
            timed = _core_stage(kind, pool_id, nbytes)
            best[name] = min(timed() for _ in range(rounds))
    _rows(rows, "alloc+free from Python", nbytes, best, base)
    pool.close()


def pin_from_python(ctx, rows, gpu):
    calls, rounds = (2000, 5) if ctx.quick else (20000, max(7, ctx.repeats))
    t = torch.randn(4096)
    pool = PinnedPool()
    if gpu:
        base = "t.pin_memory()"
        contenders = {base: t.pin_memory}
    else:
        base = "torch.empty_like(t).copy_(t) (pin_memory's steps, unpinned)"
        contenders = {base: lambda: torch.empty_like(t).copy_(t), "t.clone()": t.clone}
    contenders["hipferry.pin(t, pool)"] = lambda: pin(t, pool)
    ctx.progress("pool", 2, 3, f"from Python: pin of {t.numel() * 4} B")
    best = _race(contenders, calls, rounds)
    _rows(rows, "pin from Python", t.numel() * 4, best, base)
    pool.close()


def prefetch_small_from_python(ctx, rows, gpu):
    calls, rounds = (50, 5) if ctx.quick else (300, max(7, ctx.repeats))
    dev = "cuda" if gpu else "cpu"
    count, numel = 64, 1024
    srcs = [torch.randn(numel) for _ in range(count)]
    if gpu:
        srcs = [s.pin_memory() for s in srcs]
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    base = f"[t.to(non_blocking) for {count} tensors]"

    def torch_copies():
        out = [s.to(dev, non_blocking=True, copy=True) for s in srcs]
        sync()
        return out

    def hipferry_prefetch():
        out = prefetch(srcs, dev).wait()
        sync()
        return out

    contenders = {base: torch_copies, f"hipferry.prefetch({count} tensors).wait()": hipferry_prefetch}
    for name, fn in contenders.items():  # warm-up, and the values checked
        assert all(torch.equal(a.cpu(), b) for a, b in zip(fn(), srcs)), name
    ctx.progress("pool", 3, 3, f"from Python: prefetch of {count} x {numel * 4 // KiB} KiB to {dev}")
    best = _race(contenders, calls, rounds)
    _rows(rows, "prefetch of 64 small from Python", count * numel * 4, best, base)


def from_python(ctx, rows, gpu):
    alloc_free_from_python(ctx, rows, gpu)
    pin_from_python(ctx, rows, gpu)
    prefetch_small_from_python(ctx, rows, gpu)
