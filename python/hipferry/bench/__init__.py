"""`python -m hipferry bench`: named benchmark suites -> table, JSON and PNG plots.

A suite is a function ``(ctx) -> SuiteResult`` registered with ``@suite("name")``
(bench/harness.py, which the suites import; this runner imports the suites).
Contenders are always measured side by side in one run (interleaved, repeated,
best kept), so ratios hold on a noisy machine.
"""
import json
import os
import sys
from typing import Dict, List

from .harness import SUITES as _SUITES
from .harness import (Context, SuiteResult, best_of_interleaved, gpu_timer, sizes_by_four, suite,  # noqa: F401
                      wall_timer)


def format_table(columns: List[str], rows: List[dict]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def write_plot(path: str, plot: dict, rows: List[dict]) -> bool:
    """plot: {"x": col, "y": col, "series": col, "title": str, "logx": bool, "logy": bool, "ylabel": str,
    "rows": the rows to draw, when not all of them, "kind": "line" (default) or "bar"}. Bar charts: one
    group of bars per value of x (a category, in row order), one bar per series in each group;
    rows whose y is not a number (e.g. "n/a") are left out."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("matplotlib not installed: no plot written (pip install matplotlib)\n")
        return False
    rows = plot.get("rows", rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    if plot.get("kind") == "bar":
        _draw_bars(ax, plot, rows)
    else:
        series = sorted({r[plot["series"]] for r in rows})
        for s in series:
            pts = sorted((r[plot["x"]], r[plot["y"]]) for r in rows if r[plot["series"]] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        if plot.get("logx", True):
            ax.set_xscale("log", base=2)
    if plot.get("logy", False):
        ax.set_yscale("log")
    ax.set_xlabel(plot.get("xlabel", plot["x"]))
    ax.set_ylabel(plot.get("ylabel", plot["y"]))
    ax.set_title(plot.get("title", ""))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # bar charts without series have none
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _draw_bars(ax, plot: dict, rows: List[dict]) -> None:
    rows = [r for r in rows if isinstance(r.get(plot["y"]), (int, float))]
    cats = list(dict.fromkeys(r[plot["x"]] for r in rows))
    series = list(dict.fromkeys(r[plot["series"]] for r in rows)) if plot.get("series") else [None]
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        value = {r[plot["x"]]: r[plot["y"]] for r in rows if s is None or r[plot["series"]] == s}
        xs = [j + (i - (len(series) - 1) / 2) * width for j, c in enumerate(cats) if c in value]
        ax.bar(xs, [value[c] for c in cats if c in value], width, label=s)
    ax.set_xticks(range(len(cats)), [str(c) for c in cats], rotation=15, ha="right", fontsize=8)


def available() -> List[str]:
    _load_suites()
    return sorted(_SUITES)


def _load_suites() -> None:
    # The suites register themselves (into harness.SUITES) as they load; loaded on demand, so that
    # importing one module of the package (bench.timeline, bench.disk_rss) loads no suite.
    from . import (copy_cast_suite, disk_suite, layers_suite, offload_suite, optim_suite, plan_suite,  # noqa: F401
                   pool_suite, transfer_suite)


def prepare_out_dir(out_dir: str) -> None:
    """Makes the directory `out_dir` (and its parents) if missing; raises ValueError naming --out and why
    it cannot hold the results (an existing file, a parent that is a file, no permission)."""
    if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir):
        raise ValueError(f"hipferry bench: --out must be a directory path, got {out_dir!r}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"hipferry bench: --out {os.fspath(out_dir)!r} is an existing file; expected a directory "
                         "(made if missing)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        parent = os.path.dirname(os.path.abspath(out_dir))
        while parent and not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        why = f"{parent!r} is a file, not a directory" if os.path.isfile(parent) else (e.strerror or str(e))
        raise ValueError(f"hipferry bench: --out {os.fspath(out_dir)!r} cannot be created: {why}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"hipferry bench: --out {os.fspath(out_dir)!r} is not writable; expected a directory "
                         "this user can write to")


def run(names: List[str], out_dir: str, ctx: Context) -> Dict[str, dict]:
    _load_suites()
    unknown = [n for n in names if n not in _SUITES]
    if unknown:
        raise ValueError(f"hipferry bench: unknown suite(s) {unknown}; expected one of {sorted(_SUITES)}")
    prepare_out_dir(out_dir)  # before any suite runs: a bad --out must not cost a run's minutes
    ctx.out_dir = out_dir
    results = {}
    for name in names or sorted(_SUITES):
        res: SuiteResult = _SUITES[name](ctx)
        print(f"\n== {name} ==")
        print(format_table(res.columns, res.rows))
        for n in res.notes:
            print(f"note: {n}")
        doc = {"suite": name, "device": ctx.device, "quick": ctx.quick, "rows": res.rows, "notes": res.notes,
               "environment": _environment()}
        json_path = os.path.join(out_dir, f"{name}.json")
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        written = [json_path]
        for i, plot in enumerate(res.plots):
            png = os.path.join(out_dir, f"{name}{'' if i == 0 else '_' + str(i)}.png")
            if write_plot(png, plot, res.rows):
                written.append(png)
        print("wrote " + ", ".join(written))
        results[name] = doc
    return results


def _environment() -> dict:
    import platform
    import torch
    from .. import platform as hf_platform
    return {"torch": torch.__version__, "hipferry_build": hf_platform.build_info(),
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "python": platform.python_version()}
