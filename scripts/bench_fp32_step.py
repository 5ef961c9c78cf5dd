"""float32 CPU AdamW step: OffloadAdamW vs the same C++ loop called directly vs
torch.optim.AdamW(fused=True), interleaved in one run (issue 31).

    python scripts/bench_fp32_step.py [--numel 59e6] [--rounds 20] [--only a,b] [--diagnose]
                                      [--offload-file PATCHED_offload_adamw.py]
    ATEN_CPU_CAPABILITY=avx2 HIPFERRY_CPU_ISA=avx2 python scripts/bench_fp32_step.py   # the AVX2 machine

Parameters are shaped like a GPT-style transformer's (token embedding, per
block qkv / proj / fc / fc2 weights and biases, LayerNorms), about --numel
float32 in all. Every contender owns its parameters, gradients (random, set
once) and state. Contenders, one step() each per round, rounds interleaved
(the order rotates), best of --rounds:
  torch          torch.optim.AdamW(fused=True)
  offload        hipferry.optim.OffloadAdamW (CPU engine)
  direct_offload the C++ step (hipferry.ops.adamw_step_) per parameter over OffloadAdamW's own
                 parameters and state tensors, without the optimizer's Python around the calls
  direct_pool    the same over state from the pinned pool (zeroed like OffloadAdamW's)
  direct_torch   the same over torch.empty state
  offload_file   (with --offload-file) OffloadAdamW from that file: a changed offload_adamw.py
                 against the installed one, in the same run
Before each round it waits (up to 20 s) until no other process used the CPUs
for 0.3 s: on a shared machine the best of the quiet rounds is the figure.
Prints each best time, torch fused's best over it, and the median over the rounds of
torch's time over the contender's in the same round (> 1: faster than torch; the
machine's memory bandwidth drifts between rounds, so the per-round ratio is
the steadier figure).
--diagnose also splits OffloadAdamW's and direct_offload's step into the time
inside the C++ calls and the time around them (Python), best of the rounds.
"""
import argparse
import gc
import importlib.util
import statistics
import sys
import time

import torch

import hipferry
from hipferry.optim import OffloadAdamW
from hipferry.optim import offload_adamw as offload_module

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
STEP_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False)
step_kernel = getattr(hipferry.ops, "adamw_step_", None) or hipferry._C._adamw_step_


def transformer_shapes(numel: float):
    """GPT-style parameter shapes (d_model 768, 4 blocks, the vocabulary sized so the total is about `numel`)."""
    d, layers = 768, 4
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    per_block = sum(torch.Size(s).numel() for s in block)
    vocab = max(1000, int((numel - layers * per_block - 2 * d) / d))
    return [(vocab, d)] + block * layers + [(d,), (d,)]


def make_params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


class Direct:
    """The C++ step called once per parameter, as OffloadAdamW calls it, without the optimizer."""

    def __init__(self, items):
        self.items, self.step_count = items, 0

    @classmethod
    def over(cls, params, alloc):
        return cls([(p, alloc(p.numel()).zero_(), alloc(p.numel()).zero_()) for p in params])

    def step(self):
        self.step_count += 1
        for p, m, v in self.items:
            step_kernel(p.data.view(-1), p.grad.view(-1), m.view(-1), v.view(-1), None, None, self.step_count,
                        **STEP_HYPER)


