"""The pieces of offload_layers alone: the prefetch predictions (prediction.py,
pure functions of the last call's block order, the position in the running call
and the saved-weight counts) as tables, and a LayerRing built on the CPU without
the handle: its public versions / is_current, and a slot's copy matching the
host weights."""
import pytest
import torch
from torch import nn

from hipferry.module_offload.block_layout import allocate_host_buffers, move_weights_to_host, plan_blocks
from hipferry.module_offload.layer_ring import LayerRing
from hipferry.module_offload.prediction import backward_future, forward_future, recompute_future
from hipferry.torch_private import tensor_version

ORDER = [0, 1, 2, 3]


@pytest.mark.parametrize("order, pos, b, then_backward, future, new_pos", [
    (ORDER, 0, 0, False, [1, 2, 3], 1),                     # in order
    (ORDER, 0, 0, True, [1, 2, 3, 3, 2, 1, 0], 1),          # with grad: backward follows in reverse
    (ORDER, 1, 2, False, [3], 3),                           # block 1 skipped: found later
    (ORDER, 3, 1, False, [2, 3], 2),                        # the call went back: found earlier
    (ORDER, 4, 3, False, [], 4),                            # past the end: found earlier, nothing after it
    (ORDER, 2, 7, False, [0, 1, 2, 3], 2),                  # unknown block: the whole order, position kept
    ([0, 1, 0, 1], 2, 0, False, [1], 3),                    # a block called twice: its second place
    ([0, 1, 0, 1], 1, 0, False, [1], 3),                    # ... the next one after the position
    ([], 0, 0, True, [], 0),
])
def test_forward_future(order, pos, b, then_backward, future, new_pos):
    assert forward_future(order, pos, b, then_backward) == (future, new_pos)


@pytest.mark.parametrize("order, live, b, future", [
    (ORDER, [1, 1, 1, 1], 3, [2, 1, 0]),      # reverse order from b
    (ORDER, [1, 0, 1, 1], 3, [2, 0]),         # only blocks still holding saved weights
    (ORDER, [1, 1, 1, 1], 1, [0, 3, 2]),      # wraps around to later blocks still waiting
    (ORDER, [0, 0, 0, 0], 2, [1, 0]),         # none saved (reentrant checkpointing): the blocks before b
    (ORDER, [0, 0, 1, 0], 2, [1, 0]),         # b's own saved weights do not count
    ([0, 1], [0, 0], 9, [0]),                 # unknown block: from the end of the order
])
def test_backward_future(order, live, b, future):
    assert backward_future(order, live, b) == future


@pytest.mark.parametrize("order, live, b, future", [
    (ORDER, [0, 0, 0, 0], 1, [2, 3, 0]),      # nothing saved yet: the rest of the rerun, then backward
    (ORDER, [0, 0, 1, 1], 1, [2, 3, 3, 2]),   # later blocks waiting for their backward, then backward
    (ORDER, [0, 0, 0, 1], 1, [3, 3]),         # only the waiting ones of the rerun
    (ORDER, [1, 1, 1, 1], 3, [2, 1, 0]),      # the last block: backward only
    (ORDER, [0, 1, 0, 0], 9, [1]),            # unknown block: no rerun left, then backward
])
def test_recompute_future(order, live, b, future):
    assert recompute_future(order, live, b) == future


def test_predictions_do_not_change_their_arguments():
    order, live = [0, 1, 2], [1, 0, 1]
    forward_future(order, 0, 1, True)
    backward_future(order, live, 2)
    recompute_future(order, live, 0)
    assert (order, live) == ([0, 1, 2], [1, 0, 1])


# ------------------------------------------------------------------ the ring alone
@pytest.fixture
def ring(pool):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    blocks, shared = plan_blocks(model, list(model), None)
    assert len(blocks) == 3 and shared == []
    allocate_host_buffers(blocks, pool)
    move_weights_to_host(blocks)
    r = LayerRing(blocks, 2, torch.device("cpu"))
    yield r
    r.close()


def test_a_slot_holds_the_host_weights_and_stays_current_until_they_change(ring):
    slot = ring.acquire(1, [2, 0], prefetch=1, pin=False)
    ring.synchronize()
    weights = [e.param for e in ring.blocks[1].entries]
    assert all(torch.equal(t, p) for t, p in zip(ring.tensors(1, slot), weights))
    assert slot.block == 1 and ring.is_current(slot)
    assert ring.versions(1) == tuple(tensor_version(p) for p in weights)
    assert ring.stats.misses == 1 and ring.stats.prefetches == 1  # block 2 copied ahead into the other slot
    before = ring.versions(1)
    with torch.no_grad():
        weights[0].add_(1)  # an in-place write (an optimizer step) bumps the version
    assert ring.versions(1) != before and not ring.is_current(slot)
    again = ring.acquire(1, [], prefetch=0, pin=False)
    ring.synchronize()
    assert ring.stats.misses == 2 and ring.is_current(again)  # copied again, with the new values
    assert torch.equal(ring.tensors(1, again)[0], weights[0])


def test_invalidate_makes_every_slot_stale(ring):
    slot = ring.acquire(0, [1], prefetch=1, pin=False)
    ring.synchronize()
    assert ring.is_current(slot)
    ring.invalidate()
    assert not ring.is_current(slot)
    assert not any(ring.is_current(s) for s in ring.slots)
    ring.acquire(0, [], prefetch=0, pin=False)
    assert ring.stats.reused == 0 and ring.stats.misses == 2
