"""OffloadAdamW(state_dtype=torch.uint8): m and v (and max_v with amsgrad) in 8
bits, blockwise, as bitsandbytes' 8-bit blockwise Adam keeps them
(csrc/core/optim/quant8.h): one uint8 code per element (a signed dynamic map
for m, an unsigned one for v) and one float32 scale per block of 256
elements. The float32 master of a bf16/fp16 parameter stays float32. One
fused pass per parameter dequantizes, updates, quantizes and writes the
parameter (_C._adamw8bit_step_).

In opt.state the codes keep torch's names (``exp_avg``: uint8, shaped and
strided like the parameter) and the scales sit beside them
(``exp_avg_absmax``: float32, one per block). Parameters that 8 bits do not
pay for or do not fit keep float32 state (Float32Store): fewer than
min_8bit_numel elements (default 4096, as bitsandbytes' min_8bit_size), complex or float64
parameters, and small GPU parameters whose state stays on the device.
"""
from typing import Dict, List, Optional

import torch

from .. import _C
from .checks import FUSED
from .layout import aligned, memory_flat, shaped, state_strides
from .state_store import Float32Store

BLOCK = 256             # elements per scale (q8::kBlock)
MIN_8BIT_NUMEL = 4096   # smaller parameters keep float32 state by default (bitsandbytes' min_8bit_size)
QUANTIZED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}


def is_8bit(st: dict) -> bool:
    """Whether a parameter's state (ours or a saved one) is in the 8-bit format."""
    return "exp_avg_absmax" in st


def blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


class Int8Store(Float32Store):
    format = "uint8"

    def __init__(self, pool, min_8bit_numel: int = MIN_8BIT_NUMEL):
        super().__init__(pool)
        self.min_8bit_numel = min_8bit_numel

    def wants_8bit(self, lp: torch.Tensor, where: str) -> bool:
        return (where == "host" and lp.dtype in FUSED and not lp.is_complex() and lp.numel() >= self.min_8bit_numel
                and memory_flat(lp) is not None)

    def plan_keys(self, lp: torch.Tensor, where: str, amsgrad: bool) -> List[str]:
        keys = self.keys(lp, amsgrad)
        if self.wants_8bit(lp, where):
            keys += [f"{k}_absmax" for k in QUANTIZED if k in keys]
        return keys

    @staticmethod
    def bytes_needed(lp: torch.Tensor, keys: List[str]) -> int:
        if "exp_avg_absmax" not in keys:
            return Float32Store.bytes_needed(lp, keys)
        n = lp.numel()
        return sum(4 * n if k == "master_param" else 4 * blocks(n) if k.endswith("_absmax") else n for k in keys)

    def new_state(self, lp: torch.Tensor, where: str, key: str, eight_bit: Optional[bool] = None) -> torch.Tensor:
        if eight_bit is None:
            eight_bit = self.wants_8bit(lp, where)
        if not eight_bit or key == "master_param":
            return super().new_state(lp, where, key)
        if key.endswith("_absmax"):
            return self.pool.empty(blocks(lp.numel()), dtype=torch.float32).zero_()
        return shaped(self.pool.empty(lp.numel(), dtype=torch.uint8), lp.shape, state_strides(lp)).fill_(
            zero_code(SIGNED[key]))

    def amsgrad_state(self, lp: torch.Tensor, where: str, st: dict) -> Dict[str, torch.Tensor]:
        if not is_8bit(st):
            return {"max_exp_avg_sq": Float32Store.new_state(self, lp, where, "max_exp_avg_sq")}
        return {k: self.new_state(lp, where, k, eight_bit=True) for k in ("max_exp_avg_sq", "max_exp_avg_sq_absmax")}

    @staticmethod
    def step(hyper: dict, target: torch.Tensor, grad: torch.Tensor, st: Dict[str, torch.Tensor], amsgrad: bool,
             out: Optional[torch.Tensor], step: int, source: Optional[dict] = None, adopt: bool = False) -> None:
        if not is_8bit(st):
            return Float32Store.step(hyper, target, grad, st, amsgrad, out, step, source, adopt)
        if source is not None:
            raise NotImplementedError("the 8-bit step runs in place only")  # (speculation skips 8-bit states)
        m = st["exp_avg"]
        flat = memory_flat
        mx = st.get("max_exp_avg_sq") if amsgrad else None
        _C._adamw8bit_step_(flat(target), flat(aligned(grad, m)), flat(m), st["exp_avg_absmax"],
                            flat(st["exp_avg_sq"]), st["exp_avg_sq_absmax"],
                            flat(mx) if mx is not None else None,
                            st["max_exp_avg_sq_absmax"] if mx is not None else None,
                            flat(out) if out is not None else None, step, **hyper, adopt_out=adopt)


