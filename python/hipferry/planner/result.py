"""What hipferry.plan returns: the candidates with their figures (Candidate), the
table that explains the choice, and how the chosen one is built (Plan.apply)."""
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..optim import DiskOptions
from .placement import Placement
from .profile import ModelProfile, trainable_parameters


@dataclass
class Candidate:
    home: str
    host_peak: int          # bytes the process will hold at its peak
    device_peak: int        # bytes of GPU memory at the peak (0 on the CPU)
    disk_bytes: int
    step_seconds: float
    parts: Dict[str, float] = field(default_factory=dict)
    host_margin: int = 0    # what the fit test adds to host_peak (HOST_MARGIN, HOST_SLACK)
    fits: bool = False
    why: str = ""
    placement: Placement = Placement()  # on a GPU: blocks streamed, activations offloaded
    blocks: int = 0         # the model's blocks (for the label)

    @property
    def host_need(self) -> int:
        return self.host_peak + self.host_margin

    @property
    def label(self) -> str:
        return self.home + self.placement.label(self.blocks)

    @property
    def offloads(self) -> int:
        """How many kinds of offload it uses: the state's, streamed blocks, activations."""
        return (self.home != "torch") + self.placement.offloads

    def row(self) -> dict:
        return {"home": self.home, "placement": self.label, "stream_blocks": self.placement.stream,
                "prefetch": self.placement.prefetch, "offload_activations": self.placement.activations,
                "fits": self.fits, "host_peak_bytes": self.host_peak,
                "host_margin_bytes": self.host_margin,
                "device_peak_bytes": self.device_peak, "disk_bytes": self.disk_bytes,
                "step_seconds": self.step_seconds, "parts": dict(self.parts), "why": self.why}


@dataclass
class Applied:
    """What Plan.apply built. `layers`: the offload_layers handle when blocks stream;
    `activations`: an offload_activations context to run each forward and backward in."""
    optimizer: torch.optim.Optimizer
    home: str
    placement: Placement = Placement()
    layers: Any = None
    activations: Any = None


def gb(n: float) -> str:
    """Bytes in GB to the MB: budgets quoted back must be precise enough to use."""
    return f"{n / 1e9:.3f} GB"


class Plan:
    """What plan() found: the candidates, the chosen one, and how to build it."""

    def __init__(self, candidates: List[Candidate], chosen: Candidate, budgets: dict, machine: dict,
                 profile: ModelProfile, state_dir: Optional[str], disk: DiskOptions):
        self.candidates, self.chosen, self.budgets = candidates, chosen, budgets
        self.machine, self.profile, self.state_dir, self.disk = machine, profile, state_dir, disk

    @property
    def home(self) -> str:
        return self.chosen.home

    def explain(self, as_dict: bool = False):
        """The table of candidates (text), or with as_dict=True everything as a dict."""
        if as_dict:
            return {"chosen": self.chosen.home, "budgets": dict(self.budgets), "machine": dict(self.machine),
                    "model": {"trainable_params": self.profile.numel, "device": str(self.profile.device),
                              "fwd_bwd_seconds": self.profile.fwd_bwd_seconds,
                              "pass_host_bytes": self.profile.pass_host_bytes,
                              "pass_device_bytes": self.profile.pass_device_bytes,
                              "blocks": len(self.profile.blocks),
                              "saved_activation_bytes": self.profile.saved_bytes},
                    "candidates": [c.row() for c in self.candidates]}
        gpu = self.profile.device.type == "cuda"
        m = self.machine
        speeds = ", ".join(f"{h} {m[f'step_s_per_param[{h}]'] * 1e9:.2f}"
                           for h in ("torch", "host-float32", "host-8bit")
                           if f"step_s_per_param[{h}]" in m)
        width = max(len(c.label) for c in self.candidates) + 2
        lines = [f"hipferry.plan: {self.profile.numel / 1e6:.1f} M trainable parameters on "
                 f"{self.profile.device}; forward+backward {self.profile.fwd_bwd_seconds * 1e3:.0f} ms (measured)",
                 f"machine (measured {m.get('measured', 'now')}): AdamW step ns/param: {speeds}"
                 + (f"; disk read {m['disk_read_gbps']:.2f} GB/s, write {m['disk_write_gbps']:.2f} GB/s"
                    if "disk_read_gbps" in m else ""),
                 "budgets: " + ", ".join(f"{k} {gb(v) if v is not None else 'not limited'}"
                                         for k, v in self.budgets.items() if gpu or k != "gpu_memory"),
                 f"{'':2}{'state home' + (' + placement' if gpu else ''):<{width}}{'host peak':>11}"
                 f"{'GPU peak' if gpu else '':>11}"
                 f"{'disk':>10}{'step':>10}  why"]
        for c in self.candidates:
            mark = "->" if c is self.chosen else "  "
            lines.append(f"{mark}{c.label:<{width}}{gb(c.host_peak):>11}{gb(c.device_peak) if gpu else '':>11}"
                         f"{gb(c.disk_bytes):>10}{c.step_seconds:>9.3f}s  {c.why}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.explain()

    def apply(self, model: nn.Module, *, home: Optional[str] = None, **optimizer_kwargs: Any) -> Applied:
        """The chosen candidate (or the one of `home` that offloads least, among those
        that fit) built over the model: its blocks streamed and its activations
        offloaded if the placement says so, then the optimizer over the trainable
        parameters (optimizer_kwargs: lr, betas, weight_decay, ... as torch.optim.AdamW takes)."""
        from ..module_offload import default_layers, offload_activations, offload_layers, plan_blocks
        from ..optim import OffloadAdamW
        chosen = self.chosen
        if home is not None:
            fitting = [c for c in self.candidates if c.fits and c.home == home]
            if not fitting:
                homes = sorted({c.home for c in self.candidates if c.fits})
                raise ValueError(f"Plan.apply: home must be one of the candidates that fit, {homes}, got {home!r}")
            chosen = chosen if chosen.home == home else min(fitting, key=lambda c: c.offloads)
        params = trainable_parameters(model)
        if not params:
            raise ValueError("Plan.apply: the model has no trainable parameters")
        home, placement, layers = chosen.home, chosen.placement, None
        if placement.stream:  # first: the optimizer must see the streamed weights where they now live, the host
            blocks = [b.module for b in plan_blocks(model, default_layers(model), None)[0]]
            layers = offload_layers(model, layers=blocks[len(blocks) - placement.stream:], prefetch=placement.prefetch)
        fused = params[0].device.type in ("cpu", "cuda") and "foreach" not in optimizer_kwargs
        dtype, extra = torch.float32, {}
        if home != "torch":
            dtype = torch.uint8 if home.endswith("8bit") else torch.float32
            parts = chosen.parts
            disk = replace(self.disk, window_bytes=int(parts["window_bytes"]), chunk_numel=int(parts["chunk_numel"])) \
                if "window_bytes" in parts else self.disk
            extra = {"state_dir": self.state_dir, "disk": disk} if home.startswith("disk") else {}
        try:
            opt = torch.optim.AdamW(params, **({"fused": True} if fused else {}), **optimizer_kwargs) \
                if home == "torch" else OffloadAdamW(params, state_dtype=dtype, **extra, **optimizer_kwargs)
        except BaseException:
            if layers is not None:  # a bad optimizer argument leaves the model as it was
                layers.undo()
            raise
        return Applied(optimizer=opt, home=home, placement=placement, layers=layers,
                       activations=offload_activations() if placement.activations else None)
