"""A timeline PNG of `hipferry.trace()` events: one row per track, bars coloured
by category, time in ms from the earliest event on x.

Events are the dicts `hipferry.trace()` records: name, category, track,
start_ns, end_ns, bytes. Chrome/Perfetto JSON (`tr.save(path)`) is the
interactive view; this is the picture that goes next to the benchmark's plots.
"""
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def events_from_chrome_json(doc: dict) -> List[dict]:
    """The events of a trace saved by `hipferry.trace(path)` (Chrome trace
    JSON: "X" events, tracks named by "thread_name" metadata), as the dicts
    `write_timeline_png` takes. Raises ValueError for JSON that is not one."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
    names = {e.get("tid"): e.get("args", {}).get("name") for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    events = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        start = int(round(float(e["ts"]) * 1e3))
        events.append({"name": e.get("name", ""), "category": e.get("cat", ""),
                       "track": names.get(e.get("tid")) or f"track {e.get('tid')}", "start_ns": start,
                       "end_ns": start + int(round(float(e.get("dur", 0)) * 1e3)),
                       "bytes": int(e.get("args", {}).get("bytes", 0))})
    return events
