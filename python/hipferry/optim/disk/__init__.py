"""OffloadAdamW's optimizer state on disk (``state_dir=``): docs/disk-state.md.

- options.py: DiskOptions, what a user can tune (window, chunk, queue depth);
- layout.py: which file holds what (Note [disk state layout] in
  csrc/core/disk/state_pass.h), the manifest that ties a folder to a model;
- journal.py: the journal that names each parameter's slot, step and chunk
  checksums, replaced atomically after a step's data is durable; the lock;
- store.py: DiskStore, the state store OffloadAdamW steps through
  (hipferry._C.DiskIo runs the I/O and the fused step);
- persistence.py: state_dict (file-backed tensors), load_state_dict, snapshot;
- raw_io.py: the disk's raw sequential speed through the same I/O queue.
"""
from .options import QUANTUM, DiskOptions
from .journal import holds_state
from .raw_io import DEPTH, REQUEST, RawIo

__all__ = ["DiskOptions", "QUANTUM", "RawIo", "DEPTH", "REQUEST", "holds_state"]
