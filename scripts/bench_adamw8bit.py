"""The CPU AdamW step with 8-bit blockwise moments (hipferry._C._adamw8bit_step_) against the
float32 step (_C._adamw_step_) and bitsandbytes' AdamW8bit on the same float32 parameters.

    python scripts/bench_adamw8bit.py [--params 50e6] [--rounds 5] [--no-bnb] [--threads N]

Rounds interleave the contenders (A B C, A B C, ...); each keeps its best time (shared
machines: the best is the least disturbed run). Prints seconds per step, ns per parameter,
host bytes of optimizer state per parameter and the ratios.
"""
import argparse
import time

import torch

from hipferry import _C

BLOCK = 256
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def contenders(n, with_bnb):
    torch.manual_seed(0)
    grad = torch.randn(n) * 1e-2
    blocks = (n + BLOCK - 1) // BLOCK
    p8, p32 = torch.randn(n), torch.randn(n)
    m8, v8 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(blocks), torch.zeros(blocks)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    steps = {"hipferry 8-bit": 0, "hipferry float32": 0}

    def run8():
        steps["hipferry 8-bit"] += 1
        _C._adamw8bit_step_(p8, grad, m8, ma, v8, va, None, None, None, steps["hipferry 8-bit"], amsgrad=False,
                            maximize=False, **HYPER)

    def run32():
        steps["hipferry float32"] += 1
        _C._adamw_step_(p32, grad, m32, v32, None, None, steps["hipferry float32"], amsgrad=False, maximize=False,
                        **HYPER)

    out = {"hipferry 8-bit": (run8, (n * 2 + blocks * 8) / n), "hipferry float32": (run32, 8.0)}
    if with_bnb:
        import bitsandbytes as bnb
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = grad
        opt = bnb.optim.AdamW8bit([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                  weight_decay=HYPER["weight_decay"], min_8bit_size=0)
        out["bitsandbytes AdamW8bit"] = (opt.step, 2 + 8 / 256)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bnb-rounds", type=int, default=2, help="bitsandbytes is slow: it runs in the first rounds only")
    ap.add_argument("--no-bnb", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    runs = contenders(n, not args.no_bnb)
    best = {name: float("inf") for name in runs}
    for name, (fn, _) in runs.items():  # warm up: first-touch page faults, lazy init
        fn()
    for r in range(args.rounds):
        for name, (fn, _) in runs.items():
            if name.startswith("bitsandbytes") and r >= args.bnb_rounds:
                continue
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"{n:,} float32 params, {torch.get_num_threads()} threads, best of {args.rounds} interleaved rounds")
    for name, (_, state_bytes) in runs.items():
        print(f"  {name:26s} {best[name] * 1e3:9.1f} ms  {best[name] * 1e9 / n:6.2f} ns/param  "
              f"state {state_bytes:.3f} B/param")
    base = best["hipferry 8-bit"]
    for name in runs:
        if name != "hipferry 8-bit":
            print(f"  hipferry 8-bit vs {name}: {best[name] / base:.2f}x faster")


if __name__ == "__main__":
    main()
