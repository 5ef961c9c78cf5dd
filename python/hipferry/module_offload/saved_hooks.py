"""Saved-tensor hooks that handle some tensors and pass the rest on.

torch applies only the innermost ``saved_tensors_hooks``. hipferry's hooks
(the weights of an offloaded block, ``offload_activations``) handle only the
tensors they are about; every other tensor goes to the hooks that were in
effect when ours were pushed (activation checkpointing, ``save_on_cpu``,
an outer ``offload_activations``), so they compose instead of shadowing each
other. With no outer hooks the tensor is kept as autograd would keep it.
"""
import torch

from ..torch_private import SavedHooks as Hooks
from ..torch_private import current_saved_tensors_hooks


def current_hooks() -> Hooks:
    """The (pack, unpack) pair in effect now, or None."""
    return current_saved_tensors_hooks()


class Passed:
    """A tensor handed to the outer hooks (or kept as is when there are none)."""

    __slots__ = ("unpack", "packed")

    def __init__(self, outer: Hooks, t: torch.Tensor):
        if outer is None:
            # detach(): keeping `t` itself would make a reference cycle through
            # its grad_fn when it is an output of the node that saves it.
            self.unpack, self.packed = None, t.detach()
        else:
            self.unpack, self.packed = outer[1], outer[0](t)

    def get(self) -> torch.Tensor:
        return self.packed if self.unpack is None else self.unpack(self.packed)