def load_offload_file(path):
    """The module in `path` as a sibling of hipferry.optim.offload_adamw (its relative imports work)."""
    spec = importlib.util.spec_from_file_location("hipferry.optim._bench_offload_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name, shapes, pool, built, offload_file=None):
    if name == "direct_offload":
        opt = built.get("offload") or build("offload", shapes, pool, built)
        return Direct([(p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in opt.param_groups[0]["params"]])
    params = make_params(shapes, seed=0)
    if name == "torch":
        return torch.optim.AdamW(params, fused=True, **HYPER)
    if name == "offload":
        return OffloadAdamW(params, pool=pool, **HYPER)
    if name == "offload_file":
        return offload_file.OffloadAdamW(params, pool=pool, **HYPER)
    if name == "direct_pool":
        return Direct.over(params, lambda n: pool.empty(n))
    if name == "direct_torch":
        return Direct.over(params, lambda n: torch.empty(n))
    raise ValueError(f"unknown contender {name!r}")


def cpu_ticks():
    """(busy, total) jiffies of each CPU, from /proc/stat."""
    out = []
    with open("/proc/stat") as f:
        f.readline()
        for line in f:
            if not line.startswith("cpu"):
                break
            v = list(map(int, line.split()[1:]))
            out.append((sum(v) - v[3] - v[4], sum(v)))
    return out


def wait_quiet(window=0.3, max_busy=0.1, timeout=20.0) -> bool:
    """Waits until every CPU was at most `max_busy` busy over `window` seconds; False after `timeout`."""
    end = time.time() + timeout
    while time.time() < end:
        a = cpu_ticks()
        time.sleep(window)
        b = cpu_ticks()
        if all(bb[0] - aa[0] <= max_busy * max(1, bb[1] - aa[1]) for aa, bb in zip(a, b)):
            return True
    return False


class KernelClock:
    """Time spent inside the C++ step calls, for --diagnose: wraps the name OffloadAdamW calls
    (offload_adamw._C._adamw_step_, in each of `modules`) and the one Direct calls."""

    def __init__(self, modules):
        self.inside = 0.0
        global step_kernel
        inner_direct, real_c = step_kernel, offload_module._C
        clock = self

        def timed(fn):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    clock.inside += time.perf_counter() - t0
            return call

        class TimedC:
            _adamw_step_ = staticmethod(timed(real_c._adamw_step_))

            def __getattr__(self, name):
                return getattr(real_c, name)

        for module in modules:
            module._C = TimedC()
        step_kernel = timed(inner_direct)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=59e6)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--only", default="torch,offload,direct_offload,direct_pool,direct_torch")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--offload-file", help="also time OffloadAdamW from this offload_adamw.py (offload_file)")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for quiet CPUs before each round")
    args = ap.parse_args()
    shapes = transformer_shapes(args.numel)
    total = sum(torch.Size(s).numel() for s in shapes)
    pool = hipferry.PinnedPool()
    names = args.only.split(",")
    offload_file = load_offload_file(args.offload_file) if args.offload_file else None
    if offload_file is not None and "offload_file" not in names:
        names.append("offload_file")
    built = {}
    for n in names:
        built[n] = build(n, shapes, pool, built, offload_file)
    for o in built.values():
        o.step()  # first step: every page faulted in, the state nonzero
    clock = KernelClock([m for m in (offload_module, offload_file) if m is not None]) if args.diagnose else None
    best = {n: float("inf") for n in names}
    best_inside = {n: float("inf") for n in names}
    best_outside = {n: float("inf") for n in names}
    quiet = 0
    times = {n: [] for n in names}
    for r in range(args.rounds):
        quiet += args.no_wait or wait_quiet()
        for n in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            if clock:
                clock.inside = 0.0
            t0 = time.perf_counter()
            built[n].step()
            t = time.perf_counter() - t0
            times[n].append(t)
            best[n] = min(best[n], t)
            if clock:
                best_inside[n] = min(best_inside[n], clock.inside)
                best_outside[n] = min(best_outside[n], t - clock.inside)
    print(f"{total / 1e6:.1f}M float32 params in {len(shapes)} tensors; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"hipferry CPU loops {hipferry.build_info()['cpu_isa']}; {quiet} of {args.rounds} rounds quiet")
    ref = best.get("torch")
    for n in names:
        per_round = statistics.median(a / b for a, b in zip(times["torch"], times[n])) if ref else 0
        ratio = f"  {ref / best[n]:5.2f}x torch fused (per round: median {per_round:5.2f}x)" if ref else ""
        split = ""
        if clock and n != "torch":
            split = f"  (in the C++ calls {best_inside[n] * 1e3:.2f} ms, around them {best_outside[n] * 1e3:.2f} ms)"
        print(f"  {n:15s} {best[n] * 1e3:8.2f} ms{ratio}{split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
