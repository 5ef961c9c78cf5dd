"""Suite `transfer`: hipferry.prefetch / offload against torch's own copies.

- bandwidth: 4 KiB .. 1 GiB (x4), host->device (h2d) and device->host (d2h).
  h2d: torch `.to(dev, non_blocking=True)` from pageable and from pinned memory,
  hipferry.prefetch from pool memory and from pageable memory (staged), and the
  raw copy engine, "pinned memcpy" (a preallocated device tensor
  `.copy_(pinned, non_blocking=True)`). d2h: torch `.to("cpu")` (pageable),
  `.to("cpu", non_blocking=True)` (torch pins the result), hipferry.offload (pool
  memory) and the pinned memcpy. `fraction_of_best_pinned`: GB/s over the pinned
  memcpy's, same size, same run.
- many_small: N x 16 KiB h2d, one prefetch of the list vs N `.to()` calls.
- overlap: a matmul loop and a prefetch of about the same duration, serial
  (copy, wait, compute) vs overlapped (prefetch, compute, wait); the overlapped
  run is traced and drawn as transfer_timeline.png (and transfer_trace.json).
- copy_cast: float32 host -> bfloat16 device, fused prefetch(dtype=) vs
  `.to(dev, bfloat16, non_blocking=True)`: time and peak device memory (GPU only).

GPU: times are CUDA events on the current stream around start..wait (wait()
orders the copy before the current stream), and, as `wall_us`, wall clock from
the start to a synchronize. CPU (device "cpu"): hipferry copies on its worker
thread; times are wall clock start..wait, so the suite measures scheduling
overhead. torch's contenders use `copy=True` (a CPU `.to("cpu")` is a no-op) and
nothing is pinned; the baseline is a preallocated `copy_` (memcpy).
"""
import os
import time

import torch

from .harness import Context, SuiteResult, best_of_interleaved, sizes_by_four, suite
from .timeline import write_timeline_png
from ..pool import default_pool
from ..trace import trace, trace_region
from ..transfer import configure_transfers, offload, prefetch

NAME = "transfer"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class _Clock:
    """Timers for best_of_interleaved that also keep each contender's best wall time."""

    def __init__(self, gpu: bool):
        self.gpu, self.wall = gpu, {}

    def timer(self, name, fn):
        def timed() -> float:
            if self.gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                fn()
                end.record()
                end.synchronize()
                wall, secs = time.perf_counter() - t0, start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                wall = secs = time.perf_counter() - t0
            self.wall[name] = min(self.wall.get(name, float("inf")), wall)
            return secs
        return timed

    def race(self, contenders, repeats):
        self.wall = {}
        return best_of_interleaved({k: self.timer(k, f) for k, f in contenders.items()}, repeats)


def _check(contenders, ref, gpu):
    """Warm-up: runs each contender once and compares its output with `ref`. hipferry's
    results are read right after wait(), with no extra synchronize: that is its contract."""
    for name, fn in contenders.items():
        out = fn()
        if gpu and not name.startswith("hipferry"):
            torch.cuda.synchronize()  # torch's non_blocking copies to the host
        outs, refs = (out, ref) if isinstance(out, (list, tuple)) else ([out], [ref])
        assert len(outs) == len(refs) and all(
            a.device == b.device and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(outs, refs)), \
            f"{NAME}: {name} produced wrong values"


