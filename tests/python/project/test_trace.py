"""hipferry.trace() and trace_region(): the events recorded around prefetch /
offload (spec: docs/transfers.md, "Timeline") and the Chrome /
Perfetto JSON they are saved as. Run on the CPU worker, and on a GPU when one
is present."""
import json
import subprocess
import sys

import pytest
import torch

import hipferry
from conftest import requires_gpu, requires_test_hooks

MiB = 2**20
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
EVENT_KEYS = {"name", "category", "track", "start_ns", "end_ns", "bytes"}
CATEGORIES = {"copy", "kernel", "pack", "user", "optim"}


def finish(device):
    if device == "cuda":
        torch.cuda.synchronize()


def traced_work(device, path=None):
    """Inside a trace: a user region around a 1 MiB prefetch, then a 1 MiB offload
    (plain copies, pinned sources, large enough not to be packed). Returns the
    trace and the bytes moved."""
    a = hipferry.pin(torch.arange(MiB // 4, dtype=torch.float32))
    b = torch.arange(MiB // 4, dtype=torch.int32).to(device)
    with hipferry.trace(path) as tr:
        with hipferry.trace_region("forward"):
            t1 = hipferry.prefetch(a, device)
            out = t1.wait()
        t2 = hipferry.offload(b)
        back = t2.wait()
        finish(device)
    assert torch.equal(out.cpu(), a) and torch.equal(back, b.cpu())
    return tr, t1.nbytes + t2.nbytes


def named(events, name):
    return [e for e in events if e["name"] == name]


@pytest.mark.parametrize("device", DEVICES)
def test_events_have_the_spec_fields(device):
    tr, _ = traced_work(device)
    assert tr.events, "a trace around two transfers recorded nothing"
    for e in tr.events:
        assert EVENT_KEYS <= set(e), e
        assert isinstance(e["name"], str) and e["name"] and isinstance(e["track"], str) and e["track"]
        assert e["category"] in CATEGORIES, e
        assert isinstance(e["start_ns"], int) and isinstance(e["end_ns"], int) and isinstance(e["bytes"], int)
        assert e["end_ns"] >= e["start_ns"], e
        assert e["bytes"] >= 0


@pytest.mark.parametrize("device", DEVICES)
def test_user_region_and_copy_bytes(device):
    tr, moved = traced_work(device)
    assert moved == 2 * MiB
    (region,) = named(tr.events, "forward")
    assert region["category"] == "user"
    copies = [e for e in tr.events if e["category"] == "copy"]
    assert copies, f"no copy events in {[e['name'] for e in tr.events]}"
    assert sum(e["bytes"] for e in copies) == moved, [(e["name"], e["bytes"]) for e in copies]


@pytest.mark.parametrize("device", DEVICES)
def test_json_written_on_exit_is_chrome_trace(device, tmp_path):
    path = tmp_path / "trace.json"
    tr, _ = traced_work(device, str(path))
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert isinstance(events, list)
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["ph"] for e in events} <= {"X", "M"}  # complete events plus track names
    assert len(complete) == len(tr.events)
    assert sorted(e["name"] for e in complete) == sorted(e["name"] for e in tr.events)
    for e in complete:
        assert {"name", "cat", "ts", "dur", "pid", "tid"} <= set(e), e
        assert e["dur"] >= 0 and e["ts"] >= 0
    (region,) = [e for e in complete if e["name"] == "forward"]
    assert region["cat"] == "user"
    copy_bytes = sum(e["args"]["bytes"] for e in complete if e["cat"] == "copy")
    assert copy_bytes == 2 * MiB


def test_save_and_path_optional(tmp_path):
    tr, _ = traced_work("cpu")  # no path: nothing written on exit, events kept
    assert tr.events and not list(tmp_path.iterdir())
    out = tmp_path / "saved.json"
    tr.save(str(out))
    complete = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(tr.events)


def test_region_outside_a_trace_is_a_no_op():
    with hipferry.trace_region("lonely"):
        x = torch.ones(3) * 2
    assert torch.equal(x, torch.full((3,), 2.0))
    with hipferry.trace() as tr:
        pass
    assert named(tr.events, "lonely") == []


def test_work_outside_the_trace_is_not_recorded():
    hipferry.prefetch(torch.ones(MiB), "cpu").wait()
    with hipferry.trace_region("before"):
        pass
    with hipferry.trace() as tr:
        pass
    assert tr.events == [], tr.events
    hipferry.prefetch(torch.ones(MiB), "cpu").wait()
    assert tr.events == [], "a finished trace must not grow"


def test_region_closes_when_its_body_raises():
    with hipferry.trace() as tr:
        with pytest.raises(KeyError):
            with hipferry.trace_region("boom"):
                raise KeyError("x")
        with hipferry.trace_region("after"):
            pass
    users = [e["name"] for e in tr.events if e["category"] == "user"]
    assert "after" in users and set(users) <= {"boom", "after"}, users


def test_region_names_are_escaped_in_json(tmp_path):
    name = 'quote " back \\ tab \t newline \n unicode \u00e9'
    path = tmp_path / "t.json"
    with hipferry.trace(str(path)):
        with hipferry.trace_region(name):
            pass
    names = [e["name"] for e in json.loads(path.read_text(encoding="utf-8"))["traceEvents"] if e["ph"] == "X"]
    assert names == [name]


def test_nested_traces_are_supported_or_a_clear_error():
    outer_cm = hipferry.trace()
    outer = outer_cm.__enter__()
    try:
        inner_cm = hipferry.trace()
        try:
            inner = inner_cm.__enter__()
        except RuntimeError as e:
            assert "trace" in str(e) and any(w in str(e) for w in ("nest", "already", "active")), str(e)
            inner = None
        if inner is not None:
            with hipferry.trace_region("inside"):
                hipferry.prefetch(torch.ones(MiB), "cpu").wait()
            inner_cm.__exit__(None, None, None)
            assert len(named(inner.events, "inside")) == 1
        with hipferry.trace_region("outer only"):
            pass
    finally:
        outer_cm.__exit__(None, None, None)
    assert len(named(outer.events, "outer only")) == 1, "the outer trace keeps recording"
    if inner is not None:
        assert named(inner.events, "outer only") == [], "a closed inner trace must not grow"
        assert len(named(outer.events, "inside")) == 1, "the outer trace records what ran inside the inner one"


@requires_gpu
def test_gpu_copies_are_timed_on_a_stream_track():
    tr, _ = traced_work("cuda")
    tracks = {e["track"] for e in tr.events if e["category"] == "copy"}
    assert tracks and all("cuda" in t or "stream" in t for t in tracks), tracks


@requires_test_hooks
def test_host_copy_in_flight_when_the_trace_ends_is_recorded():
    src = torch.ones(MiB)  # 4 MiB: above the inline limit, a worker task
    with hipferry.trace() as tr:
        hipferry._C._testing.transfer_worker_sleep(100)
        t = hipferry.prefetch(src, "cpu")
    copies = [e for e in tr.events if e["category"] == "copy"]
    assert [e["bytes"] for e in copies] == [src.nbytes], tr.events
    assert copies[0]["track"] == "cpu transfer worker"
    assert torch.equal(t.wait(), src)


def test_copy_cast_is_traced_on_the_cpu():
    src = torch.randn(1000)
    dst = torch.empty(1000, dtype=torch.bfloat16)
    with hipferry.trace() as tr:
        hipferry.copy_cast_(dst, src)
    assert [(e["name"], e["track"], e["bytes"]) for e in tr.events] == [("copy_cast_", "caller thread", 2000)]


def test_timeline_command_draws_a_saved_trace(tmp_path):
    path = tmp_path / "t.json"
    traced_work("cpu", str(path))
    r = subprocess.run([sys.executable, "-m", "hipferry", "timeline", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from hipferry.bench.timeline import events_from_chrome_json
    events = events_from_chrome_json(json.loads(path.read_text()))
    assert {e["track"] for e in events} >= {"user"} and any(e["name"] == "forward" for e in events)
    assert all(e["end_ns"] >= e["start_ns"] for e in events)


def test_timeline_command_rejects_what_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"events": []}')
    r = subprocess.run([sys.executable, "-m", "hipferry", "timeline", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "not a Chrome trace" in r.stderr, r.stderr


# --- timeline: bad traces and bad --out are one-line errors, not tracebacks ---------------

GOOD_X = {"ph": "X", "pid": 1, "tid": 1, "name": "copy", "cat": "copy", "ts": 0.0, "dur": 2.0, "args": {"bytes": 8}}


def run_timeline(*args):
    return subprocess.run([sys.executable, "-m", "hipferry", "timeline", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in last, f"{n!r} should be in {last!r}"


def timeline_in_process(capsys, *args):
    """`python -m hipferry timeline ARGS` in this process (seconds faster than a subprocess): the exit code and
    captured output; an exception other than the CLI's SystemExit propagates and fails the test, as the
    traceback would."""
    from hipferry.__main__ import main
    try:
        rc = main(["timeline", *map(str, args)])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


@pytest.mark.parametrize("events,needles", [
    ([dict(GOOD_X, ts=float("inf"))], ["traceEvents[0]", "'ts'", "inf", "finite"]),
    ([GOOD_X, dict(GOOD_X, dur=float("-inf"))], ["traceEvents[1]", "'dur'", "finite"]),
    ([dict(GOOD_X, ts=float("nan"))], ["traceEvents[0]", "'ts'", "finite"]),
    ([dict(GOOD_X, ts=1e308)], ["traceEvents[0]", "'ts'"]),  # finite in us, not in ns
    ([dict(GOOD_X, args=[1, 2])], ["traceEvents[0]", "'args'", "object"]),
    ([{"ph": "M", "tid": 1, "name": "thread_name", "args": "worker"}, GOOD_X], ["traceEvents[0]", "'args'", "object"]),
    ([GOOD_X, 3, "event"], ["traceEvents[1]", "int", "object"]),
    ([dict(GOOD_X, cat=["copy"])], ["traceEvents[0]", "'cat'", "string"]),
    ([dict(GOOD_X, tid=[1])], ["traceEvents[0]", "'tid'"]),
    ([dict(GOOD_X, args={"bytes": "lots"})], ["traceEvents[0]", "'args.bytes'"]),
    ([{k: v for k, v in GOOD_X.items() if k != "ts"}], ["traceEvents[0]", "'ts'"]),
], ids=["ts-inf", "dur-inf", "ts-nan", "ts-overflows-ns", "args-list", "meta-args-str", "non-object", "cat-list",
        "tid-list", "bytes-str", "no-ts"])
def test_timeline_command_rejects_bad_events_in_one_line(tmp_path, capsys, events, needles):
    trace = tmp_path / "bad.json"
    trace.write_text(json.dumps({"traceEvents": events}))  # json writes inf/nan as Infinity/NaN, as json.loads reads
    r = timeline_in_process(capsys, trace)
    assert_one_line_error(r, "bad.json", *needles)
    assert not (tmp_path / "bad.png").exists()


def test_timeline_command_accepts_what_the_checks_allow(tmp_path, capsys):
    # The counterpart of the rejections above: ints or floats, a string tid, an event without args.
    trace = tmp_path / "ok.json"
    events = [GOOD_X, dict(GOOD_X, ts=5, dur=1, tid="worker"), {k: v for k, v in GOOD_X.items() if k != "args"}]
    trace.write_text(json.dumps({"traceEvents": events}))
    r = timeline_in_process(capsys, trace)
    assert r.returncode == 0, r.stderr
    from hipferry.bench.timeline import events_from_chrome_json
    got = events_from_chrome_json(json.loads(trace.read_text()))
    assert [(e["start_ns"], e["end_ns"], e["bytes"]) for e in got] == [(0, 2000, 8), (5000, 6000, 8), (0, 2000, 0)]


@pytest.mark.parametrize("where,needles", [
    ("missing-dir", ["--out", "does not exist"]),
    ("directory", ["--out", "is a directory"]),
    ("under-a-file", ["--out", "not a directory"]),
])
def test_timeline_command_rejects_an_out_it_cannot_write(tmp_path, capsys, where, needles):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [GOOD_X]}))
    (tmp_path / "plain").write_text("x")
    (tmp_path / "d.png").mkdir()
    out = {"missing-dir": tmp_path / "nope" / "t.png", "directory": tmp_path / "d.png",
           "under-a-file": tmp_path / "plain" / "t.png"}[where]
    r = timeline_in_process(capsys, trace, "--out", out)
    assert_one_line_error(r, str(out), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.png", "plain", "t.json"]  # nothing written
    assert not any((tmp_path / "d.png").iterdir())


def test_timeline_command_writes_exactly_the_out_path(tmp_path, capsys):
    # matplotlib adds ".png" to a name without an extension unless told the format: "wrote X" must be X.
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [GOOD_X]}))
    r = timeline_in_process(capsys, trace, "--out", tmp_path / "picture")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "picture").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "picture.png").exists()


