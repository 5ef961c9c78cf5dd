"""Suite `disk`: OffloadAdamW with its state on disk (state_dir=...) against the
disk's own speed, measured in the same run on the same folder.

The folder: ``--disk-dir`` (or the environment's HIPFERRY_BENCH_DISK_DIR);
default a temporary folder under the current directory (its disk, not
/dev/shm). The suite works in a fresh subfolder of it and removes it after.

- disk speed (disk_speed.py): sequential read and write of a 256 MiB file
  (quick: 32 MiB) by fio (io_uring, direct, 1 MiB requests, depth 32) and by
  hipferry's own reader/writer (DiskIo.raw_pass, same depth and request
  size), interleaved, best of the rounds.
- step: one ``step()`` of OffloadAdamW over float32 parameters (4 tensors)
  whose state is 4x the window (window 64 MiB, chunk 2^20: 22M parameters,
  264 MiB of float32 state; quick: window 8 MiB, chunk 2^18, 32 MiB of
  state), after 2 warm-up steps, contenders interleaved, best of the rounds:
  io_backend "auto" (io_uring where the kernel allows it), "threads", and
  8-bit state (state_dtype=torch.uint8). Bytes read and written per step
  come from memory_stats(); ``efficiency`` = (read bytes / the disk's read
  speed + written bytes / its write speed) / step time, the disk's speed
  being fio's (the own reader/writer's when fio did not run).
- RSS (disk_rss.py): the peak RSS growth of making and stepping the
  optimizer (float32 state) in a fresh process, against the window.

Targets (issue 32): efficiency >= 0.85; 8-bit bytes per step <= 0.55 x
float32's; RSS growth <= window + 10%. The notes say met or missed.
"""
import gc
import os
import shutil
import tempfile
import time
from typing import Callable, Dict, List

import torch

from .harness import Context, SuiteResult, suite
from . import disk_rss
from .disk_speed import OWN_READ, OWN_WRITE, measure_speed, reference

NAME = "disk"
MiB = 1 << 20
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
F32_URING, F32_THREADS, EIGHT = "step float32 state, io auto", "step float32 state, io threads", "step 8-bit state"
COLUMNS = ["measure", "contender", "GBps", "seconds", "read_MiB", "written_MiB", "efficiency", "efficiency_own",
           "io_backend", "direct_io", "ratio", "target", "met"]


def _sizes(ctx: Context) -> dict:
    if ctx.quick:
        window, chunk, speed_bytes = 8 * MiB, 1 << 18, 32 * MiB
    else:
        window, chunk, speed_bytes = 64 * MiB, 1 << 20, 256 * MiB
    numel = 4 * window // 12  # float32 state (master, m, v: 12 B a parameter) = 4 windows
    return dict(window=window, chunk=chunk, numel=numel, speed_bytes=speed_bytes)


def work_folder(ctx: Context) -> str:
    """A fresh subfolder of --disk-dir / HIPFERRY_BENCH_DISK_DIR / the current directory."""
    parent = getattr(ctx, "disk_dir", None) or os.environ.get("HIPFERRY_BENCH_DISK_DIR") or os.getcwd()
    if not os.path.isdir(parent):
        raise ValueError(f"hipferry bench disk: --disk-dir {parent!r} is not a directory; expected an existing "
                         "folder on the disk to measure")
    return tempfile.mkdtemp(prefix="hipferry-bench-disk-", dir=parent)


