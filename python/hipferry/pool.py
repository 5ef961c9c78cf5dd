"""Pinned host memory pools: ``PinnedPool``, ``default_pool()`` and ``pin()``.

The allocator itself is C++ (csrc/core/host_pool, Note [hipferry pinned
pool]); this module validates arguments, names things and holds the pool id.
"""
from __future__ import annotations

import inspect
import os
import threading
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from . import _C
from .host_memory import default_budget
from .ops import call_op
from .pool_args import (ALIGNMENTS, MIN_CAPACITY, PROVIDERS, RESERVE_GRANULE, UNLIMITED, Size, check_shape,
                        device_index, device_numa_nodes, host_alloc_flags, numa_placement, parse_bytes)
from .torch_private import eager_dispatch

__all__ = ["PinnedPool", "default_pool", "pin", "resolve_pool", "configure_default_pool", "default_pool_config",
           "parse_pool_config", "parse_bytes", "device_numa_nodes", "numa_placement"]  # (the last three: pool_args)
MAX_REGISTER_THREADS = 64  # page-touching threads of provider="register" (more only contend for the page tables)


class PinnedPool:
    """A pool of page-locked host memory that tensors are allocated from.

    Args:
        capacity: hard cap on the host memory the pool holds (bytes, or a
            string such as ``"16GiB"``); ``None`` for no cap. An allocation
            that would exceed it first returns cached free memory to the
            system, then waits for blocks still used by GPU work, then raises
            ``torch.OutOfMemoryError`` stating requested, in use and capacity.
        max_cached: free segments beyond this many bytes are given back to the
            system as soon as they become free (``None``: kept until ``trim()``).
        reserve: bytes allocated now and kept for the pool's lifetime (warm
            start; ``trim()`` keeps them).
        provider: ``"auto"`` (``hipHostMalloc`` when a GPU is present, ordinary
            memory otherwise), ``"host_alloc"``, ``"register"`` (ordinary
            memory, pages touched by ``register_threads`` threads, then
            ``hipHostRegister``) or ``"pageable"`` (ordinary memory, not pinned).
        portable, mapped, coherent, numa_user, write_combined: ``hipHostMalloc``
            flags. ``coherent=None`` leaves the platform default; ``False`` asks
            for non-coherent memory, which AMD GPUs re-read faster (no effect
            on NVIDIA). ``mapped`` memory is readable by GPU kernels directly.
        numa_node: which NUMA node the pool's pages come from (bound before
            they are first touched; pages on the other socket cost copy
            bandwidth). ``"auto"`` (default): on a host of several nodes,
            memory for each GPU comes from that GPU's node (sysfs, by its PCI
            address), with free lists per node; on one node nothing is bound.
            An int: every page from that node. A dict ``{device_index:
            node}``: that placement (other devices and host-only memory:
            unbound). ``None``: where the first touch puts them.
            ``empty(..., for_device=)`` names the GPU a tensor is for (default:
            the current one). The reserve lives on the int node, else unbound,
            and serves every node.
    """

    def __init__(self, capacity: Size = None, *, max_cached: Size = None, reserve: Size = 0,
                 provider: str = "auto", portable: bool = True, mapped: bool = True,
                 coherent: Optional[bool] = None, numa_user: bool = False, write_combined: bool = False,
                 register_threads: int = 8, numa_node: Union[None, int, str, Dict[int, int]] = "auto",
                 _capacity_origin: str = "", _growth_limit: Optional[float] = None):
        cap = parse_bytes(capacity, "capacity")
        if cap is not None and cap < MIN_CAPACITY:
            raise ValueError(f"hipferry.PinnedPool: capacity must be at least {MIN_CAPACITY} bytes (one block), "
                             f"got {cap}")
        cached = parse_bytes(max_cached, "max_cached")
        reserve_bytes = parse_bytes(reserve, "reserve") or 0
        for name, v in (("capacity", cap), ("max_cached", cached), ("reserve", reserve_bytes)):
            if v is not None and v > UNLIMITED:
                raise ValueError(f"hipferry.PinnedPool: {name} must be at most 2**64 - 1 bytes (None: no bound), "
                                 f"got {v}")
        if cap is not None and -(-reserve_bytes // RESERVE_GRANULE) * RESERVE_GRANULE > cap:
            rounded = -(-reserve_bytes // RESERVE_GRANULE) * RESERVE_GRANULE
            raise ValueError(f"hipferry.PinnedPool: reserve ({reserve_bytes} bytes, {rounded} once rounded up to "
                             f"the pool's {RESERVE_GRANULE >> 10} KiB segment granule) must not exceed "
                             f"capacity ({cap} bytes)")
        if provider not in PROVIDERS:
            raise ValueError(f"hipferry.PinnedPool: provider must be one of {PROVIDERS}, got {provider!r}")
        if isinstance(register_threads, bool) or not isinstance(register_threads, int) or \
                not 1 <= register_threads <= MAX_REGISTER_THREADS:
            raise ValueError(f"hipferry.PinnedPool: register_threads must be an int from 1 to "
                             f"{MAX_REGISTER_THREADS}, got {register_threads!r}")
        default_node, device_nodes = numa_placement(numa_node)
        for flag, value in (("portable", portable), ("mapped", mapped), ("numa_user", numa_user),
                            ("write_combined", write_combined)):
            if not isinstance(value, bool):  # "no" or [] would silently mean True / False
                raise TypeError(f"hipferry.PinnedPool: {flag} must be True or False, got {value!r}")
        if coherent is not None and not isinstance(coherent, bool):  # 0 == False, but `coherent is False` is not
            raise ValueError(f"hipferry.PinnedPool: coherent must be None, True or False, got {coherent!r}")
        self._id: Optional[int] = None
        self._provider_kind = provider
        self._id = _C.create_pinned_pool(provider,
                                         host_alloc_flags(portable, mapped, coherent, numa_user, write_combined),
                                         register_threads, UNLIMITED if cap is None else cap,
                                         UNLIMITED if cached is None else cached, reserve_bytes,
                                         _capacity_origin, default_node, device_nodes,
                                         *([] if _growth_limit is None else [float(_growth_limit)]))

    # --- allocation -----------------------------------------------------------------
    def empty(self, *size: Any, dtype: torch.dtype = torch.float32, for_device: Any = None,
              alignment: int = 256) -> torch.Tensor:
        """A contiguous CPU tensor whose storage lives in the pool.

        The memory goes back to the pool when the tensor and every view of it
        are gone, and only after GPU work recorded on it (``record_use``, or
        hipferry's own copies) has completed. ``for_device`` (an index,
        ``"cuda:1"`` or a ``torch.device``; default: the current GPU) is the
        GPU whose copies will use it: its pages come from that GPU's NUMA node
        where the pool places by device (``numa_node``). ``alignment``: the
        storage starts at a multiple of it, 256 (every block) or 4096: a page,
        and a block of whole pages, as ``O_DIRECT`` reads and writes need (the
        same buffer then goes to the GPU without another copy).
        """
        if eager_dispatch():  # Note [pool fast path] (csrc/torch/pool_fast_path.cpp): None if not plain
            t = _C.pool_empty_fast(self._id, size, dtype, for_device, alignment)
            if t is not None:
                return t
        return self._empty_checked(size, dtype, for_device, alignment)

    def _empty_checked(self, size: Tuple[Any, ...], dtype: Any, for_device: Any, alignment: Any = 256) -> torch.Tensor:
        """``empty`` through its checks and the op (tracing, dispatch modes,
        arguments the fast path leaves alone: each error is raised here)."""
        shape = check_shape(size)
        device = device_index(for_device, "hipferry.PinnedPool.empty")
        if type(alignment) is not int or alignment not in ALIGNMENTS:  # (True == 1, 4096.0 == 4096: refused too)
            raise ValueError(f"hipferry.PinnedPool.empty: alignment must be 256 (the default) or 4096 (a page, "
                             f"as O_DIRECT needs), got {alignment!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"hipferry.PinnedPool.empty: dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
            raise ValueError(f"hipferry.PinnedPool.empty: dtype {dtype} is quantized; expected a plain dtype")
        return call_op(torch.ops.hipferry.pool_empty.default, self._open_id("empty"), shape, dtype, device, alignment)

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """``empty(t.shape, dtype=t.dtype)``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hipferry.PinnedPool.empty_like: t must be a torch.Tensor, got {type(t).__name__}")
        return self.empty(tuple(t.shape), dtype=t.dtype)

    def record_use(self, t: torch.Tensor, stream: Optional[Any] = None) -> None:
        """Note that work queued on ``stream`` (default: the current GPU stream)
        reads or writes ``t``: its block is reused only after that work is done.

        Needed for copies hipferry does not make itself, e.g.
        ``t.to("cuda", non_blocking=True)``. Without a GPU there is no
        asynchronous work and this only checks ``t``.
        """
        pool_id = self._open_id("record_use")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hipferry.PinnedPool.record_use: t must be a torch.Tensor, got {type(t).__name__}")
        if stream is not None and (not hasattr(stream, "cuda_stream") or not hasattr(stream, "device")):
            raise TypeError("hipferry.PinnedPool.record_use: stream must be a torch.cuda.Stream or None, "
                            f"got {type(stream).__name__}")  # (checked for every t, on machines without a GPU too)
        if t.device.type == "cpu" and t.numel() == 0:
            return  # an empty tensor owns no block
        if t.device.type != "cpu" or not _C.pool_owns(pool_id, t.untyped_storage().data_ptr()):
            raise ValueError("hipferry.PinnedPool.record_use: t must be a tensor allocated from this pool "
                             f"(PinnedPool.empty or hipferry.pin), got a {t.device} tensor that is not")
        if stream is None:
            if _C.device_count() == 0:
                return
            stream = torch.cuda.current_stream()
        if _C.device_count() == 0:
            raise ValueError("hipferry.PinnedPool.record_use: a GPU stream was given but this process sees "
                             "no GPU through hipferry; expected stream=None")
        _C.pool_record_use(pool_id, t.untyped_storage().data_ptr(), stream.device.index, stream.cuda_stream)

    def numa_node_of(self, t: torch.Tensor) -> int:
        """The NUMA node the pool placed ``t``'s block on (-1: unbound, where
        its first touch put it; ``_C.numa_node_of_address`` asks the kernel)."""
        pool_id = self._open_id("numa_node_of")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hipferry.PinnedPool.numa_node_of: t must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu" or t.numel() == 0 or not _C.pool_owns(pool_id, t.untyped_storage().data_ptr()):
            raise ValueError("hipferry.PinnedPool.numa_node_of: t must be a non-empty tensor allocated from this "
                             f"pool, got a {t.device} tensor that is not")
        return _C.pool_node_of_block(pool_id, t.untyped_storage().data_ptr())

    @property
    def numa_placement(self) -> dict:
        """``{"default": node, "devices": {index: node}}``: where host-only
        memory and the reserve come from, and each placed GPU's node (-1:
        unbound)."""
        default, devices = _C.pool_numa_placement(self._open_id("numa_placement"))
        return {"default": default, "devices": {d: n for d, n in enumerate(devices) if n >= 0}}

    # --- maintenance ----------------------------------------------------------------
    def stats(self) -> dict:
        """Bytes requested/allocated/reserved (current and peak), cache hits and
        misses, system allocations and frees and the time they took, blocks
        waiting on GPU events, capacity, ``reserved_by_node`` (-1: unbound)."""
        s = _C.pool_stats(self._open_id("stats"))
        if s["capacity"] == UNLIMITED:
            s["capacity"] = None
        return s

    def trim(self) -> int:
        """Return cached free segments (not the reserve) to the system; returns bytes released."""
        return _C.pool_trim(self._open_id("trim"))

    def process_events(self) -> int:
        """Make blocks whose GPU work has completed reusable now; returns how many."""
        return _C.pool_process_events(self._open_id("process_events"))

    def close(self) -> None:
        """Release cached memory and the reserve; later calls raise. Tensors
        from the pool stay valid, their memory is released as they die."""
        if self._id is not None:
            pool_id, self._id = self._id, None
            _C.destroy_pinned_pool(pool_id)

    @property
    def capacity(self) -> Optional[int]:
        return self.stats()["capacity"]

    @property
    def provider(self) -> str:
        """What the memory comes from, e.g. ``hipHostMalloc(portable|mapped)``."""
        return _C.pool_provider(self._open_id("provider"))

    @property
    def closed(self) -> bool:
        return self._id is None

    @property
    def native_id(self) -> Optional[int]:
        """The id ``_C``'s pool functions and ops take (None once closed): for
        hipferry's modules that hand the pool to the engine."""
        return self._id

    def check_invariants(self) -> None:
        """Raise if the allocator's bookkeeping is inconsistent (tests, debugging)."""
        _C.pool_check_invariants(self._open_id("check_invariants"))

    def _open_id(self, what: str) -> int:
        if self._id is None:
            raise RuntimeError(f"hipferry.PinnedPool.{what}: the pool is closed; expected an open pool")
        return self._id

    def __enter__(self) -> "PinnedPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._id is None:
            return "PinnedPool(closed)"
        s = self.stats()
        return (f"PinnedPool(provider={self.provider!r}, capacity={s['capacity']}, "
                f"reserved={s['reserved_bytes']}, requested={s['requested_bytes']})")


# --- the default pool -------------------------------------------------------------------
_default_lock = threading.Lock()
_default_pool: Optional[PinnedPool] = None
_default_config: Optional[dict] = None
ENV_VAR = "HIPFERRY_PINNED_POOL"


def parse_pool_config(text: str) -> dict:
    """``"capacity=16GiB,max_cached=2GiB,provider=register"`` -> PinnedPool keyword arguments."""
    config: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"hipferry: {ENV_VAR} entries must be key=value, got {item!r}")
        if key in ("capacity", "max_cached") and value.lower() == "none":
            config[key] = None  # no bound
        elif key in ("capacity", "max_cached", "reserve", "provider"):
            config[key] = value
        elif key == "register_threads":
            try:
                config[key] = int(value)
            except ValueError:
                raise ValueError(f"hipferry: {ENV_VAR} register_threads must be an integer from 1 to "
                                 f"{MAX_REGISTER_THREADS}, got {value!r}") from None
        elif key == "numa_node":
            if value.lower() in ("none", "auto"):
                config[key] = None if value.lower() == "none" else "auto"
            else:
                try:
                    config[key] = int(value)
                except ValueError:
                    raise ValueError(f"hipferry: {ENV_VAR} numa_node must be auto, none or a node number, "
                                     f"got {value!r}") from None
        elif key in ("portable", "mapped", "numa_user", "write_combined", "coherent"):
            if value.lower() not in ("0", "1", "true", "false", "none"):
                raise ValueError(f"hipferry: {ENV_VAR} {key} must be true/false, got {value!r}")
            config[key] = None if value.lower() == "none" else value.lower() in ("1", "true")
        else:
            raise ValueError(f"hipferry: {ENV_VAR} has unknown key {key!r}; expected capacity, max_cached, "
                             "reserve, provider, register_threads, portable, mapped, coherent, numa_user, "
                             "write_combined, numa_node")
    return config


