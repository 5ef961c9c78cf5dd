"""A timeline PNG of `hipferry.trace()` events: one row per track, bars coloured
by category, time in ms from the earliest event on x.

Events are the dicts `hipferry.trace()` records: name, category, track,
start_ns, end_ns, bytes. Chrome/Perfetto JSON (`tr.save(path)`) is the
interactive view; this is the picture that goes next to the benchmark's plots.
"""
import math
import sys
from typing import Iterable, List

_COLOURS = {"copy": "tab:blue", "kernel": "tab:orange", "pack": "tab:green", "user": "tab:gray"}
_OTHER = ["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:red"]


def _tracks(events: List[dict]) -> List[str]:
    """Tracks in order of first appearance (by start time), user regions last."""
    order = []
    for e in sorted(events, key=lambda e: e["start_ns"]):
        if e["track"] not in order:
            order.append(e["track"])
    return [t for t in order if t != "user"] + [t for t in order if t == "user"]


def write_timeline_png(path: str, events: Iterable[dict], title: str = "") -> bool:
    """Draws `events` into `path`. Returns False (saying why on stderr) when
    matplotlib is missing or there is nothing to draw."""
    events = list(events)
    if not events:
        sys.stderr.write(f"timeline: no trace events, {path} not written\n")
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        sys.stderr.write("matplotlib not installed: no timeline written (pip install matplotlib)\n")
        return False
    origin = min(e["start_ns"] for e in events)
    tracks = _tracks(events)
    colours = dict(_COLOURS)
    for c in sorted({e["category"] for e in events} - set(colours)):
        colours[c] = _OTHER[len(colours) % len(_OTHER)]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(tracks)))
    for e in events:
        row = tracks.index(e["track"])
        start = (e["start_ns"] - origin) / 1e6
        width = max((e["end_ns"] - e["start_ns"]) / 1e6, 1e-4)  # zero-length events stay visible
        ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=colours[e["category"]],
                       edgecolors="black", linewidth=0.3)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels(tracks, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    used = sorted({e["category"] for e in events})
    ax.legend(handles=[Patch(color=colours[c], label=c) for c in used], fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # exactly `path`, no extension added
    plt.close(fig)
    return True


def events_from_chrome_json(doc: dict) -> List[dict]:
    """The events of a trace saved by `hipferry.trace(path)` (Chrome trace
    JSON: "X" events, tracks named by "thread_name" metadata), as the dicts
    `write_timeline_png` takes. Raises ValueError, naming the event and the
    field, for JSON that is not one (``json.load`` also accepts ``Infinity``
    and ``NaN``: they are rejected here)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
    raw = doc["traceEvents"]
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            raise ValueError(f"traceEvents[{i}] is {_kind(e)}; expected an object")
        if "args" in e and not isinstance(e["args"], dict):
            raise ValueError(f"traceEvents[{i}] 'args' is {_kind(e['args'])}; expected an object")
        if "tid" in e and (isinstance(e["tid"], bool) or not isinstance(e["tid"], (int, str))):
            raise ValueError(f"traceEvents[{i}] 'tid' is {_kind(e['tid'])}; expected an integer or a string")
    names = {}
    for i, e in enumerate(raw):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            name = e.get("args", {}).get("name")
            if name is not None and not isinstance(name, str):
                raise ValueError(f"traceEvents[{i}] 'args.name' is {_kind(name)}; expected a string")
            names[e.get("tid")] = name
    events = []
    for i, e in enumerate(raw):
        if e.get("ph") != "X":
            continue
        if "ts" not in e:
            raise ValueError(f"traceEvents[{i}] has no 'ts'; expected the start time of an \"X\" event")
        for key in ("name", "cat"):
            if not isinstance(e.get(key, ""), str):
                raise ValueError(f"traceEvents[{i}] '{key}' is {_kind(e[key])}; expected a string")
        start = _nanoseconds(e["ts"], i, "ts")
        nbytes = e.get("args", {}).get("bytes", 0)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes):
            raise ValueError(f"traceEvents[{i}] 'args.bytes' is {_kind(nbytes)}; expected a finite number")
        events.append({"name": e.get("name", ""), "category": e.get("cat", ""),
                       "track": names.get(e.get("tid")) or f"track {e.get('tid')}", "start_ns": start,
                       "end_ns": start + _nanoseconds(e.get("dur", 0), i, "dur"), "bytes": int(nbytes)})
    return events


def _nanoseconds(us, i: int, key: str) -> int:
    """A Chrome trace time (microseconds, a finite number) in nanoseconds."""
    if isinstance(us, bool) or not isinstance(us, (int, float)) or not math.isfinite(us):
        raise ValueError(f"traceEvents[{i}] '{key}' is {_kind(us)}; expected a finite number of microseconds")
    ns = float(us) * 1e3
    if not math.isfinite(ns):  # e.g. 1e308 microseconds
        raise ValueError(f"traceEvents[{i}] '{key}' is {us!r} microseconds; expected a time that fits a float in ns")
    return int(round(ns))


def _kind(value) -> str:
    if isinstance(value, float):
        return repr(value)  # inf, nan
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
