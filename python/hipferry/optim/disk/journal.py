"""The journal of a disk state folder, and the folder's lock.

Note [disk journal]
~~~~~~~~~~~~~~~~~~~
A step writes each stepped parameter's new state into the slot its journal
entry does not name, makes those writes durable (fdatasync), then replaces the
journal: written to journal.tmp, fsynced, renamed over journal (atomic), and
the folder fsynced. A kill at any moment leaves either the old journal, whose
slots the step never wrote, or the new one, whose slots are durable. Each
entry carries the checksums of its chunks, so a torn or stale chunk is found
when read. The journal checks itself (crc32c of its body).
"""
import base64
import fcntl
import json
import os
from typing import List, Optional

import torch

from ... import _C


def _crc(data: bytes) -> int:
    return int(_C._crc32c(torch.frombuffer(bytearray(data), dtype=torch.uint8))) if data else 0


def pack_crcs(crcs: torch.Tensor) -> str:
    return base64.b64encode(crcs.numpy().tobytes()).decode()


def unpack_crcs(text: str) -> torch.Tensor:
    raw = bytearray(base64.b64decode(text))
    return torch.frombuffer(raw, dtype=torch.int32).clone() if raw else torch.zeros(0, dtype=torch.int32)


class Journal:
    """entries[i] = {"slot": 0 or 1, "step": steps taken, "crc": int32 tensor [chunks * arrays]}."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, "journal")
        self.folder = folder
        self.steps = 0            # optimizer steps committed
        self.entries: List[dict] = []

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def load(self) -> None:
        with open(self.path, "rb") as f:
            raw = f.read()
        head, _, body = raw.partition(b"\n")
        try:
            want = int(head.decode())
        except ValueError:
            want = None
        if want is None or want != _crc(body):
            raise RuntimeError(f"OffloadAdamW: the journal {self.path} is damaged (its checksum does not match); "
                               "the folder cannot be resumed")
        data = json.loads(body)
        self.steps = data["steps"]
        self.entries = [dict(slot=e["slot"], step=e["step"], crc=unpack_crcs(e["crc"])) for e in data["entries"]]

    def commit(self, entries: List[dict], steps: int, fault: Optional[str] = None) -> None:
        """Makes `entries` and `steps` the journal on disk (Note [disk journal]); self
        changes only once that worked."""
        body = json.dumps({"steps": steps, "entries": [dict(slot=e["slot"], step=e["step"], crc=pack_crcs(e["crc"]))
                                                        for e in entries]}, separators=(",", ":")).encode()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(str(_crc(body)).encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        sync_folder(self.folder)
        self.entries, self.steps = entries, steps


def sync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderLock:
    """An exclusive flock on <folder>/lock while an optimizer uses the folder: a second
    optimizer (this process or another) is refused; the kernel drops it when the holder dies."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, "lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = -1
            raise RuntimeError(f"OffloadAdamW: state_dir {folder!r} is in use by another optimizer (process "
                               f"{holder}); one folder holds one optimizer's state") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # (closing drops the flock)
            self.fd = -1


def holds_state(folder: str) -> bool:
    """Whether `folder` holds optimizer state to resume from (DiskOptions(resume=True))."""
    return Journal(folder).exists()
