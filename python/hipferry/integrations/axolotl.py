"""An Axolotl plugin: OffloadAdamW from the YAML config.

    plugins:
      - hipferry.integrations.axolotl.HipferryPlugin
    optimizer: adamw_torch          # replaced by OffloadAdamW (lr, betas, eps, weight_decay kept)
    hipferry_state: host8           # host | host8 | disk | disk8
    hipferry_overlap: backward      # none | backward
    # hipferry_state_dir: /nvme/run1   (disk, disk8); also hipferry_step_on, hipferry_skip_nonfinite,
    # hipferry_disk_window, hipferry_min_offload_numel, hipferry_clip, hipferry_activations,
    # hipferry_activations_min_bytes: the keys of .options

``HipferryArgs`` (``get_input_args``) adds those keys to Axolotl's pydantic
config; a bad value fails config validation, naming the key, before a model
is loaded. The keys carry the ``hipferry_`` prefix because Axolotl merges every
plugin's fields into one flat config.

Axolotl builds its own trainer class (AxolotlTrainer and its mixins), so the
plugin does not replace it (``get_trainer_cls`` would drop Axolotl's
features). At ``post_trainer_create`` it gives that trainer instance a
subclass of its own class with ``HipferryTrainerMixin`` in front (the
optimizer, the clipping through ``OffloadAdamW.clip_grad_norm_``,
accumulation and disk resume of hipferry.integrations.transformers): an
override of one object's class, nothing global. ``create_optimizer``
(called by Axolotl versions whose trainers ask the plugins) does the same and
returns the optimizer that trainer then builds.

Tested with axolotl 0.19.0 installed without its dependencies (it pins
torch<=2.13, this project runs 2.15): its ``BasePlugin`` and
``PluginManager`` are the real ones; Axolotl's full ``axolotl train`` pipeline
was not run (docs/integrations.md). Without axolotl, the plugin derives from
a stand-in with BasePlugin's method names, so it stays importable and testable.
"""
from typing import Any, Dict, Optional

from pydantic import BaseModel, model_validator

from .options import HipferryOptions, parse_options
from .transformers import HipferryTrainerMixin, check_optim_name

try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # axolotl missing, or its own imports fail: the interface, duck-typed
    class BasePlugin:  # type: ignore[no-redef]
        """Stand-in for axolotl.integrations.base.BasePlugin (the hooks used here)."""

        def get_input_args(self) -> Optional[str]:
            return None

        def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
            return None

        def create_optimizer(self, cfg: Any, trainer: Any) -> Any:
            return None

PREFIX = "hipferry_"
CONFIG_KEYS = ("state", "state_dir", "disk_window", "overlap", "step_on", "skip_nonfinite", "min_offload_numel",
               "clip", "activations", "activations_min_bytes")


class HipferryArgs(BaseModel):
    """The plugin's keys in Axolotl's config (module doc); None: the default."""
    hipferry_state: Optional[str] = None
    hipferry_state_dir: Optional[str] = None
    hipferry_disk_window: Optional[Any] = None
    hipferry_overlap: Optional[str] = None
    hipferry_step_on: Optional[str] = None
    hipferry_skip_nonfinite: Optional[bool] = None
    hipferry_min_offload_numel: Optional[int] = None
    hipferry_clip: Optional[str] = None
    hipferry_activations: Optional[str] = None
    hipferry_activations_min_bytes: Optional[Any] = None

    @model_validator(mode="after")
    def _hipferry_options_are_valid(self):
        options_from_cfg(self)  # ValueError naming the key: pydantic reports it as a validation error
        return self


def options_from_cfg(cfg: Any) -> HipferryOptions:
    """The ``hipferry_*`` keys of an Axolotl config (a DictDefault, dict or pydantic model)."""
    get = cfg.get if hasattr(cfg, "get") else (lambda key: getattr(cfg, key, None))
    values: Dict[str, Any] = {k: get(PREFIX + k) for k in CONFIG_KEYS}
    if values.get("overlap") is False:  # YAML reads a bare `none`-like `no`/`off` as False
        values["overlap"] = "none"
    return parse_options({k: v for k, v in values.items() if v is not None}, "axolotl config (hipferry_* keys)")


_CLASSES: Dict[type, type] = {}


def adopt(trainer: Any, options: HipferryOptions) -> Any:
    """Gives `trainer` HipferryTrainerMixin's hooks (a subclass of its class) and `options`."""
    check_optim_name(trainer.args)
    cls = type(trainer)
    if not isinstance(trainer, HipferryTrainerMixin):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Hipferry{cls.__name__}", (HipferryTrainerMixin, cls), {})
        trainer.__class__ = _CLASSES[cls]
    trainer.hipferry_options = options
    trainer.hipferry_setup()
    return trainer


class HipferryPlugin(BasePlugin):
    """Axolotl plugin: OffloadAdamW and its clipping for Axolotl's trainer (module doc)."""

    def get_input_args(self) -> str:
        return f"{__name__}.HipferryArgs"

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        adopt(trainer, options_from_cfg(cfg))

    def create_optimizer(self, cfg: Any, trainer: Any) -> Any:
        adopt(trainer, options_from_cfg(cfg))
        if trainer.optimizer is None:
            trainer.create_optimizer()
        return trainer.optimizer


__all__ = ["HipferryPlugin", "HipferryArgs", "options_from_cfg", "adopt"]
