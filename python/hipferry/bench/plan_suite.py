"""Suite `plan`: the planner's own test. For each model size, every home of the
optimizer state is run for real (bench/plan_run.py, a process each) and its
measured peak resident growth and step time are set beside the planner's
prediction; then, for each host budget and set of allowed homes, the planner's
choice is set beside the best of the others that fit.

Targets (issue 34): memory within 10%, step time within 25%, the chosen home
never more than 10% slower than the fastest other home that fits."""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .harness import Context, SuiteResult, suite

# name: (family, hidden, layers, vocab, batch, tokens). The Llama sizes are the issue's
# table; the other families (their own attention, MLP, tied embeddings, loss shapes; other
# batches) were not used in setting the estimate and show how far it carries.
SIZES = {
    "llama-9m": ("llama", 256, 6, 8192, 2, 128),
    "llama-33m": ("llama", 512, 8, 8192, 2, 128),
    "llama-96m": ("llama", 768, 10, 16384, 2, 128),
}
FAMILIES_CHECK = {
    "gpt2-15m": ("gpt2", 384, 6, 12000, 2, 256),
    "mistral-19m": ("mistral", 256, 4, 32000, 2, 128),
    "qwen2-23m": ("qwen2", 384, 6, 16000, 2, 256),
    "gpt-neox-31m": ("gpt_neox", 512, 6, 12000, 4, 128),
}
QUICK_SIZES = {"llama-2m": ("llama", 128, 2, 2048, 2, 128)}
FAMILIES = {"all homes": None, "float32 homes": ("torch", "host-float32", "disk-float32")}
MEMORY_TOL, TIME_TOL, CHOICE_TOL = 0.10, 0.25, 0.10


