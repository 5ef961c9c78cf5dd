"""Part of suite `disk`: the disk's sequential speed, measured in the same run as
the optimizer steps, by `fio` (when it is on PATH: ioengine=io_uring, direct=1,
bs=1M, iodepth=32, --output-format=json) and by hipferry's own reader/writer
(``hipferry._C.DiskIo.raw_pass``: the optimizer's I/O queue with the same
depth and request size over a page-aligned window, no compute). A write is
timed with its flush (fio --end_fsync=1; DiskIo.sync), as a step's is."""
import json
import os
import shutil
import subprocess
from typing import Callable, Dict, Optional, Tuple

from ..optim.disk import DEPTH, REQUEST, RawIo

FIO_READ, FIO_WRITE = "fio read (io_uring, direct)", "fio write (io_uring, direct)"
OWN_READ, OWN_WRITE = "own reader (DiskIo.raw_pass)", "own writer (DiskIo.raw_pass)"


def _fio(path: str, rw: str, nbytes: int) -> float:
    """Bytes per second of one fio job; raises RuntimeError with fio's words if it fails."""
    cmd = ["fio", f"--name=hipferry-{rw}", f"--filename={path}", f"--rw={rw}", f"--bs={REQUEST}",
           f"--iodepth={DEPTH}", "--ioengine=io_uring", "--direct=1", f"--size={nbytes}", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    except (ValueError, KeyError, IndexError):
        raise RuntimeError(f"fio failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[:200]}") from None
    if job.get("error") or r.returncode:
        raise RuntimeError(f"fio {rw} failed: error {job.get('error')}: {r.stderr.strip()[:200]}")
    return float(job[rw]["bw_bytes"])


def measure_speed(folder: str, nbytes: int, repeats: int, step: Callable[[str], None]) -> Tuple[Dict[str, float], list]:
    """{contender: best bytes/s} for fio (if on PATH) and the own reader/writer,
    interleaved `repeats` rounds (write before read: the read finds a written file);
    and notes."""
    notes = []
    fio = shutil.which("fio")
    if fio is None:
        notes.append("fio not on PATH: the disk's speed is the own reader/writer's alone (apt install fio)")
    best: Dict[str, float] = {}
    own: Optional[RawIo] = RawIo(os.path.join(folder, "own.dat"), nbytes)
    if not own.direct:
        notes.append(f"O_DIRECT refused in {folder}: the own reader/writer (and the step) go through the page "
                     f"cache ({own.io.file_info(own.file)[2]})")
    fio_path = os.path.join(folder, "fio.dat")
    try:
        for r in range(repeats):
            step(f"disk speed round {r + 1}/{repeats}: {nbytes >> 20} MiB sequential, fio and own reader/writer")
            if fio is not None:
                try:
                    for rw, name in (("write", FIO_WRITE), ("read", FIO_READ)):
                        best[name] = max(best.get(name, 0.0), _fio(fio_path, rw, nbytes))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    notes.append(f"fio not measured: {e}")
                    fio = None
            for op, name in (("write", OWN_WRITE), ("read", OWN_READ)):
                best[name] = max(best.get(name, 0.0), nbytes / own.timed(op))
    finally:
        own.close()
        for p in (fio_path, os.path.join(folder, "own.dat")):
            if os.path.exists(p):
                os.remove(p)
    return best, notes


def reference(best: Dict[str, float]) -> Tuple[float, float, str]:
    """(read B/s, write B/s, which) the step's efficiency is measured against: fio when it ran."""
    if FIO_READ in best and FIO_WRITE in best:
        return best[FIO_READ], best[FIO_WRITE], "fio"
    return best[OWN_READ], best[OWN_WRITE], "own reader/writer"
