"""offload_layers under the code that real training scripts run around a model
(without Hugging Face; test_hf_models.py runs the same cases on
transformers/peft models): checkpointing that recomputes a block's class
forward without calling the module, optimizer steps that bump no version,
calls through inner modules, model.to(), copy.deepcopy, state_dict dtype,
meta parameters and accelerate hooks. Every result is compared bitwise with
the same model without offload on the same device."""
import copy
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hipferry
from hipferry.torch_private import in_backward
from offload_module_helpers import (DEVICES, MLPBlock, MLPNet, assert_same_grads, assert_same_outputs,
                                    assert_same_params, loss_of, model_and_reference)


class SelfCheckpointingBlock(MLPBlock):
    """Checkpoints its own class forward inside its call, as transformers 5's
    GradientCheckpointingLayer does: the recompute in backward runs
    ``MLPBlock.forward(self, x)`` without going through ``nn.Module.__call__``."""

    reentrant = False

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            return checkpoint(partial(MLPBlock.forward, self), x, use_reentrant=self.reentrant)
        return MLPBlock.forward(self, x)


def make_self_checkpointing(reentrant, **kw):
    SelfCheckpointingBlock.reentrant = reentrant
    return MLPNet(block=lambda h: SelfCheckpointingBlock(16, h), **kw)


class LinearReads:
    """Counts, during backward, the weights F.linear reads: host parameters of
    offloaded blocks vs anything else (ring tensors)."""

    def __init__(self, model):
        self.host = {id(p) for n, p in model.named_parameters() if n.startswith("blocks.")}
        self.host_ptrs = {p.untyped_storage().data_ptr() for n, p in model.named_parameters()
                          if n.startswith("blocks.")}
        self.ring = self.from_host = 0
        self.handles = [m.register_forward_pre_hook(self._pre) for m in model.modules() if isinstance(m, nn.Linear)]

    def _pre(self, module, args):
        if in_backward():
            w = module.weight
            if id(w) in self.host or w.untyped_storage().data_ptr() in self.host_ptrs:
                self.from_host += 1
            else:
                self.ring += 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_of_the_class_forward_recomputes_from_ring_weights(device, reentrant):
    model, ref = model_and_reference(partial(make_self_checkpointing, reentrant), device)
    hipferry.offload_layers(model, device=device)
    reads = LinearReads(model)
    for step in range(2):
        x = model.example(step, device).requires_grad_(reentrant)  # reentrant: an input that requires grad
        model.zero_grad(), ref.zero_grad()
        loss_of(model(x)).backward()
        loss_of(ref(x)).backward()
        assert_same_grads(model, ref)
    assert reads.ring == 2 * 2 * 4 and reads.from_host == 0, (reads.ring, reads.from_host)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_of_the_class_forward_with_a_host_dtype(device):
    # The host keeps bfloat16, forward computes in float32: a recompute from the
    # host parameters fails ("expected m1 and m2 to have the same dtype").
    model, ref = model_and_reference(partial(make_self_checkpointing, False), device)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.startswith("blocks."):
                p.copy_(p.bfloat16().float())
    hipferry.offload_layers(model, device=device, dtype=torch.bfloat16)
    x = model.example(0, device)
    loss_of(model(x)).backward()
    loss_of(ref(x)).backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.blocks.parameters())
    assert_same_grads(model, ref, cast=True)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for_loop"])
@pytest.mark.parametrize("through", ["model", "inner"])
def test_optimizer_steps_that_bump_no_version(through, fused):
    # torch's fused AdamW writes the parameters without bumping their versions;
    # every model call -- also one through an inner module -- uses fresh copies.
    model, ref = model_and_reference(make_self_checkpointing, "cpu", reentrant=False)
    model.eval(), ref.eval()  # (no checkpointing: forward saves weights the normal way)
    hipferry.offload_layers(model, device="cpu", prefetch=10)  # a ring holding every block
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, fused=fused, foreach=False if not fused else None)
            for m in (model, ref)]

    def run(m, x):
        if through == "model":
            return m(x)
        h = m.inp(x)
        for blk in m.blocks:  # calls of the blocks alone, not through the model
            h = blk(h)
        return m.head(h)
    for step in range(3):
        x = model.example(step)
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            loss_of(run(m, x)).backward()
            opt.step()
        assert_same_params(model, ref, f"after step {step}")


def test_data_write_between_calls_as_peft_merges():
    model, ref = model_and_reference(MLPNet, "cpu")
    hipferry.offload_layers(model, device="cpu", prefetch=10)
    x = model.example(0)
    with torch.no_grad():
        model(x)
        for m in (model, ref):
            m.blocks[2].fc1.weight.data += 1.0  # what PEFT's merge_adapter does
        assert_same_outputs(model(x), ref(x), "after a .data write")
        assert_same_outputs(model.blocks[2](x.new_ones(4, 16)), ref.blocks[2](x.new_ones(4, 16)), "block alone")


