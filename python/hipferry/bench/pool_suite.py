"""Suite `pool`: the pinned pool vs torch's allocators, side by side.

- from Python (pool_calls.py): pool.empty, hipferry.pin and a prefetch of 64
  small tensors against torch's own calls, timed as a script makes them, and
  the stages of pool.empty's path.
- alloc+free: latency of a cached allocate+free pair (median and p99, ns),
  timed in C++ without Python in the loop: the pool's core, a pool tensor
  (the op torch.ops.hipferry.pool_empty), torch's pinned allocator (GPU) and
  torch's CPU allocator (malloc). Baseline: torch pinned on a GPU, torch cpu
  otherwise. The C++ timing loop is a hook built with the tests only
  (hipferry._C._testing); a production build times the same pairs from
  Python instead (the contenders' names say so) and has no "allocator" row.
- overhead: reserved/requested bytes at the peak of a mixed workload shaped
  like offloaded fine-tuning of a transformer (bf16 weights, fp32 master and
  Adam moments, odd-sized norms and biases, layers freed and re-allocated);
  torch's pinned allocator on the same sequence when a GPU is present.
- churn: reserved / peak requested after a first fill shaped like bf16
  fine-tuning and after each of three churn rounds (a random half freed and
  reallocated at sizes scaled by U(0.5, 1.5)), with torch's pinned-allocator
  rule on the same sequence as a computed reference.
- cold: seconds to the first allocation of 1 GiB from a fresh pool, and to
  having written every byte of it (page faults included), for each provider
  (and torch pinned on a GPU).
"""
import math
import statistics
import time

import torch

from .harness import Context, SuiteResult, suite
from .pool_calls import from_python
from .. import _C
from ..pool import PinnedPool
from ..torch_private import host_empty_cache

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _row(measure, size, contender, value, unit, baseline=None, base_value=None, lower_is_better=True):
    r = {"measure": measure, "bytes": size, "contender": contender, "value": value, "unit": unit,
         "baseline": baseline or ""}
    if base_value:
        r["vs_baseline"] = base_value / value if lower_is_better else value / base_value
    return r


def _alloc_free(ctx, rows, gpu):
    sizes = [256, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB] + ([] if ctx.quick else [64 * MiB])
    iters = 200 if ctx.quick else 5000
    rounds = 2 if ctx.quick else max(3, ctx.repeats)
    hooks = getattr(_C, "_testing", None)
    contenders = (["pool_core"] if hooks else []) + ["pool_tensor", "torch_cpu"] + (["torch_pinned"] if gpu else [])
    names = {"pool_core": "hipferry pool (allocator)", "pool_tensor": "hipferry pool.empty (tensor)",
             "torch_cpu": "torch.empty (cpu, malloc)", "torch_pinned": "torch.empty(pin_memory=True)"}
    if hooks is None:
        names = {k: v + " [from Python]" for k, v in names.items()}
    baseline = "torch_pinned" if gpu else "torch_cpu"
    pool = PinnedPool()
    time_pairs = hooks.pool_bench_alloc_free if hooks else _python_alloc_free
    for i, size in enumerate(sizes):
        ctx.progress("pool", i + 1, len(sizes), f"alloc+free {size} B")
        best = {k: (float("inf"), float("inf")) for k in contenders}
        for _ in range(rounds):  # interleaved rounds; keep each contender's best
            for k in contenders:
                ns = time_pairs(k, pool.native_id, size, iters)
                ns.sort()
                med, p99 = statistics.median(ns), ns[int(0.99 * (len(ns) - 1))]
                best[k] = (min(best[k][0], med), min(best[k][1], p99))
        for k in contenders:
            rows.append(_row("alloc+free median", size, names[k], best[k][0], "ns", names[baseline],
                             best[baseline][0]))
            rows.append(_row("alloc+free p99", size, names[k], best[k][1], "ns", names[baseline],
                             best[baseline][1]))
    pool.close()


