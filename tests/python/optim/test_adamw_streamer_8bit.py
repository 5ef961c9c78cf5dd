"""The GPU-streamed step with 8-bit moments (hipferry._C.AdamWStreamer with scales):
bit for bit the one-call 8-bit step (_C._adamw8bit_step_), over chunks of whole
blocks that wrap the ring, parameters smaller and larger than a chunk, short last
blocks, a float32 master for bf16, amsgrad, and float32 and 8-bit moments in one
call; its argument checks before anything moves; and OffloadAdamW's streamed
engine passing its 8-bit state. Host mode (device -1) runs the same schedule
everywhere; the GPU variant is skipped without a GPU."""
import pytest
import torch

import hipferry  # noqa: F401  (loads hipferry._C)
from hipferry import _C
from hipferry.optim.int8_store import blocks
from conftest import requires_gpu
from offload_adamw_helpers import CpuRemoteOffloadAdamW, make_model

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
SIZES = (2500, 999, 300, 7)
DEVICES = ["host", pytest.param("cuda", marks=requires_gpu)]


def make_state(sizes, dtype, amsgrad, eight_bit, seed=0):
    """Per parameter: param, master, and per moment (codes, scales) or (float32 values, None)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        p = torch.randn(n, generator=g).to(dtype)
        moments = {}
        for key, signed, values in (("m", True, torch.randn(n, generator=g) * 0.1),
                                    ("v", False, torch.rand(n, generator=g) * 0.01),
                                    ("x", False, torch.rand(n, generator=g) * 0.02)):
            if key == "x" and not amsgrad:
                moments[key] = (None, None)
            elif eight_bit[i]:
                codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(blocks(n))
                _C._quantize_blockwise_8bit(values, signed, codes, scales)
                moments[key] = (codes, scales)
            else:
                moments[key] = (values, None)
        out.append({"param": p, "master": p.float() if dtype != torch.float32 else None, **moments})
    return out


def clone(state):
    return [{k: (tuple(None if t is None else t.clone() for t in v) if isinstance(v, tuple)
                 else None if v is None else v.clone()) for k, v in s.items()} for s in state]


def streamer_args(state, where):
    return dict(params=[s["param"].to(where) for s in state], masters=[s["master"] for s in state],
                exp_avgs=[s["m"][0] for s in state], exp_avg_sqs=[s["v"][0] for s in state],
                max_exp_avg_sqs=[s["x"][0] for s in state], exp_avg_absmaxes=[s["m"][1] for s in state],
                exp_avg_sq_absmaxes=[s["v"][1] for s in state], max_exp_avg_sq_absmaxes=[s["x"][1] for s in state])


def reference_step(state, grads, step, amsgrad):
    for s, g in zip(state, grads):
        target = s["master"] if s["master"] is not None else s["param"]
        out = s["param"] if s["master"] is not None else None
        if s["m"][1] is not None:
            _C._adamw8bit_step_(target, g, s["m"][0], s["m"][1], s["v"][0], s["v"][1], s["x"][0], s["x"][1], out,
                                step, amsgrad=amsgrad, maximize=False, **HYPER)
        else:
            _C._adamw_step_(target, g, s["m"][0], s["v"][0], s["x"][0], out, step, amsgrad=amsgrad, maximize=False,
                            **HYPER)


def assert_same(a, b):
    for x, y in zip(a, b):
        for k in x:
            for u, w in zip(x[k] if isinstance(x[k], tuple) else (x[k],), y[k] if isinstance(y[k], tuple) else (y[k],)):
                assert (u is None) == (w is None), k
                if u is not None:
                    assert torch.equal(u.cpu().view(torch.uint8), w.cpu().view(torch.uint8)), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("eight_bit", [(True, True, True, True), (True, False, True, False)])
@pytest.mark.parametrize("chunk,slots", [(512, 2), (256, 3)])
def test_streamed_8bit_step_is_bit_identical_to_the_fused_8bit_step(device, dtype, amsgrad, eight_bit, chunk, slots):
    state = make_state(SIZES, dtype, amsgrad, eight_bit)
    expected = clone(state)
    where = "cpu" if device == "host" else "cuda"
    streamer = _C.AdamWStreamer(-1 if device == "host" else torch.cuda.current_device(), chunk, slots)
    args = streamer_args(state, where)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grads = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
        streamer.step(**args, grads=[x.to(where) for x in grads], step=step, amsgrad=amsgrad, maximize=False,
                      **HYPER)
        reference_step(expected, grads, step, amsgrad)
    streamer.synchronize()
    for s, p in zip(state, args["params"]):
        s["param"] = p.cpu()
    assert_same(state, expected)
    # a slot: the master, then per moment chunk floats, or chunk codes and their scales, each array
    # from a 256-byte boundary; as large as the largest parameter's layout
    master, moments = (chunk * 4 if dtype != torch.float32 else 0), 2 + amsgrad
    in_8bit = master + moments * (chunk + 256 * -(-blocks(chunk) * 4 // 256))
    assert streamer.ring_bytes == slots * (in_8bit if all(eight_bit) else master + moments * chunk * 4)


def test_bad_8bit_arguments_are_refused_before_anything_moves():
    state = make_state(SIZES, torch.float32, False, (True,) * 4)
    before = clone(state)
    grads = [torch.randn(n) for n in SIZES]
    call = dict(grads=grads, step=1, amsgrad=False, maximize=False, **HYPER)
    with pytest.raises(ValueError, match="whole blocks of 256 elements; this streamer's chunk_numel is 1000"):
        _C.AdamWStreamer(-1, 1000, 2).step(**streamer_args(state, "cpu"), **call)
    streamer = _C.AdamWStreamer(-1, 512, 2)
    args = streamer_args(state, "cpu")
    args["exp_avg_sq_absmaxes"][2] = torch.empty(blocks(300) + 1)
    with pytest.raises(ValueError, match=r"exp_avg_sq_absmaxes\[2\] must be a contiguous float32 host tensor "
                                         r"with 2 elements; got torch.float32 on cpu with 3 elements"):
        streamer.step(**args, **call)
    args = streamer_args(state, "cpu")
    args["exp_avg_sq_absmaxes"][1] = None
    with pytest.raises(ValueError, match="parameter 1 has the scales of some of its moments but not all"):
        streamer.step(**args, **call)
    args = streamer_args(state, "cpu")
    args["exp_avg_absmaxes"] = args["exp_avg_absmaxes"][:3]
    with pytest.raises(ValueError, match="one entry per parameter"):
        streamer.step(**args, **call)
    args = streamer_args(state, "cpu")
    args["exp_avgs"][0] = args["exp_avgs"][0].float()
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] must be a contiguous uint8 host tensor"):
        streamer.step(**args, **call)
    assert_same(state, before)
    assert streamer.ring_bytes == 0, "nothing was allocated"


class StreamedOnTheCpu(CpuRemoteOffloadAdamW):
    """The streamed engine on CPU parameters: its streamer in host mode (device -1)."""

    def _choose_engine(self):
        super()._choose_engine()
        self.step_on = "gpu"
        stream = self._streamed._stream
        self._streamed._stream = lambda device, step, items: stream(-1 if device is None else device, step, items)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_offload_adamw_streams_its_8bit_state_as_its_cpu_step_updates_it(amsgrad):
    a, b = make_model(seed=3), make_model(seed=3)
    kw = dict(lr=1e-2, state_dtype=torch.uint8, min_8bit_numel=256, amsgrad=amsgrad, chunk_numel=512)
    plain, streamed = hipferry.optim.OffloadAdamW(a.parameters(), **kw), StreamedOnTheCpu(b.parameters(), **kw)
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model, opt in ((a, plain), (b, streamed)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert streamed._streamed.ring_bytes > 0, "the streamed engine ran"
    formats = {"exp_avg_absmax" in st for st in streamed.state.values()}
    assert formats == {True, False}, "8-bit and float32 moments in one streamed step"
    for (pa, pb) in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        for k, v in plain.state[pa].items():
            assert torch.equal(v, streamed.state[pb][k]), k


@requires_gpu
def test_offload_adamw_on_a_gpu_streams_8bit_state_bit_identical_to_its_cpu_step():
    a, b = make_model("cuda", seed=5), make_model("cuda", seed=5)
    kw = dict(lr=1e-2, state_dtype=torch.uint8, min_8bit_numel=256)
    on_cpu = hipferry.optim.OffloadAdamW(a.parameters(), step_on="cpu", **kw)
    on_gpu = hipferry.optim.OffloadAdamW(b.parameters(), step_on="gpu", **kw)
    assert on_gpu.step_on == "gpu"
    x = torch.randn(16, 24, device="cuda")
    for _ in range(3):
        for model, opt in ((a, on_cpu), (b, on_gpu)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        for k, v in on_cpu.state[pa].items():
            assert torch.equal(v.cpu(), on_gpu.state[pb][k].cpu()), k
