"""hipferry._C.AdamWStreamer, the GPU-streamed step of OffloadAdamW, against the
one-call fused step (_C._adamw_step_): bit for bit, over chunks that wrap the
ring many times, parameters smaller and larger than a chunk, a float32 master
for bfloat16/float16 parameters, amsgrad and maximize; its argument checks.

The schedule (chunks, ring slots, which state array goes where) is the same
code in host mode (device -1: synchronous, a CPU ring, the CPU loop), which
runs everywhere; the GPU variant (streams, events, the kernel) is skipped
without a GPU."""
import pytest
import torch

import hipferry  # noqa: F401  (loads hipferry._C)
from hipferry import _C
from conftest import requires_gpu

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
SIZES = (2500, 999, 1000, 7, 1)  # chunk 1000: several chunks, exact and partial, tiny
DEVICES = ["host", pytest.param("cuda", marks=requires_gpu)]


def make_state(sizes, dtype, amsgrad, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    master = [p.float() for p in params] if dtype != torch.float32 else [None] * len(sizes)
    m = [torch.randn(n, generator=g) * 0.1 for n in sizes]
    v = [torch.rand(n, generator=g) * 0.01 for n in sizes]
    mx = [x.clone() * 1.5 for x in v] if amsgrad else [None] * len(sizes)
    return params, master, m, v, mx


def clone_all(lists):
    return [[None if t is None else t.clone() for t in ts] for ts in lists]


def run_streamer(device, params, grads, master, m, v, mx, steps, amsgrad, maximize, chunk=1000, slots=2):
    index = -1 if device == "host" else torch.cuda.current_device()
    streamer = _C.AdamWStreamer(index, chunk, slots)
    where = "cpu" if device == "host" else "cuda"
    dev_params = [p.to(where) for p in params]
    for step in range(1, steps + 1):
        dev_grads = [g[step - 1].to(where) for g in grads]
        streamer.step(dev_params, dev_grads, master, m, v, mx, step, amsgrad=amsgrad, maximize=maximize, **HYPER)
    streamer.synchronize()
    return [p.cpu() for p in dev_params], streamer


def run_reference(params, grads, master, m, v, mx, steps, amsgrad, maximize):
    for step in range(1, steps + 1):
        for i, p in enumerate(params):
            full = master[i] if master[i] is not None else p
            _C._adamw_step_(full, grads[i][step - 1], m[i], v[i], mx[i], p if master[i] is not None else None,
                            step, amsgrad=amsgrad, maximize=maximize, **HYPER)
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True)])
def test_streamed_step_is_bit_identical_to_the_fused_step(device, dtype, amsgrad, maximize):
    steps = 4
    state = make_state(SIZES, dtype, amsgrad)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(n, generator=g).to(dtype) for _ in range(steps)] for n in SIZES]
    ref = clone_all(state)
    mine = clone_all(state)
    ref_params = run_reference(*ref[:1], grads, *ref[1:], steps, amsgrad, maximize)
    got, streamer = run_streamer(device, mine[0], grads, *mine[1:], steps, amsgrad, maximize)
    for a, b in zip(got, ref_params):
        assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           b.view(torch.int16 if dtype != torch.float32 else torch.int32))
    for name, k in (("master", 1), ("exp_avg", 2), ("exp_avg_sq", 3), ("max_exp_avg_sq", 4)):
        for a, b in zip(mine[k], ref[k]):
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), f"{name} differs"
    assert mine[2][0].ne(state[2][0]).any(), "the state was written back"
    arrays = 2 + (dtype != torch.float32) + amsgrad
    # slots x arrays x chunk floats, each array from a 256-byte boundary: the ring only
    assert streamer.ring_bytes == 2 * arrays * 4096


def test_host_mode_ring_grows_when_a_master_arrives_later():
    streamer = _C.AdamWStreamer(-1, 64, 3)
    p32, g32 = torch.randn(100), torch.randn(100)
    m, v = torch.zeros(100), torch.zeros(100)
    streamer.step([p32], [g32], [None], [m], [v], [None], 1, amsgrad=False, maximize=False, **HYPER)
    assert streamer.ring_bytes == 3 * 2 * 64 * 4
    pb = torch.randn(100).bfloat16()
    master = pb.float()
    streamer.step([pb], [g32.bfloat16()], [master], [m.clone()], [v.clone()], [None], 1, amsgrad=False,
                  maximize=False, **HYPER)
    assert streamer.ring_bytes == 3 * 3 * 64 * 4
    assert torch.equal(pb, master.bfloat16()), "the bf16 parameter is the rounded master"


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="chunk_numel must be >= 1"):
        _C.AdamWStreamer(-1, 0, 2)
    with pytest.raises(ValueError, match="slots must be >= 2"):
        _C.AdamWStreamer(-1, 10, 1)
    with pytest.raises(ValueError, match="device must be a GPU index or -1"):
        _C.AdamWStreamer(-2, 10, 2)


