"""What each home of the AdamW state costs, from the parameters alone (hipferry.plan
asks): host,
GPU and disk bytes that stay for the whole run, and bytes on the disk a step
reads and writes. The rules are the stores' own (state_store.py, int8_store.py,
disk/), written beside them so that a prediction follows them when they change.

Homes:
  torch          torch.optim.AdamW where the parameters are: nothing offloaded
  host-float32   OffloadAdamW, float32 m and v (and master) in pinned host memory
  host-8bit      OffloadAdamW(state_dtype=torch.uint8): blockwise 8-bit m and v
  disk-float32   OffloadAdamW(state_dir=...): the state in files, a window in RAM
  disk-8bit      the same with 8-bit m and v
"""
from dataclasses import dataclass
from typing import List, Tuple

import torch

from .. import _C
from .disk.options import DiskOptions, quantum_up
from .disk.store import window_size
from .int8_store import MIN_8BIT_NUMEL

HOMES = ("torch", "host-float32", "host-8bit", "disk-float32", "disk-8bit")
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class HomeCost:
    resident_bytes: int      # on the device of the parameters (torch) or the host (the others)
    disk_bytes: int = 0      # both slots of every file
    disk_step_bytes: int = 0  # read and, again, written by a step
    where: str = "host"      # where resident_bytes are: "host" or "device"


def _has_master(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def _fmt(home: str, numel: int) -> str:
    return "uint8" if home.endswith("8bit") and numel >= MIN_8BIT_NUMEL else "float32"


def _ram_bytes(numel: int, dtype: torch.dtype, fmt: str, amsgrad: bool) -> int:
    master = 4 * numel if _has_master(dtype) else 0
    if fmt == "uint8":
        blocks = -(-numel // 256)
        return master + (numel + 4 * blocks) * (3 if amsgrad else 2)
    return master + 4 * numel * (3 if amsgrad else 2)


def home_cost(home: str, trainable: List[Tuple[int, torch.dtype]], on_gpu: bool, amsgrad: bool = False,
              disk: DiskOptions = DiskOptions()) -> HomeCost:
    if home == "torch":  # m and v (and max_v) in the parameter's dtype, where it lives
        nbytes = sum(n * (torch.finfo(d).bits // 8 if d in _FLOAT else 4) * (3 if amsgrad else 2)
                     for n, d in trainable)
        return HomeCost(nbytes, where="device" if on_gpu else "host")
    if home.startswith("host"):
        return HomeCost(sum(_ram_bytes(n, d, _fmt(home, n), amsgrad) for n, d in trainable))
    # On disk (DiskStore): every float parameter's state in files; the host holds the window.
    slot = 0
    for n, _ in trainable:
        slot += sum(_C._disk_regions(_fmt(home, n), amsgrad, n))
    return HomeCost(_window_touched(home, trainable, amsgrad, disk), disk_bytes=2 * slot, disk_step_bytes=slot)


def _window_touched(home: str, trainable: List[Tuple[int, torch.dtype]], amsgrad: bool, disk: DiskOptions) -> int:
    """The bytes of the window that passes touch (resident memory counts touched pages):
    each format's pass (store.by_format) cuts the window into buffers for its own longest
    chunk (disk_bindings.cpp: pass_buffer_bytes), hands chunk i buffer i mod buffers
    (chunk_pipeline.cpp), and a chunk fills the start of its buffer."""
    window = window_size([n for n, _ in trainable], disk.chunk_numel, disk.window_bytes)
    spans = []
    for fmt in ("float32", "uint8"):
        group = [n for n, _ in trainable if _fmt(home, n) == fmt]
        if not group:
            continue
        each = _C._disk_chunk_buffer_bytes(fmt, amsgrad, quantum_up(max(min(n, disk.chunk_numel) for n in group)))
        buffers = window // each
        i = 0
        for n in group:
            for first in range(0, n, disk.chunk_numel):
                at = (i % buffers) * each
                spans.append((at, at + _C._disk_chunk_buffer_bytes(fmt, amsgrad, min(disk.chunk_numel, n - first))))
                i += 1
    touched, end = 0, 0
    for a, b in sorted(spans):  # the union of the spans
        if b > end:
            touched += b - max(a, end)
            end = b
    return touched
