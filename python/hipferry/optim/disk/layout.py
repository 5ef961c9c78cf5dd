"""Which file holds what (Note [disk state layout] in csrc/core/disk/state_pass.h),
and the manifest that ties a folder to one model's parameters.

Each array name has two files, <name>.0 and <name>.1 (the slots). Parameter i
owns the same page-aligned region of both. Its arrays depend on its format:
float32 (master, exp_avg, exp_avg_sq [, max_exp_avg_sq]) or uint8 (master,
exp_avg codes and scales, exp_avg_sq codes and scales [, max_exp_avg_sq's])."""
import json
import os
from typing import Dict, List

import torch

from ... import _C

ARRAYS = {
    "float32": ["master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    "uint8": ["master_param", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax", "max_exp_avg_sq",
              "max_exp_avg_sq_absmax"],
}
# The element type of each array's bytes, as tensors handed out by state_dict() see them.
ARRAY_DTYPES = {"master_param": torch.float32, "exp_avg_absmax": torch.float32, "exp_avg_sq_absmax": torch.float32,
                "max_exp_avg_sq_absmax": torch.float32}


def arrays_of(fmt: str, amsgrad: bool) -> List[str]:
    names = ARRAYS[fmt]
    return names if amsgrad else [n for n in names if not n.startswith("max_")]


def array_dtype(fmt: str, name: str) -> torch.dtype:
    return ARRAY_DTYPES.get(name, torch.uint8 if fmt == "uint8" else torch.float32)


def file_name(array: str, slot: int) -> str:
    return f"{array}.{slot}"


class Manifest:
    """params[i] = {"shape", "dtype", "format", "amsgrad", "offsets": {array: byte offset}};
    ends[array] = the bytes each of the array's files needs."""

    def __init__(self, folder: str, chunk_numel: int):
        self.path = os.path.join(folder, "manifest.json")
        self.chunk_numel = chunk_numel
        self.params: List[dict] = []
        self.ends: Dict[str, int] = {}

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def load(self) -> None:
        with open(self.path) as f:
            data = json.load(f)
        self.chunk_numel, self.params, self.ends = data["chunk_numel"], data["params"], data["ends"]

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"version": 1, "chunk_numel": self.chunk_numel, "params": self.params, "ends": self.ends}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def planned(self, shape: tuple, dtype: torch.dtype, fmt: str, amsgrad: bool) -> dict:
        """The entry of a new parameter, placed after the others (not yet added)."""
        numel = 1
        for s in shape:
            numel *= s
        names = arrays_of(fmt, amsgrad)
        offsets, at = {}, dict(self.ends)
        for name, size in zip(names, _C._disk_regions(fmt, amsgrad, numel)):
            offsets[name] = at.get(name, 0)
            at[name] = offsets[name] + size
        return {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "numel": numel, "format": fmt,
                "amsgrad": amsgrad, "offsets": offsets}

    def add(self, entry: dict) -> None:
        self.params.append(entry)
        regions = _C._disk_regions(entry["format"], entry["amsgrad"], entry["numel"])
        for name, size in zip(arrays_of(entry["format"], entry["amsgrad"]), regions):
            self.ends[name] = max(self.ends.get(name, 0), entry["offsets"][name] + size)

    def chunks(self, index: int) -> int:
        return -(-self.params[index]["numel"] // self.chunk_numel)


def first_mismatch(saved: dict, wanted: dict, index: int) -> str:
    """'' when the folder's parameter `index` is the one wanted, else what differs."""
    for key in ("shape", "dtype", "format", "amsgrad"):
        if saved[key] != wanted[key]:
            return (f"parameter {index}: the folder holds {key}={saved[key]!r}, this optimizer has "
                    f"{key}={wanted[key]!r}")
    return ""
