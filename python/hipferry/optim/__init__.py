"""Optimizers whose state lives in host memory (docs/optimizer.md)."""
from .calibration import cache_file, calibrate, link_gbps
from .disk.options import DiskOptions
from .footprint import HOMES, HomeCost, home_cost
from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW", "DiskOptions", "calibrate", "cache_file", "link_gbps", "HOMES", "HomeCost", "home_cost"]
