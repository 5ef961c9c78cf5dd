"""What the stable ABI costs: import time and per-call overhead of two hipferry
builds installed side by side (e.g. the ATen build of one commit and the
stable-ABI build of the next), interleaved.

    python scripts/bench_abi_overhead.py --a /tmp/aten-site --b /tmp/stable-site \
        --rounds 5 --out bench-abi

Each round starts one fresh process per build (alternating which goes first)
with that build's folder first on PYTHONPATH. The process measures:
  * import_ms: `import hipferry` after `import torch` (wall clock, one import
    per process, so every round is a cold import of hipferry in a warm page
    cache), and the cumulative `-X importtime` of hipferry._C (the extension
    module's load and op registration);
  * per-call microseconds, each the best over 7 repeats of the mean over a
    batch of calls: copy_cast_ (64 elements, float32 -> float16, CPU),
    PinnedPool.empty (4 KiB, freed), hipferry.pin (16 KiB), prefetch + wait
    of one 4 KiB CPU tensor and of 64 of them, and _C._adamw_step_ on 64
    elements; beside them torch's own calls ("(reference)": torch.empty,
    clone, 64 .to() calls), the same in both builds, to divide by.
Each build keeps its best per measure over the rounds; the table prints B/A
(< 1: B is faster) and the bars go to OUT/abi_overhead.png.
"""
import argparse
import json
import os
import subprocess
import sys

WORKER = r"""
import json, sys, time
import torch
t0 = time.perf_counter()
import hipferry
import_ms = (time.perf_counter() - t0) * 1e3
from hipferry import _C

def per_call_us(fn, calls):
    fn()
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6

src, dst = torch.randn(64), torch.empty(64, dtype=torch.float16)
pool = hipferry.PinnedPool()
one = [torch.randn(1024)]
many = [torch.randn(1024) for _ in range(64)]
t16 = torch.randn(4096)
p, g, m, v = (torch.randn(64) for _ in range(4))
m.zero_(); v.zero_()
calls = {
    "copy_cast_ 64 el": (lambda: hipferry.copy_cast_(dst, src), 2000),
    "PinnedPool.empty 4 KiB": (lambda: pool.empty(1024), 2000),
    "torch.empty 4 KiB (reference)": (lambda: torch.empty(1024), 2000),
    "hipferry.pin 16 KiB": (lambda: hipferry.pin(t16, pool), 2000),
    "t.clone() 16 KiB (reference)": (lambda: t16.clone(), 2000),
    "prefetch 1 x 4 KiB": (lambda: hipferry.prefetch(one, "cpu").wait(), 500),
    "prefetch 64 x 4 KiB": (lambda: hipferry.prefetch(many, "cpu").wait(), 100),
    "64 x .to(copy=True) 4 KiB (reference)": (lambda: [t.to("cpu", copy=True) for t in many], 100),
    "_adamw_step_ 64 el": (lambda: _C._adamw_step_(p, g, m, v, None, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01,
                                                   False, False), 2000),
}
out = {"import_ms": import_ms, "abi": hipferry.build_info().get("torch_abi", "?")}
for name, (fn, n) in calls.items():
    out[name + " (us)"] = per_call_us(fn, n)
print(json.dumps(out))
"""


def run_once(site):
    env = dict(os.environ, PYTHONPATH=site + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", WORKER], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the worker failed under {site}:\n{done.stderr}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    # "import time: self [us] | cumulative | name": the extension module's own load.
    for line in done.stderr.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == "hipferry._C":
            res["import hipferry._C (ms)"] = int(parts[1]) / 1e3
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="site folder of build A (the baseline)")
    ap.add_argument("--b", required=True, help="site folder of build B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench-abi")
    ap.add_argument("--title", default="build B vs build A", help="the plot's title")
    args = ap.parse_args()
    best = {"A": {}, "B": {}}
    abi = {}
    for r in range(args.rounds):
        order = [("A", args.a), ("B", args.b)] if r % 2 == 0 else [("B", args.b), ("A", args.a)]
        for label, site in order:
            res = run_once(site)
            abi[label] = res.pop("abi")
            for k, val in res.items():
                best[label][k] = min(val, best[label].get(k, float("inf")))
        print(f"round {r + 1}/{args.rounds}: import A {best['A']['import_ms']:.1f} ms, "
              f"B {best['B']['import_ms']:.1f} ms (best so far)", flush=True)
    print(f"A: {args.a} ({abi['A']})\nB: {args.b} ({abi['B']})")
    print(f"{'measure':28s} {'A':>10s} {'B':>10s} {'B/A':>6s}")
    rows = []
    for k in best["A"]:
        a, b = best["A"][k], best["B"][k]
        rows.append({"measure": k, "A": a, "B": b, "B_over_A": b / a})
        print(f"{k:28s} {a:10.2f} {b:10.2f} {b / a:6.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "abi_overhead.json"), "w") as f:
        json.dump({"a": args.a, "b": args.b, "abi": abi, "rounds": args.rounds, "rows": rows}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["measure"] for r in rows]
    ax.barh(names, [r["B_over_A"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(f"B / A (best of {args.rounds} interleaved rounds; < 1: B faster)")
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "abi_overhead.png"), dpi=120)
    print("plot:", os.path.join(args.out, "abi_overhead.png"))


if __name__ == "__main__":
    main()
