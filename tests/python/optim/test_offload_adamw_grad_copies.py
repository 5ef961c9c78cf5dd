"""The CPU engine's gradient copies for parameters that live elsewhere than
their state (GPU parameters; on the CPU through the `cpu-remote` test seam):
a copy started by the backward hook is used by step() when the gradient is
unchanged since, and made again when it changed (accumulation, torch's
clip_grad_norm_, an in-place edit, GradScaler.unscale_); OffloadAdamW's own
clip_grad_norm_ keeps the copies. Every case also matches torch.optim.AdamW
(SideBySide), so a stale copy would show in the parameters."""
import pytest
import torch

from conftest import requires_gpu
from offload_adamw_helpers import (SideBySide, assert_close_to_torch, backward, copy_grads, loss_of, make_model,
                                   offload_adamw)

REMOTE = [pytest.param(("cpu", "cpu-remote"), id="cpu-remote"),
          pytest.param(("cuda", "cpu"), id="cuda-cpu", marks=requires_gpu)]
NUM_OFFLOADED = 2  # TinyNet's two Linear weights are above MIN_OFFLOAD; on a GPU the rest step on the device


def offloaded(run):
    """How many parameters go through the host step (all of them for CPU parameters)."""
    return NUM_OFFLOADED if run.params[0].is_cuda else len(run.params)


def counters(opt):
    return opt.grad_copies_reused, opt.grad_copies_made_at_step


@pytest.mark.parametrize("engine", REMOTE)
@pytest.mark.parametrize("accumulate", [1, 3])
def test_copies_from_backward_are_used_when_the_gradient_did_not_change(engine, accumulate):
    run = SideBySide.create(engine)
    run.run(4, accumulate=accumulate)
    n = offloaded(run)
    assert counters(run.opt) == (4 * n, 0), "every step used the hooks' copies (the last micro-batch's)"


@pytest.mark.parametrize("engine", REMOTE)
def test_torch_clip_grad_norm_changes_gradients_so_they_are_copied_again(engine):
    run = SideBySide.create(engine)
    run.run(3, clip=1e-3)  # small enough to clip every step
    assert all(n > m for n, m in zip([float(x) for x in run.norms], [1e-3] * 3))
    assert counters(run.opt) == (0, 3 * offloaded(run))


@pytest.mark.parametrize("engine", REMOTE)
def test_the_optimizers_clip_grad_norm_scales_the_copies_instead(engine):
    run = SideBySide.create(engine)
    run.run(3, clip=1e-3, clip_with_optimizer=True)
    assert [float(a) for a in run.norms] == pytest.approx([float(b) for b in run.ref_norms], rel=1e-6)
    assert counters(run.opt) == (3 * offloaded(run), 0)


@pytest.mark.parametrize("engine", REMOTE)
def test_a_gradient_edited_in_place_after_backward_is_copied_again(engine):
    run = SideBySide.create(engine)

    def edit(step):
        with torch.no_grad():
            run.model.fc1.weight.grad.mul_(3.0)
    run.run(2, before_step=edit)  # the reference gets the edited gradients (copy_grads comes after)
    assert counters(run.opt) == (2 * (offloaded(run) - 1), 2)


@pytest.mark.parametrize("engine", REMOTE)
def test_zero_grad_drops_the_copies(engine):
    run = SideBySide.create(engine)
    backward(run.model, 0)
    assert any(s.grad_copy is not None for s in run.opt._slots.values())
    run.opt.zero_grad()
    assert all(s.grad_copy is None for s in run.opt._slots.values())


@pytest.mark.parametrize("engine", REMOTE)
@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_uses_the_copies_or_copies_again_after_unscale(engine, unscale_first):
    run = SideBySide.create(engine)
    device = engine[0]
    scaler, ref_scaler = grad_scaler_for(device), grad_scaler_for(device)
    for step in range(3):
        run.opt.zero_grad()
        run.ref.zero_grad()
        scaler.scale(loss_of(run.model, step)).backward()
        ref_scaler.scale(loss_of(run.ref_model, step)).backward()
        copy_grads(run.params, run.ref_params)
        if unscale_first:  # e.g. to clip: unscale_ rewrites the gradients in place, with no version bump
            scaler.unscale_(run.opt)
            ref_scaler.unscale_(run.ref)
        scaler.step(run.opt)
        ref_scaler.step(run.ref)
        scaler.update()
        ref_scaler.update()
        assert_close_to_torch(run.params, run.ref_params, f"parameters after step {step}")
    n = offloaded(run)
    assert counters(run.opt) == ((0, 3 * n) if unscale_first else (3 * n, 0))


def grad_scaler_for(device):
    return torch.amp.GradScaler(device, init_scale=2.0**12)


def test_hooks_do_not_keep_a_dropped_optimizer_alive():
    import gc
    import weakref
    model = make_model()
    opt = offload_adamw(list(model.parameters()), "cpu-remote")
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    backward(model, 0)  # the removed hooks start no copies and raise nothing
    assert all(p.grad is not None for p in model.parameters())