def _params(numel: int, contenders: int) -> List[List[torch.Tensor]]:
    """`contenders` copies of the same parameters; one set of gradients shared (a step only reads them)."""
    torch.manual_seed(0)
    sizes = [numel // 4] * 3 + [numel - 3 * (numel // 4)]
    first = [torch.randn(s) for s in sizes]
    grads = [torch.randn(s) * 1e-2 for s in sizes]
    out = []
    for _ in range(contenders):
        ps = [torch.nn.Parameter(x.clone()) for x in first]
        for p, g in zip(ps, grads):
            p.grad = g
        out.append(ps)
    return out


def _optimizers(folder: str, sz: dict) -> Dict[str, object]:
    from ..optim import DiskOptions, OffloadAdamW
    out = {}
    kinds = ((F32_URING, "auto", torch.float32), (F32_THREADS, "threads", torch.float32), (EIGHT, "auto", torch.uint8))
    for (name, backend, dtype), params in zip(kinds, _params(sz["numel"], len(kinds))):
        state_dir = os.path.join(folder, name.replace(" ", "_").replace(",", ""))
        disk = DiskOptions(window_bytes=sz["window"], chunk_numel=sz["chunk"], queue_depth=32,
                           request_bytes=1 << 20, io_backend=backend)
        out[name] = OffloadAdamW(params, state_dir=state_dir, disk=disk, state_dtype=dtype, **HYPER)
    return out


def _timer(opt) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0
    return run


def measure_steps(folder: str, sz: dict, repeats: int, step: Callable[[str], None]) -> Dict[str, dict]:
    """{contender: best seconds and its memory_stats()} (interleaved rounds after 2 warm-up steps)."""
    step(f"steps: {sz['numel'] / 1e6:.1f}M params, window {sz['window'] >> 20} MiB: making the state files")
    opts = _optimizers(folder, sz)
    try:
        for name, opt in opts.items():
            step(f"steps: 2 warm-up steps, {name}")
            opt.step()
            opt.step()
        best = {k: float("inf") for k in opts}
        for r in range(repeats):
            step(f"steps: round {r + 1}/{repeats} (3 contenders interleaved)")
            for name, opt in opts.items():
                best[name] = min(best[name], _timer(opt)())
        return {k: dict(seconds=best[k], stats=opts[k].memory_stats()) for k in opts}
    finally:
        del opts
        gc.collect()


def _speed_rows(speed: Dict[str, float]) -> List[dict]:
    return [{"measure": "disk speed", "contender": k, "GBps": v / 1e9, "seconds": "", "io_backend": "",
             "direct_io": ""} for k, v in speed.items()]


def _step_rows(steps: Dict[str, dict], read_bw: float, write_bw: float, speed: Dict[str, float]) -> List[dict]:
    """efficiency: against (read_bw, write_bw), fio's when it ran; efficiency_own: against the own reader/writer."""
    rows = []
    f32 = steps[F32_URING]["stats"]
    f32_bytes = f32["disk_bytes_read_per_step"] + f32["disk_bytes_written_per_step"]
    for name, m in steps.items():
        s, secs = m["stats"], m["seconds"]
        rd, wr = s["disk_bytes_read_per_step"], s["disk_bytes_written_per_step"]
        eff = (rd / read_bw + wr / write_bw) / secs
        own = (rd / speed[OWN_READ] + wr / speed[OWN_WRITE]) / secs
        row = {"measure": "step", "contender": name, "GBps": (rd + wr) / secs / 1e9, "seconds": secs,
               "read_MiB": rd / MiB, "written_MiB": wr / MiB, "efficiency": eff, "efficiency_own": own,
               "io_backend": s["io_backend"], "direct_io": s["direct_io"]}
        if name == EIGHT:
            row.update(ratio=(rd + wr) / f32_bytes, target="bytes <= 0.55x float32's",
                       met=(rd + wr) / f32_bytes <= 0.55)
        else:
            row.update(target="efficiency >= 0.85", met=eff >= 0.85)
        rows.append(row)
    return rows


def _rss_row(child, step: Callable[[str], None], notes: List[str]) -> List[dict]:
    step("RSS: making and stepping the optimizer in a fresh process")
    try:
        got = disk_rss.finish(child)
    except RuntimeError as e:
        notes.append(f"RSS growth not measured: {e}")
        return []
    ratio = got["growth_bytes"] / got["window_bytes"]
    what = f"float32 state, io auto (fresh process, {got['steps']} steps)"
    return [{"measure": "peak RSS growth", "contender": what,
             "ratio": ratio, "read_MiB": "", "written_MiB": "", "GBps": "", "seconds": "", "io_backend": "",
             "direct_io": "", "target": "growth <= window + 10%", "met": ratio <= 1.10,
             "growth_MiB": got["growth_bytes"] / MiB, "window_MiB": got["window_bytes"] / MiB,
             "baseline": got["baseline"], "first_use_MiB": got["first_use_bytes"] / MiB}]


def _verdicts(rows: List[dict], which: str, notes: List[str]) -> None:
    for r in rows:
        if r.get("target"):
            word = "met" if r["met"] else "MISSED"
            if r["measure"] == "step" and r["contender"] != EIGHT:
                fig = (f"efficiency {r['efficiency']:.2f} vs {which} ({r['read_MiB']:.0f} MiB read + "
                       f"{r['written_MiB']:.0f} MiB written in {r['seconds']:.3f} s; the disk's bytes alone would "
                       f"take {r['efficiency'] * r['seconds']:.3f} s)")
            elif r["measure"] == "step":
                fig = (f"{r['read_MiB'] + r['written_MiB']:.0f} MiB a step, {r['ratio']:.3f}x float32's "
                       f"(efficiency {r['efficiency']:.2f})")
            else:
                fig = (f"{r['growth_MiB']:.1f} MiB over a {r['window_MiB']:.0f} MiB window = {r['ratio']:.3f}x "
                       f"(baseline {r['baseline']}; not counted: the one-off first use of the disk optimizer in "
                       f"the process, {r['first_use_MiB']:.0f} MiB of code pages and runtime, measured apart)")
            notes.append(f"target {r['target']} ({r['contender']}): {word}: {fig}")
    if any(r["measure"] == "step" and r["efficiency"] > 1 for r in rows):
        notes.append("an efficiency above 1: the step's reads and writes overlap, and this disk serves both at "
                     "once faster than the sum of its one-direction times (the bound adds them)")
    if any(r.get("direct_io") is False for r in rows):
        notes.append("the state files are not O_DIRECT here: reads may come from the page cache (see direct_io)")


def _plot(rows: List[dict]) -> dict:
    bars = [r for r in rows if r["measure"] in ("disk speed", "step")]
    for r in bars:
        r["bar"] = r["contender"]
    return {"kind": "bar", "x": "bar", "y": "GBps", "rows": bars, "xlabel": "",
            "ylabel": "GB/s (steps: bytes read + written / time)",
            "title": "Disk speed and OffloadAdamW(state_dir=...) step traffic, best of rounds"}


@suite(NAME)
def run_disk(ctx: Context) -> SuiteResult:
    sz = _sizes(ctx)
    repeats = 1 if ctx.quick else max(1, ctx.repeats)
    total = [0, 2 + 2 * repeats + 3 + 1]

    def step(what: str) -> None:
        total[0] += 1
        ctx.progress(NAME, total[0], max(total), what)

    folder = work_folder(ctx)
    notes = [f"folder measured: {os.path.dirname(folder)} (free {shutil.disk_usage(folder).free / 1e9:.0f} GB); "
             f"window {sz['window'] >> 20} MiB, chunk_numel {sz['chunk']}, {sz['numel']} float32 params"]
    rss_args = (os.path.join(folder, "rss"), sz["numel"], sz["window"], sz["chunk"], 2 if ctx.quick else 3)
    # Quick (a smoke run): the RSS child (mostly torch's imports) runs beside the timings; full: after them.
    child = disk_rss.start(*rss_args) if ctx.quick else None
    try:
        speed, more = measure_speed(folder, sz["speed_bytes"], repeats, step)
        notes += more
        read_bw, write_bw, which = reference(speed)
        rows = _speed_rows(speed)
        rows += _step_rows(measure_steps(folder, sz, repeats, step), read_bw, write_bw, speed)
        rows += _rss_row(child or disk_rss.start(*rss_args), step, notes)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        shutil.rmtree(folder, ignore_errors=True)
    _verdicts(rows, which, notes)
    return SuiteResult(rows=rows, columns=COLUMNS, plots=[_plot(rows)], notes=notes)
