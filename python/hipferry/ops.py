"""Thin Python wrappers over torch.ops.hipferry (the schemas live in csrc/torch/ops.cpp)."""
import torch


def copy_cast_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write ``src`` converted to ``dst.dtype`` into ``dst`` and return ``dst``.

    ``src`` and ``dst`` may be on different devices: host->device,
    device->host, or the same device. Conversions between float32, float16 and
    bfloat16 (round to nearest even, bit-identical to ``.to(dtype)``) and copies
    between equal dtypes are supported. Both tensors must be contiguous and of
    equal shape.

    On a GPU this is ONE kernel on the current stream that reads the source
    where it lies: host tensors must be pinned (page-locked, mapped), e.g. from
    ``tensor.pin_memory()``. Like a ``non_blocking`` copy it is ordered on the
    current stream: keep both tensors alive until the stream passes it and
    synchronize before reading a host ``dst``. On the CPU it is a vectorized,
    multi-threaded loop that has finished when the call returns.

    Raises ``RuntimeError`` (naming the argument and what was expected) for bad
    input, in which case ``dst`` is left untouched.
    """
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"hipferry.copy_cast_: dst must be a torch.Tensor, got {type(dst).__name__}")
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"hipferry.copy_cast_: src must be a torch.Tensor, got {type(src).__name__}")
    for name, t in (("dst", dst), ("src", src)):
        if t.layout != torch.strided:
            raise ValueError(f"hipferry.copy_cast_: {name} must be a strided (dense) tensor, got layout {t.layout}")
    torch.ops.hipferry.copy_cast_.default(dst, src)
    return dst


_CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.register_fake("hipferry::copy_cast_")
def _copy_cast_fake(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Same shape/dtype rules as the C++ checks, written for symbolic shapes.
    if dst.shape != src.shape:
        raise RuntimeError(f"hipferry.copy_cast_: dst has shape {list(dst.shape)} but src has shape "
                           f"{list(src.shape)}; expected equal shapes")
    if dst.dtype != src.dtype and not (dst.dtype in _CONVERTIBLE and src.dtype in _CONVERTIBLE):
        raise RuntimeError(f"hipferry.copy_cast_: cannot convert src dtype {src.dtype} to dst dtype {dst.dtype}; "
                           "expected float32, float16 or bfloat16 on both sides, or equal dtypes")