def _child(spec: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "hipferry.bench.plan_run", json.dumps(spec)], capture_output=True,
                       text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"plan run {spec['home']} failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _budgets(runs: dict) -> list:
    """Host budgets that separate the homes, from the runs' predictions: all fit; float32
    in RAM does not (where the homes' needs, peak plus margin, allow it). The budget
    where only the disk fits needs the window shrunk: _disk_only_row plans and runs it."""
    need = {h: r["predicted"]["host_peak_bytes"] + r["predicted"]["host_margin_bytes"] for h, r in runs.items()}
    out = [("ample", int(max(need.values()) * 1.2))]
    ram_f32, rest = min(need["torch"], need["host-float32"]), max(need["host-8bit"], need["disk-float32"])
    if rest < ram_f32:
        out.append(("no float32 in RAM", (rest + ram_f32) // 2))
    return out


def _choice_rows(size: str, runs: dict, state_dir: str) -> list:
    from ..planner import Candidate, choose
    rows = []
    for budget_name, host in _budgets(runs):
        for family, homes in FAMILIES.items():
            cands = [Candidate(h, r["predicted"]["host_peak_bytes"], 0, r["predicted"]["disk_bytes"],
                               r["predicted"]["step_seconds"], host_margin=r["predicted"]["host_margin_bytes"])
                     for h, r in runs.items() if homes is None or h in homes]
            chosen = choose(cands, {"host_memory": host, "gpu_memory": None, "disk": None}, state_dir)
            measured = {h: runs[h]["measured_step"] for h in (c.home for c in cands if c.fits)}
            row = {"model": size, "host budget": f"{budget_name} ({host / 1e9:.2f} GB)", "homes": family,
                   "chosen": chosen.home if chosen else "none fits"}
            if chosen:
                others = {h: t for h, t in measured.items() if h != chosen.home}
                best = min(others, key=others.get) if others else None
                row.update({"chosen measured s": measured[chosen.home], "best other": best or "-",
                            "best other measured s": others[best] if best else None,
                            "chosen / best other": measured[chosen.home] / others[best] if best else None,
                            "chosen peak fits": runs[chosen.home]["measured_peak"] <= host})
                row["ok"] = (best is None or row["chosen / best other"] <= 1 + CHOICE_TOL) and row["chosen peak fits"]
            rows.append(row)
    return rows


def _disk_only_row(size: str, runs: dict, spec: dict) -> dict:
    """A host budget just under the 8-bit state in RAM: only a disk home, with its window
    shrunk to fit, can train. The planner chooses under that budget and the choice runs."""
    need_8bit = runs["host-8bit"]["predicted"]["host_peak_bytes"] + runs["host-8bit"]["predicted"]["host_margin_bytes"]
    budget = int(need_8bit * 0.95)
    out = _child({**spec, "home": None, "host_memory": budget})
    row = {"model": size, "host budget": f"disk only ({budget / 1e9:.2f} GB)", "homes": "all homes"}
    if out["home"] is None:  # at small sizes the smallest window plus margin needs more than the 8-bit state
        return {**row, "chosen": "none fits (no disk-only budget at this size)", "ok": None,
                "why": out["plan_error"].split(". ")[-1]}
    pred = next(c for c in out["candidates"] if c["home"] == out["home"])
    measured_step = statistics.median(out["step_times"][1:])
    window = pred["parts"].get("window_bytes")
    return {**row, "chosen": out["home"], "window MiB": window / 2**20 if window else None,
            "predicted need GB": (pred["host_peak_bytes"] + pred["host_margin_bytes"]) / 1e9,
            "measured peak GB": out["peak_bytes"] / 1e9, "chosen peak fits": out["peak_bytes"] <= budget,
            "memory error": (pred["host_peak_bytes"] - out["held_bytes"]) / out["measured_growth"] - 1,
            "time error": pred["step_seconds"] / measured_step - 1,
            "ok": out["home"].startswith("disk") and out["peak_bytes"] <= budget}


def _gpu_budget_row(size: str, runs: dict, spec: dict) -> dict:
    """On a GPU: a device budget 60% of what everything resident needs; the planner streams
    blocks or offloads activations (placement.py) to fit, and the choice runs."""
    budget = int(runs["torch"]["predicted"]["device_peak_bytes"] * 0.6)
    out = _child({**spec, "home": None, "gpu_memory": budget})
    row = {"model": size, "host budget": f"GPU {budget / 1e9:.2f} GB", "homes": "all homes"}
    if out["home"] is None:
        return {**row, "chosen": "none fits", "ok": False, "why": out["plan_error"][-300:]}
    pred, measured = out["chosen"], statistics.median(out["step_times"][1:])
    return {**row, "chosen": out["placement"], "predicted GPU peak GB": pred["device_peak_bytes"] / 1e9,
            "measured GPU peak GB": out["device_peak_bytes"] / 1e9,
            "GPU memory error": pred["device_peak_bytes"] / out["device_peak_bytes"] - 1,
            "time error": pred["step_seconds"] / measured - 1,
            "ok": out["device_peak_bytes"] <= budget and abs(pred["step_seconds"] / measured - 1) <= TIME_TOL}


@suite("plan")
def plan_suite(ctx: Context) -> SuiteResult:
    import torch

    from ..optim import HOMES
    from ..planner import measure_machine
    sizes = QUICK_SIZES if ctx.quick else {**SIZES, **FAMILIES_CHECK}
    base = ctx.disk_dir or tempfile.gettempdir()
    steps = 3 if ctx.quick else 7
    ctx.progress("plan", 0, len(sizes) * len(HOMES), "measuring the machine (refresh: this run's own figures)")
    with tempfile.TemporaryDirectory(dir=base, prefix="hipferry-plan-") as folder:
        device = torch.device("cuda", torch.cuda.current_device()) if ctx.device == "cuda" else torch.device("cpu")
        measure_machine(device, folder, refresh=True, rounds=1 if ctx.quick else 3)
        rows, choice_rows, i = [], [], 0
        for size, (family, hidden, layers, vocab, batch, tokens) in sizes.items():
            model_spec = {"family": family, "hidden": hidden, "layers": layers, "vocab": vocab, "batch": batch,
                          "seq": tokens, "steps": steps, "device": ctx.device}
            runs = {}
            for home in HOMES:
                i += 1
                ctx.progress("plan", i, len(sizes) * len(HOMES), f"{size}, state {home}: plan, then {steps} steps")
                state_dir = os.path.join(folder, f"{size}-{home}")
                out = _child({**model_spec, "home": home, "state_dir": state_dir})
                pred = next(c for c in out["candidates"] if c["home"] == home)
                measured_step = statistics.median(out["step_times"][1:])
                growth_pred = pred["host_peak_bytes"] - out["held_bytes"]
                runs[home] = {"predicted": pred, "measured_step": measured_step, "measured_peak": out["peak_bytes"]}
                mem_err = growth_pred / out["measured_growth"] - 1
                time_err = pred["step_seconds"] / measured_step - 1
                rows.append({"model": size, "table": "families" if size in FAMILIES_CHECK else "issue",
                             "params (M)": out["params"] / 1e6, "home": home, "batch": f"{batch} x {tokens}",
                             "predicted growth (MB)": growth_pred / 1e6,
                             "measured growth (MB)": out["measured_growth"] / 1e6, "memory error": mem_err,
                             "predicted step (s)": pred["step_seconds"], "measured step (s)": measured_step,
                             "time error": time_err, "memory ok": abs(mem_err) <= MEMORY_TOL,
                             "time ok": abs(time_err) <= TIME_TOL})
                if ctx.device == "cuda":
                    rows[-1].update({"predicted GPU peak (MB)": pred["device_peak_bytes"] / 1e6,
                                     "measured GPU peak (MB)": out["device_peak_bytes"] / 1e6})
            if size not in FAMILIES_CHECK:
                choice_rows += _choice_rows(size, runs, folder)
                ctx.progress("plan", i, len(sizes) * len(HOMES), f"{size}: the choice when only the disk fits")
                choice_rows.append(_disk_only_row(size, runs, {
                    **model_spec, "state_dir": os.path.join(folder, f"{size}-disk-only")}))
                if ctx.device == "cuda":
                    choice_rows.append(_gpu_budget_row(size, runs, {
                        **model_spec, "state_dir": os.path.join(folder, f"{size}-gpu-budget")}))
    notes = [f"peak resident growth: {out['measured_by']}, from the RSS before plan() to the peak of the steps; "
             f"step: median of steps 2..{steps} (forward, backward, step, zero_grad), a process per run",
             "the choice: for each budget and set of allowed homes, the planner picks from its predictions; "
             "'chosen / best other' compares the measured steps of the chosen home and the fastest other that fits"]
    for table, label in (("issue", "the Llama table"), ("families", "the other families")):
        group = [r for r in rows if r["table"] == table]
        for name, key, tol in (("memory", "memory error", MEMORY_TOL), ("step time", "time error", TIME_TOL)):
            if not group:
                continue
            worst = max(group, key=lambda r: abs(r[key]))
            inside = sum(abs(r[key]) <= tol for r in group)
            notes.append(f"{label}: target {name} within {tol:.0%}: "
                         f"{'met' if inside == len(group) else 'MISSED'} in {inside}/{len(group)} "
                         f"(worst {worst[key]:+.1%}: {worst['model']}, {worst['home']})")
    bad = [r for r in choice_rows if r.get("ok") is False]
    judged = [r for r in choice_rows if r.get("ok") is not None]  # (not: a disk-only budget that does not arise)
    unjudged = len(choice_rows) - len(judged)
    notes.append(f"target chosen home <= {1 + CHOICE_TOL:.2f}x the best other that fits: "
                 f"{'met' if not bad else 'MISSED'} in {len(judged) - len(bad)}/{len(judged)} configurations"
                 + (f" ({unjudged} disk-only budget(s) that do not arise at their size)" if unjudged else ""))
    for r in choice_rows:
        notes.append("choice: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in r.items()))
    plots = [{"x": "home", "y": "measured step (s)", "series": "model", "kind": "bar", "logx": False,
              "title": "Measured step time by home of the state", "ylabel": "seconds"},
             {"x": "home", "y": "memory error", "series": "model", "kind": "bar", "logx": False,
              "title": "Predicted / measured peak growth - 1", "ylabel": "relative error"}]
    return SuiteResult(rows=rows, columns=["model", "params (M)", "batch", "home", "predicted growth (MB)",
                                           "measured growth (MB)", "memory error", "predicted step (s)",
                                           "measured step (s)", "time error", "memory ok", "time ok"]
                       + (["predicted GPU peak (MB)", "measured GPU peak (MB)"] if ctx.device == "cuda" else []),
                       plots=plots, notes=notes)
