"""PinnedPool's arguments: byte counts, host allocation flags, shapes, NUMA
placement and device indices, checked and turned into what ``_C`` takes.
The flag values, provider names and reserve granule come from ``_C`` (C++
owns them: hip/runtime.h, hip/pinned_memory.h, size_classes.h)."""
import re
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from . import _C

Size = Union[int, str, None]

HOST_ALLOC_FLAGS = dict(_C.HOST_ALLOC_FLAGS)  # PinnedPool's flag arguments -> rt::HostAllocFlags values
PROVIDERS = tuple(_C.HOST_MEMORY_PROVIDERS)   # PinnedPool(provider=...)
RESERVE_GRANULE = _C.RESERVE_GRANULE          # the reserve is one segment, rounded up to this
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MIN_CAPACITY = 256  # one block
ALIGNMENTS = (256, 4096)  # every block's; a page's, for O_DIRECT (size_classes.h: kAlignment, kPageAlignment)
MAX_DIM = 2**63 - 1
UNLIMITED = 2**64 - 1


def parse_bytes(value: Size, name: str) -> Optional[int]:
    """``4096``, ``"512MiB"``, ``"1.5GB"`` -> bytes; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"hipferry: {name} must be a byte count (int or a string like '8GiB'), got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"hipferry: {name} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        raise ValueError(f"hipferry: {name} must look like '8GiB', '512MiB', '1.5GB' or '4096', got {value!r}")
    raise TypeError(f"hipferry: {name} must be a byte count (int or a string like '8GiB'), "
                    f"got {type(value).__name__}")


def host_alloc_flags(portable: bool, mapped: bool, coherent: Optional[bool], numa_user: bool,
                     write_combined: bool) -> int:
    """PinnedPool's flag arguments as the hipHostMalloc flags _C.create_pinned_pool takes."""
    chosen = dict(portable=portable, mapped=mapped, write_combined=write_combined, numa_user=numa_user,
                  coherent=coherent is True, non_coherent=coherent is False)
    flags = 0
    for name, on in chosen.items():
        if on:
            flags |= HOST_ALLOC_FLAGS[name]
    return flags


def check_shape(size: Sequence[Any]) -> list:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    shape = []
    for i, d in enumerate(size):
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"hipferry.PinnedPool.empty: size must be ints, got {type(d).__name__} at index {i}")
        if d < 0:
            raise ValueError(f"hipferry.PinnedPool.empty: size must be >= 0 in every dimension, got {d} at index {i}")
        if d > MAX_DIM:
            raise ValueError(f"hipferry.PinnedPool.empty: size must be at most 2**63 - 1 in every dimension, got {d} "
                             f"at index {i}")
        shape.append(d)
    return shape


def numa_placement(numa_node: Any) -> Tuple[int, List[int]]:
    """PinnedPool's numa_node -> (node of host-only memory, node of each device)."""
    where = "hipferry.PinnedPool: numa_node"
    if numa_node is None:
        return -1, []
    if isinstance(numa_node, str):
        if numa_node != "auto":
            raise ValueError(f"{where} must be 'auto', None, a node number or a dict {{device: node}}, "
                             f"got {numa_node!r}")
        nodes = device_numa_nodes()
        return -1, nodes if any(n >= 0 for n in nodes) else []
    online = _C.numa_nodes()

    def node(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}{what} must be an int, got {value!r}")
        if value not in online:
            raise ValueError(f"{where}{what} is {value}, not an online NUMA node; this host has node(s) {online}")
        return value

    if isinstance(numa_node, dict):
        devices: List[int] = []
        for d, n in numa_node.items():
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 1 << 16:
                raise TypeError(f"{where} keys must be device indices (ints from 0), got {d!r}")
            n = node(n, f"[{d}]")
            devices.extend([-1] * (d + 1 - len(devices)))
            devices[d] = n
        return -1, devices
    if isinstance(numa_node, bool) or not isinstance(numa_node, int):
        raise TypeError(f"{where} must be 'auto', None, a node number or a dict {{device: node}}, got {numa_node!r}")
    return node(numa_node, ""), []


def device_numa_nodes(pci_bus_ids: Optional[Sequence[str]] = None, sysfs_root: str = "/sys") -> List[int]:
    """The NUMA node each GPU's pinned memory should come from: the GPU's own
    node on a host of several nodes, -1 (no binding) on one node or where
    sysfs does not say. ``pci_bus_ids`` defaults to the visible GPUs'."""
    if pci_bus_ids is None:
        pci_bus_ids = [_C.device_info(d)["pci_bus_id"] for d in range(_C.device_count())]
    return list(_C.numa_device_nodes(list(pci_bus_ids), sysfs_root))


def device_index(device: Any, where: str) -> int:
    """for_device -> a GPU index, -1 for None (the current GPU)."""
    if device is None:
        return -1
    if isinstance(device, bool):
        raise TypeError(f"{where}: for_device must be a GPU index, 'cuda:N', a torch.device or None, got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        try:
            d = torch.device(device)
        except (TypeError, RuntimeError):
            raise TypeError(f"{where}: for_device must be a GPU index, 'cuda:N', a torch.device or None, "
                            f"got {device!r}") from None
        if d.type != "cuda":
            raise ValueError(f"{where}: for_device must name a GPU, got {d}")
        index = -1 if d.index is None else d.index
    if not -1 <= index < 1 << 16:
        raise ValueError(f"{where}: for_device must be a GPU index from 0, got {index}")
    return index
