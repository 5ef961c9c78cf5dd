"""The machine's speeds, measured once and cached (extends optim/calibration.py):
DRAM triad, the CPU AdamW step for each home of the state (torch's fused
AdamW, hipferry's float32 and 8-bit state), the disk of a state folder (read
and write, with its flush), and the host link of a GPU.

Cached in $HIPFERRY_CACHE_DIR/machine.json (default ~/.cache/hipferry), keyed by
the machine (CPU, GPU, threads, torch, hipferry) and, for a disk, the
filesystem the folder is on; refresh=True measures again."""
import logging
import os
import platform
import shutil
import tempfile
import time
from typing import Callable, Dict, Optional

import torch

from ..optim import cache_file, link_gbps, load_cached, store_cached
from ..optim.disk import RawIo

_MiB = 1 << 20
_STEP_NUMEL = 4 << 20   # per tensor: 4 tensors, 16 M parameters, 256+ MiB of float32 state: past any cache
_DISK_BYTES = 256 * _MiB
_memory: Dict[str, dict] = {}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def machine_key(device: torch.device) -> str:
    from ..version import __version__
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no gpu"
    return f"{_cpu_name()}|{gpu}|{torch.get_num_threads()} threads|torch {torch.__version__}|hipferry {__version__}"


def _best(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def triad_gbps(numel: int = 32 << 20, repeats: int = 3) -> float:
    a, b, c = (torch.empty(numel) for _ in range(3))
    b.fill_(1.0)
    c.fill_(2.0)
    return 12 * numel / _best(lambda: torch.add(b, c, alpha=0.5, out=a), repeats) / 1e9


def step_seconds_per_param(home: str, repeats: int = 3, state_dir: Optional[str] = None,
                           numel: int = _STEP_NUMEL) -> float:
    """One AdamW step over 16 M float32 parameters in 4 tensors, with the state in `home`
    ('torch', 'host-float32', 'host-8bit'; 'disk-float32', 'disk-8bit' in `state_dir`),
    best of `repeats` after a warm-up step. One optimizer at a time, so the peak is one
    home's state."""
    from ..optim import OffloadAdamW
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn(numel) * 1e-3
    if home == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        extra = {"state_dir": state_dir} if home.startswith("disk") else {}
        opt = OffloadAdamW(params, lr=1e-4, state_dtype=torch.uint8 if home.endswith("8bit") else torch.float32,
                           **extra)
    optim_log = logging.getLogger("hipferry.optim")
    level = optim_log.level
    optim_log.setLevel(logging.ERROR)  # the disk's wear warning is for training runs, not this measurement
    try:
        opt.step()
        seconds = _best(opt.step, repeats)
    finally:
        optim_log.setLevel(level)
    del opt
    return seconds / (4 * numel)


def interleaved_steps(homes, rounds: int = 3, repeats: int = 2, state_dir: Optional[str] = None,
                      numel: int = _STEP_NUMEL, progress: Callable[[str], None] = lambda s: None) -> Dict[str, float]:
    """step_seconds_per_param of each home, measured in turns (`rounds` times each, the
    best kept): a swing of this machine's speed then reaches every home alike, instead
    of the one measured while it lasted."""
    best = {home: float("inf") for home in homes}
    for r in range(rounds):
        for home in homes:
            progress(f"  AdamW step, state {home} (round {r + 1}/{rounds})")
            where = os.path.join(state_dir, f"{home}-{r}") if state_dir is not None else None
            best[home] = min(best[home], step_seconds_per_param(home, repeats, where, numel))
            if where is not None:  # (this round's state files: 0.4 GB for float32; one round's at a time)
                shutil.rmtree(where, ignore_errors=True)
    return {f"step_s_per_param[{home}]": s for home, s in best.items()}


def disk_speeds(folder: str, nbytes: int = _DISK_BYTES, repeats: int = 2, step_numel: int = _STEP_NUMEL,
                rounds: int = 3) -> dict:
    """Sequential write (with its flush) and read of `nbytes` in `folder`, by the
    optimizer's own I/O queue, best of `repeats`; one flush's latency; and the AdamW
    step with the state in files there, float32 and 8-bit."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".hipferry-speed-") as tmp:
        io = RawIo(os.path.join(tmp, "speed.dat"), nbytes)
        try:
            write = min(io.timed("write") for _ in range(repeats))
            read = min(io.timed("read") for _ in range(repeats))
            flush = min(io.flush_seconds() for _ in range(3))
            direct = io.direct
        finally:
            io.close()
        steps = interleaved_steps(("disk-float32", "disk-8bit"), rounds=rounds, state_dir=tmp, numel=step_numel)
    return {"disk_read_gbps": nbytes / read / 1e9, "disk_write_gbps": nbytes / write / 1e9,
            "disk_flush_seconds": flush, "disk_direct_io": direct, **steps}


def _filesystem_key(folder: str) -> str:
    st = os.stat(folder)
    return f"disk dev {os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _cached(key: str, refresh: bool, measure: Callable[[], dict], progress: Callable[[str], None], what: str) -> dict:
    if not refresh:
        if key in _memory:
            return dict(_memory[key])
        stored = load_cached(cache_file("machine.json")).get(key)
        if stored:
            _memory[key] = stored
            return dict(stored)
    progress(f"measuring {what} (once: cached in {cache_file('machine.json')})")
    value = dict(measure(), measured=time.strftime("%Y-%m-%d %H:%M:%S"))
    _memory[key] = value
    store_cached(cache_file("machine.json"), key, value)
    return dict(value)


def measure_machine(device: torch.device, state_dir: Optional[str] = None, *, refresh: bool = False,
                    progress: Callable[[str], None] = lambda s: None, rounds: int = 3) -> dict:
    """Every speed the planner uses; see the module doc. `rounds`: of the step speeds
    (interleaved_steps; 1 for a smoke run such as `bench plan --quick`)."""
    key = machine_key(device)

    def cpu() -> dict:
        out = {"dram_triad_gbps": triad_gbps()}
        out.update(interleaved_steps(("torch", "host-float32", "host-8bit"), rounds=rounds, progress=progress))
        if device.type == "cuda":
            out["link_h2d_gbps"], out["link_d2h_gbps"] = link_gbps(device)
        return out

    result = _cached(key, refresh, cpu, progress, "this machine's memory, AdamW step and link speeds")
    if state_dir is not None:
        disk_key = f"{key}|{_filesystem_key(state_dir)}"
        result.update(_cached(disk_key, refresh, lambda: disk_speeds(state_dir, rounds=rounds), progress,
                              f"the disk under {state_dir}"))
    return result
