"""Entering one offload_activations() object again inside itself (issue 33, 7a):
`with c: with c:` nests like a counter -- every saved tensor is looked at once,
by the innermost entry, and what it keeps goes to the hooks outside the first
entry, never back to the context itself (that recursed without end) -- and a
context entered again inside another context's hooks passes to those. Gradients
stay bit-identical to the step without the context, and every exit leaves the
saved-tensor hooks as they were before the matching entry."""
import pytest
import torch

import hipferry
from hipferry.torch_private import current_saved_tensors_hooks
from offload_module_helpers import DEVICES, assert_same_grads, assert_same_outputs, loss_of, make_mlp, \
    model_and_reference, train_step

MIN_BYTES = 8192  # BIG's activations are 16 KiB and 32 KiB: offloaded; smaller ones kept
BIG = dict(d=64, hidden=(128,) * 4, n_in=32, batch=64)


def step_under(contexts, model, x):
    """Forward under the contexts entered in order (innermost last), backward after; returns the output."""
    def enter(i):
        if i == len(contexts):
            return model(x)
        with contexts[i]:
            out = enter(i + 1)
            assert current_saved_tensors_hooks() is not None
        return out
    out = enter(0)
    loss_of(out).backward()
    return out.detach()


def counts(ctx):
    s = ctx.stats()
    return {k: s[k] for k in ("offloaded_tensors", "offloaded_bytes", "deduplicated", "kept_small",
                              "kept_params", "kept_other")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth", [2, 3])
def test_the_same_context_entered_again_nests_like_a_counter(device, depth, pool):
    model, ref = model_and_reference(make_mlp, device, **BIG)
    once, _ = model_and_reference(make_mlp, device, **BIG)
    x = model.example(0, device)
    ctx = hipferry.offload_activations(min_bytes=MIN_BYTES, pool=pool)
    out = step_under([ctx] * depth, model, x)
    assert current_saved_tensors_hooks() is None, "every exit pops what its entry pushed"
    assert_same_outputs(out, train_step(ref, x))
    assert_same_grads(model, ref)
    single = hipferry.offload_activations(min_bytes=MIN_BYTES, pool=pool)
    step_under([single], once, x)
    # Each saved tensor was looked at once: the same counts as one entry.
    assert counts(ctx) == counts(single) and counts(ctx)["offloaded_tensors"] > 0, (counts(ctx), counts(single))


def test_the_outer_entry_goes_on_after_the_inner_one_exits(pool):
    model, ref = model_and_reference(make_mlp, "cpu", **BIG)
    x = model.example(0)
    ctx = hipferry.offload_activations(min_bytes=MIN_BYTES, pool=pool)
    with ctx:
        with ctx:
            first = model(x)
        inner = ctx.stats()["offloaded_tensors"]
        top = current_saved_tensors_hooks()
        assert top is not None and top[0] is ctx.pack_hook, "the outer entry's hooks are in effect again"
        second = model(x)  # under the outer entry only
        assert ctx.stats()["offloaded_tensors"] > inner > 0
    (loss_of(first) + loss_of(second)).backward()
    ref_first, ref_second = ref(x), ref(x)
    (loss_of(ref_first) + loss_of(ref_second)).backward()
    assert_same_outputs(second.detach(), ref_second.detach())
    assert_same_grads(model, ref)


@pytest.mark.parametrize("between", ["offload_activations", "save_on_cpu"])
def test_entered_again_inside_other_hooks(between, pool):
    """c, then other hooks, then c again: the inner c passes what it keeps to
    the other hooks (which may pass it to the outer c, whose own outer is none)."""
    model, ref = model_and_reference(make_mlp, "cpu", **BIG)
    x = model.example(0)
    ctx = hipferry.offload_activations(min_bytes=MIN_BYTES, pool=pool)
    other = (hipferry.offload_activations(min_bytes=1 << 30, pool=pool) if between == "offload_activations"
             else torch.autograd.graph.save_on_cpu())
    out = step_under([ctx, other, ctx], model, x)
    assert current_saved_tensors_hooks() is None
    assert_same_outputs(out, train_step(ref, x))
    assert_same_grads(model, ref)
    assert ctx.stats()["offloaded_tensors"] > 0
    if between == "offload_activations":
        passed = sum(v for k, v in other.stats().items() if k.startswith("kept"))
        assert passed > 0, "the inner c passes what it keeps (parameters) on to the hooks it entered inside"
