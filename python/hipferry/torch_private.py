"""Every private torch name hipferry uses, in one place.

Note [private torch names]
~~~~~~~~~~~~~~~~~~~~~~~~~~
* hipferry prefers public APIs; what is here has none (checked against
  torch 2.15). Each name is wrapped by one small function, and
  tests/python/abi/test_torch_private.py checks each against the installed torch,
  so a torch release that renames or removes one fails in one test that says
  which -- as hip/platform.h keeps the vendor names of the GPU runtimes.
* Nothing outside this module spells a private torch name (``torch._...``,
  ``Tensor._version``/``._base``, ``Module._parameters``, autograd node class
  names); the test of this module greps the package for them.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils import _pytree

SavedHooks = Optional[Tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]]


# ------------------------------------------------------------------ autograd engine
def current_graph_task_id() -> int:
    """The id of the backward running on this thread, -1 outside backward.
    (``torch._C._current_graph_task_id``; no public equivalent.)"""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """True inside a backward (e.g. activation checkpointing recomputing forward)."""
    return torch._C._current_graph_task_id() != -1


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Runs ``fn`` when the backward running now ends (only from inside it).
    (``Variable._execution_engine.queue_callback``; FSDP uses it too.)"""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def post_accumulate_grad_hooks(p: torch.Tensor) -> List[Callable[[torch.Tensor], None]]:
    """The hooks registered with ``p.register_post_accumulate_grad_hook``, in
    order (``Tensor._post_accumulate_grad_hooks``): hipferry accumulates some
    gradients itself and must run them as AccumulateGrad would."""
    return list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())


def current_saved_tensors_hooks() -> SavedHooks:
    """The (pack, unpack) pair of ``saved_tensors_hooks`` in effect now, or None
    (``torch._C._autograd._top_saved_tensors_default_hooks``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_dtype_cast_node(fn: Any) -> bool:
    """Whether an autograd node is the backward of ``Tensor.to(dtype)`` (the cast
    autocast makes of a weight): its class name, ``ToCopyBackward0``."""
    return fn is not None and type(fn).__name__ == "ToCopyBackward0"


# ------------------------------------------------------------------ tensors
def tensor_version(t: torch.Tensor) -> int:
    """The in-place write counter of ``t`` (``Tensor._version``)."""
    return t._version


def tensor_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of, or None (``Tensor._base``)."""
    return t._base


def storage_holders(t: torch.Tensor) -> int:
    """How many tensors, views, ``.data`` aliases, numpy arrays and storage objects
    hold ``t``'s storage (the storage's use count, ``torch._C._storage_Use_Count``
    of ``UntypedStorage._cdata``; the storage object this call makes is not counted)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share one storage object (``UntypedStorage._cdata``)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack  # looked up once: eager_dispatch is on hot paths


def eager_dispatch() -> bool:
    """True when ops called now run eagerly on real tensors: no torch.compile
    or export tracing, no TorchDispatchMode (FakeTensorMode among them) on the
    stack. Fast paths that bypass the dispatcher take only such calls.
    (``torch._C._len_torch_dispatch_stack``; no public equivalent.)"""
    return not (_is_compiling() or _dispatch_stack_len())


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the negative bit flipped (``torch._neg_view``)."""
    return torch._neg_view(t)


