"""Suite `copy_cast`: hipferry.copy_cast_ vs torch's own conversion, 4 KiB .. 1 GiB.

CPU: both in host memory; contenders are copy_cast_ into a preallocated tensor,
torch `dst.copy_(src)` (same work, torch's kernel) and `src.to(dtype)` (what
users write; allocates). GPU (when present): pinned host -> device, where
copy_cast_ is one kernel reading mapped memory and torch is
`.to(device, dtype, non_blocking=True)` (copy, then cast on the device), and
device -> pinned host.
Bandwidth counts source bytes (what crosses the link / is read).
"""
import torch

from .harness import Context, SuiteResult, best_of_interleaved, gpu_timer, sizes_by_four, suite, wall_timer
from ..ops import copy_cast_

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)]


def _pair_name(src_dt, dst_dt) -> str:
    return f"{str(src_dt)[6:]}->{str(dst_dt)[6:]}"


def _add_rows(rows, direction, src_dt, dst_dt, nbytes, best, baseline, calls=1):
    """One row per contender; `best` holds seconds for `calls` calls; speedup is
    against `baseline`, measured in the same interleaved rounds."""
    for contender, secs in best.items():
        rows.append({"direction": direction, "pair": _pair_name(src_dt, dst_dt), "bytes": nbytes,
                     "contender": contender, "seconds": secs / calls, "GBps": nbytes * calls / secs / 1e9,
                     "baseline": baseline, "speedup_vs_baseline": best[baseline] / secs})


def _repeats(ctx: Context, nbytes: int) -> int:
    if ctx.quick:
        return 2
    return ctx.repeats if nbytes <= 64 * MiB else max(2, ctx.repeats // 2)


def _cpu_cases(ctx, name, sizes, rows):
    total = len(sizes) * len(PAIRS)
    i = 0
    for src_dt, dst_dt in PAIRS:
        for nbytes in sizes:
            i += 1
            n = nbytes // torch.tensor([], dtype=src_dt).element_size()
            ctx.progress(name, i, total, f"cpu {_pair_name(src_dt, dst_dt)} {nbytes // KiB} KiB")
            src = (torch.randn(n) * 100).to(src_dt)
            dst = torch.empty(n, dtype=dst_dt)
            ref = torch.empty(n, dtype=dst_dt)
            # Warm-up also checks the result: a benchmark of wrong output is worthless.
            copy_cast_(dst, src)
            ref.copy_(src)
            assert torch.equal(dst.view(torch.int16 if dst_dt != torch.float32 else torch.int32),
                               ref.view(torch.int16 if dst_dt != torch.float32 else torch.int32))
            inner = max(1, (4 * MiB) // nbytes)  # small sizes: time a batch of calls

            def batch(fn):
                def run():
                    for _ in range(inner):
                        fn()
                return wall_timer(run)
            best = best_of_interleaved({
                "hipferry copy_cast_": batch(lambda: copy_cast_(dst, src)),
                "torch copy_": batch(lambda: ref.copy_(src)),
                "torch .to(dtype)": batch(lambda: src.to(dst_dt)),
            }, _repeats(ctx, nbytes))
            _add_rows(rows, "host", src_dt, dst_dt, nbytes, best, "torch copy_", calls=inner)


def _gpu_cases(ctx, name, sizes, rows):
    dev = torch.device("cuda", torch.cuda.current_device())
    total = len(sizes) * len(PAIRS) * 2
    i = 0
    for src_dt, dst_dt in PAIRS:
        for nbytes in sizes:
            n = nbytes // torch.tensor([], dtype=src_dt).element_size()
            host = (torch.randn(n) * 100).to(src_dt).pin_memory()
            dst_dev = torch.empty(n, dtype=dst_dt, device=dev)
            i += 1
            ctx.progress(name, i, total, f"h2d {_pair_name(src_dt, dst_dt)} {nbytes // KiB} KiB")
            best = best_of_interleaved({
                "hipferry copy_cast_": gpu_timer(lambda: copy_cast_(dst_dev, host)),
                "torch .to(dev, dtype, non_blocking)": gpu_timer(lambda: host.to(dev, dst_dt, non_blocking=True)),
                "torch memcpy (same dtype, reference)": gpu_timer(
                    lambda: torch.empty(n, dtype=src_dt, device=dev).copy_(host, non_blocking=True)),
            }, _repeats(ctx, nbytes))
            _add_rows(rows, "h2d", src_dt, dst_dt, nbytes, best, "torch .to(dev, dtype, non_blocking)")
            src_dev = (torch.randn(n, device=dev) * 100).to(src_dt)
            host_dst = torch.empty(n, dtype=dst_dt).pin_memory()
            i += 1
            ctx.progress(name, i, total, f"d2h {_pair_name(src_dt, dst_dt)} {nbytes // KiB} KiB")
            best = best_of_interleaved({
                "hipferry copy_cast_": gpu_timer(lambda: copy_cast_(host_dst, src_dev)),
                "torch .to(cpu, dtype, non_blocking)": gpu_timer(
                    lambda: host_dst.copy_(src_dev, non_blocking=True)),
            }, _repeats(ctx, nbytes))
            _add_rows(rows, "d2h", src_dt, dst_dt, nbytes, best, "torch .to(cpu, dtype, non_blocking)")


@suite("copy_cast")
def copy_cast_suite(ctx: Context) -> SuiteResult:
    rows = []
    sizes = sizes_by_four(ctx)
    _cpu_cases(ctx, "copy_cast", sizes, rows)
    if ctx.device == "cuda":
        _gpu_cases(ctx, "copy_cast", sizes, rows)
    plots = [{"x": "bytes", "y": "GBps", "series": "label", "title": "copy_cast: source GB/s vs size",
              "xlabel": "source bytes", "ylabel": "GB/s (source bytes)"}]
    for r in rows:
        r["label"] = f"{r['direction']} {r['pair']} {r['contender']}"
    return SuiteResult(rows=rows, columns=["direction", "pair", "bytes", "contender", "GBps",
                                           "speedup_vs_baseline"], plots=plots,
                       notes=[f"torch threads: {torch.get_num_threads()}; best of interleaved repeats",
                              "baseline: host 'torch copy_', h2d 'torch .to(dev, dtype, non_blocking)', "
                              "d2h 'torch .to(cpu, dtype, non_blocking)'"])