def test_timeline_command_does_not_overwrite_its_trace(tmp_path, capsys):
    trace = tmp_path / "t.png"  # the default --out of "t.png" is "t.png"
    text = json.dumps({"traceEvents": [GOOD_X]})
    trace.write_text(text)
    r = timeline_in_process(capsys, trace)
    assert_one_line_error(r, "--out", "the trace itself")
    assert trace.read_text() == text


def test_timeline_command_line_prints_one_line_not_a_traceback(tmp_path):
    # The same checks through the real command line: exit status 2 and one line on stderr.
    trace = tmp_path / "bad.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "tid": 1, "ts": Infinity, "dur": 1}]}')
    r = run_timeline(trace)
    assert r.returncode == 2
    assert_one_line_error(r, "traceEvents[0] 'ts' is inf")
    trace.write_text(json.dumps({"traceEvents": [GOOD_X]}))
    r = run_timeline(trace, "--out", tmp_path)
    assert r.returncode == 2
    assert_one_line_error(r, "--out", "is a directory")


def test_the_optimizer_steps_and_copies_back_show_on_the_timeline():
    from offload_adamw_helpers import CpuRemoteOffloadAdamW
    from hipferry.optim import OffloadAdamW
    local_model, remote_model = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    local_opt = OffloadAdamW(local_model.parameters())
    remote_opt = CpuRemoteOffloadAdamW(remote_model.parameters(), step_on="cpu", min_offload_numel=0)
    with hipferry.trace() as tr:
        for model, opt in ((local_model, local_opt), (remote_model, remote_opt)):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
    optim = [e for e in tr.events if e["category"] == "optim"]
    tracks = {e["track"] for e in optim}
    assert {"OffloadAdamW step", "OffloadAdamW copies back"} <= tracks, tracks
    steps = [e for e in optim if e["track"] == "OffloadAdamW step"]
    assert len(steps) == 4 and {e["bytes"] for e in steps} == {64 * 32 * 4, 32 * 4}
    backs = [e for e in optim if e["track"] == "OffloadAdamW copies back"]
    assert len(backs) == 2 and all(e["end_ns"] >= e["start_ns"] for e in backs)
    # outside a trace nothing is recorded
    with hipferry.trace() as empty:
        pass
    local_model(torch.randn(4, 64)).sum().backward()
    local_opt.step()
    assert [e for e in empty.events if e["category"] == "optim"] == []
