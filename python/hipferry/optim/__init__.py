"""Optimizers whose state lives in host memory (docs/optimizer.md)."""
from .calibration import calibrate
from .disk.options import DiskOptions
from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW", "DiskOptions", "calibrate"]
