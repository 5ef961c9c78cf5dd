"""`python -m hipferry bench plan --quick`: the planner's validation suite end to end
(every home run for real in a process of its own, set beside its prediction; the
choice set beside the others). The figures themselves are the full suite's
(docs/measurements.md); here: that every part is measured and reported."""
import json
import os
import subprocess
import sys

from hipferry.optim import HOMES


def test_the_quick_validation_runs_every_home_and_reports_each_target(tmp_path):
    env = {**os.environ, "HIPFERRY_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", "plan", "--quick", "--out", str(tmp_path / "out"),
                        "--disk-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[plan] {len(HOMES)}/{len(HOMES)} llama-2m, state {HOMES[-1]}" in r.stderr  # progress
    assert "1,000 steps write" not in r.stderr, "the machine's measurement gives no wear warning"
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    rows = {row["home"]: row for row in doc["rows"]}
    assert sorted(rows) == sorted(HOMES)
    for row in rows.values():
        assert row["predicted growth (MB)"] > 0 and row["measured growth (MB)"] > 0
        assert 0 < row["predicted step (s)"] and 0 < row["measured step (s)"]
        assert row["memory ok"] == (abs(row["memory error"]) <= 0.10)
    notes = doc["notes"]
    assert any(n.startswith("the Llama table: target memory within 10%") for n in notes)
    assert any(n.startswith("the Llama table: target step time within 25%") for n in notes)
    choices = [n for n in notes if n.startswith("choice: ")]
    assert choices and all("chosen" in n for n in choices)
    assert (tmp_path / "out" / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("hipferry-plan-")], "its state folders are removed"


def test_the_gpu_budget_row_judges_the_placement_that_ran(monkeypatch):
    """The GPU row (run by scripts/gpu_check.sh when a GPU is lent) from what a run reports:
    its budget is 60% of the all-resident peak, and it is judged on the measured peak and time."""
    from hipferry.bench import plan_suite
    asked = []

    def child(spec):
        asked.append(spec)
        return {"home": "host-8bit", "placement": "host-8bit +stream 3/8 (3 slots)", "device_peak_bytes": 5.5e8,
                "step_times": [2.0, 1.0, 1.1, 0.9],
                "chosen": {"device_peak_bytes": 5.0e8, "step_seconds": 1.2}}
    monkeypatch.setattr(plan_suite, "_child", child)
    runs = {"torch": {"predicted": {"device_peak_bytes": 1.0e9}}}
    row = plan_suite._gpu_budget_row("llama-9m", runs, {"steps": 4})
    assert asked == [{"steps": 4, "home": None, "gpu_memory": 600000000}]
    assert row["chosen"] == "host-8bit +stream 3/8 (3 slots)" and row["ok"] is True
    assert abs(row["GPU memory error"] - (5.0 / 5.5 - 1)) < 1e-12 and abs(row["time error"] - (1.2 / 1.0 - 1)) < 1e-12
    monkeypatch.setattr(plan_suite, "_child", lambda spec: {"home": None, "plan_error": "no placement fits"})
    assert plan_suite._gpu_budget_row("llama-9m", runs, {})["ok"] is False
