"""The CPU engine's traffic for GPU parameters: gradient copies to the host
(started by backward hooks, used at step() while current), the scaling that
clipping and GradScaler apply to them on the host, and the copies of the new
values back. All copies go through one DeviceCopies (device_copies.py), the
seam the order tests replace with a fake."""
from typing import Dict, Iterable, List, Optional

import torch

from .. import ops
from ..torch_private import amp_unscale_, tensor_version
from .device_copies import DeviceCopies
from .state import local
from .slots import FinishedCopy, Slot


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` (on one device) hold the same bits (one memcmp on the host, an
    integer comparison on a GPU); the same memory is the same bits."""
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    if a.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        return ops.bits_equal(a.reshape(-1), b.reshape(-1))
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def inv_scale(scale: torch.Tensor) -> torch.Tensor:
    """The factor GradScaler unscales by (GradScaler.unscale_'s own formula)."""
    return scale.double().reciprocal().float()


class GradCopies:
    def __init__(self, pool):
        self.pool = pool
        self.copies = DeviceCopies()
        self._back_events: list = []  # per device, an event after the last step's copies back
        self.reused = 0               # gradient copies from backward that step() used ...
        self.made_at_step = 0         # ... and copies it had to make itself (none, or a changed gradient)

    def start(self, slot: Slot, grad: torch.Tensor) -> None:
        """Backward hook: the gradient `grad` is final; copy it to the host now."""
        slot.grad_copy = self.copies.to_host(grad, self.pool)
        slot.copied_grad, slot.copied_version = grad, tensor_version(grad)

    def start_reduced(self, slot: Slot, reduced: torch.Tensor) -> None:
        """DDP's comm hook: `reduced` (a view of the reduced bucket) holds the parameter's
        gradient, which DDP puts into p.grad at the end of backward; copy it to the host now."""
        self.start(slot, reduced)

    def host_grad(self, slot: Slot, grad: torch.Tensor) -> torch.Tensor:
        """The host copy of `grad` (the one backward started while it is current, or while it
        copied DDP's reduced bucket and `grad` holds the same bits, else a new one)."""
        if slot.copy_is_current(grad) or self._copies_reduced(slot, grad):
            copy = slot.grad_copy
            self.reused += 1
        else:
            copy = self.copies.to_host(grad, self.pool)  # changed since the hook (accumulation, clipping, scaling)
            self.made_at_step += 1
        slot.drop_grad_copy()
        return copy.wait()

    @staticmethod
    def _copies_reduced(slot: Slot, grad: torch.Tensor) -> bool:
        source = slot.copied_grad
        if slot.grad_copy is None or source is None or source is grad or \
                tensor_version(source) != slot.copied_version:
            return False
        return same_bits(source, grad)

    def settle(self, slot: Slot, grad: torch.Tensor) -> torch.Tensor:
        """Waits for the current copy of `grad` and keeps its host tensor, which the
        caller may now scale in place (clipping, unscaling) on the host."""
        host = slot.grad_copy.wait()
        self.keep(slot, grad, host)
        return host

    @staticmethod
    def keep(slot: Slot, grad: torch.Tensor, host: torch.Tensor) -> None:
        """`host` (scaled on the host as `grad` was on its device) is the current copy of `grad`."""
        slot.grad_copy = FinishedCopy(host)
        slot.copied_version = tensor_version(grad)

    @staticmethod
    def drop(slots: Iterable[Slot]) -> None:
        for slot in slots:
            slot.drop_grad_copy()

    def unscale(self, slots_and_grads: List[tuple], scale: torch.Tensor) -> None:
        """What GradScaler.unscale_ does (the same op and factor), applied to the host
        copies where they are current, else to the gradients themselves."""
        inv = inv_scale(scale)
        groups: Dict[tuple, list] = {}
        for slot, grad in slots_and_grads:
            if slot.copy_is_current(grad):
                grad = self.settle(slot, grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in groups.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            amp_unscale_(grads, found, inv.to(device))

    def send_back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.back(dst, src)

    def mark_back(self, params: List[torch.Tensor]) -> None:
        self._back_events.extend(self.copies.mark(params))

    def back_events(self) -> list:
        """Events after the copies back started so far (the host buffers they read stay unwritten until then)."""
        return list(self._back_events)

    def wait_back(self) -> None:
        for event in self._back_events:
            event.synchronize()
        self._back_events = []

    def clip(self, params: List[torch.Tensor], slots: List[Optional[Slot]], max_norm: float, norm_type: float,
             error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over `params` (same result); their current host
        copies are scaled on the host by the same factor instead of being copied again."""
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite, foreach)
        # Copies still reading a gradient must finish before it is scaled in place.
        copied = [(p, slot, slot.grad_copy.wait()) for p, slot in zip(params, slots)
                  if slot is not None and slot.copy_is_current(local(p.grad))]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        if copied:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).to("cpu")  # as clip_grads_with_norm_ does
            for p, slot, host in copied:
                host.mul_(coef.to(host.dtype))  # CUDA's foreach mul rounds the factor to the grad dtype
                self.keep(slot, local(p.grad), host)
        return total
