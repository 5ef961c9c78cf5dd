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
one is redone). Contenders interleaved, best of the rounds kept; the counters
of the overlapped run are reported. On this machine kind backward and the
speculative steps share the same cores, so the overlapped backward is slower:
the total is reported too.
"""
import time

import torch

from ..optim import OffloadAdamW


def _model(layers, width):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0,
                                                                  batch_first=True) for _ in range(layers)])


def overlap_rows(ctx, rows, notes, step, device="cpu"):
    layers, width, rounds = (2, 256, 3) if ctx.quick else (4, 512, max(5, ctx.repeats))
    x = torch.randn(8, 64, width, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = {}
    for regime, max_norm in (("clipping never fires", 1e9), ("clipping always fires", 1e-6)):
        for overlap in (None, "backward"):
            model = _model(layers, width).to(device)
            opt = OffloadAdamW(model.parameters(), lr=1e-4, overlap=overlap, step_on="cpu", min_offload_numel=0)
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
        rows.append({"measure": f"overlap on {device}, {regime}", "params": n,
                     "contender": f"OffloadAdamW(overlap={overlap!r})", "seconds": crit,
                     "backward_s": back, "backward_end_to_step_end_s": crit, "iteration_s": total,
                     "critical_path_vs_plain": crit / plain[1], "iteration_vs_plain": total / plain[2],
                     "committed": stats["committed"], "redone": stats["redone"]})
    notes.append(f"overlap on {device}: backward end to step end = clip_grad_norm_ + step()"
                 + (" + the copies back, synchronized" if device == "cuda" else "")
                 + "; with overlap='backward' the step ran during backward"
                 + (", on the same cores (CPU parameters)" if device == "cpu" else ", on the CPU (CPU engine)"))