# ------------------------------------------------------------------ model.to()
@pytest.mark.parametrize("device", DEVICES)
def test_moving_the_model_to_its_device_keeps_the_blocks_on_the_host(device):
    model, ref = model_and_reference(MLPNet, device)
    handle = hipferry.offload_layers(model, device=device)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert model.to(handle.device) is model
    model.to(device=device, dtype=torch.float32)
    model.float()
    if handle.device.type == "cuda":
        model.cuda()
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert all(p.device.type == "cpu" for p in model.blocks.parameters())
    x = model.example(0, device)
    loss_of(model(x)).backward()
    loss_of(ref(x)).backward()
    assert_same_grads(model, ref)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.to("meta"),
                                     lambda m: m.blocks[1].to(torch.bfloat16), lambda m: m.blocks.double()],
                         ids=["float64", "half", "meta", "one_block", "inner_list"])
def test_conversions_the_ring_cannot_follow_are_rejected_before_any_change(convert):
    model, ref = model_and_reference(MLPNet, "cpu")
    handle = hipferry.offload_layers(model, device="cpu")
    before = {n: (p, p.dtype, p.device, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"offloaded weight 'blocks\.\d\.fc\d\.\w+'.*nothing was changed.*undo\(\)"):
        convert(model)
    for n, p in model.named_parameters():
        obj, dtype, dev, value = before[n]
        assert p is obj and p.dtype == dtype and p.device == dev and torch.equal(p.detach(), value), n
    x = model.example(0)
    with torch.no_grad():
        assert_same_outputs(model(x), ref(x))
    handle.undo()
    model.to(torch.float64)  # the hooks are gone with undo()
    assert all(p.dtype == torch.float64 for p in model.parameters())


# ------------------------------------------------------------------ copy.deepcopy
@pytest.mark.parametrize("host_dtype", [None, torch.bfloat16], ids=["same_dtype", "bf16_host"])
@pytest.mark.parametrize("device", DEVICES)
def test_deepcopy_is_an_independent_offloaded_model(device, host_dtype):
    model, _ = model_and_reference(MLPNet, device)
    handle = hipferry.offload_layers(model, device=device, dtype=host_dtype)
    x = model.example(0, device)
    twin = copy.deepcopy(model)
    twin_handle = hipferry.LayerOffload.of(twin)
    assert hipferry.LayerOffload.of(model) is handle and twin_handle is not None and twin_handle is not handle
    assert twin_handle.block_names == handle.block_names and twin_handle.dtype == host_dtype
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert p is not q and p.dtype == q.dtype and p.device == q.device and torch.equal(p.cpu(), q.cpu()), n
        assert p.data_ptr() != q.data_ptr(), n
    with torch.no_grad():
        before = twin(x)
        assert_same_outputs(before, model(x), "the copy's output")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_of(model(x)).backward()
    opt.step()
    with torch.no_grad():
        assert_same_outputs(twin(x), before, "the copy after a step of the original")
        assert not torch.equal(model(x), before)
    assert twin_handle.stats()["fetches"] > 0
    twin_handle.undo()  # the copy's weights come back as plain parameters
    assert all(p.dtype == torch.float32 for p in twin.parameters())
    with torch.no_grad():
        assert_same_outputs(twin(x).cpu(), before.cpu(), "the copy after its undo()")


def test_deepcopy_of_a_block_alone_is_a_plain_module():
    model, ref = model_and_reference(MLPNet, "cpu")
    handle = hipferry.offload_layers(model, device="cpu", dtype=torch.bfloat16)
    blk = copy.deepcopy(model.blocks[1])
    assert hipferry.LayerOffload.of(blk) is None and not blk._forward_pre_hooks and not blk._forward_hooks
    assert all(p.dtype == torch.float32 for p in blk.parameters())
    h = torch.randn(4, 16)
    with torch.no_grad():
        assert_same_outputs(blk(h), model.blocks[1](h), "the copied block")
    assert hipferry.LayerOffload.of(model.blocks[1]) is handle


# ------------------------------------------------------------------ state_dict
def test_state_dict_keeps_the_model_dtype_with_a_host_dtype():
    model, _ = model_and_reference(MLPNet, "cpu")
    hipferry.offload_layers(model, device="cpu", dtype=torch.bfloat16)
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values()), {k: v.dtype for k, v in sd.items()}
    assert torch.equal(sd["blocks.0.fc1.weight"], model.blocks[0].fc1.weight.detach().float())
    inner = model.blocks.state_dict()
    assert inner["0.fc1.weight"].dtype == torch.float32
    assert model.state_dict(keep_vars=True)["blocks.0.fc1.weight"] is model.blocks[0].fc1.weight
    fresh = MLPNet()
    fresh.load_state_dict(sd)
    x = model.example(0)
    with torch.no_grad():
        assert_same_outputs(fresh(x), model(x), "a model loaded from the state dict")


