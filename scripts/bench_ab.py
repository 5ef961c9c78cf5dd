"""A/B benchmark of two hipferry builds installed side by side, interleaved.

    python scripts/bench_ab.py --a /tmp/old-site --b python --rounds 3 --out bench-ab \
        transfer optim layers activations [--quick]

Each round runs `python -m hipferry bench <suites>` once with build A on
PYTHONPATH and once with build B (alternating which goes first). CPU timings
on shared machines swing by 2x between runs, so each hipferry measurement is
first divided by a baseline measured in the SAME run (`--baseline
SUITE=CONTENDER_PREFIX`: the row of that contender with the same size / case;
defaults below: memcpy for transfer, torch's fused AdamW for optim, the model
without offload for layers and activations); then each build keeps the median
of its normalized values over the rounds (not the best: one slow baseline in
one run would make a ratio look best). Prints, per suite and field, the geometric
mean of B/A over hipferry's rows (time fields: < 1 is faster; rate fields:
> 1 is faster) and writes the per-row table as JSON next to the runs.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict

RATE_WORDS = ("gbps", "gb/s", "per_s", "throughput")
FIELDS = ("seconds", "step_s", "tokens_per_s", "GBps", "value")  # primary measures; the rest are derived
BASELINES = {"transfer": "memcpy", "optim": "torch AdamW fused=True", "layers": "no offload",
             "activations": "no offload", "pool": "torch.empty"}


def is_rate(field, row):
    f = field.lower()
    return any(w in f for w in RATE_WORDS) or str(row.get("unit", "")).lower() in ("gb/s", "gbps")


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def key_of(row):
    """Who and what a row measures (never an outcome such as a hit count, which differs between builds)."""
    return (("contender", row.get("contender")),) + group_of(row)


GROUP_KEYS = ("case", "direction", "bytes", "measure", "params", "regime", "width", "tokens", "layers")


def group_of(row):
    """What a row measures, apart from who: the same size / case / regime."""
    return tuple((k, row[k]) for k in GROUP_KEYS if k in row)


def normalized(rows, prefix):
    """Each row's primary fields divided by its group's baseline row (same run)."""
    base = {}
    for r in rows:
        if prefix and str(r.get("contender", "")).startswith(prefix):
            base.setdefault(group_of(r), r)
    out = []
    for r in rows:
        b = base.get(group_of(r))
        if b is None:
            continue
        out.append((r, {f: r[f] / b[f] for f in FIELDS if is_number(r.get(f)) and is_number(b.get(f))
                        and b[f] > 0 and r[f] > 0}))
    return out


def run(site, suites, out, quick, device, reuse=False):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(site))
    cmd = [sys.executable, "-m", "hipferry", "bench", *suites, "--out", out, "--device", device]
    if quick:
        cmd.append("--quick")
    if not reuse:
        print("$ PYTHONPATH=" + env["PYTHONPATH"] + " " + " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return {s: json.load(open(os.path.join(out, f"{s}.json")))["rows"] for s in suites}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="site dir (or package parent) of build A (the baseline)")
    ap.add_argument("--b", required=True, help="site dir of build B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-ab")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--baseline", action="append", default=[], metavar="SUITE=CONTENDER_PREFIX")
    ap.add_argument("--reuse", action="store_true", help="summarize the rounds already in --out, run nothing")
    ap.add_argument("suites", nargs="+")
    args = ap.parse_args()
    seen = {"a": defaultdict(dict), "b": defaultdict(dict)}  # build -> (suite, key) -> field -> values
    rows_of = {}
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for build in order:
            print(f"round {r + 1}/{args.rounds}: build {build.upper()}", flush=True)
            res = run(getattr(args, build), args.suites, os.path.join(args.out, f"{build}-{r + 1}"), args.quick,
                      args.device, args.reuse)
            for suite, rows in res.items():
                prefix = dict(BASELINES, **dict(b.split("=", 1) for b in args.baseline)).get(suite)
                for row, values in normalized(rows, prefix):
                    if "hipferry" not in str(row.get("contender", "")):
                        continue
                    k = (suite, key_of(row))
                    rows_of[k] = row
                    for f, v in values.items():
                        if math.isfinite(v):
                            seen[build][k].setdefault(f, []).append(v)
    median = {build: {k: {f: statistics.median(vs) for f, vs in fields.items()} for k, fields in per.items()}
              for build, per in seen.items()}
    table, summary = [], defaultdict(list)
    for k, fields in median["b"].items():
        for f, vb in fields.items():
            va = median["a"].get(k, {}).get(f)
            if va is None:
                continue
            ratio = vb / va
            table.append({"suite": k[0], "row": dict(k[1]), "field": f, "a": va, "b": vb, "b_over_a": ratio,
                          "kind": "rate" if is_rate(f, rows_of[k]) else "time"})
            summary[(k[0], f, table[-1]["kind"])].append(ratio)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab.json"), "w") as fh:
        json.dump(table, fh, indent=1)
    print(f"\n{'suite':<12} {'field':<24} {'kind':<5} {'rows':>4} {'geomean B/A':>12} {'min':>7} {'max':>7}")
    for (suite, f, kind), rs in sorted(summary.items()):
        g = math.exp(sum(math.log(x) for x in rs) / len(rs))
        print(f"{suite:<12} {f:<24} {kind:<5} {len(rs):>4} {g:>12.3f} {min(rs):>7.3f} {max(rs):>7.3f}")
    print(f"wrote {os.path.join(args.out, 'ab.json')}")


if __name__ == "__main__":
    main()
