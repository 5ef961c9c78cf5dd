"""Optimizers whose state lives in host memory (docs/optimizer.md)."""
from .calibration import cache_file, calibrate, link_gbps, load_cached, store_cached
from .disk.options import DiskOptions
from .footprint import HOMES, HomeCost, home_cost
from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW", "DiskOptions", "calibrate", "cache_file", "link_gbps", "load_cached", "store_cached",
           "HOMES", "HomeCost", "home_cost"]
