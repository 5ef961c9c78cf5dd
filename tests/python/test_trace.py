"""hipferry.trace() and trace_region(): the events recorded around prefetch /
offload (spec: docs/transfer-engine-plan.md, "Trace") and the Chrome /
Perfetto JSON they are saved as. Run on the CPU worker, and on a GPU when one
is present."""
import json
import subprocess
import sys

import pytest
import torch

import hipferry
from conftest import requires_gpu

MiB = 2**20
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
EVENT_KEYS = {"name", "category", "track", "start_ns", "end_ns", "bytes"}
CATEGORIES = {"copy", "kernel", "pack", "user"}


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


def test_host_copy_in_flight_when_the_trace_ends_is_recorded():
    src = torch.ones(MiB)  # 4 MiB: above the inline limit, a worker task
    with hipferry.trace() as tr:
        hipferry._C.transfer_worker_sleep(100)
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