def _repeats(ctx: Context, nbytes: int) -> int:
    base = 5 if ctx.quick else (ctx.repeats if nbytes <= 64 * MiB else max(2, ctx.repeats // 2))
    return base * 3 if nbytes <= 256 * KiB else base  # small ones are cheap and noisy


def _human(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _row(case, direction, nbytes, contender, secs, wall, **extra):
    r = {"case": case, "direction": direction, "bytes": nbytes, "contender": contender, "seconds": secs,
         "us": secs * 1e6, "wall_us": wall * 1e6}
    r.update(extra)
    return r


def _bandwidth(ctx, dev, rows, step):
    gpu = ctx.device == "cuda"
    memcpy = "pinned memcpy (copy engine)" if gpu else "memcpy (preallocated copy_)"
    pool, clock = default_pool(), _Clock(gpu)
    for nbytes in sizes_by_four(ctx):
        n = nbytes // 4
        pageable = torch.randn(n)
        pooled = pool.empty(n)
        pooled.copy_(pageable)
        pinned = pageable.pin_memory() if gpu else None
        for direction in ("h2d", "d2h"):
            step(f"{direction} {_human(nbytes)}")
            if direction == "h2d":
                ref = pageable.to(dev, copy=True)
                dst = torch.empty(n, device=dev)
                cs = {"torch .to (pageable)": lambda: pageable.to(dev, non_blocking=True, copy=True)}
                if gpu:
                    cs["torch .to (pinned)"] = lambda: pinned.to(dev, non_blocking=True)
                cs["hipferry prefetch (pool)"] = lambda: prefetch(pooled, dev).wait()
                cs["hipferry prefetch (pageable, staged)"] = lambda: prefetch(pageable, dev).wait()
                cs[memcpy] = (lambda: dst.copy_(pinned, non_blocking=True)) if gpu else (lambda: dst.copy_(pageable))  # noqa: F821 (a name deleted further down; the lambda runs before that)
            else:
                ref, src = pageable, pageable.to(dev, copy=True)
                dst = torch.empty(n, pin_memory=gpu)
                cs = {"torch .to(cpu) (pageable)": lambda: src.to("cpu", copy=True)}
                if gpu:  # torch allocates a pinned result for a non_blocking device->host copy
                    cs["torch .to(cpu, non_blocking) (pinned)"] = lambda: src.to("cpu", non_blocking=True)
                cs["hipferry offload (pool)"] = lambda: offload(src).wait()
                cs[memcpy] = lambda: dst.copy_(src, non_blocking=gpu)  # noqa: F821 (a name deleted further down; the lambda runs before that)
            _check(cs, ref, gpu)
            best = clock.race(cs, _repeats(ctx, nbytes))
            for name, secs in best.items():
                frac = best[memcpy] / secs
                rows.append(_row("bandwidth", direction, nbytes, name, secs, clock.wall[name],
                                 GBps=nbytes / secs / 1e9, fraction_of_best_pinned=frac, vs=frac))
            del ref, dst, cs
    return memcpy


def _many_small(ctx, dev, rows, step):
    gpu, count = ctx.device == "cuda", 100 if ctx.quick else 1000
    step(f"{count} x 16 KiB h2d")
    srcs = [torch.randn(4096) for _ in range(count)]
    if gpu:
        srcs = [s.pin_memory() for s in srcs]
    refs = [s.to(dev, copy=True) for s in srcs]
    hf_name, torch_name = f"hipferry prefetch(list of {count})", f"torch .to(non_blocking) x {count}"
    cs = {hf_name: lambda: prefetch(srcs, dev).wait(),
          torch_name: lambda: [s.to(dev, non_blocking=True, copy=True) for s in srcs]}
    previous = configure_transfers()["batched_copy"].split(" ")[0]
    if gpu:  # both batched paths: hipferry's kernel (above) and the runtime's batched copy
        def runtime_batched():
            configure_transfers(batched_copy="runtime")
            try:
                return prefetch(srcs, dev).wait()
            finally:
                configure_transfers(batched_copy=previous)
        configure_transfers(batched_copy="kernel")
        cs[f"hipferry prefetch(list of {count}), runtime batched copy"] = runtime_batched
    _check(cs, refs, gpu)
    clock = _Clock(gpu)
    try:
        best = clock.race(cs, 3 if ctx.quick else max(ctx.repeats, 5))
    finally:
        configure_transfers(batched_copy=previous)
    if gpu:  # say so when the runtime had no batched copy and the kernel ran instead
        effective = configure_transfers(batched_copy="runtime")["batched_copy"]
        configure_transfers(batched_copy=previous)
        if effective != "runtime":
            best = {(k + " [unavailable: ran the kernel]" if k.endswith("runtime batched copy") else k): v
                    for k, v in best.items()}
            clock.wall = {(k + " [unavailable: ran the kernel]" if k.endswith("runtime batched copy") else k): v
                          for k, v in clock.wall.items()}
    for name, secs in best.items():
        speedup = best[torch_name] / secs
        rows.append(_row("many_small", "h2d", 16 * KiB * count, name, secs, clock.wall[name],
                         GBps=16 * KiB * count / secs / 1e9, speedup_vs_torch=speedup, vs=speedup))


def _overlap(ctx, dev, rows, notes, step):
    gpu = ctx.device == "cuda"
    big = (64 * MiB if ctx.quick else 256 * MiB) if gpu else (8 * MiB if ctx.quick else 64 * MiB)
    nbytes = min(ctx.max_bytes or big, big)
    step(f"overlap: prefetch {_human(nbytes)} with a matmul loop")
    threads = torch.get_num_threads()
    if not gpu:  # matmuls on one core, the worker's copy on the other
        torch.set_num_threads(1)
    try:
        src = default_pool().empty(nbytes // 4).uniform_()
        ref = src.to(dev, copy=True)
        m = 2048 if gpu else 128
        a, b = torch.randn(m, m, device=dev), torch.randn(m, m, device=dev)
        c = torch.empty(m, m, device=dev)

        def compute(k):
            for _ in range(k):
                torch.mm(a, b, out=c)

        def copy():
            return prefetch(src, dev).wait()

        _check({"hipferry prefetch": copy}, ref, gpu)
        clock, rounds = _Clock(gpu), 10 if ctx.quick else max(ctx.repeats, 10)  # cheap; first runs fault pages
        one = clock.race({"copy": copy, "compute x1": lambda: compute(1)}, rounds)
        k = max(1, round(one["copy"] / one["compute x1"]))

        def overlapped():
            t = prefetch(src, dev)
            compute(k)
            return t.wait()

        _check({"hipferry overlapped": overlapped}, ref, gpu)
        names = ["copy alone", f"compute alone ({k} matmuls {m}x{m})", "serial (copy, wait, compute)",
                 "overlapped (prefetch, compute, wait)"]
        cs = dict(zip(names, [copy, lambda: compute(k), lambda: (copy(), compute(k)), overlapped]))
        best = clock.race(cs, rounds)
        longer = max(best[names[0]], best[names[1]])
        for name, secs in best.items():
            extra = {"overlapped_over_longer": secs / longer} if name in names[2:] else {}
            rows.append(_row("overlap", "h2d", nbytes, name, secs, clock.wall[name],
                             vs=secs / longer if name in names[2:] else "", **extra))
        notes.append(f"overlap: overlapped / max(copy, compute) = {best[names[3]] / longer:.2f} (target <= 1.1), "
                     f"serial / overlapped = {best[names[2]] / best[names[3]]:.2f}"
                     + ("" if gpu else "; torch threads set to 1 for this case (2 cores: compute + worker)"))
        _trace(ctx, dev, src, compute, k, notes, gpu)
    finally:
        torch.set_num_threads(threads)


def _trace(ctx, dev, src, compute, k, notes, gpu):
    """One overlapped run under trace(), drawn as a timeline."""
    with trace() as tr:
        with trace_region("prefetch() call"):
            t = prefetch(src, dev)
        with trace_region("compute"):
            compute(k)
            if gpu:  # the region spans the matmuls on the device, not just their launches
                torch.cuda.current_stream().synchronize()
        with trace_region("wait() call"):
            t.wait()
        if gpu:
            torch.cuda.synchronize()
    events = list(tr.events)
    counts = {}
    for e in events:
        counts[e["category"]] = counts.get(e["category"], 0) + 1
    notes.append(f"trace of the overlapped run: {len(events)} events {dict(sorted(counts.items()))}, "
                 f"tracks {sorted({e['track'] for e in events})}")
    out_dir = getattr(ctx, "out_dir", None)
    if not out_dir:
        notes.append("timeline not written: the bench runner gave no output directory")
        return
    png, js = os.path.join(out_dir, f"{NAME}_timeline.png"), os.path.join(out_dir, f"{NAME}_trace.json")
    tr.save(js)
    title = f"overlapped prefetch of {_human(src.numel() * 4)} + {k} matmuls ({ctx.device})"
    if write_timeline_png(png, events, title):
        notes.append(f"timeline: {png}; Chrome/Perfetto trace: {js}")
    else:
        notes.append(f"timeline not written (see stderr); Chrome/Perfetto trace: {js}")


def _copy_cast(ctx, dev, rows, step):
    big = 64 * MiB if ctx.quick else 1 * GiB
    nbytes = min(ctx.max_bytes or big, big)  # float32 source bytes
    step(f"copy+cast float32 -> bfloat16 {_human(nbytes)}")
    pinned = torch.randn(nbytes // 4).pin_memory()
    ref = pinned.to(torch.bfloat16).to(dev)
    hf_name, torch_name = "hipferry prefetch(dtype=bfloat16)", "torch .to(dev, bfloat16, non_blocking)"
    cs = {hf_name: lambda: prefetch(pinned, dev, dtype=torch.bfloat16).wait(),
          torch_name: lambda: pinned.to(dev, torch.bfloat16, non_blocking=True)}
    _check(cs, ref, True)
    peak = {}
    for name, fn in cs.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak[name] = torch.cuda.max_memory_allocated() - base
        del out
    clock = _Clock(True)
    best = clock.race(cs, _repeats(ctx, nbytes))
    for name, secs in best.items():
        rows.append(_row("copy_cast fp32->bf16", "h2d", nbytes, name, secs, clock.wall[name],
                         GBps=nbytes / secs / 1e9, peak_device_bytes=peak[name], peak_MiB=peak[name] / MiB,
                         vs=peak[name] / max(1, peak[torch_name])))


@suite(NAME)
def transfer_suite(ctx: Context) -> SuiteResult:
    gpu = ctx.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    total = 2 * len(sizes_by_four(ctx)) + 2 + (1 if gpu else 0)
    done = [0]

    def step(what):
        done[0] += 1
        ctx.progress(NAME, done[0], total, what)

    rows, notes = [], []
    memcpy = _bandwidth(ctx, dev, rows, step)
    _many_small(ctx, dev, rows, step)
    _overlap(ctx, dev, rows, notes, step)
    if gpu:
        _copy_cast(ctx, dev, rows, step)
    else:
        notes.append("copy+cast fp32 -> bf16 skipped: peak device memory needs a GPU")
    plots = [{"x": "bytes", "y": "GBps", "series": "contender", "xlabel": "bytes", "ylabel": "GB/s (log)", "logy": True,
              "rows": [r for r in rows if r["case"] == "bandwidth" and r["direction"] == d],
              "title": f"transfer {d} ({ctx.device}): GB/s vs size, best of interleaved repeats"}
             for d in ("h2d", "d2h")]
    notes += [f"vs: bandwidth = fraction_of_best_pinned (GB/s / '{memcpy}'s); many_small = speedup over the "
              "torch loop; overlap = time / max(copy alone, compute alone); copy_cast = peak device memory / "
              "torch's (torch's caching allocator only)",
              ("us: CUDA events on the current stream around start..wait; wall_us: to a synchronize" if gpu else
               "us = wall_us: wall clock start..wait (hipferry copies on its worker thread; torch on the caller's)")
              + f"; torch threads {torch.get_num_threads()}"]
    return SuiteResult(rows=rows, plots=plots, notes=notes,
                       columns=["case", "direction", "bytes", "contender", "us", "wall_us", "GBps", "peak_MiB", "vs"])
