"""Part of suite `optim`: OffloadAdamW with 8-bit state (state_dtype=torch.uint8)
against the same optimizer with float32 state, and against bitsandbytes'
AdamW8bit on the CPU (its 8-bit blockwise Adam, when it can be imported),
on the same parameters: one step() over N float32 parameters in 4 tensors,
cold caches, contenders interleaved, best of the rounds kept. Also the host
bytes of state per parameter (m and v; the float32 master of bf16 params
comes on top, 4 B)."""
from typing import Callable, Dict, List

import torch

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
EIGHT = "hipferry OffloadAdamW 8-bit state"
FP32 = "hipferry OffloadAdamW float32 state"
BNB = "bitsandbytes AdamW8bit (CPU)"


def _params(n: int, seed: int) -> List[torch.Tensor]:
    torch.manual_seed(seed)
    base = n // 4
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [base] * 3 + [n - 3 * base]]
    for p in ps:
        p.grad = torch.randn(p.shape) * 1e-2
    return ps


def _contenders(n: int, OffloadAdamW) -> tuple:
    out: Dict[str, Callable[[], None]] = {}
    notes = []
    eight = OffloadAdamW(_params(n, 1), state_dtype=torch.uint8, **HYPER)
    out[EIGHT] = eight.step
    out[FP32] = OffloadAdamW(_params(n, 1), **HYPER).step
    try:
        import bitsandbytes as bnb
        theirs = bnb.optim.AdamW8bit(_params(n, 1), **HYPER)
        theirs.step()  # it may refuse this machine: then no row, and a note
        out[BNB] = theirs.step
    except Exception as e:  # ImportError, or a bitsandbytes without a CPU 8-bit optimizer
        notes.append(f"bitsandbytes AdamW8bit not measured: {type(e).__name__}: {str(e)[:120]}")
    return out, eight.memory_stats()["host_bytes_per_param"], notes


def eight_bit_rows(sizes: List[int], repeats: int, rows: List[dict], notes: List[str], plots: List[dict], step,
                   OffloadAdamW, cold_timer, best_of_interleaved) -> None:
    """`cold_timer(fn)`: a timer of one run of fn from cold caches (the suite's)."""
    if OffloadAdamW is None:
        return
    found = {}
    for n in sizes:
        step(f"step 8-bit state {n / 1e6:g}M params: setup + warm-up, {repeats} interleaved rounds")
        cs, per_param, more = _contenders(n, OffloadAdamW)
        notes.extend(m for m in more if m not in notes)
        for warm_up in cs.values():
            warm_up()
        best = best_of_interleaved({k: cold_timer(f) for k, f in cs.items()}, repeats)
        found[n] = (best, per_param)
        for name, secs in best.items():
            rows.append({"measure": "step 8-bit state", "params": n, "contender": name, "seconds": secs,
                         "hipferry_speedup": secs / best[EIGHT],
                         "host_bytes_per_param": per_param if name == EIGHT else ""})
        del cs
    _verdicts(found, notes)
    plots.append({"x": "params", "y": "seconds", "series": "contender", "logy": True,
                  "rows": [r for r in rows if r["measure"] == "step 8-bit state"], "xlabel": "parameters",
                  "ylabel": "seconds per step (log)",
                  "title": "AdamW with 8-bit state on the CPU, best of interleaved rounds"})


def _verdicts(found: dict, notes: List[str]) -> None:
    for target, key, need in ((">= 1.4x the float32-state step", FP32, 1.4),
                              (">= 10x bitsandbytes AdamW8bit", BNB, 10.0)):
        got = [(n, best[key] / best[EIGHT]) for n, (best, _) in found.items() if key in best]
        if got:
            missed = [f"{n / 1e6:g}M ({v:.2f})" for n, v in got if v < need]
            notes.append(f"target 8-bit step {target}: " + ("met everywhere" if not missed else
                                                             "MISSED at " + ", ".join(missed))
                         + f" (worst {min(v for _, v in got):.2f})")
    per = [p for _, p in found.values()]
    if per:
        notes.append(f"target 8-bit host state <= 2.1 B/param (m and v, float32 params): "
                     f"{max(per):.3f} B/param" + (" met" if max(per) <= 2.1 else " MISSED"))
