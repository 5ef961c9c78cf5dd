"""Feed a model from host memory with hipferry.prefetch: the next batch moves while this one computes.

A training-style input pipeline: batches of float32 features live in host
memory and the model runs in bfloat16. The plain loop
copies each batch with `.to(device, dtype, non_blocking=True)` right before
using it; the hipferry loop starts the copy (and the fused conversion) of
batch i+1 before computing batch i, so the copy hides behind the compute.
Both loops see the same inputs, and their outputs are checked bit for bit.
The hipferry loop is recorded with hipferry.trace(): a Chrome/Perfetto trace
JSON and a timeline PNG show the copies overlapping the compute.

    python examples/prefetch_pipeline.py [--steps 12] [--batch 512] [--width 1024]
                                         [--device auto|cpu|cuda] [--out prefetch-out]
"""
import argparse
import os
import sys
import time

import torch
from torch import nn

import hipferry


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="batches per loop")
    p.add_argument("--batch", type=int, default=512, help="rows per batch")
    p.add_argument("--width", type=int, default=1024, help="features per row (a multiple of 64)")
    p.add_argument("--layers", type=int, default=4, help="linear layers of the model")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default="prefetch-out", help="directory for the trace JSON and timeline PNG")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error(f"--steps must be >= 2, got {a.steps}")
    if a.batch < 1 or a.layers < 1:
        p.error("--batch and --layers must be >= 1")
    if a.width < 64 or a.width % 64:
        p.error(f"--width must be a positive multiple of 64, got {a.width}")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() and hipferry.device_count() > 0 else "cpu"
    if a.device == "cuda" and hipferry.device_count() == 0:
        p.error("--device cuda: no GPU visible to hipferry")
    return a


def make_model(args, dtype):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*layers).to(args.device, dtype).eval()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def plain_loop(model, batches, device, dtype, progress):
    outs = []
    for i, b in enumerate(batches):
        x = b.to(device, dtype, non_blocking=True)
        outs.append(model(x).sum(dim=1))
        progress(i)
    sync(device)
    return outs


def prefetch_loop(model, batches, device, dtype, progress):
    outs = []
    pending = hipferry.prefetch(batches[0], device, dtype=dtype)
    for i in range(len(batches)):
        x = pending.wait()  # the current stream waits for the copy, the host does not
        if i + 1 < len(batches):
            pending = hipferry.prefetch(batches[i + 1], device, dtype=dtype)  # moves while we compute
        with hipferry.trace_region(f"compute batch {i}"):
            outs.append(model(x).sum(dim=1))
        progress(i)
    sync(device)
    return outs


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    dtype = torch.bfloat16  # the copy converts on the way in (fused in hipferry)
    print(f"device {device}, hipferry {hipferry.build_info()['target']} build; {args.steps} batches of "
          f"{args.batch}x{args.width} float32 -> {str(dtype)[6:]}, {args.layers}-layer MLP")
    model = make_model(args, dtype)
    g = torch.Generator().manual_seed(1)
    # Pinned host batches from hipferry's pool (what a data loader with pin_memory gives).
    batches = [hipferry.pin(torch.randn(args.batch, args.width, generator=g)) for _ in range(args.steps)]

    def progress(name):
        def report(i):
            sys.stderr.write(f"\r[{name}] batch {i + 1}/{args.steps}")
            if i + 1 == args.steps:
                sys.stderr.write("\n")
            sys.stderr.flush()
        return report

    with torch.no_grad():
        plain_loop(model, batches[:2], device, dtype, lambda i: None)  # warm-up (kernels, allocator)
        prefetch_loop(model, batches[:2], device, dtype, lambda i: None)
        best = {"plain .to()": float("inf"), "hipferry.prefetch": float("inf")}
        results = {}
        for rnd in range(3):  # interleaved rounds, best kept: CPU timings are noisy
            for name, loop in (("plain .to()", plain_loop), ("hipferry.prefetch", prefetch_loop)):
                t0 = time.perf_counter()
                results[name] = loop(model, batches, device, dtype, progress(f"{name} round {rnd + 1}"))
                best[name] = min(best[name], time.perf_counter() - t0)
        os.makedirs(args.out, exist_ok=True)
        trace_path = os.path.join(args.out, "prefetch_pipeline.json")
        with hipferry.trace(trace_path) as tr:
            prefetch_loop(model, batches, device, dtype, progress("traced run"))

    same = all(torch.equal(a, b) for a, b in zip(results["plain .to()"], results["hipferry.prefetch"]))
    print(f"outputs bit-identical between the two loops: {same}")
    for name, secs in best.items():
        print(f"{name:>18}: {secs * 1e3:8.2f} ms for {args.steps} batches ({secs / args.steps * 1e3:.2f} ms/batch)")
    print(f"ratio plain/hipferry: {best['plain .to()'] / best['hipferry.prefetch']:.2f}x")
    copies = [e for e in tr.events if e["category"] != "user"]
    print(f"trace: {len(tr.events)} events ({len(copies)} copies/kernels), written to {trace_path} "
          "(open in ui.perfetto.dev)")
    try:
        from hipferry.bench.timeline import write_timeline_png
        png = os.path.join(args.out, "prefetch_pipeline.png")
        if write_timeline_png(png, tr.events, f"prefetch pipeline on {device}"):
            print(f"timeline: {png}")
    except ImportError:
        pass
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
