"""hipferry: overlapped host<->device data movement for PyTorch on ROCm, CUDA and CPU.

Importing hipferry registers its ops under ``torch.ops.hipferry``.
"""
from .version import __version__  # noqa: F401,E402  (one version: version.py)

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from . import torch_compat

# Before the module loads: a torch it cannot run under fails here, in one sentence.
torch_compat.check_torch(torch_compat.load_build_record())
from . import _C  # noqa: F401,E402  (registers torch.ops.hipferry.*)

_C.cpu_isa()  # a bad HIPFERRY_CPU_ISA fails here, in one sentence, not inside a later op
from . import optim  # noqa: F401  (hipferry.optim.OffloadAdamW)
from .module_offload import LayerOffload, NothingOffloadedWarning, offload_activations, offload_layers
from .ops import copy_cast_
from .planner import plan
from .platform import build_info, device_count, device_info
from .pool import PinnedPool, configure_default_pool, default_pool, pin
from .trace import Trace, trace, trace_region
from .transfer import Transfer, configure_transfers, offload, prefetch, transfer_stats

__all__ = ["copy_cast_", "build_info", "device_count", "device_info", "PinnedPool", "default_pool",
           "configure_default_pool", "pin", "prefetch", "offload", "Transfer", "transfer_stats",
           "configure_transfers", "offload_layers", "LayerOffload", "offload_activations",
           "NothingOffloadedWarning", "plan", "trace", "trace_region", "Trace", "optim", "__version__"]
