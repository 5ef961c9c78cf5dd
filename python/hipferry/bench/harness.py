"""The harness the suites of `python -m hipferry bench` build on: the registry they
join with ``@suite("name")``, the Context they run in, the SuiteResult they
return, and the side-by-side timing (interleaved rounds, best kept). The
runner (bench/__init__.py) loads the suites; they import this module, never
the runner, so the package has no import circle."""
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

SUITES: Dict[str, Callable] = {}  # name -> the suite function, filled as the suite modules load


def suite(name: str):
    def register(fn):
        SUITES[name] = fn
        return fn
    return register


@dataclass
class Context:
    quick: bool = False          # small sizes, few repeats (tests, smoke runs)
    max_bytes: Optional[int] = None
    repeats: int = 5
    device: str = "cpu"          # where the suites run: "cpu" or "cuda"
    out_dir: Optional[str] = None  # set by run(): where suites may write extra files
    disk_dir: Optional[str] = None  # suite disk: the folder on the disk to measure (default: the current one)

    def progress(self, suite_name: str, i: int, n: int, what: str) -> None:
        sys.stderr.write(f"[{suite_name}] {i}/{n} {what}\n")
        sys.stderr.flush()


@dataclass
class SuiteResult:
    rows: List[dict]                          # one dict per measurement
    columns: List[str]                        # table columns, in order
    plots: List[dict] = field(default_factory=list)  # see write_plot
    notes: List[str] = field(default_factory=list)


def best_of_interleaved(contenders: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, float]:
    """Runs every contender once per round, `repeats` rounds, and keeps each one's
    best time. Each callable returns its own elapsed seconds."""
    best = {k: float("inf") for k in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            best[name] = min(best[name], run())
    return best


def sizes_by_four(ctx: Context) -> List[int]:
    """4 KiB, 16 KiB, ... up to ctx.max_bytes (default 4 MiB quick, 1 GiB full)."""
    top = ctx.max_bytes or ((4 << 20) if ctx.quick else (1 << 30))
    s, out = 4 << 10, []
    while s <= top:
        out.append(s)
        s *= 4
    return out


def wall_timer(fn: Callable[[], None]) -> Callable[[], float]:
    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed


def gpu_timer(fn: Callable[[], None]) -> Callable[[], float]:
    """Seconds of fn's work on the current GPU stream, from timing events."""
    import torch

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return timed
