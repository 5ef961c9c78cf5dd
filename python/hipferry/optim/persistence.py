"""OffloadAdamW's persistence: torch.optim.AdamW's state_dict format in and
out, pickling and deepcopy. A mixin of OffloadAdamW (these are the
torch.optim.Optimizer protocol's own methods); it reads the optimizer's
state, slots and store, and restores state only into tensors the store made."""
import copy
from typing import Any, Dict, Optional

import torch

from ..pool import PinnedPool
from ..torch_private import optimizer_load_state_dict_hooks
from .checks import TORCH_FLAG_DEFAULTS, check_loadable
from .disk import persistence as disk
from .int8_store import check_saved, restore_key
from .layout import real
from .slots import param_key
from .state import local, to_global_state


class StatePersistence:
    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's format. Under FSDP2 the state of a DTensor
        parameter is a DTensor like the parameter (as torch.optim.AdamW keeps it),
        wrapping this rank's host tensors without copying them."""
        self.synchronize()
        self._reread_written()  # a master written outside step() is saved as written
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["state"] = {i: to_global_state(params[i], st) if isinstance(i, int) and i < len(params) else st
                       for i, st in sd["state"].items()}
        if getattr(self, "_disk", None) is not None:  # file-backed tensors, verified first (disk/persistence.py)
            disk.verify(self._store)
            for i, st in sd["state"].items():
                if isinstance(st, dict) and "disk" in st:
                    st = dict(st, **disk.export_state(self._store, st["disk"], local(params[i])))
                    st.pop("disk")
                    sd["state"][i] = st
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch.optim.Optimizer.load_state_dict's protocol: pre-hooks may edit or
        replace the state dict, groups lacking newer keys get torch's defaults
        (__setstate__), post-hooks run after the state is restored. Everything
        is validated before anything changes; the state is copied into the pool
        tensors this optimizer already holds."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"OffloadAdamW.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        state_dict = state_dict.copy()
        for pre_hook in optimizer_load_state_dict_hooks(self)[0]:
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.synchronize()
        by_param = check_loadable(self, state_dict)  # validates everything first
        for i, (p, saved) in enumerate(by_param.items()):
            check_saved(saved, local(p), f"the state of parameter {i}")
        if self._overlap is not None:
            self._overlap.speculation.drop()  # its jobs read the state written below
        if getattr(self, "_disk", None) is not None:  # written and committed first: a failure changes nothing
            disk.load_states(self._store, [(p, by_param.get(p)) for g in self.param_groups for p in g["params"]
                                           if "disk" in self.state[p]])
        groups = []
        for g, saved in zip(self.param_groups, copy.deepcopy(state_dict["param_groups"])):
            saved["params"] = g["params"]
            if "param_names" in g and "param_names" not in saved:
                saved["param_names"] = g["param_names"]
            groups.append(saved)
        added = {p: self._store.amsgrad_state(local(p), self._slots[p].where, self.state[p]) for g in groups
                 if g["amsgrad"] for p in g["params"] if "max_exp_avg_sq" not in self.state[p]}
        super().__setstate__({"state": self.state, "param_groups": groups})
        self._fill_group_defaults()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if p in added:
                    st.update(added[p])
                elif not group["amsgrad"]:  # torch's keys exactly; the memory goes back to the pool
                    st.pop("max_exp_avg_sq", None)
                    st.pop("max_exp_avg_sq_absmax", None)
                self._restore_state(p, st, by_param.get(p))
        self._grad_copies.drop(self._slots.values())
        for post_hook in optimizer_load_state_dict_hooks(self)[1]:
            post_hook(self)

    def _restore_state(self, p: torch.Tensor, st: dict, saved: Optional[dict]) -> None:
        """Copies a saved state (or zeros, without one) into the state tensors of `p`."""
        for k, t in st.items():
            if k == "disk":
                continue  # (load_states wrote it)
            if k == "step":
                t.fill_(float(saved["step"]) if saved is not None else 0.0)
            elif k.endswith("_absmax") or restore_key(st, k, saved):
                pass  # 8-bit state, or a conversion between the formats (int8_store.py)
            elif k == "master_param":
                t.copy_(_as_local(saved[k]) if saved is not None and k in saved else local(p))
            elif saved is not None and k in saved:
                t.copy_(_as_local(saved[k]))
            else:
                t.zero_()
        slot = self._slots[p]
        slot.seen = param_key(local(p))
        if slot.host_param is not None:
            real(slot.host_param).copy_(real(local(p)))

    def snapshot(self, folder: str) -> str:
        """state_dir=...: copies the state as of the last step into `folder` (new or empty), a
        folder to resume from (reflinks where the file system has them, else kernel copies)."""
        if getattr(self, "_disk", None) is None:
            raise ValueError("OffloadAdamW.snapshot: this optimizer keeps its state in memory (no state_dir); "
                             "use torch.save(opt.state_dict(), path)")
        return disk.snapshot(self._store, folder)

    def _fill_group_defaults(self) -> None:
        """What torch.optim.AdamW's __setstate__ fills into groups of older state dicts."""
        for group in self.param_groups:
            for k, v in TORCH_FLAG_DEFAULTS.items():
                group.setdefault(k, v)

    def __getstate__(self) -> Dict[str, Any]:
        """torch's three entries (defaults, state, param_groups: the state as
        plain tensors once pickled) and this optimizer's own settings. The pool
        is not pickled: an unpickled optimizer uses the default pool (a
        deepcopy shares the original's pool)."""
        if getattr(self, "_disk", None) is not None:
            raise TypeError("OffloadAdamW: an optimizer with its state on disk (state_dir=...) cannot be pickled or "
                            "deep-copied; save opt.state_dict() or take opt.snapshot(folder)")
        self.synchronize()
        self._reread_written()
        return {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups,
                "hipferry": dict(self._settings),
                "counters": dict(skipped_steps=self.skipped_steps, last_step_skipped=self.last_step_skipped)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "_slots" in self.__dict__:  # torch.optim.Optimizer's protocol inside load_state_dict
            super().__setstate__(state)
            self._fill_group_defaults()
            return
        self._rebuild(state, pool=None)

    def __deepcopy__(self, memo: dict):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new._rebuild(copy.deepcopy(self.__getstate__(), memo), pool=self._pool)
        return new

    @torch.no_grad()
    def _rebuild(self, state: Dict[str, Any], pool: Optional[PinnedPool]) -> None:
        """Unpickling / deepcopy: a new optimizer over the copied parameters (its
        state in `pool`), then the copied state restored into it."""
        d = state["defaults"]
        own = {k: d[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                                 "capturable", "differentiable", "fused") if k in d}
        groups = [dict(g) for g in state["param_groups"]]
        type(self).__init__(self, groups, **own, **state.get("hipferry", {}), pool=pool)
        for p in (p for g in self.param_groups for p in g["params"]):
            self._restore_state(p, self.state[p], state["state"].get(p))
        for k, v in state.get("counters", {}).items():
            setattr(self, k, v)


def _as_local(t: Any) -> torch.Tensor:
    return local(t) if isinstance(t, torch.Tensor) else torch.as_tensor(t)