def step_args(n=10, dtype=torch.float32, master=None, amsgrad=False):
    p = torch.randn(n).to(dtype)
    return dict(params=[p], grads=[torch.randn(n)], masters=[master], exp_avgs=[torch.zeros(n)],
                exp_avg_sqs=[torch.zeros(n)], max_exp_avg_sqs=[torch.zeros(n) if amsgrad else None])


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(grads=[]), "one entry per parameter"),
    (lambda a: a.update(params=[torch.randn(10, dtype=torch.float64)]), r"params\[0\] has dtype torch.float64"),
    (lambda a: a.update(params=[torch.randn(10).bfloat16()]),
     r"params\[0\] is torch.bfloat16 and needs a float32 master"),
    (lambda a: a.update(masters=[torch.zeros(10)]), r"params\[0\] is torch.float32 and must not have"),
    (lambda a: a.update(exp_avgs=[torch.zeros(9)]), r"exp_avgs\[0\] must be a contiguous float32 host tensor"),
    (lambda a: a.update(exp_avg_sqs=[torch.zeros(10, dtype=torch.float16)]), r"exp_avg_sqs\[0\]"),
    (lambda a: a.update(grads=[torch.randn(11)]), r"grads\[0\] must be a contiguous float tensor"),
    (lambda a: a.update(params=[torch.randn(20)[::2]]), r"params\[0\] must be a contiguous tensor on the CPU"),
    (lambda a: a.update(max_exp_avg_sqs=[torch.zeros(10)]), r"max_exp_avg_sqs\[0\] must be None without"),
])
def test_step_arguments_are_checked_before_anything_changes(change, match):
    streamer = _C.AdamWStreamer(-1, 4, 2)
    args = step_args()
    change(args)
    before = [t.clone() for ts in args.values() for t in ts if t is not None]
    with pytest.raises(ValueError, match=match):
        streamer.step(**args, step=1, amsgrad=False, maximize=False, **HYPER)
    after = [t for ts in args.values() for t in ts if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert streamer.ring_bytes == 0


def test_amsgrad_needs_its_state_and_step_counts_from_one():
    streamer = _C.AdamWStreamer(-1, 4, 2)
    with pytest.raises(ValueError, match="is needed with amsgrad"):
        streamer.step(**step_args(), step=1, amsgrad=True, maximize=False, **HYPER)
    with pytest.raises(ValueError, match="step must be >= 1"):
        streamer.step(**step_args(), step=0, amsgrad=False, maximize=False, **HYPER)


@requires_gpu
def test_gpu_streamer_rejects_host_parameters():
    streamer = _C.AdamWStreamer(torch.cuda.current_device(), 4, 2)
    with pytest.raises(ValueError, match="must be a contiguous tensor on cuda"):
        streamer.step(**step_args(), step=1, amsgrad=False, maximize=False, **HYPER)


@pytest.mark.parametrize("device", DEVICES)
def test_streamed_chunks_show_on_the_trace(device):
    """Every chunk's copies in, its kernel and its copies out are spans of the
    timeline, on the streamer's tracks, with the bytes they moved."""
    sizes = (2500, 7)  # chunk 1000: 3 + 1 chunks
    params, master, m, v, mx = make_state(sizes, torch.float32, amsgrad=False)
    grads = [[torch.randn(n)] for n in sizes]  # per parameter, per step
    with hipferry.trace() as tr:
        run_streamer(device, params, grads, master, m, v, mx, steps=1, amsgrad=False, maximize=False)
    names = [e["name"] for e in tr.events]
    chunks = 4
    assert names.count("adamw chunk") == chunks, names
    assert names.count("adamw state in") == 2 * chunks, "exp_avg and exp_avg_sq per chunk"
    assert names.count("adamw state out") == 2 * chunks
    kernels = [e for e in tr.events if e["name"] == "adamw chunk"]
    assert all(e["category"] == "kernel" for e in kernels)
    ins = [e for e in tr.events if e["name"] == "adamw state in"]
    assert sum(e["bytes"] for e in ins) == 2 * 4 * sum(sizes), "every state byte copied in once"
    tracks = {e["track"] for e in tr.events if e["name"].startswith("adamw")}
    assert any("state in" in t for t in tracks) and any("state out" in t for t in tracks), tracks
