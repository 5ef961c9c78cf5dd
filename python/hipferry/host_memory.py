"""What host memory this process may pin: the machine's and its cgroup's.

Pinned memory cannot be swapped out, so a pool that grows past what the
machine has ends in the kernel's OOM killer, not in an error. The default
pool's capacity is therefore bounded by ``DEFAULT_BUDGET_FRACTION`` of the
smaller of

* the memory the machine has available (``MemAvailable`` in /proc/meminfo), and
* the room left in this process's cgroup (``memory.max - memory.current`` in
  cgroup v2, ``memory.limit_in_bytes - memory.usage_in_bytes`` in v1),

measured when the default pool is made. ``capacity=`` (of the pool,
``configure_default_pool`` or ``HIPFERRY_PINNED_POOL``) overrides it;
``capacity=None`` there asks for no bound at all.

The readers take their roots as arguments, so tests run them on fake trees.
"""
import os
from dataclasses import dataclass
from typing import Optional, Tuple

DEFAULT_BUDGET_FRACTION = 0.5  # of the memory available to the process when the default pool is made


@dataclass
class HostMemory:
    total: Optional[int] = None          # MemTotal
    available: Optional[int] = None      # MemAvailable
    cgroup_limit: Optional[int] = None   # None: no limit (or no cgroup memory controller)
    cgroup_usage: Optional[int] = None
    cgroup_path: Optional[str] = None    # the cgroup file the limit came from

    @property
    def cgroup_room(self) -> Optional[int]:
        if self.cgroup_limit is None:
            return None
        return max(0, self.cgroup_limit - (self.cgroup_usage or 0))


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= 2**62 else value  # cgroup v1 writes "no limit" as a huge number


def _meminfo(proc_root: str) -> dict:
    out = {}
    try:
        with open(os.path.join(proc_root, "meminfo")) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def _own_cgroup(proc_root: str) -> Tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 memory path) of this process's cgroup, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2 = parts[2]
                elif "memory" in parts[1].split(","):
                    v1 = parts[2]
    except OSError:
        pass
    return v2, v1


def read_host_memory(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> HostMemory:
    info = _meminfo(proc_root)
    mem = HostMemory(total=info.get("MemTotal"), available=info.get("MemAvailable", info.get("MemFree")))
    v2, v1 = _own_cgroup(proc_root)
    candidates = []
    if v2 is not None:
        # The limit that binds may sit on any ancestor: take the tightest room on the way up.
        path = v2.strip("/")
        while True:
            d = os.path.join(cgroup_root, path) if path else cgroup_root
            candidates.append((os.path.join(d, "memory.max"), os.path.join(d, "memory.current")))
            if not path:
                break
            path = os.path.dirname(path)
    if v1 is not None:
        d = os.path.join(cgroup_root, "memory", v1.strip("/"))
        candidates.append((os.path.join(d, "memory.limit_in_bytes"), os.path.join(d, "memory.usage_in_bytes")))
        d = os.path.join(cgroup_root, "memory")
        candidates.append((os.path.join(d, "memory.limit_in_bytes"), os.path.join(d, "memory.usage_in_bytes")))
    for limit_file, usage_file in candidates:
        limit = _read_int(limit_file)
        if limit is None:
            continue
        usage = _read_int(usage_file) or 0
        if mem.cgroup_limit is None or limit - usage < mem.cgroup_room:
            mem.cgroup_limit, mem.cgroup_usage, mem.cgroup_path = limit, usage, limit_file
    return mem


def default_budget(mem: Optional[HostMemory] = None, fraction: float = DEFAULT_BUDGET_FRACTION
                   ) -> Tuple[Optional[int], str]:
    """(bytes, which bound) for the default pool's capacity; (None, why) when nothing can be read."""
    mem = mem if mem is not None else read_host_memory()
    bounds = []
    if mem.available is not None:
        bounds.append((mem.available, "the memory available on this machine (MemAvailable)"))
    if mem.cgroup_room is not None:
        bounds.append((mem.cgroup_room, f"the room left in this process's cgroup ({mem.cgroup_path})"))
    if not bounds:
        return None, "no memory figures could be read (no /proc/meminfo, no cgroup limit)"
    room, what = min(bounds)
    return int(room * fraction), f"{fraction:.0%} of {what}, {room} bytes when the pool was made"
