"""Part of suite `optim`: what OffloadAdamW(overlap="backward") takes off the
critical path (issue 26).

One training iteration of a small transformer (quick: 2 layers of width 256;
full: 4 of width 512) on CPU parameters, and on GPU parameters with the CPU
engine when the bench runs on a GPU: backward, clip_grad_norm_, step()
(synchronized on a GPU).
Timed apart: backward (its speculative steps run beside it) and "backward end
to step end" (clipping and step(): what overlap takes off the critical path),
for overlap=None and overlap="backward", in two regimes: clipping that never
fires (every speculation is committed) and clipping that always fires (every
one is redone); on the CPU two more regimes stand in for a GPU's backward,
in which the host idles: each layer's backward sleeps 5 ms (clipping never
fires), with the parameters stepped in place, and through the CPU engine's
path for GPU parameters (host gradient copies, host working copies, copies
back). Contenders interleaved, best of the rounds kept; the counters
of the overlapped run are reported. On this machine kind backward and the
speculative steps share the same cores, so the overlapped backward is slower:
the total is reported too.
"""
import time

import torch

from ..optim import OffloadAdamW


class _IdleInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the host idles there, as it does while a GPU runs backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _Idle(torch.nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return _IdleInBackward.apply(x, self.seconds) if self.seconds else x


def _model(layers, width, idle_s):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True),
                   _Idle(idle_s)]
    return torch.nn.Sequential(*blocks)


IDLE_S = 0.005  # per layer, in the regimes where backward leaves the host idle


class _GpuParameterPath(OffloadAdamW):
    """CPU parameters through the CPU engine's path for GPU parameters (gradient copies started by
    the hooks, host working copies, copies back): with the host idle in backward, the nearest this
    machine kind comes to a GPU run (the test seam CpuRemoteOffloadAdamW, for the bench)."""

    def _is_remote(self, p):
        return True


def overlap_rows(ctx, rows, notes, step, device="cpu", plots=None):
    layers, width, rounds = (2, 256, 3) if ctx.quick else (4, 512, max(5, ctx.repeats))
    x = torch.randn(8, 64, width, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    regimes = [("clipping never fires", 1e9, 0.0, OffloadAdamW), ("clipping always fires", 1e-6, 0.0, OffloadAdamW)]
    if device == "cpu":  # (on a GPU the host idles during backward anyway)
        idle = f"backward idles the host {IDLE_S * 1e3:g} ms a layer"
        regimes += [(idle, 1e9, IDLE_S, OffloadAdamW), (f"{idle}, GPU-parameter path", 1e9, IDLE_S, _GpuParameterPath)]
    runs = {}
    for regime, max_norm, idle_s, cls in regimes:
        for overlap in (None, "backward"):
            model = _model(layers, width, idle_s).to(device)
            opt = cls(model.parameters(), lr=1e-4, overlap=overlap, step_on="cpu", min_offload_numel=0)
            runs[(regime, overlap)] = (model, opt, max_norm)
    n = sum(p.numel() for p in runs[next(iter(runs))][0].parameters())
    best = {k: (float("inf"), float("inf"), float("inf")) for k in runs}
    for r in range(rounds + 1):  # round 0 warms up (state allocated, scratch made)
        step(f"overlap on {device}: {n / 1e6:.1f}M parameters, round {r}/{rounds}")
        for key, (model, opt, max_norm) in runs.items():
            sync()
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            sync()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.synchronize()
            sync()
            t2 = time.perf_counter()
            opt.zero_grad()
            if r:
                b, s, t = best[key]
                best[key] = (min(b, t1 - t0), min(s, t2 - t1), min(t, t2 - t0))
    for (regime, overlap), (back, crit, total) in best.items():
        plain = best[(regime, None)]
        stats = runs[(regime, overlap)][1].overlap_stats()
        rows.append({"measure": f"overlap on {device}, {regime}", "regime": regime, "params": n,
                     "contender": f"OffloadAdamW(overlap={overlap!r})", "seconds": crit,
                     "backward_s": back, "backward_end_to_step_end_s": crit, "iteration_s": total,
                     "critical_path_vs_plain": crit / plain[1], "iteration_vs_plain": total / plain[2],
                     "committed": stats["committed"], "redone": stats["redone"]})
    if plots is not None:
        mine = [r for r in rows if r["measure"].startswith(f"overlap on {device}")]
        plots.append({"kind": "bar", "x": "regime", "y": "backward_end_to_step_end_s", "series": "contender",
                      "rows": mine, "ylabel": "backward end to step end, s (lower is better)",
                      "title": f"OffloadAdamW overlap='backward': what stays on the critical path ({device})"})
    notes.append(f"overlap on {device}: backward end to step end = clip_grad_norm_ + step()"
                 + (" + the copies back, synchronized" if device == "cuda" else "")
                 + "; with overlap='backward' the step ran during backward"
                 + (", on the same cores (CPU parameters)" if device == "cpu" else ", on the CPU (CPU engine)"))
