"""Whether this build of hipferry can run under the torch in this environment.

Checked from the build record (``hipferry/_build_config.py``, written by CMake
next to the module) BEFORE ``hipferry._C`` is loaded: a module loaded under a
torch whose ABI it does not share fails with an undefined symbol, or worse
loads and crashes later. A mismatch that cannot work raises ImportError with
one sentence that says what is wrong and what to do.
"""
import re
from types import ModuleType
from typing import Optional, Tuple

REBUILD = "pip install --no-build-isolation --force-reinstall ."


def minor_of(version: str) -> Tuple[int, int]:
    """(2, 15) from '2.15.0+cu132', '2.14.0a0+git1234' or '2.13'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def supported_range(build: ModuleType) -> str:
    """'2.15', '2.13 to 2.15' or '2.13 and newer', as the build record says."""
    oldest, newest = build.torch_oldest, build.torch_newest
    if build.torch_newer_loads:
        return f"{oldest} and newer (checked up to {newest})"
    return oldest if oldest == newest else f"{oldest} to {newest}"


def mismatch(build: ModuleType, torch_version: str, torch_hip: Optional[str],
             torch_cuda: Optional[str]) -> Optional[str]:
    """The sentence saying why this build cannot run under that torch, or None when it can.

    ``torch_hip`` and ``torch_cuda`` are torch.version.hip and torch.version.cuda.
    """
    # A GPU build under the other vendor's torch cannot share its streams and
    # memory. Under a CPU-only torch it loads (its CPU paths work; doctor says so).
    flavor = "ROCm" if torch_hip else "CUDA" if torch_cuda else "CPU-only"
    if (build.target == "rocm" and flavor == "CUDA") or (build.target == "cuda" and flavor == "ROCm"):
        wanted = "ROCm" if build.target == "rocm" else "CUDA"
        return (f"this hipferry was built for {wanted} but torch {torch_version} is a {flavor} build: "
                f"install a {wanted} build of torch, or rebuild hipferry against this one ({REBUILD}).")
    runtime = torch_hip if build.target == "rocm" else torch_cuda if build.target == "cuda" else None
    if runtime and build.runtime_major is not None and minor_of(runtime)[0] != build.runtime_major:
        name = "ROCm/HIP" if build.target == "rocm" else "CUDA"
        return (f"this hipferry was built with {name} {build.runtime_major} but torch {torch_version} uses "
                f"{name} {runtime}: install a torch built for {name} {build.runtime_major}.x, or rebuild hipferry "
                f"against this one ({REBUILD}).")
    have = minor_of(torch_version)
    oldest, newest = minor_of(build.torch_oldest), minor_of(build.torch_newest)
    if have < oldest or (have > newest and not build.torch_newer_loads):
        return (f"this hipferry supports torch {supported_range(build)} ({build.torch_abi}) but this environment "
                f"has torch {torch_version}: install a torch in that range, or rebuild hipferry against this "
                f"one ({REBUILD}).")
    return None


def load_build_record() -> ModuleType:
    """hipferry._build_config, or ImportError saying the build is incomplete."""
    try:
        from . import _build_config
    except ImportError:
        raise ImportError("hipferry has no build record (hipferry/_build_config.py is written by the build next to "
                          f"hipferry._C): build or reinstall hipferry ({REBUILD}).") from None
    return _build_config


def check_torch(build: ModuleType) -> None:
    """Raises ImportError when this build cannot run under the imported torch."""
    import torch

    problem = mismatch(build, torch.__version__, getattr(torch.version, "hip", None),
                       getattr(torch.version, "cuda", None))
    if problem is not None:
        raise ImportError(problem)
