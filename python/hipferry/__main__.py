"""python -m hipferry {doctor,bench,timeline} — see README."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hipferry")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="platform report, self-test and measured bandwidth")
    doc.add_argument("--quick", action="store_true", help="smaller bandwidth measurements")
    bench = sub.add_parser("bench", help="run benchmark suites; tables, JSON and PNG plots")
    bench.add_argument("suites", nargs="*", help="suite names (default: all)")
    bench.add_argument("--out", default="bench-out", help="directory for JSON and PNG (default: bench-out)")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    bench.add_argument("--max-bytes", type=int, default=None, help="largest size measured")
    bench.add_argument("--repeats", type=int, default=5, help="interleaved rounds, best kept")
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="auto: add GPU cases when a GPU is visible")
    bench.add_argument("--disk-dir", default=None,
                       help="suite disk: folder on the disk to measure (default: $HIPFERRY_BENCH_DISK_DIR, else "
                            "the current directory); a temporary subfolder is used and removed")
    bench.add_argument("--list", action="store_true", help="list suites and exit")
    tl = sub.add_parser("timeline", help="draw a trace saved by hipferry.trace(path) as a PNG")
    tl.add_argument("trace", help="Chrome/Perfetto trace JSON written by hipferry.trace()")
    tl.add_argument("--out", default=None, help="PNG path (default: the trace's path with .png)")
    args = parser.parse_args(argv)

    if args.command == "timeline":
        return _timeline(parser, args)

    if args.command == "doctor":
        from . import doctor
        return doctor.run(quick=args.quick)

    from . import bench as bench_mod
    if args.list:
        print("\n".join(bench_mod.available()))
        return 0
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_bytes is not None and args.max_bytes < 4096:
        parser.error(f"--max-bytes must be >= 4096, got {args.max_bytes}")
    import torch
    from .platform import device_count
    device = args.device
    if device == "auto":
        device = "cuda" if device_count() > 0 and torch.cuda.is_available() else "cpu"
    elif device == "cuda" and device_count() == 0:
        parser.error("--device cuda: no GPU visible to hipferry")
    ctx = bench_mod.Context(quick=args.quick, max_bytes=args.max_bytes, repeats=args.repeats, device=device,
                            disk_dir=args.disk_dir)
    try:
        bench_mod.run(args.suites, args.out, ctx)
    except ValueError as e:
        parser.error(str(e))
    return 0


def _timeline(parser, args) -> int:
    import json
    import os
    from .bench.timeline import events_from_chrome_json, write_timeline_png
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    option = "--out" if args.out else "--out (default: the trace's path with .png)"
    problem = _cannot_write_file(out)
    if problem is None and os.path.exists(out) and os.path.exists(args.trace) and os.path.samefile(out, args.trace):
        problem = "is the trace itself; expected another path for the PNG"
    if problem:
        parser.error(f"timeline: {option} {out!r} {problem}")
    try:
        with open(args.trace) as f:
            events = events_from_chrome_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        parser.error(f"timeline: cannot read {args.trace}: {e}")
    try:
        if not write_timeline_png(out, events, os.path.basename(args.trace)):
            return 1
    except OSError as e:
        parser.error(f"timeline: cannot write {option} {out!r}: {e.strerror or e}")
    print(f"wrote {out} ({len(events)} events)")
    return 0


def _cannot_write_file(path: str):
    """Why a file cannot be written at `path` (None if it can, as far as can be told without writing it)."""
    import os
    if os.path.isdir(path):
        return "is a directory; expected a PNG file path"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"is in a directory that does not exist ({parent}); expected an existing directory"
    if not os.path.isdir(parent):
        return f"is under {parent}, which is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "is not writable"
    return None


if __name__ == "__main__":
    sys.exit(main())