def _python_alloc_free(kind, pool_id, size, iters):
    """The pairs of the C++ hook, timed from Python (a production build has no hook)."""
    make = {"pool_tensor": lambda: torch.ops.hipferry.pool_empty(pool_id, [size], torch.uint8),
            "torch_cpu": lambda: torch.empty(size, dtype=torch.uint8),
            "torch_pinned": lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True)}[kind]
    make()
    out, clock = [], time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        make()  # the tensor dies at once: an allocate+free pair
        out.append(clock() - t0)
    return out


def _workload(hidden, layers):
    """(op, key, bytes) of offloaded fine-tuning: allocate everything, then
    free and re-allocate layer by layer (as a streamed step would)."""
    inter, vocab = hidden * 11 // 4, 32000
    shapes = {"embed": vocab * hidden}
    for layer in range(layers):
        for name, n in (("q", hidden * hidden), ("k", hidden * hidden // 4), ("v", hidden * hidden // 4),
                        ("o", hidden * hidden), ("gate", hidden * inter), ("up", hidden * inter),
                        ("down", inter * hidden), ("norm1", hidden), ("norm2", hidden), ("bias", 3 * hidden + 7)):
            shapes[f"{layer}.{name}"] = n
    ops = []
    for key, n in shapes.items():
        ops.append(("alloc", key + ":bf16", 2 * n))
        for state in ("master", "exp_avg", "exp_avg_sq"):
            ops.append(("alloc", f"{key}:{state}", 4 * n))
    for layer in range(0, layers, 2):  # half the layers' low-precision copies are re-staged as grads
        for key in [k for k in shapes if k.startswith(f"{layer}.")]:
            ops.append(("free", key + ":bf16", 0))
            ops.append(("alloc", key + ":grad", 4 * shapes[key]))
    return ops


def _overhead(ctx, rows, notes, gpu):
    hidden, layers = (256, 2) if ctx.quick else (1024, 6)
    ops = _workload(hidden, layers)
    ctx.progress("pool", 1, 1, f"mixed workload: {len(ops)} operations, hidden {hidden}, {layers} layers")

    def run(alloc):
        live, requested, peak_requested = {}, 0, 0
        for op, key, n in ops:
            if op == "alloc":
                live[key] = alloc(n)
                requested += n
            else:
                requested -= live.pop(key).numel()
            peak_requested = max(peak_requested, requested)
        return live, peak_requested

    notes.append("torch's pinned-allocator rule (next power of two, no splitting) would hold "
                 f"{_power_of_two_model(ops):.2f}x the requested bytes at the peak of this workload "
                 "(computed from the rule, not measured)")
    with PinnedPool() as pool:
        live, peak_requested = run(lambda n: pool.empty(n, dtype=torch.uint8))
        s = pool.stats()
        rows.append(_row("reserved/requested at peak", peak_requested, "hipferry pool",
                         s["peak_reserved_bytes"] / peak_requested, "ratio"))
        rows.append(_row("reserved/requested at end", s["requested_bytes"], "hipferry pool",
                         s["reserved_bytes"] / s["requested_bytes"], "ratio"))
        del live
    if gpu and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        host_empty_cache()
        torch.cuda.reset_peak_host_memory_stats()
        live, peak_requested = run(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        end_requested = sum(t.numel() for t in live.values())
        hs = torch.cuda.host_memory_stats()
        peak, current = _torch_reserved(hs, "peak"), _torch_reserved(hs, "current")
        if peak is None:
            notes.append("torch pinned allocator not measured: torch.cuda.host_memory_stats() has no "
                          f"reserved-bytes key in torch {torch.__version__} (keys: {sorted(hs)[:8]})")
        else:
            rows.append(_row("reserved/requested at peak", peak_requested, "torch pinned allocator",
                             peak / peak_requested, "ratio"))
            rows.append(_row("reserved/requested at end", end_requested, "torch pinned allocator",
                             current / end_requested, "ratio"))
        del live
        host_empty_cache()


def _power_of_two_model(ops, marks=False):
    """Peak reserved/requested of torch's CachingHostAllocator rule on `ops`:
    every request rounded up to a power of two, a freed block reused only for
    the same rounded size, nothing split or released. Computed, not measured.
    With `marks`: {mark: reserved / peak requested so far} at each "mark" op."""
    cached, live, reserved, requested, peak_req, peak_res = {}, {}, 0, 0, 0, 0
    at = {}
    for op, key, n in ops:
        if op == "mark":
            at[key] = reserved / peak_req
            continue
        if op == "alloc":
            size = 1 << max(0, (n - 1).bit_length())
            if cached.get(size):
                cached[size] -= 1
            else:
                reserved += size
            live[key] = (size, n)
            requested += n
        else:
            size, n = live.pop(key)
            cached[size] = cached.get(size, 0) + 1
            requested -= n
        peak_req, peak_res = max(peak_req, requested), max(peak_res, reserved)
    return at if marks else peak_res / peak_req


def _churn_ops(seed, hidden, mlp, layers, small, rounds):
    """(op, key, bytes) of the churn workload (issue 16): bf16 weights of `layers`
    layers (attention hidden x hidden, MLP hidden x mlp), activations of an odd
    batch, `small` small odd sizes; then `rounds` times a random half freed and
    allocated again at its size scaled by U(0.5, 1.5). ("mark", round, 0) ends
    the first fill and each round."""
    import random
    rng = random.Random(seed)
    tokens = 3 * 517
    sizes = []
    for _ in range(layers):
        sizes += [hidden * hidden * 2] * 4 + [hidden * mlp * 2] * 3 + [tokens * hidden * 2] * 2 + [tokens * mlp * 2]
    sizes += [int(math.exp(rng.uniform(math.log(64), math.log(MiB)))) + 1 + rng.randrange(255) for _ in range(small)]
    rng.shuffle(sizes)
    ops, live, n = [], {}, 0
    for size in sizes:
        live[n] = size
        ops.append(("alloc", n, size))
        n += 1
    ops.append(("mark", 0, 0))
    for r in range(rounds):
        keys = list(live)
        rng.shuffle(keys)
        for k in keys[:len(keys) // 2]:
            size = live.pop(k)
            ops.append(("free", k, 0))
            live[n] = max(1, int(size * rng.uniform(0.5, 1.5)))
            ops.append(("alloc", n, live[n]))
            n += 1
        ops.append(("mark", r + 1, 0))
    return ops


def _churn(ctx, rows, notes):
    """reserved / peak requested after the first fill and after each churn round; beside it,
    the figure torch's pinned-allocator rule would give (computed)."""
    # the sizes (about 1.3 GB; quick too: it takes well under a second)
    hidden, mlp, layers, small = 2048, 5504, 8, 2000
    rounds = 3
    ops = _churn_ops(0, hidden, mlp, layers, small, rounds)
    ctx.progress("pool", 1, 1, f"churn: {len(ops)} operations, hidden {hidden}, MLP {mlp}, {layers} layers, "
                 f"{rounds} rounds")
    model = _power_of_two_model(ops, marks=True)
    # The pool as built, and (measured, the alternative its growth bound is
    # chosen over) the same pool splitting cached segments but giving none back.
    for contender, growth_limit in (("hipferry pool", None), ("hipferry pool, no growth bound (splitting only)", 0.0)):
        with PinnedPool(_growth_limit=growth_limit) as pool:
            live, requested, peak = {}, 0, 0
            for op, key, n in ops:
                if op == "alloc":
                    live[key] = pool.empty(n, dtype=torch.uint8)
                    requested += n
                    peak = max(peak, requested)
                elif op == "free":
                    requested -= live.pop(key).numel()
                else:
                    s = pool.stats()
                    what = "first fill" if key == 0 else f"after churn round {key}"
                    rows.append(_row(f"reserved/peak requested, {what}", peak, contender,
                                     s["reserved_bytes"] / peak, "ratio"))
                    if growth_limit is None:
                        rows.append(_row(f"reserved/peak requested, {what}", peak,
                                         "torch pinned rule (power of two, no splitting; computed)", model[key],
                                         "ratio"))
            del live
    notes.append("churn (issue 16): a random half freed and allocated again at sizes scaled by U(0.5, 1.5), "
                 f"{rounds} rounds; the torch rows apply torch's CachingHostAllocator rule to the same sequence "
                 "(computed, not measured)")


def _torch_reserved(stats, which):
    """Bytes torch's pinned allocator holds (active + cached), across torch versions."""
    for key in (f"allocated_bytes.{which}", f"reserved_bytes.{which}", f"allocated_bytes.all.{which}",
                f"reserved_bytes.all.{which}", f"segment.all.{which}"):
        if key in stats:
            return stats[key]
    return None


def _cold(ctx, rows, gpu):
    size = 64 * MiB if ctx.quick else 1 * GiB
    contenders = {f"pool provider={p}": p for p in (("auto", "register") if gpu else ("auto",))}
    if gpu:
        contenders["torch.empty(pin_memory=True)"] = None
    else:
        contenders["torch.empty (cpu)"] = None
    best = {k: (float("inf"), float("inf")) for k in contenders}
    rounds = 1 if ctx.quick else 3
    step = 0
    for _ in range(rounds):
        for name, provider in contenders.items():
            step += 1
            ctx.progress("pool", step, rounds * len(contenders), f"cold {size // MiB} MiB: {name}")
            if provider is not None:
                pool = PinnedPool(provider=provider)
                t0 = time.perf_counter()
                t = pool.empty(size, dtype=torch.uint8)
            else:
                if gpu:
                    host_empty_cache()
                t0 = time.perf_counter()
                t = torch.empty(size, dtype=torch.uint8, pin_memory=gpu)
            t1 = time.perf_counter()
            t.fill_(1)
            t2 = time.perf_counter()
            best[name] = (min(best[name][0], t1 - t0), min(best[name][1], t2 - t0))
            del t
            if provider is not None:
                pool.close()
            elif gpu:
                host_empty_cache()
    base = "torch.empty(pin_memory=True)" if gpu else "torch.empty (cpu)"
    for name in contenders:
        rows.append(_row("cold first allocation", size, name, best[name][0], "s", base, best[base][0]))
        rows.append(_row("cold allocation + first write", size, name, best[name][1], "s", base, best[base][1]))


@suite("pool")
def pool_suite(ctx: Context) -> SuiteResult:
    gpu = ctx.device == "cuda"
    rows = []
    _alloc_free(ctx, rows, gpu)
    from_python(ctx, rows, gpu)
    notes = []
    _overhead(ctx, rows, notes, gpu)
    _churn(ctx, rows, notes)
    _cold(ctx, rows, gpu)
    for r in rows:
        r["label"] = r["contender"]
    latency = [r for r in rows if r["measure"] == "alloc+free median"]
    plots = [{"x": "bytes", "y": "value", "series": "label", "rows": latency,
              "title": "cached allocate+free, median latency", "xlabel": "bytes", "ylabel": "ns (log)",
              "logy": True},
             {"kind": "bar", "x": "contender", "y": "ratio_to_baseline", "series": "measure",
              "ylabel": "time per call / torch's call (1 = torch; < 1: faster)",
              "rows": [r for r in rows if r["measure"].endswith("from Python")],
              "title": "one call from Python against torch's own (same run, best of interleaved rounds)"}]
    return SuiteResult(rows=rows, columns=["measure", "bytes", "contender", "value", "unit", "vs_baseline",
                                           "ratio_to_baseline"],
                       plots=plots,
                       notes=notes + ["vs_baseline > 1: better than the baseline (times: baseline/value)",
                              "alloc+free: per-pair wall clock in C++ (steady_clock, ~20 ns of it is the clock); "
                              "best median and best p99 over interleaved rounds",
                              "reserved/requested: ratio of bytes held from the system to bytes asked for",
                              "cold: a fresh pool per round; on the CPU nothing is pinned (ordinary memory)"])
