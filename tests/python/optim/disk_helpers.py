"""Shared by the disk state store tests: small models whose state spans several
chunks, gradients that depend only on (step, parameter), and comparisons that
hipferry owns on both sides (the disk step runs the same fused loop as the
in-memory one, so they agree bit for bit)."""
from typing import Dict, List

import torch

from hipferry.optim import DiskOptions, OffloadAdamW

CHUNK = 1 << 18  # the smallest chunk: parameters below span several, the last one partial


def make_params(seed: int = 0, dtypes=(torch.float32, torch.bfloat16)) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(600_000,), (300, 700), (4097,), (17,), (2, 3, 5)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        out.append(torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)))
    out.append(torch.nn.Parameter(torch.randn(40, 50, generator=g).t()))  # strides not contiguous: memory order
    return out


def set_grads(params: List[torch.Tensor], step: int) -> None:
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * step + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        if p.grad.dim() == 2 and p.stride() != p.grad.stride():
            p.grad = p.grad.t().contiguous().t()


def disk_opt(params, folder, **kw) -> OffloadAdamW:
    opts = kw.pop("disk", None) or DiskOptions(chunk_numel=CHUNK, window_bytes=8 * 16 * CHUNK)
    return OffloadAdamW(params, lr=1e-2, weight_decay=0.1, state_dir=str(folder), disk=opts, **kw)


def ram_opt(params, **kw) -> OffloadAdamW:
    return OffloadAdamW(params, lr=1e-2, weight_decay=0.1, **kw)


def train(opt, params, steps: range) -> None:
    for k in steps:
        set_grads(params, k)
        opt.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8) if t.element_size() == 1 \
        else t.view(torch.int32)


def assert_same_params(a: List[torch.Tensor], b: List[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(bits(x), bits(y)), f"parameter {i} differs"


def state_tensors(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    sd = opt.state_dict()["state"]
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd.items()}


def assert_same_state(a: dict, b: dict, keys=None) -> None:
    assert a.keys() == b.keys()
    for i in a:
        names = set(a[i]) & set(b[i]) if keys is None else keys
        for k in names:
            if k == "step":
                assert float(a[i][k]) == float(b[i][k]), (i, k)
            else:
                assert torch.equal(bits(a[i][k]), bits(b[i][k])), f"state {i} {k} differs"


def digest(params, opt) -> str:
    """A hash of every parameter's bits and every state tensor's bits (crash test)."""
    import hashlib
    h = hashlib.sha1()
    for p in params:
        h.update(bits(p).numpy().tobytes())
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k in sorted(st):
            h.update(k.encode() + (str(float(st[k])).encode() if k == "step" else bits(st[k]).numpy().tobytes()))
    return h.hexdigest()


def crash_child(folder: str, last_step: int, ready) -> None:
    """Trains from wherever the folder's journal is (or from scratch) towards last_step,
    saying "ready" once it is about to step: the parent kills it at a random moment."""
    import os
    torch.set_num_threads(1)
    params = make_params()
    resume = os.path.exists(os.path.join(folder, "journal"))
    opts = DiskOptions(chunk_numel=CHUNK, window_bytes=4 * 16 * CHUNK, resume=resume)
    opt = disk_opt(params, folder, disk=opts)
    done = opt.memory_stats()["disk_steps"]
    ready.send(done)
    train(opt, params, range(done, last_step))


def resume_options() -> DiskOptions:
    return DiskOptions(chunk_numel=CHUNK, window_bytes=8 * 16 * CHUNK, resume=True)
