"""The CPU step rows of `python -m hipferry bench optim` alone (float32, and
bf16+master with --bf16), with OffloadAdamW's per-parameter path beside its
batched one (issue 31: one C++ call for all of a step's parameters), in one run.

    python scripts/bench_cpu_step_rows.py [--numel 10e6] [--rounds 5] [--shapes bench|transformer] [--bf16]
    ATEN_CPU_CAPABILITY=avx2 HIPFERRY_CPU_ISA=avx2 python scripts/bench_cpu_step_rows.py   # AVX2 on both sides

Contenders, each over its own parameters and state, one step() each per round, rounds
interleaved, each run from a cold cache (the suite's flush) after the CPUs were idle for
0.3 s (bench_fp32_step.wait_quiet, at most 3 s), best of --rounds:
  torch fused           torch.optim.AdamW(fused=True) (bf16: + copy_ into bf16 copies, as the suite)
  hipferry batched      OffloadAdamW, as shipped
  hipferry per-param    OffloadAdamW with the in-place engine's batching off (one C++ call per parameter)
--shapes bench: the suite's 4 tensors; transformer: scripts/bench_fp32_step.py's 51 GPT-style tensors.
Prints each best time and torch fused's best over it (> 1: faster than torch).
"""
import argparse
import os
import sys

import torch

import hipferry
from hipferry.bench import best_of_interleaved
from hipferry.bench.optim_suite import CAST, HYPER, _cold_timer, _Flush, _split
from hipferry.optim import OffloadAdamW

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp32_step import transformer_shapes, wait_quiet  # noqa: E402


def contenders(shapes, bf16: bool) -> dict:
    torch.manual_seed(0)
    master = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    out = {}
    ps = [m.clone() for m in master]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = torch.optim.AdamW(ps, **HYPER, fused=True)
    if bf16:
        lows = [m.to(torch.bfloat16) for m in master]

        def fused_and_cast(opt=opt, ps=ps, lows=lows):
            opt.step()
            for lo, p in zip(lows, ps):
                lo.copy_(p)
        out["torch fused" + CAST] = fused_and_cast
    else:
        out["torch fused"] = opt.step
    dt = torch.bfloat16 if bf16 else torch.float32
    for name, batched in (("hipferry batched", True), ("hipferry per-param", False)):
        ps = [m.to(dt, copy=True) for m in master]
        for p, g in zip(ps, grads):
            p.grad = g.to(dt, copy=True)
        opt = OffloadAdamW(ps, **HYPER)
        opt._in_place.batched = batched
        out[name] = opt.step
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=10e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", choices=("bench", "transformer"), default="bench")
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    shapes = [(s,) for s in _split(int(args.numel))] if args.shapes == "bench" else transformer_shapes(args.numel)
    cs = contenders(shapes, args.bf16)
    for run in cs.values():  # state allocation, first touch of every page
        run()
    flush = _Flush()
    quiet = [0, 0]

    def after_quiet(timed):  # on a shared machine: each run waits (up to 3 s) for idle CPUs
        def run():
            quiet[0] += wait_quiet(timeout=3.0)
            quiet[1] += 1
            return timed()
        return run
    best = best_of_interleaved({k: after_quiet(_cold_timer(f, flush)) for k, f in cs.items()}, args.rounds)
    ref = next(v for k, v in best.items() if k.startswith("torch fused"))
    total = sum(torch.Size(s).numel() for s in shapes)
    print(f"{'bf16+master' if args.bf16 else 'float32'} {total / 1e6:.1f}M params in {len(shapes)} tensors; "
          f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, hipferry loops "
          f"{hipferry.build_info()['cpu_isa']}; {torch.get_num_threads()} threads; best of {args.rounds}; "
          f"{quiet[0]} of {quiet[1]} runs after quiet CPUs")
    for name, secs in best.items():
        print(f"  {name:34s} {secs * 1e3:8.3f} ms  torch fused / this {ref / secs:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
