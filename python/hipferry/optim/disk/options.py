"""What a user of OffloadAdamW(state_dir=...) can tune."""
from dataclasses import dataclass

QUANTUM = 1 << 18  # chunk_numel's unit (kChunkQuantum: every chunk of every array starts on a page)


def quantum_up(numel: int) -> int:
    """numel rounded up to whole QUANTUMs (at least one): the chunk a buffer is sized for."""
    return max(QUANTUM, -(-numel // QUANTUM) * QUANTUM)


@dataclass(frozen=True)
class DiskOptions:
    """OffloadAdamW(state_dir=..., disk=DiskOptions(...)).

    window_bytes: host memory for the chunks in flight (read ahead, stepped,
        being written); the state itself never sits in RAM.
    chunk_numel: elements per chunk (a multiple of 2^18); a float32 chunk of
        master, m and v is 12 bytes per element.
    queue_depth: I/O requests in flight (NVMe needs many: 16-64).
    request_bytes: bytes per request (1 MiB, as fio and DeepSpeed's aio use).
    io_backend: "auto" (io_uring where the kernel allows it, else threads
        doing pread/pwrite), "io_uring" or "threads".
    resume: continue from the state the folder's journal names; without it a
        folder that holds state is refused.
    """
    window_bytes: int = 256 << 20
    chunk_numel: int = 1 << 20
    queue_depth: int = 32
    request_bytes: int = 1 << 20
    io_backend: str = "auto"
    resume: bool = False

    def check(self) -> None:
        def positive_int(name: str, value, multiple: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple:
                extra = f" multiple of {multiple}" if multiple > 1 else ""
                raise ValueError(f"OffloadAdamW: disk.{name} must be a positive{extra} int, got {value!r}")
        positive_int("window_bytes", self.window_bytes)
        positive_int("chunk_numel", self.chunk_numel, QUANTUM)
        positive_int("queue_depth", self.queue_depth)
        positive_int("request_bytes", self.request_bytes, 4096)
        if self.queue_depth > 4096:
            raise ValueError(f"OffloadAdamW: disk.queue_depth must be <= 4096, got {self.queue_depth}")
        if self.io_backend not in ("auto", "io_uring", "threads"):
            raise ValueError("OffloadAdamW: disk.io_backend must be 'auto', 'io_uring' or 'threads', got "
                             f"{self.io_backend!r}")
        if not isinstance(self.resume, bool):
            raise ValueError(f"OffloadAdamW: disk.resume must be a bool, got {self.resume!r}")


def check_disk_options(state_dir, disk, overlap, step_on) -> None:
    """OffloadAdamW's state_dir= and disk= arguments, and what they cannot go with."""
    if disk is not None and not isinstance(disk, DiskOptions):
        raise ValueError(f"OffloadAdamW: disk must be a hipferry.optim.DiskOptions, got {type(disk).__name__}")
    if state_dir is None:
        if disk is not None:
            raise ValueError("OffloadAdamW: disk=DiskOptions(...) needs state_dir= (the folder of the state)")
        return
    import os
    if not isinstance(state_dir, (str, os.PathLike)):
        raise ValueError(f"OffloadAdamW: state_dir must be a path (str or os.PathLike), got "
                         f"{type(state_dir).__name__}")
    if overlap is not None:
        raise ValueError("OffloadAdamW: overlap='backward' is not built for state on disk (state_dir=...): a "
                         "speculative step would need a second copy of the state; pass overlap=None")
    if step_on == "gpu":
        raise ValueError("OffloadAdamW: step_on='gpu' is not built for state on disk (state_dir=...): the state "
                         "steps on the CPU; pass step_on='cpu' or 'auto'")
    (disk or DiskOptions()).check()
