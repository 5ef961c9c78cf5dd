"""hipferry.plan(): every home of the optimizer state estimated from the model's
measured pass and the machine's measured speeds; the fastest that fits chosen.

Peak memory of a step = what the process holds now + the pass's measured growth
(activations, gradients, temporaries) + what the state's home keeps resident.
Step time = the measured pass + the state's step: parameters x the measured
seconds per parameter of that home, and for a disk home at least its bytes
over the measured read and write speeds, plus two flushes. On a GPU whose
budget is short, each home is also tried with blocks streamed and activations
offloaded (placement.py)."""
import os
import shutil
import sys
from dataclasses import replace
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .. import _C
from ..optim import HOMES, DiskOptions, home_cost
from ..optim.disk import QUANTUM
from ..pool_args import parse_bytes
from .machine import measure_machine
from .placement import Placement, placement_cost, placements
from .profile import ModelProfile, profile_model, trainable_parameters
from .result import Applied, Candidate, Plan, gb
from .rss import rss_bytes

__all__ = ["plan", "choose", "PlanError", "Plan", "Candidate", "Applied"]

# A candidate that offloads more (the state, blocks, activations) is taken over one that
# offloads less only when predicted this much faster: below it the difference is within
# what the estimate can tell (docs/planner.md).
PREFER_PLAIN_WITHIN = 0.10
# A home fits when its estimated peak plus a margin fits: HOST_MARGIN of the growth, plus
# HOST_SLACK, for the spread the estimate cannot tell (what the C allocator keeps differs
# from model to model and from run to run): the validation measured peaks up to 15% of the
# growth either side of the estimate (docs/planner.md).
HOST_MARGIN, HOST_SLACK = 0.10, 64 << 20
# What the C allocator keeps over the passes' own growth once training runs. glibc serves
# blocks below 32 MiB (its largest mmap threshold) from heaps it rarely returns; the state,
# allocated between passes, splits the free space that the passes reused, and the peak
# creeps up over the first steps. Measured over pass + state, on eight models of 8-96 M
# parameters (docs/planner.md): 4-42% of the pass's growth, most near 15-20%.
RETAINED_FRACTION = 0.15


def allocator_retention(prof: ModelProfile) -> int:
    """Host bytes the C allocator is expected to keep beyond the pass's measured growth
    (CPU training only: on a GPU the pass's large blocks are device memory)."""
    if prof.device.type != "cpu":
        return 0
    return int(RETAINED_FRACTION * prof.pass_host_bytes)


class PlanError(ValueError):
    """No placement fits; the message names the smallest budget that would work."""


def _check_budget(value: Any, name: str) -> Optional[int]:
    if isinstance(value, float) and not isinstance(value, bool):
        if value < 0 or value != value:
            raise ValueError(f"hipferry.plan: {name} must be >= 0 bytes, got {value}")
        value = int(value)
    try:
        return parse_bytes(value, name)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("hipferry:", "hipferry.plan:")) from None


def _check_state_dir(state_dir: Any) -> Optional[str]:
    if state_dir is None:
        return None
    if not isinstance(state_dir, (str, os.PathLike)):
        raise ValueError(f"hipferry.plan: state_dir must be a path (str or os.PathLike), got "
                         f"{type(state_dir).__name__}")
    state_dir = os.fspath(state_dir)
    probe = state_dir if os.path.isdir(state_dir) else os.path.dirname(os.path.abspath(state_dir))
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"hipferry.plan: state_dir {state_dir!r} is not a writable folder (or in one)")
    return state_dir


def _available_host() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"] + max(0, rss_bytes())
    except (OSError, KeyError, ValueError):
        return 0