# ------------------------------------------------------------------ what cannot be offloaded
def test_meta_parameters_are_rejected_with_what_to_do():
    with torch.device("meta"):
        model = MLPNet()
    with pytest.raises(ValueError, match=r"parameter 'inp\.weight' is on the meta device.*Load the real weights"):
        hipferry.offload_layers(model, device="cpu")
    assert all(p.is_meta for p in model.parameters()) and not model.blocks[0]._forward_pre_hooks


def test_accelerate_hooks_are_rejected_with_how_to_remove_them():
    hooks = pytest.importorskip("accelerate.hooks")
    model = MLPNet()
    hooks.add_hook_to_module(model.blocks[0], hooks.ModelHook())
    with pytest.raises(ValueError, match=r"'blocks\.0' has accelerate hooks.*remove_hook_from_module"):
        hipferry.offload_layers(model, device="cpu")
    hooks.remove_hook_from_module(model, recurse=True)
    hipferry.offload_layers(model, device="cpu").undo()


def test_torch_compile_runs_the_blocks_from_the_ring():
    # hipferry's hooks run eagerly (torch.compiler.disable): one graph break at each
    # block call; the loop around the blocks then runs eagerly, and the blocks'
    # forward compiles ONCE for all ten blocks (more than dynamo's recompile limit
    # of 8): a recompile per block would raise here (error_on_recompile).
    from torch._dynamo.utils import counters
    model, ref = model_and_reference(MLPNet, "cpu", hidden=(32,) * 10)
    handle = hipferry.offload_layers(model, device="cpu")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            x = model.example(step)
            model.zero_grad(), ref.zero_grad()
            out = compiled(x)
            loss_of(out).backward()
            ref_out = ref(x)
            loss_of(ref_out).backward()
            torch.testing.assert_close(out, ref_out)
            for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
                torch.testing.assert_close(p.grad, r.grad, msg=n)
    breaks = sum(counters["graph_break"].values())
    assert breaks <= len(handle.blocks), dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1, dict(counters["stats"])
    assert handle.stats()["fetches"] >= 2 * 10
    torch._dynamo.reset()


def test_a_parameter_added_to_a_block_after_offload_is_named():
    # PEFT's get_peft_model on an offloaded model adds adapters inside the blocks;
    # on another device than the ring's they cannot run: the error says what to do.
    model, ref = model_and_reference(MLPNet, "cpu")
    hipferry.offload_layers(model, device="cpu")
    model.blocks[2].fc1.extra = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"block 'blocks\.2' has a parameter 'fc1\.extra' on meta that was added "
                                           r"after offload_layers.*undo\(\)"):
        model(model.example(0))
    del model.blocks[2].fc1.extra
    x = model.example(0)
    with torch.no_grad():
        assert_same_outputs(model(x), ref(x), "after removing it")


@pytest.mark.parametrize("how", ["dropped", "raises"])
def test_forwards_without_backward_keep_nothing_alive(how):
    # A training forward whose graph is dropped (or that raises inside a block):
    # nothing of it stays -- no reference cycle through autograd nodes, no pool bytes.
    from offload_module_helpers import pool_in_use
    import gc
    model, _ = model_and_reference(MLPNet, "cpu")
    with hipferry.PinnedPool(capacity="64MiB") as pool:
        handle = hipferry.offload_layers(model, device="cpu", pool=pool)
        marks = {}
        for i in range(1, 121):
            x = model.example(i % 3)
            if how == "raises":
                with pytest.raises(RuntimeError):
                    model.blocks[1](torch.zeros(2, 3, 5))  # wrong width: fails inside the block
            loss_of(model(x))  # the graph goes with the loss
            if i in (20, 120):
                gc.collect()
                marks[i] = (len(gc.get_objects()), pool_in_use(pool))
        assert marks[120][1] == marks[20][1], marks
        assert marks[120][0] - marks[20][0] < 500, marks
        assert not handle._runs and not handle._backward
        handle.undo()


def test_a_block_call_whose_pre_hook_fails_leaves_no_model_call_open():
    # A block called alone is a model call of its own; if taking its ring slot fails,
    # that call must not stay open -- later calls would then never refresh their copies.
    model, ref = model_and_reference(MLPNet, "cpu")
    handle = hipferry.offload_layers(model, device="cpu", prefetch=10)  # a ring holding every block
    x = model.example(0)
    with torch.no_grad():
        model(x)
        params = dict(model.named_parameters())
        real = handle.ring.acquire

        def failing(*args, **kwargs):
            raise RuntimeError("no slot")
        handle.ring.acquire = failing
        with pytest.raises(RuntimeError, match="no slot"):
            model.blocks[0](x.new_ones(4, 16))
        handle.ring.acquire = real
        assert all(p is params[n] for n, p in model.named_parameters())
        model(x)  # copies every block again: they stay resident
        for m in (model, ref):
            m.blocks[0].fc1.weight.data.mul_(-2.0)  # no version bump: only a fresh model call sees it
        assert_same_outputs(model(x), ref(x), "after the failed call and a .data write")
