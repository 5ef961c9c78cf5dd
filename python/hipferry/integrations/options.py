"""The options of the Hugging Face entry points, read from a config.

One string, as ``TrainingArguments(optim_args=...)`` holds it (comma separated
``key=value``; JSON-serializable like every other field), or a dict (Axolotl's
YAML keys). Everything is checked here, before any optimizer is built: an
unknown key or a bad value names the key and what was expected.

| key | values | default | OffloadAdamW |
|---|---|---|---|
| ``state`` | ``host``, ``host8``, ``disk``, ``disk8`` | ``host`` | ``state_dtype``, ``state_dir`` |
| ``state_dir`` | a folder (``disk``/``disk8`` only) | | ``state_dir`` |
| ``disk_window`` | bytes (``"256MiB"``) | 256 MiB | ``DiskOptions(window_bytes)`` |
| ``overlap`` | ``none``, ``backward`` | ``none`` | ``overlap`` |
| ``step_on`` | ``auto``, ``cpu``, ``gpu`` | ``auto`` | ``step_on`` |
| ``skip_nonfinite`` | ``true``, ``false`` | ``false`` | ``skip_nonfinite`` |
| ``min_offload_numel`` | int >= 0 | 65536 | ``min_offload_numel`` (smaller GPU parameters step on the GPU) |
| ``clip`` | ``hipferry``, ``accelerate`` | ``hipferry`` | who clips (see transformers.py) |
| ``activations`` | ``none``, ``hipferry`` | ``none`` | ``offload_activations`` around each micro-batch |
| ``activations_min_bytes`` | bytes | 1 MiB | ``offload_activations(min_bytes)`` |
"""
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Union

import torch

from ..pool_args import parse_bytes

API = "hipferry.integrations"
CHOICES = {
    "state": ("host", "host8", "disk", "disk8"),
    "overlap": ("none", "backward"),
    "step_on": ("auto", "cpu", "gpu"),
    "clip": ("hipferry", "accelerate"),
    "activations": ("none", "hipferry"),
}
BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
BYTES = ("disk_window", "activations_min_bytes")
COUNTS = ("min_offload_numel",)


@dataclass(frozen=True)
class HipferryOptions:
    """What the config asks of OffloadAdamW and of the trainer (module doc)."""
    state: str = "host"
    state_dir: Optional[str] = None
    disk_window: int = 256 << 20
    overlap: str = "none"
    step_on: str = "auto"
    skip_nonfinite: bool = False
    min_offload_numel: int = 65536
    clip: str = "hipferry"
    activations: str = "none"
    activations_min_bytes: int = 1 << 20

    @property
    def on_disk(self) -> bool:
        return self.state in ("disk", "disk8")


KEYS = tuple(f.name for f in fields(HipferryOptions))


def _expected(key: str) -> str:
    if key in CHOICES:
        return "one of " + ", ".join(repr(c) for c in CHOICES[key])
    if key in BYTES:
        return "a byte count (an int or a size like '64MiB')"
    if key == "skip_nonfinite":
        return "true or false"
    if key in COUNTS:
        return "an int >= 0"
    return "a folder path"


def _value(key: str, raw: Any, where: str) -> Any:
    bad = ValueError(f"{API}: {where}: option {key!r} must be {_expected(key)}, got {raw!r}")
    if key in CHOICES:
        value = raw.strip().lower() if isinstance(raw, str) else raw
        if value not in CHOICES[key]:
            raise bad
        return value
    if key in BYTES:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise bad
        try:
            value = parse_bytes(raw.strip() if isinstance(raw, str) else raw, f"{API}: {key}")
        except (TypeError, ValueError):
            raise bad from None
        if value <= 0:
            raise bad
        return value
    if key in COUNTS:
        text = raw.strip() if isinstance(raw, str) else raw
        if isinstance(text, str) and text.isdigit():
            return int(text)
        if isinstance(text, bool) or not isinstance(text, int) or text < 0:
            raise bad
        return text
    if key == "skip_nonfinite":
        if isinstance(raw, bool):
            return raw
        if not isinstance(raw, str) or raw.strip().lower() not in BOOLS:
            raise bad
        return BOOLS[raw.strip().lower()]
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise bad
    return os.fspath(raw).strip() if isinstance(raw, str) else os.fspath(raw)


def parse_options(config: Union[None, str, Mapping[str, Any], HipferryOptions],
                  where: str = "optim_args") -> HipferryOptions:
    """``"state=host8,overlap=backward"`` or ``{"state": "host8", ...}`` -> HipferryOptions.
    None or "" gives the defaults. Raises ValueError naming the key at fault."""
    if isinstance(config, HipferryOptions):
        return config
    if config is None:
        return HipferryOptions()
    if isinstance(config, str):
        pairs: Dict[str, Any] = {}
        for item in (s.strip() for s in config.split(",")):
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq:
                raise ValueError(f"{API}: {where}: {item!r} is not key=value (expected comma-separated key=value "
                                 f"pairs with keys among {', '.join(KEYS)})")
            if key in pairs:
                raise ValueError(f"{API}: {where}: option {key!r} is given twice")
            pairs[key] = raw.strip()
    elif isinstance(config, Mapping):
        pairs = {k: v for k, v in config.items() if v is not None}
    else:
        raise TypeError(f"{API}: {where} must be a string of key=value pairs or a dict, got "
                        f"{type(config).__name__}")
    unknown = [k for k in pairs if k not in KEYS]
    if unknown:
        raise ValueError(f"{API}: {where}: unknown option {unknown[0]!r}; expected one of {', '.join(KEYS)}")
    values = {k: _value(k, v, where) for k, v in pairs.items()}
    options = HipferryOptions(**values)
    _check_together(options, where)
    return options


def _check_together(o: HipferryOptions, where: str) -> None:
    if o.on_disk and o.state_dir is None:
        raise ValueError(f"{API}: {where}: state={o.state} needs the option 'state_dir' (the folder of the state)")
    if not o.on_disk and o.state_dir is not None:
        raise ValueError(f"{API}: {where}: option 'state_dir' is only for state=disk or state=disk8, got "
                         f"state={o.state}")
    if o.on_disk and o.overlap == "backward":
        raise ValueError(f"{API}: {where}: overlap=backward is not built for state on disk (state={o.state}); "
                         "expected overlap=none")
    if o.on_disk and o.step_on == "gpu":
        raise ValueError(f"{API}: {where}: step_on=gpu is not built for state on disk; expected auto or cpu")


def optimizer_kwargs(o: HipferryOptions, resume: bool = False) -> Dict[str, Any]:
    """OffloadAdamW's keyword arguments for `o` (beyond lr, betas, eps, weight_decay).
    resume: continue from what state_dir holds (Trainer's resume_from_checkpoint)."""
    from ..optim import DiskOptions
    kwargs: Dict[str, Any] = dict(state_dtype=torch.uint8 if o.state in ("host8", "disk8") else torch.float32,
                                  overlap=None if o.overlap == "none" else o.overlap, step_on=o.step_on,
                                  skip_nonfinite=o.skip_nonfinite, min_offload_numel=o.min_offload_numel)
    if o.on_disk:
        kwargs.update(state_dir=o.state_dir, disk=DiskOptions(window_bytes=o.disk_window, resume=resume))
    return kwargs