def configure_default_pool(**kwargs: Any) -> None:
    """Set the default pool's ``PinnedPool`` arguments before its first use
    (they override ``$HIPFERRY_PINNED_POOL``). Raises once the pool exists."""
    global _default_config
    with _default_lock:
        if _default_pool is not None and not _default_pool.closed:
            raise RuntimeError("hipferry.configure_default_pool: the default pool already exists; configure it "
                               "before the first hipferry.default_pool()/pin() call")
        # Values are checked when the pool is made; names are checked now.
        allowed = [p for p in inspect.signature(PinnedPool.__init__).parameters
                   if p != "self" and not p.startswith("_")]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise TypeError(f"hipferry.configure_default_pool: unknown arguments {unknown}; expected {list(allowed)}")
        _default_config = dict(kwargs)


def default_pool_config() -> dict:
    """The ``PinnedPool`` arguments the default pool is (or would be) made with."""
    return dict(_default_config) if _default_config is not None else parse_pool_config(os.environ.get(ENV_VAR, ""))


def default_pool() -> PinnedPool:
    """The process-wide pool hipferry uses when no ``pool=`` is given, made on
    first use from ``configure_default_pool()`` or ``$HIPFERRY_PINNED_POOL``.
    Without a ``capacity`` there, its capacity is the default budget
    (``hipferry.host_memory``: half of what the machine or the process's cgroup
    has available when it is made); ``capacity=None`` asks for no bound."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            config = default_pool_config()
            if "capacity" not in config:
                budget, why = default_budget()
                if budget is not None:
                    config["capacity"] = max(budget, MIN_CAPACITY)
                    config["_capacity_origin"] = (
                        f"the default pool's budget, {why}; raise it with HIPFERRY_PINNED_POOL=capacity=<bytes> "
                        "or hipferry.configure_default_pool(capacity=...) (None: no bound)")
            _default_pool = PinnedPool(**config)
        return _default_pool


def pin(tensor: torch.Tensor, pool: Optional[PinnedPool] = None) -> torch.Tensor:
    """A copy of the CPU tensor ``tensor`` in pinned pool memory (contiguous)."""
    target = _default_pool if pool is None else pool
    if type(target) is PinnedPool and eager_dispatch():  # Note [pool fast path]: None if not plain
        out = _C.pool_pin_fast(target._id, tensor)
        if out is not None:
            return out
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hipferry.pin: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"hipferry.pin: tensor must be on the CPU, got a tensor on {tensor.device}")
    if tensor.layout != torch.strided:
        raise ValueError(f"hipferry.pin: tensor must be strided (dense), got layout {tensor.layout}")
    if tensor.is_nested:  # layout strided too; its .shape would raise an internal error
        raise ValueError("hipferry.pin: tensor is a nested tensor; expected a plain dense tensor (pin each component)")
    if tensor.is_quantized:  # else PinnedPool.empty would name its own dtype argument
        raise ValueError(f"hipferry.pin: tensor is quantized ({tensor.dtype}); expected a plain dtype "
                         "(pin tensor.int_repr() and keep the quantization parameters)")
    out = resolve_pool(pool, "hipferry.pin").empty(tuple(tensor.shape), dtype=tensor.dtype)
    out.copy_(tensor)
    return out


def resolve_pool(pool: Optional[PinnedPool], api: str) -> PinnedPool:
    """The pool a public entry point ``api`` was given (``pool=``): the default
    pool for None. Raises, naming ``api``, unless it is an open PinnedPool."""
    if pool is None:
        pool = default_pool()
    if not isinstance(pool, PinnedPool):
        raise TypeError(f"{api}: pool must be a hipferry.PinnedPool or None, got {type(pool).__name__}")
    if pool.closed:
        raise RuntimeError(f"{api}: the pool is closed; expected an open pool")
    return pool


@torch.library.register_fake("hipferry::pool_empty")
def _pool_empty_fake(pool: int, size: Sequence[int], dtype: torch.dtype, for_device: int = -1,
                     alignment: int = 256) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device="cpu")
