"""What this build of hipferry is and what the runtime sees (from hipferry._C)."""
from typing import Any, Dict

import torch

from . import _C, torch_compat


def build_info() -> Dict[str, Any]:
    """The build target ('rocm', 'cuda' or 'cpu'), its GPU architectures, runtime
    and driver versions, the torch version it was built against, the torch
    releases it runs under ('torch_supported') and the ABI it uses ('torch_abi')."""
    record = torch_compat.load_build_record()
    return dict(_C.build_info(), torch_supported=torch_compat.supported_range(record), torch_abi=record.torch_abi)


def device_count() -> int:
    """GPU devices the HIP/CUDA runtime sees; 0 without a GPU or in a CPU-only build."""
    return int(_C.device_count())


def device_info(device: int = 0) -> Dict[str, Any]:
    """Name, architecture, memory and capabilities of GPU ``device``."""
    if not isinstance(device, int) or isinstance(device, bool):
        raise TypeError(f"hipferry.device_info: device must be an int, got {type(device).__name__}")
    n = device_count()
    if not 0 <= device < n:
        raise ValueError(f"hipferry.device_info: device must be in [0, {n}), got {device}"
                         + (" (no GPU visible)" if n == 0 else ""))
    return dict(_C.device_info(device))


def torch_flavor() -> str:
    """What the running torch was built for: 'rocm', 'cuda' or 'cpu'."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    if getattr(torch.version, "cuda", None):
        return "cuda"
    return "cpu"
