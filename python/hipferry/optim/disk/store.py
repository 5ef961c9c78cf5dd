"""DiskStore: OffloadAdamW's state store with the state in files (state_dir=...).

Parameters it can hold (float32/bf16/fp16, real, dense, with state on the
host) live on disk; the others keep the in-RAM store (`ram`). A step is one
pass per (format, amsgrad) over the parameters' chunks: read, verify, step,
checksum, write the other slot (csrc/core/disk/state_pass.h), then fdatasync
and the journal (journal.py, Note [disk journal]). Host memory is the window.
"""
import logging
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from ... import _C
from ..checks import FUSED
from ..layout import memory_flat
from ..slots import step_dtype
from .journal import FolderLock, Journal
from .layout import Manifest, arrays_of, file_name, first_mismatch
from .options import DiskOptions, quantum_up

log = logging.getLogger("hipferry.optim")
PAGE = 4096


class DiskStore:
    def __init__(self, folder: str, options: DiskOptions, ram_store, eight_bit: bool, min_8bit_numel: int, pool):
        options.check()
        self.folder, self.options, self.ram = os.fspath(folder), options, ram_store
        self.format = "disk-uint8" if eight_bit else "disk-float32"
        self.eight_bit, self.min_8bit_numel = eight_bit, min_8bit_numel
        os.makedirs(self.folder, exist_ok=True)
        self.lock = FolderLock(self.folder)
        try:
            self._open_folder(options, pool)
        except BaseException:
            self.lock.release()
            raise

    def _open_folder(self, options: DiskOptions, pool) -> None:
        self.manifest = Manifest(self.folder, options.chunk_numel)
        self.journal = Journal(self.folder)
        if self.manifest.exists() and not self.journal.exists():
            os.remove(self.manifest.path)  # a creation killed before its journal: it never held state
        existing = self.journal.exists()
        if existing and not options.resume:
            raise ValueError(f"OffloadAdamW: state_dir {self.folder!r} already holds optimizer state; pass "
                             "disk=DiskOptions(resume=True) to continue from it, or choose an empty folder")
        if options.resume and not self.journal.exists():
            raise ValueError(f"OffloadAdamW: disk.resume=True but state_dir {self.folder!r} holds no journal "
                             "(no state to resume from)")
        if existing:
            self.manifest.load()
            self.journal.load()
        self.resumable = len(self.manifest.params)  # folder parameters allocate() matches in order
        self.io = _C.DiskIo(options.io_backend, options.queue_depth, options.request_bytes)
        self.files: Dict[Tuple[str, int], int] = {}
        self.index: Dict[int, int] = {}   # id(param) -> manifest index
        self.strides: Dict[int, tuple] = {}  # manifest index -> the strides whose memory order the files keep
        self.matched = 0                  # resume: folder parameters matched by allocate() so far
        need = _C._disk_chunk_buffer_bytes("float32", True, self.manifest.chunk_numel)
        if options.window_bytes < 2 * need:
            raise ValueError(f"OffloadAdamW: disk.window_bytes={options.window_bytes} holds fewer than 2 chunks "
                             f"of {need} bytes (chunk_numel={self.manifest.chunk_numel}); raise window_bytes or "
                             "lower chunk_numel")
        self.pool, self.window = pool, None  # (_ensure_window: sized to the state, at most window_bytes)
        self.written_last_step = 0
        self.read_last_step = 0
        self._warned_wear = self._warned_buffered = False

    # ------------------------------------------------------- store interface
    def holds(self, lp: torch.Tensor, where: str) -> bool:
        return where == "host" and lp.dtype in FUSED and not lp.is_complex() and memory_flat(lp) is not None

    def plan_keys(self, lp: torch.Tensor, where: str, amsgrad: bool) -> List[str]:
        if not self.holds(lp, where):
            return self.ram.plan_keys(lp, where, amsgrad)
        return ["max_exp_avg_sq"] if amsgrad else []

    def amsgrad_state(self, lp: torch.Tensor, where: str, st: dict) -> dict:
        if "disk" not in st:
            return self.ram.amsgrad_state(lp, where, st)
        if self.manifest.params[st["disk"]]["amsgrad"]:
            return {}  # (its max_exp_avg_sq is on disk)
        raise ValueError("OffloadAdamW: amsgrad cannot be switched on for state on disk (its files were laid out "
                         "without max_exp_avg_sq); build the optimizer with amsgrad=True")

    def state_bytes(self, st: dict) -> int:
        return 0 if "disk" in st else self.ram.state_bytes(st)

    def allocate(self, plan: List[tuple]) -> List[dict]:
        ram = [(i, e) for i, e in enumerate(plan) if not self.holds(e[0], e[1])]
        states: List[Optional[dict]] = [None] * len(plan)
        for (i, _), st in zip(ram, self.ram.allocate([e for _, e in ram])):
            states[i] = st
        disk = [(i, lp, "max_exp_avg_sq" in keys) for i, (lp, where, keys) in enumerate(plan) if states[i] is None]
        if disk:
            for i, st in zip([i for i, _, _ in disk], self._place([(lp, ams) for _, lp, ams in disk])):
                states[i] = st
        return states

    def _fmt(self, lp: torch.Tensor) -> str:
        return "uint8" if self.eight_bit and lp.numel() >= self.min_8bit_numel else "float32"

    def _place(self, params: List[Tuple[torch.Tensor, bool]]) -> List[dict]:
        """The state of `params` on disk: matched against the folder's (resume), or new."""
        m = self.manifest
        count, ends = len(m.params), dict(m.ends)
        entries = []
        try:
            for lp, amsgrad in params:
                wanted = m.planned(tuple(lp.shape), lp.dtype, self._fmt(lp), amsgrad)
                if self.matched < self.resumable:
                    index = self.matched
                    why = first_mismatch(m.params[index], wanted, index)
                    if why:
                        raise ValueError(f"OffloadAdamW: state_dir {self.folder!r} holds the state of a different "
                                         f"model: {why}")
                    self.matched += 1
                else:
                    index = len(m.params)
                    m.add(wanted)
                entries.append((lp, index, wanted))
            new = [(lp, i, w) for lp, i, w in entries if i >= count]
            self._ensure_window()
            if new:
                self._create(new, ends)
        except BaseException:
            del m.params[count:]
            m.ends = ends
            self.matched -= sum(1 for _, i, _ in entries if i < count)  # (only matched ones are below count)
            raise
        old = [(lp, i) for lp, i, _ in entries if i < count]
        if old:
            self._restore_params(old)
        states = []
        for lp, index, _ in entries:
            self.index[id(lp)] = index
            self.strides[index] = tuple(lp.stride())
            step = self.journal.entries[index]["step"]
            states.append({"step": torch.tensor(float(step), dtype=step_dtype()), "disk": index})
        return states

    # --------------------------------------------------------------- files
    def file(self, array: str, slot: int) -> int:
        key = (array, slot)
        if key not in self.files:
            self.files[key] = self.io.open(os.path.join(self.folder, file_name(array, slot)), True)
            path, direct, note, _ = self.io.file_info(self.files[key])
            if not direct and not self._warned_buffered:
                self._warned_buffered = True
                log.warning("OffloadAdamW: %s: %s (the page cache holds what is read and written, and the "
                            "host's memory use grows with it)", path, note)
        return self.files[key]

    def _fd(self, array: str, slot: int) -> int:
        return self.io.file_info(self.file(array, slot))[3]

    def _create(self, new: List[tuple], before: Dict[str, int]) -> None:
        """Reserves room for `new` parameters (already in the manifest) in every file,
        writes their first state (master = the parameter, zero moments) to slot 0, then
        the manifest and the journal. No space: the files shrink back (the caller drops
        the manifest entries) and nothing is kept."""
        try:
            for array, end in self.manifest.ends.items():
                for slot in (0, 1):
                    if end > before.get(array, 0):
                        self.io.reserve(self.file(array, slot), end)
            crcs = self._fill(new)
        except BaseException:
            for (array, slot) in self.files:
                os.ftruncate(self._fd(array, slot), before.get(array, 0))
            raise
        self.manifest.save()
        entries = self.journal.entries + [dict(slot=0, step=0, crc=c) for c in crcs]
        self.journal.commit(entries, self.journal.steps)

    def _fill(self, new: List[tuple]) -> List[torch.Tensor]:
        from ..int8_store import zero_code
        crcs = []
        for (fmt, amsgrad), group in by_format([(w, (lp, i, w)) for lp, i, w in new]):
            names = arrays_of(fmt, amsgrad)
            params = []
            for lp, index, w in group:
                crc = torch.zeros(self.manifest.chunks(index) * len(names), dtype=torch.int32)
                fill = [zero_code(n == "exp_avg") if fmt == "uint8" and not n.endswith("absmax") and n != "master_param"
                        else 0 for n in names]
                params.append(dict(numel=w["numel"], offsets=[w["offsets"][n] for n in names],
                                   write_files=[self.file(n, 0) for n in names], crc_out=crc,
                                   source=memory_flat(lp.detach()).cpu(), fill_bytes=fill))
                crcs.append((index, crc))
            self._run("fill", fmt, amsgrad, params)
        self._sync_written()
        return [c for _, c in sorted(crcs, key=lambda x: x[0])]

    def _restore_params(self, old: List[tuple]) -> None:
        """resume: each parameter := its master as the journal names it."""
        for (fmt, amsgrad), group in by_format([(self.manifest.params[i], (lp, i)) for lp, i in old]):
            names = arrays_of(fmt, amsgrad)
            params, back = [], []
            for lp, index in group:
                e, w = self.journal.entries[index], self.manifest.params[index]
                flat = memory_flat(lp.detach())
                out = flat if flat.device.type == "cpu" else torch.empty_like(flat, device="cpu")
                back.append((flat, out))
                params.append(dict(numel=w["numel"], offsets=[w["offsets"][n] for n in names],
                                   read_files=[self.file(n, e["slot"]) for n in names], crc_in=e["crc"],
                                   out=out, dests=[]))
            self._run("read", fmt, amsgrad, params)
            for flat, out in back:
                if out is not flat:
                    flat.copy_(out)

    def _ensure_window(self) -> None:
        m = self.manifest
        if not m.params:
            return
        size = window_size([w["numel"] for w in m.params], m.chunk_numel, self.options.window_bytes)
        if self.window is None or self.window.numel() < size:
            self.window = _page_aligned(self.pool, size)

    def _run(self, kind: str, fmt: str, amsgrad: bool, params: List[dict]) -> None:
        self.io.run_pass(kind, fmt, amsgrad, self.manifest.chunk_numel, self.window, params)

    def _sync_written(self) -> None:
        for f in self.files.values():
            self.io.sync(f)

    # ----------------------------------------------------------------- step
    def check_files(self) -> None:
        """A state file deleted, replaced or truncated since it was opened is an error
        now, before the step reads it."""
        for (array, slot), f in self.files.items():
            path, _, _, fd = self.io.file_info(f)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                raise RuntimeError(f"OffloadAdamW: the state file {path} was deleted while training; the state "
                                   "on disk is lost (resume from a snapshot)") from None
            mine = os.fstat(fd)
            if (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
                raise RuntimeError(f"OffloadAdamW: the state file {path} was replaced while training")
            if mine.st_size < self.manifest.ends.get(array, 0):
                raise RuntimeError(f"OffloadAdamW: the state file {path} was truncated while training (it has "
                                   f"{mine.st_size} bytes, the state needs {self.manifest.ends[array]})")

    def step(self, items: List[dict]) -> None:
        """items: {"param", "grad" (flat, the state's order), "out" (flat, or None), "adopt", "step",
        "hyper"}. On any failure the parameters are as before and the journal unchanged."""
        self.check_files()
        before = self.io.counters()
        done: List[Tuple[str, bool, List[dict]]] = []
        new_entries = list(self.journal.entries)
        try:
            for (fmt, amsgrad), group in by_format([(self.manifest.params[self.index[id(it["param"])]], it)
                                                     for it in items]):
                params = [self._step_plan(fmt, amsgrad, it, new_entries) for it in group]
                self._run("step", fmt, amsgrad, params)
                done.append((fmt, amsgrad, params))
            self._sync_written()
            self.journal.commit(new_entries, self.journal.steps + 1)
        except BaseException:
            self._undo(done)
            raise
        after = self.io.counters()
        self.written_last_step = after["bytes_written"] - before["bytes_written"]
        self.read_last_step = after["bytes_read"] - before["bytes_read"]
        self._warn_wear_once()

    def _step_plan(self, fmt: str, amsgrad: bool, it: dict, new_entries: List[dict]) -> dict:
        index = self.index[id(it["param"])]
        names, e, w = arrays_of(fmt, amsgrad), self.journal.entries[index], self.manifest.params[index]
        crc = torch.empty_like(e["crc"])
        new_entries[index] = dict(slot=1 - e["slot"], step=it["step"], crc=crc)
        h = it["hyper"]
        return dict(numel=w["numel"], offsets=[w["offsets"][n] for n in names],
                    read_files=[self.file(n, e["slot"]) for n in names],
                    write_files=[self.file(n, 1 - e["slot"]) for n in names], crc_in=e["crc"], crc_out=crc,
                    grad=it["grad"], out=it["out"], adopt=it["adopt"], step=it["step"],
                    hyper=(h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["amsgrad"], h["maximize"]))

    def _undo(self, done: List[tuple]) -> None:
        """Passes that finished before a later failure: their parameters get the master
        of the slot they read (untouched) back."""
        for fmt, amsgrad, params in done:
            restore = [dict(numel=p["numel"], offsets=p["offsets"], read_files=p["read_files"],
                            crc_in=p["crc_in"], out=p["out"], dests=[]) for p in params if p["out"] is not None]
            if restore:
                self._run("read", fmt, amsgrad, restore)

    def _warn_wear_once(self) -> None:
        if self._warned_wear or not self.written_last_step:
            return
        self._warned_wear = True
        total = shutil.disk_usage(self.folder).total
        per_1000 = self.written_last_step * 1000
        log.warning("OffloadAdamW: the optimizer state on disk writes %.2f GB a step: 1,000 steps write %.1f GB, "
                    "%.2f times this drive's %.0f GB (check the drive's rated endurance, TBW)",
                    self.written_last_step / 1e9, per_1000 / 1e9, per_1000 / total, total / 1e9)

    # ----------------------------------------------------------- reporting
    def stats(self) -> dict:
        infos = [self.io.file_info(f) for f in self.files.values()]
        return {"disk_state_bytes": sum(2 * e for e in self.manifest.ends.values()),
                "disk_bytes_written_per_step": self.written_last_step,
                "disk_bytes_read_per_step": self.read_last_step,
                "disk_window_bytes": 0 if self.window is None else self.window.numel(), "io_backend": self.io.backend,
                "io_backend_note": self.io.note, "direct_io": all(i[1] for i in infos) if infos else None,
                "direct_io_note": next((i[2] for i in infos if i[2]), ""), "disk_steps": self.journal.steps}

    def close(self) -> None:
        io = getattr(self, "io", None)
        if io is not None:
            io.close()
        self.lock.release()


def window_size(numels: List[int], chunk_numel: int, window_bytes: int) -> int:
    """The window's bytes: buffers for the longest chunk any parameter has, in the largest
    format, as many as fit in window_bytes, and no more than the state has chunks (the
    planner's estimate, optim/footprint.py, asks the same)."""
    longest = max(min(n, chunk_numel) for n in numels)
    buf = _C._disk_chunk_buffer_bytes("float32", True, quantum_up(longest))
    chunks = sum(-(-n // chunk_numel) for n in numels)
    return max(1, min(window_bytes // buf, chunks)) * buf


def by_format(pairs: List[tuple]) -> List[tuple]:
    """[(manifest entry, x)] -> [((format, amsgrad), [x, ...])], in first-seen order."""
    groups: Dict[tuple, list] = {}
    for entry, x in pairs:
        groups.setdefault((entry["format"], entry["amsgrad"]), []).append(x)
    return list(groups.items())


def _page_aligned(pool, nbytes: int) -> torch.Tensor:
    """`nbytes` of pool memory starting on a page (O_DIRECT's alignment)."""
    return pool.empty(nbytes, dtype=torch.uint8, alignment=PAGE)