def amp_unscale_(grads: List[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's fused unscale + inf check (``torch._amp_foreach_non_finite_check_and_unscale_``)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def host_empty_cache() -> bool:
    """Empties torch's caching host allocator where torch has the call
    (``torch._C._host_emptyCache``, torch >= 2.5); False where it does not."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        return False
    fn()
    return True


def dtensor_local(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A DTensor's local shard (``DTensor._local_tensor``; the public
    ``to_local()`` records an autograd op), None for other tensors."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else None


# ------------------------------------------------------------------ modules
def module_parameters(m: nn.Module) -> Dict[str, Optional[nn.Parameter]]:
    """A module's own parameter slots (``Module._parameters``), which hipferry
    fills with device tensors while a block runs, as FSDP2 does."""
    return m._parameters


def module_hook_dicts(m: nn.Module) -> List[Dict[int, Any]]:
    """The dicts holding a module's forward pre-, forward and state_dict post
    hooks by handle id (``Module._forward_pre_hooks``, ``_forward_hooks``,
    ``_state_dict_hooks``; public registration returns only a handle): a deep
    copy of an offloaded model leaves hipferry's out."""
    return [m._forward_pre_hooks, m._forward_hooks, m._state_dict_hooks]


def module_buffers(m: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """A module's own buffer slots (``Module._buffers``)."""
    return m._buffers


MODULE_APPLY = "_apply"  # what model.to()/.cuda()/.float() call on each module: an instance attribute overrides it


def module_apply(m: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    """torch's conversion of ``m``'s parameters and buffers by ``fn`` (what
    ``model.to()`` runs; ``nn.Module._apply``), bypassing an override of ``m``'s own."""
    return nn.Module._apply(m, fn, recurse)


def override_module_apply(m: nn.Module, fn: Callable[..., nn.Module]) -> None:
    """Makes ``model.to()`` and friends call ``fn(fn_of_tensors, recurse=True)``
    for ``m`` instead of torch's conversion: an instance attribute ``_apply``
    (``del m.__dict__[MODULE_APPLY]`` undoes it)."""
    m.__dict__[MODULE_APPLY] = fn


# ------------------------------------------------------------------ optimizers
def optimizer_load_state_dict_hooks(opt: torch.optim.Optimizer) -> Tuple[List[Callable], List[Callable]]:
    """The (pre, post) hooks registered with ``register_load_state_dict_pre_hook``
    / ``_post_hook``, in the order torch runs them
    (``Optimizer._optimizer_load_state_dict_pre_hooks`` / ``_post_hooks``): an
    optimizer that loads state itself runs them as torch's ``load_state_dict`` does."""
    return (list(opt._optimizer_load_state_dict_pre_hooks.values()),
            list(opt._optimizer_load_state_dict_post_hooks.values()))


def supports_amp_scaling(cls: type) -> type:
    """Class decorator: ``torch.amp.GradScaler.step`` then hands the
    optimizer's ``step`` ``grad_scale`` and ``found_inf`` (as attributes)
    instead of unscaling the gradients itself (``_step_supports_amp_scaling``)."""
    cls._step_supports_amp_scaling = True
    return cls


# ------------------------------------------------------------------ containers
# torch.utils._pytree: how torch walks nested containers (tuples, lists, dicts,
# namedtuples, OrderedDict, defaultdict, deque, torch.return_types and what
# libraries register, e.g. transformers' ModelOutput). No public module yet.
def tree_flatten(tree: Any, is_leaf: Optional[Callable[[Any], bool]] = None) -> Tuple[List[Any], Any]:
    """Leaves and structure of nested containers, as torch sees them
    (``_pytree.tree_flatten``); ``is_leaf(x)`` true stops the walk at ``x``."""
    return _pytree.tree_flatten(tree, is_leaf=is_leaf)


def tree_unflatten(leaves: List[Any], spec: Any) -> Any:
    """The structure ``spec`` (from :func:`tree_flatten`) rebuilt around ``leaves``
    (``_pytree.tree_unflatten``)."""
    return _pytree.tree_unflatten(leaves, spec)


def tree_leaf_paths(tree: Any) -> List[str]:
    """Where each leaf of ``tree_flatten(tree)`` sits, as an index suffix such as
    ``"['w'][1]"`` (``_pytree.tree_flatten_with_path`` and ``_pytree.keystr``),
    for error messages that name the offending element."""
    return [_pytree.keystr(path) for path, _ in _pytree.tree_flatten_with_path(tree)[0]]


def tree_is_leaf(x: Any) -> bool:
    """Whether pytree treats ``x`` as a leaf: a type it does not know how to walk,
    e.g. a ``collections.UserDict`` (``_pytree.tree_is_leaf``)."""
    return _pytree.tree_is_leaf(x)


def register_mapping_node(cls: type, flatten: Callable[[Any], Tuple[List[Any], List[Any], Any]],
                          unflatten: Callable[[List[Any], Any], Any]) -> None:
    """Makes pytree walk instances of ``cls`` (a class of hipferry's own) as a
    mapping: ``flatten(x)`` gives (keys, values, context), ``unflatten(values,
    context)`` rebuilds ``x``, and leaf paths read ``[key]``
    (``_pytree.register_pytree_node`` with ``_pytree.MappingKey``)."""
    def with_keys(x):
        keys, values, context = flatten(x)
        return [(_pytree.MappingKey(k), v) for k, v in zip(keys, values)], context

    _pytree.register_pytree_node(cls, lambda x: flatten(x)[1:],
                                 lambda values, context: unflatten(list(values), context),
                                 flatten_with_keys_fn=with_keys)