def _estimate(home: str, prof: ModelProfile, machine: dict, held: int, amsgrad: bool, disk: DiskOptions,
              placement: Placement = Placement()) -> Candidate:
    on_gpu = prof.device.type == "cuda"
    cost = home_cost(home, prof.trainable, on_gpu, amsgrad, disk)
    n = prof.numel
    # A disk home without a state_dir (refused in choose) is shown at its RAM twin's speed.
    key = f"step_s_per_param[{home}]"
    step = n * machine[key if key in machine else f"step_s_per_param[host-{home.split('-')[1]}]"]
    parts = {"fwd_bwd": prof.fwd_bwd_seconds, "state_step": step}
    fwd_bwd, saved, added, resident = prof.fwd_bwd_seconds, 0, 0, 1.0
    if on_gpu:
        pc = placement_cost(prof, placement, machine["link_h2d_gbps"], machine["link_d2h_gbps"])
        saved, added, resident = pc.device_saved, pc.host_added, pc.resident_share
        if placement.offloads:
            parts.update(fwd_bwd_with_copies=pc.pass_seconds, copies=pc.copy_seconds)
            fwd_bwd = pc.pass_seconds
    if on_gpu and home != "torch":  # the device's gradients down and parameters up, beside the host step
        link = resident * n * 4 / (min(machine["link_h2d_gbps"], machine["link_d2h_gbps"]) * 1e9)
        parts["link"] = link
        step = max(step, link)
    if home.startswith("disk") and "disk_read_gbps" in machine:  # the I/O alone, for the table
        io = cost.disk_step_bytes / (machine["disk_read_gbps"] * 1e9) + \
            cost.disk_step_bytes / (machine["disk_write_gbps"] * 1e9) + 2 * machine["disk_flush_seconds"]
        parts["disk_io"] = io
    retained = allocator_retention(prof)
    if retained:
        parts["allocator_bytes"] = retained
    host = held + prof.pass_host_bytes + retained + (cost.resident_bytes if cost.where == "host" else 0) + added
    device = (prof.device_held + prof.pass_device_bytes + (cost.resident_bytes if cost.where == "device" else 0)
              - saved) if on_gpu else 0
    return Candidate(home, host, device, cost.disk_bytes, fwd_bwd + step, parts,
                     host_margin=int(HOST_MARGIN * (host - held)) + HOST_SLACK, placement=placement,
                     blocks=len(prof.blocks))


