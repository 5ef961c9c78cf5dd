"""The disk store's state dicts and snapshots.

state_dict(): the state as torch.optim.AdamW's keys, each a tensor backed by the
state file itself (a private, copy-on-write memory map of the slot the journal
names), so torch.save streams it from the page cache and nothing holds the whole
state in RAM. The chunks' checksums are verified first (one read pass). Such a
tensor shows the state of the step it was taken at until the step after next
rewrites that slot: save it before stepping twice.
load_state_dict(): the saved tensors are written into the other slot, then the
journal is committed, so a failure leaves the state as it was.
snapshot(dest): a folder that resumes from this step (reflinks where the file
system has them, else kernel-side copies: copy_file_range)."""
import errno
import fcntl
import os
import shutil
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..int8_store import SIGNED, dequantized, is_8bit, quantize_into, zero_code
from ..layout import aligned, memory_flat, shaped
from ..state import LOW_PRECISION, local
from .layout import array_dtype, arrays_of, file_name
from .store import by_format

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def export_state(store, index: int, lp: torch.Tensor) -> dict:
    """Parameter `index`'s state as file-backed tensors (see module doc)."""
    w, e = store.manifest.params[index], store.journal.entries[index]
    strides, out = store.strides[index], {}
    for name in arrays_of(w["format"], w["amsgrad"]):
        if name == "master_param" and lp.dtype not in LOW_PRECISION:
            continue  # a float32 parameter is its own master
        dtype = array_dtype(w["format"], name)
        count = -(-w["numel"] // 256) if name.endswith("_absmax") else w["numel"]
        path = os.path.join(store.folder, file_name(name, e["slot"]))
        flat = torch.from_numpy(np.memmap(path, dtype=np.dtype(str(dtype).replace("torch.", "")), mode="c",
                                          offset=w["offsets"][name], shape=(count,)))
        out[name] = flat if name.endswith("_absmax") else shaped(flat, lp.shape, strides)
    return out


def verify(store) -> None:
    """Reads every chunk of the state the journal names and checks its checksum."""
    for (fmt, amsgrad), group in _groups(store, range(len(store.manifest.params))):
        names = arrays_of(fmt, amsgrad)
        store._run("read", fmt, amsgrad, [dict(numel=store.manifest.params[i]["numel"],
                                               offsets=[store.manifest.params[i]["offsets"][n] for n in names],
                                               read_files=[store.file(n, store.journal.entries[i]["slot"])
                                                           for n in names],
                                               crc_in=store.journal.entries[i]["crc"], dests=[]) for i in group])


def load_states(store, pairs: List[Tuple[torch.Tensor, Optional[dict]]]) -> None:
    """Writes each (parameter, saved state or None) into the slot its journal entry does not
    name, then commits; nothing changes when any of it fails."""
    entries = list(store.journal.entries)
    by_index = {store.index[id(p)]: (local(p), saved) for p, saved in pairs}
    for (fmt, amsgrad), group in _groups(store, sorted(by_index)):
        names, params = arrays_of(fmt, amsgrad), []
        for i in group:
            lp, saved = by_index[i]
            w, e = store.manifest.params[i], store.journal.entries[i]
            crc = torch.empty_like(e["crc"])
            entries[i] = dict(slot=1 - e["slot"], step=int(float(saved["step"])) if saved else 0, crc=crc)
            like = torch.empty_strided(lp.shape, store.strides[i], dtype=torch.float32, device="meta")
            sources = _sources(names, fmt, lp, saved, like)
            params.append(dict(numel=w["numel"], offsets=[w["offsets"][n] for n in names],
                               write_files=[store.file(n, 1 - e["slot"]) for n in names], crc_out=crc,
                               sources=sources, fill_bytes=[_fill_byte(fmt, n) for n in names]))
        store._run("load", fmt, amsgrad, params)
    store._sync_written()
    store.journal.commit(entries, store.journal.steps)


def _sources(names: List[str], fmt: str, lp: torch.Tensor, saved: Optional[dict], like: torch.Tensor) -> list:
    """The flat bytes each array in `names` gets (in the memory order of `like`), None where
    it is filled (a missing key: zeros)."""
    out = {}
    master = saved.get("master_param") if saved is not None and lp.dtype in LOW_PRECISION else None
    value = local(master) if master is not None else lp
    out["master_param"] = memory_flat(aligned(value.detach().to("cpu", torch.float32), like)).contiguous()
    for name in names:
        if name in out or name.endswith("_absmax") or saved is None or name not in saved:
            continue
        value = local(saved[name]).to("cpu")
        if is_8bit(saved) and fmt == "float32":
            value = dequantized(value, local(saved[f"{name}_absmax"]).to("cpu"), name)
        if fmt == "float32":
            out[name] = memory_flat(aligned(value.to(torch.float32), like)).contiguous()
            continue
        if is_8bit(saved):
            codes, scales = aligned(value, like), local(saved[f"{name}_absmax"]).to("cpu")
        else:
            codes = torch.empty_strided(lp.shape, like.stride(), dtype=torch.uint8)
            scales = torch.empty(-(-lp.numel() // 256), dtype=torch.float32)
            quantize_into(value, codes, scales, name)
        out[name], out[f"{name}_absmax"] = memory_flat(codes).contiguous(), scales.contiguous()
    return [out.get(n) for n in names]


def _fill_byte(fmt: str, name: str) -> int:
    return zero_code(SIGNED[name]) if fmt == "uint8" and name in SIGNED else 0


def _groups(store, indices) -> list:
    """[((format, amsgrad), [index, ...])] of the manifest's parameters `indices` (store.by_format)."""
    return by_format([(store.manifest.params[i], i) for i in indices])


def snapshot(store, dest: str) -> str:
    """Copies the folder's state as of the last committed step into `dest` (new or empty):
    a folder OffloadAdamW(state_dir=dest, disk=DiskOptions(resume=True)) continues from."""
    dest = os.fspath(dest)
    os.makedirs(dest, exist_ok=True)
    if any(n for n in os.listdir(dest)):
        raise ValueError(f"OffloadAdamW.snapshot: {dest!r} is not empty; expected a new or empty folder")
    for (array, slot) in sorted(store.files):
        _copy_file(os.path.join(store.folder, file_name(array, slot)), os.path.join(dest, file_name(array, slot)))
    for name in ("manifest.json", "journal"):
        shutil.copyfile(os.path.join(store.folder, name), os.path.join(dest, name))
    return dest


def _copy_file(src: str, dst: str) -> None:
    """A reflink (FICLONE: btrfs, xfs, bcachefs) where the file system shares blocks, else
    copy_file_range (the kernel copies; nothing passes through this process)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS):
                raise
            size, done = os.fstat(fin.fileno()).st_size, 0
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done, done, done)
                if n == 0:
                    raise OSError(errno.EIO, f"copy_file_range of {src} stopped at {done} of {size} bytes")
                done += n
        fout.flush()
        os.fsync(fout.fileno())
