"""Twins: the same training with OffloadAdamW(overlap=None) and
OffloadAdamW(overlap="backward"), step by step, every parameter, gradient and
state tensor compared bit for bit after every step (issue 31: the promise of
overlap="backward" is bit identity with overlap=None; hipferry computes both
sides). Used by test_offload_adamw_overlap_promise.py and
test_offload_adamw_overlap_lifetime.py."""
from typing import Callable

import torch

from hipferry.optim import OffloadAdamW


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (-0.0 differs from 0.0, a NaN equals its own bits)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


class Twins:
    """`make_model()` twice; `cls(model.parameters(), overlap=..., **kw, **per_run())` on each."""

    def __init__(self, make_model: Callable[[], torch.nn.Module], cls=OffloadAdamW,
                 per_run: Callable[[], dict] = dict, **kw):
        self.runs = []
        for overlap in (None, "backward"):
            model = make_model()
            self.runs.append((model, cls(model.parameters(), overlap=overlap, **kw, **per_run())))
        self.steps = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.runs[1][0]

    @property
    def opt(self) -> OffloadAdamW:
        return self.runs[1][1]

    def stats(self) -> dict:
        return self.opt.overlap_stats()

    def step(self, iteration: Callable) -> None:
        """iteration(model, opt, step) on the plain run, then on the overlapped one (it ends
        with opt.step()), then the comparison."""
        for model, opt in self.runs:
            iteration(model, opt, self.steps)
        self.check(f"after step {self.steps}")
        self.steps += 1

    def check(self, when: str) -> None:
        (a, a_opt), (b, b_opt) = self.runs
        for (name, x), y in zip(a.named_parameters(), b.parameters()):
            assert same_bits(x, y), f"{when}: parameter {name}"
            assert (x.grad is None) == (y.grad is None), f"{when}: gradient of {name}"
            if x.grad is not None:
                assert same_bits(x.grad, y.grad), f"{when}: gradient of {name}"
            want, got = a_opt.state[x], b_opt.state[y]
            assert sorted(want) == sorted(got), f"{when}: state keys of {name}"
            for k, t in want.items():
                assert same_bits(t, got[k]), f"{when}: state {k!r} of {name}"


def backward_then(write: Callable = None, clip: float = None) -> Callable:
    """An iteration on the test transformer: backward on that step's batch, then
    write(model, opt, step) if given (between backward and step()), clipping, step()."""
    from test_offload_adamw_overlap import batches, loss_of
    data = batches(torch.float32, 8)

    def iteration(model, opt, step):
        opt.zero_grad()
        loss_of(model, data[step % len(data)].to(next(model.parameters()).dtype)).backward()
        if write is not None:
            write(model, opt, step)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return iteration
