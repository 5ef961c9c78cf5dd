"""Part of suite `disk`: the host memory OffloadAdamW(state_dir=...) adds, in a
fresh process (so nothing measured before shares its peak). The parameters and
gradients are made first (filled in place: no temporaries). A first use of the
disk optimizer (a 2^18-element parameter, its own pool, closed after) then
loads code pages and starts thread pools: that one-off cost is reported apart
("first use"). Then the peak RSS is reset (``/proc/self/clear_refs`` = 5;
where refused, the peak so far is the baseline), the optimizer is made on the
default pool and stepped, and the growth of the peak (VmHWM) is what it
needed. Run as ``python -m hipferry.bench.disk_rss FOLDER NUMEL WINDOW CHUNK
STEPS``; prints JSON.
"""
import json
import os
import subprocess
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _first_use(folder: str, chunk: int) -> None:
    import gc
    import torch
    from ..pool import PinnedPool
    from hipferry.optim import DiskOptions, OffloadAdamW
    with PinnedPool() as pool:
        p = torch.nn.Parameter(torch.zeros(1 << 18))
        p.grad = torch.zeros(1 << 18)
        opt = OffloadAdamW([p], lr=1e-3, pool=pool, state_dir=folder,
                           disk=DiskOptions(window_bytes=2 * 16 * chunk, chunk_numel=1 << 18))
        opt.step()
        del opt
        gc.collect()


def child(folder: str, numel: int, window: int, chunk: int, steps: int) -> dict:
    import torch
    from hipferry.optim import DiskOptions, OffloadAdamW
    torch.manual_seed(0)
    sizes = [numel // 4] * 3 + [numel - 3 * (numel // 4)]
    params = [torch.nn.Parameter(torch.empty(s).normal_()) for s in sizes]
    for p in params:
        p.grad = torch.empty(p.numel()).normal_(std=1e-2)
    before_first = _status_kib("VmHWM")
    _first_use(os.path.join(folder, "first-use"), 1 << 18)
    first_use = _status_kib("VmHWM") - before_first
    reset = _reset_peak()
    base = _status_kib("VmRSS" if reset else "VmHWM")
    opt = OffloadAdamW(params, lr=1e-3, state_dir=os.path.join(folder, "measured"),
                       disk=DiskOptions(window_bytes=window, chunk_numel=chunk))
    for _ in range(steps):
        opt.step()
    peak = _status_kib("VmHWM")
    stats = opt.memory_stats()
    return {"growth_bytes": (peak - base) * 1024, "baseline": "VmRSS after reset" if reset else "VmHWM",
            "first_use_bytes": first_use * 1024, "window_bytes": stats["disk_window_bytes"], "steps": steps}


def start(folder: str, numel: int, window: int, chunk: int, steps: int) -> subprocess.Popen:
    """The child, running (finish() collects it)."""
    cmd = [sys.executable, "-m", "hipferry.bench.disk_rss", folder, str(numel), str(window), str(chunk), str(steps)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def finish(child_process: subprocess.Popen) -> dict:
    """The child's JSON; raises RuntimeError with its stderr if it failed."""
    try:
        out, err = child_process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        child_process.kill()
        child_process.communicate()
        raise RuntimeError("RSS child ran past 600 s") from None
    if child_process.returncode:
        raise RuntimeError(f"RSS child failed (exit {child_process.returncode}): {err.strip()[-300:]}")
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(child(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]))))
