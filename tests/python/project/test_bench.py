import json
import subprocess
import sys

import pytest

from hipferry import bench


def test_bench_quick_suite_writes_table_json_and_plot(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", "copy_cast", "--quick", "--max-bytes", "65536",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[copy_cast] 1/" in r.stderr  # progress
    assert "hipferry copy_cast_" in r.stdout and "torch copy_" in r.stdout
    doc = json.loads((tmp_path / "copy_cast.json").read_text())
    sizes = sorted({row["bytes"] for row in doc["rows"]})
    assert sizes == [4096, 16384, 65536]
    assert all(row["GBps"] > 0 for row in doc["rows"])
    png = (tmp_path / "copy_cast.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def run_main(args, capsys):
    """(exit status, stdout, stderr) of `python -m hipferry ARGS`, run in this process: the refusals
    below come before any suite runs, so no interpreter and torch import per case."""
    from hipferry.__main__ import main
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_unknown_suite_is_a_clear_error(tmp_path, capsys):
    code, _, err = run_main(["bench", "nope", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "unknown suite(s) ['nope']" in err


@pytest.mark.parametrize("args,msg", [(["--repeats", "0"], "--repeats must be >= 1"),
                                      (["--max-bytes", "10"], "--max-bytes must be >= 4096")])
def test_bad_arguments(args, msg, tmp_path, capsys):
    code, _, err = run_main(["bench", *args, "--out", str(tmp_path)], capsys)
    assert code == 2 and msg in err


@pytest.mark.parametrize("where,msg", [("existing-file", "is an existing file; expected a directory"),
                                       ("under-a-file", "is a file, not a directory")])
def test_out_that_cannot_be_a_directory_is_a_one_line_error_before_any_suite_runs(tmp_path, where, msg, capsys):
    plain = tmp_path / "results"
    plain.write_text("keep me")
    out = plain if where == "existing-file" else plain / "sub"  # root ignores permissions: a file in the way
    # (in this process: an exception instead of the one line would fail the test here)
    code, stdout, stderr = run_main(["bench", "copy_cast", "--quick", "--max-bytes", "4096", "--out", str(out)],
                                    capsys)
    assert code == 2, stdout + stderr
    last = stderr.strip().splitlines()[-1]
    assert f"--out {str(out)!r}" in last and msg in last, last
    assert "[copy_cast]" not in stderr and "== copy_cast ==" not in stdout  # no suite ran
    assert plain.read_text() == "keep me"


def test_prepare_out_dir_makes_missing_parents(tmp_path):
    out = tmp_path / "a" / "b"
    bench.prepare_out_dir(str(out))
    assert out.is_dir()
    bench.prepare_out_dir(str(out))  # an existing directory is fine


def test_best_of_interleaved_keeps_each_minimum():
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}
    best = bench.best_of_interleaved({k: (lambda k=k: next(times[k])) for k in times}, repeats=3)
    assert best == {"a": 1.0, "b": 4.0}


def test_format_table_aligns_columns():
    out = bench.format_table(["x", "value"], [{"x": 1, "value": 2.5}, {"x": 100, "value": 12345.6}])
    lines = out.splitlines()
    assert len({len(line) for line in lines}) == 1 and "12346" in lines[-1]


def test_pool_suite_measures_every_contender(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", "pool", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[pool] 1/" in r.stderr
    rows = json.loads((tmp_path / "pool.json").read_text())["rows"]
    measures = {row["measure"] for row in rows}
    assert {"alloc+free median", "alloc+free p99", "reserved/requested at peak", "cold first allocation",
            "cold allocation + first write"} <= measures
    latency = {row["contender"] for row in rows if row["measure"] == "alloc+free median"}
    assert {"hipferry pool (allocator)", "hipferry pool.empty (tensor)", "torch.empty (cpu, malloc)"} <= latency
    assert all(row["value"] > 0 for row in rows)
    # Bytes held can never be fewer than bytes asked for.
    assert all(row["value"] >= 1.0 for row in rows if row["measure"].startswith("reserved/requested"))
    assert (tmp_path / "pool.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "pool_1.png").read_bytes()[:4] == b"\x89PNG"  # the from-Python bars
    # From Python (issue 25): each public call beside torch's own, with a ratio to it, and the stages.
    calls = {}
    for row in rows:
        if row["measure"].endswith("from Python"):
            calls.setdefault(row["measure"], {})[row["contender"]] = row
    assert set(calls) == {"alloc+free from Python", "pin from Python", "prefetch of 64 small from Python"}
    alloc = calls["alloc+free from Python"]
    assert {"torch.empty((n,), dtype=float32)", "pool.empty((n,), dtype=float32)",
            "before: pool.empty's checks + the op (dispatcher)"} <= set(alloc)
    assert "hipferry.pin(t, pool)" in calls["pin from Python"]
    for rows_of_measure in calls.values():
        base = [row for row in rows_of_measure.values() if row["contender"] == row["baseline"]]
        assert len(base) == 1 and base[0]["ratio_to_baseline"] == 1.0
        assert all(row["value"] > 0 and row["ratio_to_baseline"] > 0 for row in rows_of_measure.values())
    # Churn (issue 16): the pool within its bound after the first fill and every round, beside the
    # measured alternative without the bound and torch's rule computed on the same sequence.
    churn = {(row["measure"], row["contender"]): row["value"] for row in rows
             if row["measure"].startswith("reserved/peak requested")}
    fills = [m for m, c in churn if c == "hipferry pool"]
    assert len(fills) == 4 and "reserved/peak requested, first fill" in fills
    for m in fills:
        assert 1.0 <= churn[(m, "hipferry pool")] <= (1.15 if m.endswith("first fill") else 1.25), m
        assert churn[(m, "torch pinned rule (power of two, no splitting; computed)")] >= 1.0
        assert churn[(m, "hipferry pool, no growth bound (splitting only)")] >= 1.0


def test_transfer_suite_measures_every_case_and_draws_a_timeline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", "transfer", "--quick", "--max-bytes", "65536",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[transfer] 1/" in r.stderr
    doc = json.loads((tmp_path / "transfer.json").read_text())
    rows = doc["rows"]
    bw = [row for row in rows if row["case"] == "bandwidth"]
    assert sorted({row["bytes"] for row in bw}) == [4096, 16384, 65536]
    assert {row["direction"] for row in bw} == {"h2d", "d2h"}
    contenders = {row["contender"] for row in bw}
    assert {"hipferry prefetch (pool)", "hipferry prefetch (pageable, staged)", "hipferry offload (pool)"} <= contenders
    assert all(row["GBps"] > 0 and row["fraction_of_best_pinned"] > 0 for row in bw)
    assert len([row for row in rows if row["case"] == "many_small"]) == 2
    overlap = [row for row in rows if row["case"] == "overlap"]
    assert len(overlap) == 4 and all(row["seconds"] > 0 for row in overlap)
    assert any(row["contender"].startswith("overlapped") and row["overlapped_over_longer"] > 0 for row in overlap)
    if doc["device"] == "cuda":
        assert len([row for row in rows if row["case"].startswith("copy_cast")]) == 2
    for png in ("transfer.png", "transfer_1.png", "transfer_timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert any("transfer_timeline.png" in note for note in doc["notes"])
    trace = json.loads((tmp_path / "transfer_trace.json").read_text())
    assert trace["traceEvents"]


def test_optim_suite_measures_every_contender_against_the_bound(tmp_path):
    import math
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", "optim", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[optim] 1/" in r.stderr
    doc = json.loads((tmp_path / "optim.json").read_text())
    rows = doc["rows"]
    triad = [row for row in rows if row["measure"] == "triad"]
    assert len(triad) == 1 and triad[0]["GBps"] > 0
    torch_names = ["torch AdamW fused=True", "torch AdamW foreach=True", "torch AdamW for-loop (foreach=False)"]
    hf = "hipferry OffloadAdamW (CPU engine)"
    expected = {"step fp32": [hf] + torch_names,
                "step bf16+master": [hf] + [n + " + copy_ to bf16" for n in torch_names]}
    for measure, names in expected.items():
        got = [row for row in rows if row["measure"] == measure]
        assert sorted(row["contender"] for row in got) == sorted(names), measure
        for row in got:
            assert math.isfinite(row["seconds"]) and row["seconds"] > 0, row
            # A step can beat the DRAM triad bound (its stores are in place, part of its working set may
            # sit in cache, the triad may have shared the memory bus): this catches unit errors only.
            assert 0 < row["fraction_of_bound"] < 3, row
            assert row["hipferry_speedup"] > 0, row
    # Issue 26: the overlapped step against the plain one, its speculations kept or redone as clipping says.
    overlap = {(row["measure"], row["contender"]): row for row in rows if row["measure"].startswith("overlap")}
    for regime in ("clipping never fires", "clipping always fires"):
        plain = overlap[(f"overlap on cpu, {regime}", "OffloadAdamW(overlap=None)")]
        spec = overlap[(f"overlap on cpu, {regime}", "OffloadAdamW(overlap='backward')")]
        assert plain["committed"] == plain["redone"] == 0 and plain["critical_path_vs_plain"] == 1.0
        assert all(row["backward_end_to_step_end_s"] > 0 and row["iteration_s"] > row["backward_s"] > 0
                   for row in (plain, spec))
        assert (spec["committed"] > 0 and spec["redone"] == 0) if regime.endswith("never fires") else \
            (spec["redone"] > 0 and spec["committed"] == 0), spec
    gpu_rows = [row for row in rows if row["measure"].startswith("gpu step")]
    if doc["device"] == "cuda":
        assert gpu_rows and all(math.isfinite(row["seconds"]) and row["seconds"] > 0 for row in gpu_rows)
        assert any(0 < row.get("fraction_of_link_bound", 0) for row in gpu_rows)
    else:
        assert not gpu_rows and any("GPU part skipped" in note for note in doc["notes"])
    assert any(note.startswith("target never slower than fused=True") for note in doc["notes"])
    for png in ("optim.png", "optim_1.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def _run_quick_suite(name, tmp_path):
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", name, "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"[{name}] 1/" in r.stderr  # progress
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_layers_suite_measures_every_contender_generating_the_same_tokens(tmp_path):
    import math
    doc = _run_quick_suite("layers", tmp_path)
    rows = {row["contender"]: row for row in doc["rows"]}
    hf = ["hipferry offload_layers(prefetch=2)", "hipferry offload_layers(prefetch=1)"]
    acc_map, acc_cpu = "accelerate device_map (same budget)", "accelerate cpu_offload"
    expected = ["no offload", *hf]
    try:
        import accelerate  # noqa: F401
        expected += [acc_map, acc_cpu]
    except ImportError:
        assert any("accelerate not importable" in note for note in doc["notes"])
    assert sorted(rows) == sorted(expected)
    for row in rows.values():
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
        assert row["seconds"] > 0 and row["vs_no_offload"] > 0, row
        # Measured on a GPU, the weights each would hold on one on the CPU: a number for every contender.
        assert row["device_MiB"] > 0, row
    for name in hf:
        assert rows[name]["ring_MiB"] > 0 and rows[name]["device_MiB"] >= rows[name]["ring_MiB"]
    assert any("same tokens (checked)" in note for note in doc["notes"])
    if acc_map in rows:
        for row in rows.values():
            assert row["vs_device_map"] > 0 and row["vs_cpu_offload"] > 0, row
        # The same budget: accelerate's device map never holds more than hipferry prefetch=2 (it keeps room
        # for one block but loads one leaf module at a time); cpu_offload holds far less.
        assert rows[acc_map]["device_MiB"] <= rows[hf[0]]["device_MiB"] * (1.02 if doc["device"] == "cuda" else 1)
        assert rows[acc_cpu]["device_MiB"] < rows[acc_map]["device_MiB"]
        assert any(note.startswith("equal device memory") and "of 4 blocks" in note for note in doc["notes"])
        target = [note for note in doc["notes"] if note.startswith("target hipferry prefetch=2 >= 3x accelerate")]
        assert len(target) == 1 and "at equal device memory (vs_device_map" in target[0]
        if doc["device"] == "cpu":
            assert "applies on a GPU only" in target[0]
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_activations_suite_measures_every_contender_in_both_regimes(tmp_path):
    import math
    doc = _run_quick_suite("activations", tmp_path)
    rows = doc["rows"]
    contenders = ["no offload", "torch save_on_cpu", "hipferry offload_activations"]
    for regime in ("wide", "narrow"):
        got = [row for row in rows if row["regime"] == regime]
        assert sorted(row["contender"] for row in got) == sorted(contenders), regime
        for row in got:
            assert math.isfinite(row["step_s"]) and row["step_s"] > 0 and row["vs_no_offload"] > 0, row
        hf = next(row for row in got if row["contender"] == "hipferry offload_activations")
        assert hf["grads_equal"] == "yes" and hf["offloaded_MiB"] > 0
        assert hf["prefetch_hits"] + hf["prefetch_late"] + hf["prefetch_misses"] > 0
    assert any("target <= 10% overhead" in note for note in doc["notes"])
    if doc["device"] == "cpu":
        assert any("scheduling overhead only" in note for note in doc["notes"])
    for png in ("activations.png", "activations_1.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_bar_plot_skips_rows_without_a_number(tmp_path):
    rows = [{"contender": "a", "value": 2.0, "regime": "x"}, {"contender": "b", "value": "n/a", "regime": "x"},
            {"contender": "a", "value": 1.0, "regime": "y"}]
    path = tmp_path / "bars.png"
    assert bench.write_plot(str(path), {"kind": "bar", "x": "contender", "y": "value", "series": "regime"}, rows)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_disk_suite_measures_the_disk_and_the_steps_on_the_named_folder(tmp_path):
    import shutil
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run([sys.executable, "-m", "hipferry", "bench", "disk", "--quick", "--disk-dir", str(disk),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[disk] 1/" in r.stderr and "steps: round 1/1" in r.stderr  # progress
    assert list(disk.iterdir()) == []  # its work folder is removed
    doc = json.loads((tmp_path / "out" / "disk.json").read_text())
    rows = {(row["measure"], row["contender"]): row for row in doc["rows"]}
    speed = {c: row["GBps"] for (m, c), row in rows.items() if m == "disk speed"}
    assert {"own reader (DiskIo.raw_pass)", "own writer (DiskIo.raw_pass)"} <= set(speed)
    if shutil.which("fio"):
        assert {"fio read (io_uring, direct)", "fio write (io_uring, direct)"} <= set(speed)
    assert all(v > 0 for v in speed.values())
    steps = {c: row for (m, c), row in rows.items() if m == "step"}
    assert set(steps) == {"step float32 state, io auto", "step float32 state, io threads", "step 8-bit state"}
    assert steps["step float32 state, io threads"]["io_backend"] == "threads"
    state_mib = 4 * 8  # float32 state = 4 windows of 8 MiB: each step reads it and writes it once
    for name in ("step float32 state, io auto", "step float32 state, io threads"):
        assert state_mib - 0.1 <= steps[name]["read_MiB"] == steps[name]["written_MiB"] <= state_mib + 1
        assert 0 < steps[name]["efficiency"] and steps[name]["seconds"] > 0
    assert 0.4 < steps["step 8-bit state"]["ratio"] <= 0.55  # bytes, not time: the same on any machine
    [rss] = [row for (m, _), row in rows.items() if m == "peak RSS growth"]
    assert 0 < rss["ratio"] and rss["window_MiB"] == 8
    verdicts = [n for n in doc["notes"] if n.startswith("target ")]
    assert len(verdicts) == 4 and all(": met: " in n or ": MISSED: " in n for n in verdicts)
    assert (tmp_path / "out" / "disk.png").read_bytes()[:4] == b"\x89PNG"


def test_disk_suite_refuses_a_folder_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, _, err = run_main(["bench", "disk", "--quick", "--disk-dir", str(missing), "--out", str(tmp_path)], capsys)
    assert code == 2 and f"--disk-dir {str(missing)!r} is not a directory" in err
