"""Which blocks an offloaded model needs next: the prefetch predictions.

Pure functions of the block order of the last complete model call
(``order``), where the running call stands in it (``pos``) and how many
saved weights of each block backward still holds (``live``). The handle
(layer_offload.py) keeps that state; the ring (layer_ring.py) copies the
first ``prefetch`` blocks of a prediction ahead.
"""
from typing import List, Sequence, Tuple


def forward_future(order: Sequence[int], pos: int, b: int, then_backward: bool) -> Tuple[List[int], int]:
    """Blocks after block ``b`` starts its forward, and the new position.

    ``b`` is looked for at ``pos`` first, then later in ``order``, then
    anywhere (a call that went back); a block not in ``order`` predicts the
    whole order and keeps ``pos``. ``then_backward`` (grad enabled): backward
    follows in reverse order; without grad the next call starts from fresh
    copies, so nothing is predicted past the end."""
    j = pos if pos < len(order) and order[pos] == b else None
    if j is None:
        later = [i for i in range(pos, len(order)) if order[i] == b]
        anywhere = [i for i, x in enumerate(order) if x == b]
        j = later[0] if later else (anywhere[0] if anywhere else None)
    if j is None:
        return list(order), pos
    return list(order[j + 1:]) + (list(reversed(order)) if then_backward else []), j + 1


def backward_future(order: Sequence[int], live: Sequence[int], b: int) -> List[int]:
    """Blocks after block ``b``'s backward: those still holding saved weights
    (``live[x] > 0``), in reverse order from ``b`` on, wrapping around.

    With none (reentrant checkpointing ran forward without grad and recomputes
    blocks in backward), backward still visits the blocks before ``b``."""
    rev = list(reversed(order))
    k = rev.index(b) if b in rev else 0
    waiting = [x for x in rev[k + 1:] + rev[:k] if live[x] > 0 and x != b]
    return waiting if waiting else [x for x in rev[k + 1:] if x != b]


def recompute_future(order: Sequence[int], live: Sequence[int], b: int) -> List[int]:
    """Blocks after block ``b`` is recomputed inside backward (activation
    checkpointing reruns blocks in forward order): the rest of the rerun --
    later blocks still waiting for their backward, or, before any has saved
    weights, simply the next ones -- then backward."""
    j = order.index(b) if b in order else len(order)
    waiting = any(live)
    rest = [x for x in order[j + 1:] if live[x] > 0 or not waiting]
    return rest + backward_future(order, live, b)
