"""Thin Python wrappers over torch.ops.hipferry (the schemas live in csrc/torch/ops.cpp)."""
from typing import List, Optional

import torch

from . import _C
from .torch_private import eager_dispatch, neg_view

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


# ------------------------------------------------------------------ adamw_step_ / bits_equal
_fast_path = eager_dispatch


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: Optional[torch.Tensor], param_out: Optional[torch.Tensor], step: int, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, amsgrad: bool, maximize: bool,
                param_in: Optional[torch.Tensor] = None, exp_avg_in: Optional[torch.Tensor] = None,
                exp_avg_sq_in: Optional[torch.Tensor] = None,
                max_exp_avg_sq_in: Optional[torch.Tensor] = None, adopt_out: bool = False) -> None:
    """One fused AdamW step over one parameter's flat state (``torch.ops.hipferry.adamw_step_``).

    ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad)
    are float32; ``grad`` and ``param_out`` (the updated values rounded, or None)
    float32, bfloat16 or float16; all contiguous, with as many elements, on one
    device. In place, or out of place when ``param_in`` and the ``*_in`` state
    are given (read from those, written to ``param`` and the state). CPU: the
    vectorized loop on torch's thread pool, done when it returns; GPU: ONE
    kernel on the current stream. Bad input raises ValueError naming the
    argument before anything is written. ``adopt_out``: ``param_out`` is the
    parameter itself (in place), and elements whose bits differ from the
    rounded ``param`` were written by the user: they become ``param`` first.
    """
    if _fast_path():  # Note [adamw_step_ fast path]
        _C._adamw_step_(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, step, lr, beta1, beta2, eps,
                        weight_decay, amsgrad, maximize, param_in, exp_avg_in, exp_avg_sq_in, max_exp_avg_sq_in,
                        adopt_out)
        return
    call_op(torch.ops.hipferry.adamw_step_.default, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out,
            step, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, param_in, exp_avg_in, exp_avg_sq_in,
            max_exp_avg_sq_in, adopt_out)


def adamw_step_many_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                     exp_avg_sqs: List[torch.Tensor], max_exp_avg_sqs: List[Optional[torch.Tensor]],
                     param_outs: List[Optional[torch.Tensor]], steps: List[int], hypers: List[dict],
                     adopt_outs: List[bool]) -> None:
    """``adamw_step_`` in place over many parameters, in one call: item i is
    ``adamw_step_(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
    max_exp_avg_sqs[i], param_outs[i], steps[i], **hypers[i],
    adopt_out=adopt_outs[i])``, the items stepped one after the other. Every
    item is checked (the same checks, the message naming the item) before any
    is stepped. Eager calls make ONE crossing into C++ (OffloadAdamW's CPU
    engine steps all of a step's parameters with it); tracing and dispatch
    modes check every item, then call the op once per item."""
    if _fast_path():
        _C._adamw_step_many_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_outs, steps, hypers,
                             adopt_outs)
        return
    items = list(zip(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_outs, steps, hypers, adopt_outs))
    for name, entries in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                          ("max_exp_avg_sqs", max_exp_avg_sqs), ("param_outs", param_outs), ("steps", steps),
                          ("hypers", hypers), ("adopt_outs", adopt_outs)):
        if len(entries) != len(params):
            raise ValueError(f"hipferry.adamw_step_many_: {name} has {len(entries)} entries but params has "
                             f"{len(params)}; expected one per parameter")
    for i, (p, g, m, v, mx, out, step, hyper, adopt) in enumerate(items):
        for name, t in zip(_ADAMW_TENSORS, (p, g, m, v, mx, out)):
            if isinstance(t, torch.Tensor) and t.is_neg():
                raise ValueError(_lazy_bit_message("adamw_step_many_", f"{name}s[{i}]", "neg"))
        try:
            _adamw_step_fake(p, g, m, v, mx, out, step, **hyper, adopt_out=adopt)
        except ValueError as e:
            raise ValueError(str(e).replace("hipferry.adamw_step_: ", f"hipferry.adamw_step_many_: item {i}: ", 1)) \
                from None
    for p, g, m, v, mx, out, step, hyper, adopt in items:
        adamw_step_(p, g, m, v, mx, out, step, **hyper, adopt_out=adopt)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors of as many bytes hold the same bytes
    (``torch.ops.hipferry.bits_equal``; memcmp split over torch's threads)."""
    if _fast_path():
        return _C._bits_equal(a, b)
    return call_op(torch.ops.hipferry.bits_equal.default, a, b)


_ADAMW_TENSORS = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param_out")  # the schema's first six
_ADAMW_INPUTS = ("param_in", "exp_avg_in", "exp_avg_sq_in", "max_exp_avg_sq_in")  # its last four


def _lazy_bit_message(op: str, name: str, bit: str) -> str:
    # The pybind fast path's message (csrc/torch/adamw_step.cpp, plain_tensor_from_python).
    return (f"hipferry.{op}: {name} has torch's {'negative' if bit == 'neg' else 'conjugate'} bit set (a lazy "
            f"view); expected a tensor without it (resolve_{bit}() makes one)")


def _adamw_check_state(t: torch.Tensor, name: str, param: torch.Tensor, float32: bool) -> None:
    # check_state in csrc/torch/adamw_step.cpp, written for symbolic shapes.
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"hipferry.adamw_step_: {name} must be a contiguous dense tensor")
    if t.numel() != param.numel():
        raise ValueError(f"hipferry.adamw_step_: {name} has {t.numel()} elements but param has {param.numel()}; "
                         "expected equal sizes")
    if t.device != param.device:
        raise ValueError(f"hipferry.adamw_step_: {name} is on {t.device} but param is on {param.device}; "
                         "expected one device")
    if (t.dtype != torch.float32) if float32 else (t.dtype not in _CONVERTIBLE):
        raise ValueError(f"hipferry.adamw_step_: {name} has dtype {t.dtype}; expected "
                         f"{'float32' if float32 else 'float32, float16 or bfloat16'}")


