"""Short measurements that let OffloadAdamW(step_on="auto") choose its engine.

The GPU-streamed engine is bound by the host link (state in and out each step),
the CPU engine by the CPU's AdamW throughput (28 bytes per parameter through
host memory) with only gradients and parameters crossing the link. Both figures
are measured once per machine and cached, since they take about a second.
"""
import json
import os
import time
from typing import Optional

import torch

from .. import _C
from ..pool import default_pool
from .int8_store import blocks

_MiB = 1 << 20
_cache: dict = {}


def cache_file(name: str) -> str:
    """$HIPFERRY_CACHE_DIR/name (default ~/.cache/hipferry/name): where measurements are kept."""
    root = os.environ.get("HIPFERRY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hipferry")
    return os.path.join(root, name)


def _cache_path() -> str:
    return cache_file("calibration.json")


def _key(device: torch.device) -> str:
    from ..version import __version__  # (not the package front: it imports hipferry.optim)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{name}|torch {torch.__version__}|hipferry {__version__}|{os.cpu_count()} cpus"


def _cpu_adamw_params_per_s(n: int = 4 << 20, repeats: int = 3) -> float:
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    best = float("inf")
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        _C._adamw_step_(p, g, m, v, None, None, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
        best = min(best, time.perf_counter() - t0)
    return n / best


def _cpu_adamw8bit_params_per_s(n: int = 4 << 20, repeats: int = 3) -> float:
    """The same with 8-bit moments (OffloadAdamW(state_dtype=torch.uint8))."""
    p, g = torch.randn(n), torch.randn(n)
    codes = {k: torch.empty(n, dtype=torch.uint8) for k in ("m", "v")}
    scales = {k: torch.empty(blocks(n)) for k in ("m", "v")}
    _C._quantize_blockwise_8bit(torch.randn(n) * 1e-3, True, codes["m"], scales["m"])
    _C._quantize_blockwise_8bit(torch.rand(n) * 1e-6, False, codes["v"], scales["v"])
    best = float("inf")
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        _C._adamw8bit_step_(p, g, codes["m"], scales["m"], codes["v"], scales["v"], None, None, None, step,
                            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                            maximize=False)
        best = min(best, time.perf_counter() - t0)
    return n / best


def link_gbps(device: torch.device, nbytes: int = 64 * _MiB, repeats: int = 3) -> tuple:
    """Pinned host <-> `device` copy speed, GB/s, (host to device, device to host), best of `repeats`."""
    host = default_pool().empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = {"h2d": float("inf"), "d2h": float("inf")}
    with torch.cuda.device(device):
        for _ in range(repeats):
            for direction, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best[direction] = min(best[direction], start.elapsed_time(end) / 1e3)
    return nbytes / best["h2d"] / 1e9, nbytes / best["d2h"] / 1e9


def calibrate(device: Optional[torch.device] = None, *, refresh: bool = False) -> dict:
    """Link bandwidth (pinned, GB/s, each direction) and CPU AdamW throughput
    (parameters/s) for `device` (default: the current GPU, else the CPU only).
    Cached in memory and in $HIPFERRY_CACHE_DIR/calibration.json (default
    ~/.cache/hipferry); `refresh=True` measures again."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate: device must be the CPU or a GPU, got {device}")
    key = _key(device)
    path = _cache_path()
    if not refresh:
        if key in _cache:
            return dict(_cache[key])
        stored = load_cached(path).get(key)
        if stored:
            if "cpu_adamw8bit_params_per_s" not in stored:  # cached by a version that did not measure it
                stored["cpu_adamw8bit_params_per_s"] = _cpu_adamw8bit_params_per_s()
                store_cached(path, key, stored)
            _cache[key] = stored
            return dict(stored)
    result = {"device": str(device), "cpu_adamw_params_per_s": _cpu_adamw_params_per_s(),
              "cpu_adamw8bit_params_per_s": _cpu_adamw8bit_params_per_s(),
              "cpu_threads": torch.get_num_threads(), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda":
        result["link_h2d_gbps"], result["link_d2h_gbps"] = link_gbps(device)
    _cache[key] = result
    store_cached(path, key, result)
    return dict(result)


def load_cached(path: str) -> dict:
    """The measurements kept in `path` ({} when missing or unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def store_cached(path: str, key: str, value: dict) -> None:
    """Keeps `value` under `key` in `path`, replaced atomically; a read-only home keeps
    only the caller's in-memory cache."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        everything = load_cached(path)
        everything[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(everything, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def choose_engine(calibration: dict, low_precision_share: float, amsgrad: bool, eight_bit: bool = False) -> tuple:
    """('gpu' or 'cpu', reason) from predicted seconds per parameter.

    GPU-streamed: the state crosses the link both ways at once (full duplex):
    per moment (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad) 4 B, or 1 B
    and a 4 B scale per 256 in 8 bits; 4 B of master for low-precision
    parameters. CPU: the fused host step (float32 or 8-bit, as measured), with
    the gradient copy overlapped with backward and the parameter copy back
    overlapped with the host step of the next parameter."""
    moment = 1 + 4 / 256 if eight_bit else 4
    state_bytes = (2 + (1 if amsgrad else 0)) * moment + 4 * low_precision_share
    h2d, d2h = calibration["link_h2d_gbps"] * 1e9, calibration["link_d2h_gbps"] * 1e9
    gpu = max(state_bytes / h2d, state_bytes / d2h)
    param_bytes = 4 - 2 * low_precision_share
    speed = calibration["cpu_adamw8bit_params_per_s" if eight_bit else "cpu_adamw_params_per_s"]
    cpu = max(1 / speed, param_bytes / h2d)
    choice = "gpu" if gpu <= cpu else "cpu"
    reason = (f"predicted {gpu * 1e9:.2f} ns/param GPU-streamed (link {h2d / 1e9:.1f}/{d2h / 1e9:.1f} GB/s "
              f"h2d/d2h) vs {cpu * 1e9:.2f} ns/param on the CPU "
              f"({speed / 1e6:.0f} M params/s{', 8-bit state' if eight_bit else ''})")
    return choice, reason