def _disk_fitted(c: Candidate, budgets: dict, prof: ModelProfile, machine: dict, held: int, amsgrad: bool,
                 disk: DiskOptions) -> Candidate:
    """A disk home over the host budget with its window shrunk (the window is its host
    memory): fewer buffers, down to DiskStore's two, then shorter chunks, down to the
    quantum; the largest window that fits, else the smallest (so that a refusal names
    the least this home needs)."""
    have = budgets["host_memory"]
    if not c.home.startswith("disk") or have is None or c.host_need <= have:
        return c
    chunk, smaller = disk.chunk_numel, c
    while chunk >= QUANTUM:
        buf = _C._disk_chunk_buffer_bytes("float32", True, chunk)
        for buffers in range(min(disk.window_bytes // buf, 4096), 1, -1):
            option = replace(disk, window_bytes=buffers * buf, chunk_numel=chunk)
            smaller = _estimate(c.home, prof, machine, held, amsgrad, option, c.placement)
            smaller.parts.update(window_bytes=option.window_bytes, chunk_numel=chunk)
            if smaller.host_need <= have:
                return smaller
        chunk = chunk // 2 // QUANTUM * QUANTUM
    return smaller


def choose(cands: List[Candidate], budgets: dict, state_dir: Optional[str]) -> Optional[Candidate]:
    """Marks each candidate as fitting the budgets or not (with why) and returns the chosen one, or None."""
    for c in cands:
        over = [f"{k} {gb(need)} > {gb(have)}" for k, need, have in
                (("host", c.host_need, budgets["host_memory"]), ("GPU", c.device_peak, budgets["gpu_memory"]),
                 ("disk", c.disk_bytes, budgets["disk"])) if have is not None and need > have]
        if c.home.startswith("disk") and state_dir is None:
            over.append("no state_dir given")
        c.fits, c.why = not over, ("refused: " + ", ".join(over)) if over else ""
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None
    # The fastest, unless one that offloads less is within PREFER_PLAIN_WITHIN of it.
    fastest = min(fitting, key=lambda c: c.step_seconds)
    near = [c for c in fitting if fastest.step_seconds >= c.step_seconds * (1 - PREFER_PLAIN_WITHIN)]
    chosen = min(near, key=lambda c: (c.offloads, c.step_seconds))
    for c in fitting:
        slower = c.step_seconds / chosen.step_seconds - 1
        if c is chosen:
            c.why = "chosen: " + ("nothing needs offloading" if c.offloads == 0 else "the fastest that fits"
                                  if c is fastest else "within 10% of the fastest, offloading less")
        elif c.offloads < chosen.offloads:
            c.why = f"fits; {chosen.label} is predicted {-slower:.0%} faster"
        else:
            c.why = f"fits, predicted {slower:+.0%} time" + ("; nothing needs offloading" if chosen.offloads == 0
                                                               else "")
    for c in cands:
        if "window_bytes" in c.parts:
            c.why += (f" (disk window shrunk to {c.parts['window_bytes'] / 2**20:.0f} MiB, chunks of "
                      f"{c.parts['chunk_numel']} elements)")
    return chosen


def _no_fit_message(cands: List[Candidate], budgets: dict, state_dir: Optional[str]) -> str:
    def others_fit(c: Candidate) -> bool:
        return all(have is None or need <= have for need, have in
                   ((c.device_peak, budgets["gpu_memory"]), (c.disk_bytes, budgets["disk"])))
    usable = [c for c in cands if others_fit(c) and (state_dir is not None or not c.home.startswith("disk"))]
    text = "hipferry.plan: no placement fits: " + "; ".join(f"{c.label} {c.why[len('refused: '):]}" for c in cands)
    if usable:
        best = min(usable, key=lambda c: c.host_need)
        text += f". The smallest host_memory that works is {gb(best.host_need)}, with the state in {best.label}"
    gpu = budgets["gpu_memory"]
    if gpu is not None and all(c.device_peak > gpu for c in cands):
        least = min(cands, key=lambda c: c.device_peak)
        text += f". The smallest gpu_memory that works is {gb(least.device_peak)}, with {least.label}"
    if state_dir is None:
        text += "; a state_dir= on a disk would let the state leave RAM (homes disk-float32, disk-8bit)"
    return text


def plan(model: nn.Module, *, batch: Any, optimizer: str = "adamw", gpu_memory: Any = None,
         host_memory: Any = None, state_dir: Any = None, disk_budget: Any = None, amsgrad: bool = False,
         loss_fn: Optional[Callable] = None, disk: Optional[DiskOptions] = None, homes: Any = HOMES,
         refresh: bool = False, verbose: bool = True) -> Plan:
    """Estimate every home of the optimizer state for training `model` on `batch`,
    pick the fastest that fits the budgets, and return the Plan (see docs/planner.md).

    batch: what one training step feeds the model (a dict for Hugging Face models, with
        labels); loss_fn(model, batch) -> scalar tensor where the model returns no .loss.
    host_memory / gpu_memory / disk_budget: bytes or '24GiB'-style strings the whole
        process may hold (default: what is available now).
    state_dir: a folder for the disk homes (they are refused without it).
    homes: the homes of the state to consider (default all: hipferry.optim.HOMES)."""
    if optimizer != "adamw":
        raise ValueError(f"hipferry.plan: optimizer must be 'adamw' (the one planned for), got {optimizer!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"hipferry.plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if batch is None:
        raise ValueError("hipferry.plan: batch= is required: what one training step feeds the model")
    budgets = {"host_memory": _check_budget(host_memory, "host_memory"),
               "gpu_memory": _check_budget(gpu_memory, "gpu_memory"),
               "disk": _check_budget(disk_budget, "disk_budget")}
    state_dir = _check_state_dir(state_dir)
    disk = disk if disk is not None else DiskOptions()
    if not isinstance(disk, DiskOptions):
        raise ValueError(f"hipferry.plan: disk must be a hipferry.optim.DiskOptions, got {type(disk).__name__}")
    disk.check()
    if isinstance(homes, str) or not all(isinstance(h, str) for h in homes) or not set(homes) <= set(HOMES) \
            or not homes:
        raise ValueError(f"hipferry.plan: homes must be a non-empty list of {list(HOMES)}, got {homes!r}")
    if not isinstance(amsgrad, bool):
        raise ValueError(f"hipferry.plan: amsgrad must be a bool, got {amsgrad!r}")
    if not trainable_parameters(model):
        raise ValueError("hipferry.plan: the model has no trainable parameters (none with requires_grad=True)")
    progress = (lambda s: print(f"[hipferry.plan] {s}", file=sys.stderr, flush=True)) if verbose else (lambda s: None)
    device = next(p.device for p in model.parameters() if p.requires_grad)
    if budgets["host_memory"] is None:
        budgets["host_memory"] = _available_host() or None
    if budgets["gpu_memory"] is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budgets["gpu_memory"] = free + torch.cuda.memory_allocated(device)
    if state_dir is not None:
        os.makedirs(state_dir, exist_ok=True)
        if budgets["disk"] is None:
            budgets["disk"] = shutil.disk_usage(state_dir).free
    # The first optimizer a process builds imports torch's compiler stack (torch.optim wraps
    # add_param_group with it): 100-160 MB of resident memory the plan's optimizer would
    # otherwise add after the process's holdings were read. One now, so they include it.
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    held = max(0, rss_bytes())
    machine = measure_machine(device, state_dir, refresh=refresh, progress=progress)
    prof = profile_model(model, batch, loss_fn, progress=progress)
    cands = []
    for h in (h for h in HOMES if h in homes):
        def device_need(placement: Placement, h=h) -> int:
            return _estimate(h, prof, machine, held, amsgrad, disk, placement).device_peak
        for placement in placements(prof, h, budgets["gpu_memory"], device_need):
            cands.append(_disk_fitted(_estimate(h, prof, machine, held, amsgrad, disk, placement), budgets, prof,
                                      machine, held, amsgrad, disk))
    chosen = choose(cands, budgets, state_dir)
    if chosen is None:
        raise PlanError(_no_fit_message(cands, budgets, state_dir))
    result = Plan(cands, chosen, budgets, machine, prof, state_dir, disk)
    if verbose:
        print(result.explain(), file=sys.stderr, flush=True)
    return result