# --------------------------------------------------------- format conversion
_ZERO_CODE: Dict[bool, int] = {}


def zero_code(signed: bool) -> int:
    """The code of 0 in the signed or unsigned map (a zeroed 8-bit state holds it)."""
    if signed not in _ZERO_CODE:
        _ZERO_CODE[signed] = int((_C._dynamic_map_8bit(signed) == 0).nonzero()[0])
    return _ZERO_CODE[signed]


def dequantized(codes: torch.Tensor, absmax: torch.Tensor, key: str) -> torch.Tensor:
    """The float32 values of 8-bit state `key`, with the codes' shape and strides (blocks
    run over the codes' memory order, as the step walks them)."""
    if memory_flat(codes) is None:
        codes = codes.contiguous()
    out = torch.empty_strided(codes.shape, codes.stride(), dtype=torch.float32)
    _C._dequantize_blockwise_8bit(memory_flat(codes), absmax.contiguous(), SIGNED[key], memory_flat(out))
    return out


def check_saved(st: dict, lp: torch.Tensor, where: str) -> None:
    """A saved 8-bit state fits `lp`: uint8 codes and one float32 scale per block (load_state_dict's check)."""
    if not is_8bit(st):
        return
    for k in QUANTIZED:
        if k not in st:
            continue
        codes, absmax = st[k], st.get(f"{k}_absmax")
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            raise ValueError(f"OffloadAdamW.load_state_dict: {where}: '{k}' must be uint8 codes in an 8-bit state "
                             f"(one with 'exp_avg_absmax'), got {getattr(codes, 'dtype', type(codes).__name__)}")
        if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32 or \
                absmax.numel() != blocks(lp.numel()):
            raise ValueError(f"OffloadAdamW.load_state_dict: {where}: '{k}_absmax' must be a float32 tensor of "
                             f"{blocks(lp.numel())} scales (one per block of {BLOCK}), got "
                             f"{getattr(absmax, 'dtype', None)} with "
                             f"{absmax.numel() if isinstance(absmax, torch.Tensor) else None} elements")


def quantize_into(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, key: str) -> None:
    """Writes float values (shaped like `codes`) into 8-bit state `key`: `codes` (dense, the
    parameter's strides) and `absmax` (one scale per block)."""
    src = aligned(values.to(torch.float32), codes)
    _C._quantize_blockwise_8bit(memory_flat(src), SIGNED[key], memory_flat(codes), absmax)


def restore_key(st: dict, key: str, saved: Optional[dict]) -> bool:
    """Copies `saved[key]` into our 8-bit or float32 `st[key]`, converting between the
    formats either way. False: nothing to convert (the caller copies as for float32)."""
    value = None if saved is None else saved.get(key)
    if key not in SIGNED or (not is_8bit(st) and (value is None or not is_8bit(saved))):
        return False
    t = st[key]
    if not is_8bit(st):  # 8-bit saved, float32 here
        t.copy_(dequantized(value, saved[f"{key}_absmax"], key))
    elif value is None:
        t.fill_(zero_code(SIGNED[key]))
        st[f"{key}_absmax"].zero_()
    elif is_8bit(saved):
        t.copy_(value)
        st[f"{key}_absmax"].copy_(saved[f"{key}_absmax"])
    else:  # float32 saved, 8-bit here
        quantize_into(value, t, st[f"{key}_absmax"], key)
    return True
