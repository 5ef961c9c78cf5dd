"""Where OffloadAdamW's state lives and in what format: the state store.

A store makes each parameter's state tensors (all of a group's at once, so a
pool that is too small fails before anything is kept), says how many host
bytes they take, and runs the fused step over them. Engines hand it the
arrays to step; they never look inside the format. Today's store keeps
master, m and v as float32 tensors in the pinned pool (torch.optim.AdamW's
state format); an 8-bit store and a disk store sit behind the same methods.
"""
from typing import Dict, List, Optional

import torch

from .. import ops
from ..pool import PinnedPool
from .checks import param_dtype
from .layout import aligned, memory_flat, real, shaped, state_strides
from .slots import step_dtype
from .state import LOW_PRECISION, format_bytes


class Float32Store:
    """master (bf16/fp16 parameters), exp_avg, exp_avg_sq (and max_exp_avg_sq
    with amsgrad) as float32 tensors (float64 for float64 parameters) in the
    pool, with the parameter's strides when it is dense (layout.py)."""

    format = "float32"

    def __init__(self, pool: PinnedPool):
        self.pool = pool

    @staticmethod
    def keys(lp: torch.Tensor, amsgrad: bool) -> List[str]:
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
        return keys + (["master_param"] if lp.dtype in LOW_PRECISION else [])

    def plan_keys(self, lp: torch.Tensor, where: str, amsgrad: bool) -> List[str]:
        """The state keys `lp` gets here (a store may add keys of its format)."""
        return self.keys(lp, amsgrad)

    def amsgrad_state(self, lp: torch.Tensor, where: str, st: dict) -> Dict[str, torch.Tensor]:
        """The zeroed tensors a group switched to amsgrad adds to the state `st` of `lp`."""
        return {"max_exp_avg_sq": self.new_state(lp, where, "max_exp_avg_sq")}

    @staticmethod
    def bytes_needed(lp: torch.Tensor, keys: List[str]) -> int:
        return real(lp).numel() * (8 if param_dtype(lp) == torch.float64 else 4) * len(keys)

    def new_state(self, lp: torch.Tensor, where: str, key: str) -> torch.Tensor:
        """A zeroed state tensor `key` of `lp`: float32 (float64 for float64 / complex128
        parameters), complex like a complex parameter, with the parameter's strides
        when it is dense; on the parameter's device where="device", else in the pool."""
        rp = real(lp)
        dtype = torch.float32 if key == "master_param" or param_dtype(lp) != torch.float64 else torch.float64
        if where == "device":
            t = torch.zeros_like(rp, dtype=dtype, memory_format=torch.preserve_format)
        else:
            t = shaped(self.pool.empty(rp.numel(), dtype=dtype), rp.shape, state_strides(rp)).zero_()
        return torch.view_as_complex(t) if lp.is_complex() else t

    @torch.no_grad()
    def allocate(self, plan: List[tuple]) -> List[dict]:
        """The zeroed state of every (lp, where, keys) in `plan`, made all at once:
        OutOfMemoryError (saying how much was needed) if the pool cannot hold it."""
        states: List[dict] = []
        st: dict = {}
        try:
            for lp, where, keys in plan:
                st = {"step": torch.zeros((), dtype=step_dtype())}
                for k in keys:
                    st[k] = self.new_state(lp, where, k)
                if "master_param" in st:
                    st["master_param"].copy_(lp)
                states.append(st)
        except torch.OutOfMemoryError as e:
            states.clear()  # gives back what this call took, before the pool's figures are read
            st = {}
            need = sum(self.bytes_needed(lp, keys) for lp, where, keys in plan if where == "host")
            raise torch.OutOfMemoryError(self._too_small(need, len(plan), e)) from None
        return states

    def _too_small(self, need: int, count: int, error: Exception) -> str:
        stats, cap = self.pool.stats(), self.pool.capacity
        free = None if cap is None else cap - stats["allocated_bytes"]
        short = f", short by {format_bytes(need - free)}" if free is not None and need > free else ""
        return (f"OffloadAdamW: the pool cannot hold the optimizer state: it needs {format_bytes(need)} for "
                f"{count} parameters; pool capacity {format_bytes(cap)}, "
                f"{format_bytes(stats['allocated_bytes'])} in use{short}. Pass a larger pool "
                f"(pool=hipferry.PinnedPool(capacity=...)). ({error})")

    def host_tensor_like(self, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A pool tensor with the shape and strides of the (real) state tensor `state`."""
        return shaped(self.pool.empty(state.numel(), dtype=dtype), state.shape, state.stride())

    @staticmethod
    def state_bytes(st: dict) -> int:
        return sum(t.nbytes for k, t in st.items() if k != "step" and isinstance(t, torch.Tensor))

    @staticmethod
    def step(hyper: dict, target: torch.Tensor, grad: torch.Tensor, st: Dict[str, torch.Tensor], amsgrad: bool,
             out: Optional[torch.Tensor], step: int, source: Optional[dict] = None, adopt: bool = False) -> None:
        """One fused step over the flat memory-order views of a float32 `target`
        (parameter, master or host copy), its gradient (aligned to the state's
        strides here) and its state `st`; `out` gets the rounded values.
        `source` (keys "param" and st's): read from those, write `target` and
        `st` (out of place: the speculative step). `adopt`: `out` is the
        parameter itself, and elements the user wrote since the last step (bits
        that differ from the rounded master) become the master first."""
        m, v = real(st["exp_avg"]), real(st["exp_avg_sq"])
        mx = real(st.get("max_exp_avg_sq")) if amsgrad else None
        flat = memory_flat
        ins = {}
        if source is not None:
            ins = dict(param_in=flat(real(source["param"])), exp_avg_in=flat(real(source["exp_avg"])),
                       exp_avg_sq_in=flat(real(source["exp_avg_sq"])))
            if amsgrad:
                ins["max_exp_avg_sq_in"] = flat(real(source["max_exp_avg_sq"]))
        ops.adamw_step_(flat(target), flat(aligned(grad, m)), flat(m), flat(v), flat(mx) if mx is not None else None,
                        flat(out) if out is not None else None, step, **hyper, **ins, adopt_out=adopt)

    @staticmethod
    def step_many(items: List[tuple]) -> None:
        """step() in place over many parameters, in ONE C++ call (ops.adamw_step_many_),
        each item checked before any is stepped: items of (hyper, target, grad, st, out,
        step, adopt), as step() takes them (amsgrad: hyper's)."""
        flat = memory_flat
        targets, grads, ms, vs, mxs, outs, steps, hypers, adopts = [], [], [], [], [], [], [], [], []
        for hyper, target, grad, st, out, step, adopt in items:
            m = real(st["exp_avg"])
            mx = st.get("max_exp_avg_sq") if hyper["amsgrad"] else None
            targets.append(flat(target))
            grads.append(flat(aligned(grad, m)))
            ms.append(flat(m))
            vs.append(flat(real(st["exp_avg_sq"])))
            mxs.append(flat(real(mx)) if mx is not None else None)
            outs.append(flat(out) if out is not None else None)
            steps.append(step)
            hypers.append(hyper)
            adopts.append(adopt)
        ops.adamw_step_many_(targets, grads, ms, vs, mxs, outs, steps, hypers, adopts)
