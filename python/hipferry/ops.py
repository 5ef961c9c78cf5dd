"""Thin Python wrappers over torch.ops.hipferry (the schemas live in csrc/torch/ops.cpp)."""
import torch

from .torch_private import neg_view

# Op kernels run behind LibTorch's stable ABI, where torch's dispatcher raises
# whatever a kernel throws as RuntimeError; the kernel tags the message with
# the type it stands for (csrc/torch/op_errors.h) and call_op raises that type.
_TAGGED = {"[hipferry ValueError] ": ValueError, "[hipferry TypeError] ": TypeError,
           "[hipferry OutOfMemoryError] ": torch.OutOfMemoryError}


def call_op(op, *args):
    """``op(*args)``, with a tagged kernel error raised as its own type."""
    try:
        return op(*args)
    except RuntimeError as e:
        text = str(e)
        for tag, kind in _TAGGED.items():
            at = text.find(tag)
            if at >= 0:
                message = text[at + len(tag):].split("\nException raised from", 1)[0].rstrip()
                raise kind(message) from None
        raise


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
        # Both report layout torch.strided, but no backend kernel of the op takes them (the dispatcher
        # would say NotImplementedError for 'QuantizedCPU' / 'NestedTensorCPU').
        if t.is_quantized:
            raise ValueError(f"hipferry.copy_cast_: {name} is quantized ({t.dtype}); expected a plain (not quantized) "
                             f"tensor, e.g. {name}.int_repr() or {name}.dequantize()")
        if t.is_nested:
            raise ValueError(f"hipferry.copy_cast_: {name} is a nested tensor; expected a plain dense tensor "
                             "(copy each component, or its .values())")
    call_op(torch.ops.hipferry.copy_cast_.default, dst, src)
    return dst


_CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _check_shape_dtype_contiguous(dst: torch.Tensor, src: torch.Tensor) -> None:
    # The C++ checks (csrc/torch/copy_cast_checks.cpp) and their messages, written for symbolic shapes.
    if dst.shape != src.shape:
        raise RuntimeError(f"hipferry.copy_cast_: dst has shape {list(dst.shape)} but src has shape "
                           f"{list(src.shape)}; expected equal shapes")
    if dst.dtype != src.dtype and not (dst.dtype in _CONVERTIBLE and src.dtype in _CONVERTIBLE):
        raise RuntimeError(f"hipferry.copy_cast_: cannot convert src dtype {src.dtype} to dst dtype {dst.dtype}; "
                           "expected float32, float16 or bfloat16 on both sides, or equal dtypes")
    if not dst.is_contiguous():
        raise RuntimeError(f"hipferry.copy_cast_: dst must be contiguous (strides {list(dst.stride())} for shape "
                           f"{list(dst.shape)}); pass a contiguous tensor")
    if not src.is_contiguous():
        raise RuntimeError(f"hipferry.copy_cast_: src must be contiguous (strides {list(src.stride())} for shape "
                           f"{list(src.shape)}); call src.contiguous() first")


@torch.library.register_fake("hipferry::copy_cast_")
def _copy_cast_fake(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Runs for two kinds of tensors: FakeTensors (torch.compile, FakeTensorMode), which report the device they
    # stand for (cpu, cuda), and real meta tensors (the Meta dispatch key, which also wins when only ONE side is
    # meta). Meta on both sides is a shape/dtype check; meta on one side only would be a copy that writes
    # nothing (or reads nothing) and says so never: an error, as a real kernel would give.
    dst_meta, src_meta = dst.device.type == "meta", src.device.type == "meta"
    if dst_meta != src_meta:
        name, other = ("src", dst) if src_meta else ("dst", src)
        raise RuntimeError(f"hipferry.copy_cast_: {name} is on the meta device but "
                           f"{'dst' if name == 'src' else 'src'} is on {other.device}; expected real tensors on "
                           "both sides (or meta tensors on both, to check shapes and dtypes)")
    # As the real kernels: a meta (or traced) call that would fail for real fails here too.
    _check_shape_dtype_contiguous(dst, src)


# Tensors with torch's conjugate / negative bit (x.conj(), neg_view(x), x.conj().imag) meet these
# kernels before any other. Without them torch's MathBitsFallback would handle them, and for a MUTATED
# argument of an op that returns nothing (as this one) the fallback reads and writes the dispatcher stack
# past its end after the call (it expects the op to return the argument it mutated): heap corruption
# ("malloc(): unsorted double linked list corrupted") for copy_cast_(x, x) with x = neg_view(t),
# "Expected Tensor but got None" with the fake kernel. Here the bit moves from dst to src: writing v into
# conj(d) / -d stores conj(v) / -v into d (negation commutes with round-to-nearest-even), and src is then
# materialized by torch, as the fallback would do (torch's negation may quiet a signalling NaN).
_math_bits = torch.library.Library("hipferry", "IMPL")


def _copy_cast_math_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    _check_shape_dtype_contiguous(dst, src)  # before src is materialized (a contiguous copy); no loop below
    if dst.is_conj():
        dst, src = dst.conj(), src.conj()
    if dst.is_neg():
        dst, src = neg_view(dst), neg_view(src)
    call_op(torch.ops.hipferry.copy_cast_.default, dst, src.resolve_conj().resolve_neg())


for _key in ("Conjugate", "Negative"):
    _math_bits.impl("copy_cast_", _copy_cast_math_bits, _key)