@torch.library.register_fake("hipferry::adamw_step_")
def _adamw_step_fake(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, step, lr, beta1, beta2, eps,
                     weight_decay, amsgrad, maximize, param_in=None, exp_avg_in=None, exp_avg_sq_in=None,
                     max_exp_avg_sq_in=None, adopt_out=False) -> None:
    # The kernel's checks in its order (adamw_step in csrc/torch/adamw_step.cpp), but for the overlap of the
    # *_in arrays with the written ones, which only real memory shows.
    if step < 1:
        raise ValueError(f"hipferry.adamw_step_: step must be >= 1, got {step}")
    _adamw_check_state(param, "param", param, True)
    _adamw_check_state(grad, "grad", param, False)
    _adamw_check_state(exp_avg, "exp_avg", param, True)
    _adamw_check_state(exp_avg_sq, "exp_avg_sq", param, True)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("hipferry.adamw_step_: amsgrad=True needs max_exp_avg_sq")
    if amsgrad:
        _adamw_check_state(max_exp_avg_sq, "max_exp_avg_sq", param, True)
    if param_out is not None:
        _adamw_check_state(param_out, "param_out", param, False)
    ins = (param_in, exp_avg_in, exp_avg_sq_in, max_exp_avg_sq_in)
    if any(t is not None for t in ins):
        for i, (name, t) in enumerate(zip(_ADAMW_INPUTS, ins)):
            wanted = i < 3 or amsgrad
            if (t is not None) != wanted:
                raise ValueError(f"hipferry.adamw_step_: {name} is missing: param_in, exp_avg_in and exp_avg_sq_in "
                                 "(and max_exp_avg_sq_in with amsgrad) come together" if wanted else
                                 f"hipferry.adamw_step_: {name} is given without amsgrad")
            if wanted:
                _adamw_check_state(t, name, param, True)
    if adopt_out and (param_out is None or param_in is not None):
        raise ValueError("hipferry.adamw_step_: adopt_out=True needs param_out (the parameter itself) and an "
                         "in-place step (no param_in)")


def _adamw_step_math_bits(*args, **kwargs) -> None:
    # Tensors with torch's negative or conjugate bit meet this kernel first (see copy_cast_'s above): a
    # negative bit is refused, as the fast path refuses it; the conjugate bit is resolved (only complex
    # tensors have it, and the kernel then refuses their dtype, as the fast path does).
    names = _ADAMW_TENSORS + ("step", "lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize") + \
        _ADAMW_INPUTS + ("adopt_out",)
    bound = dict(zip(names, args), **kwargs)
    for name, t in bound.items():
        if isinstance(t, torch.Tensor) and t.is_neg():
            raise ValueError(_lazy_bit_message("adamw_step_", name, "neg"))
    bound = {k: t.resolve_conj() if isinstance(t, torch.Tensor) else t for k, t in bound.items()}
    call_op(torch.ops.hipferry.adamw_step_.default, *(bound.get(k) for k in names))


@torch.library.register_fake("hipferry::bits_equal")
def _bits_equal_fake(a: torch.Tensor, b: torch.Tensor):
    for name, t in (("a", a), ("b", b)):
        if t.device.type not in ("cpu", "meta") or t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(f"hipferry.bits_equal: {name} must be a contiguous dense CPU tensor")
    if a.numel() * a.element_size() != b.numel() * b.element_size():
        raise ValueError(f"hipferry.bits_equal: a has {a.numel() * a.element_size()} bytes and b "
                         f"{b.numel() * b.element_size()}; expected as many")
    # The answer is in the data: a fresh unbacked symbol (torch.compile breaks the graph on a branch over it).
    return torch.library.get_ctx().new_dynamic_size(min=0, max=1) == 1


def _bits_equal_math_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bytes of a tensor with a lazy bit are not its values: refused, as by the fast path.
    for name, t in (("a", a), ("b", b)):
        for bit in ("neg", "conj"):
            if getattr(t, f"is_{bit}")():
                raise ValueError(_lazy_bit_message("bits_equal", name, bit))
    return call_op(torch.ops.hipferry.bits_equal.default, a, b)


for _key in ("Conjugate", "Negative"):
    _math_bits.impl("adamw_step_", _adamw_step_math_bits, _key)
    _math_bits.impl("bits_equal", _bits_equal_math_bits, _key)
