"""``transformers.Trainer`` with hipferry's OffloadAdamW, switched on from a config.

    from hipferry.integrations.transformers import HipferryTrainer
    args = TrainingArguments(..., optim_args="state=host8,overlap=backward")
    HipferryTrainer(model=model, args=args, train_dataset=data).train()

Why this route (transformers 5.25):
- ``TrainingArguments.optim`` is an enum of names transformers knows, and the
  arguments must stay JSON-serializable (they go into every checkpoint's
  ``training_args.bin`` and to the loggers). ``optim_args`` is a plain string
  that transformers passes to some optimizers and leaves alone for
  ``adamw_torch``/``adamw_torch_fused``: the options live there, so an existing
  ``TrainingArguments`` (or TRL's ``SFTConfig``, a subclass) carries them with
  no new field, from Python, JSON or YAML alike.
- ``optimizer_cls_and_kwargs`` would take the class but not the clipping: a
  Trainer calls ``accelerator.clip_grad_norm_(model.parameters(), ...)``,
  which scales every gradient on the device after OffloadAdamW's backward
  hooks copied it to the host: the optimizer notices the write and copies
  each gradient again. So a small subclass (a mixin,
  reused by the TRL and Axolotl entry points) overrides Trainer's own hook
  points, nothing global:
  - ``get_optimizer_cls_and_kwargs``: OffloadAdamW with lr, betas, eps from the
    arguments (``create_optimizer`` still builds the weight-decay groups and
    leaves out frozen parameters, e.g. everything but LoRA adapters);
  - ``_clip_grad_norm`` / ``_get_grad_norm``: ``OffloadAdamW.clip_grad_norm_``,
    which scales the host copies in place (same norm as torch's). With a
    GradScaler the gradients are unscaled first, as accelerate does. Sharded
    set-ups (FSDP, DeepSpeed, mixed meshes) keep Trainer's path, as does
    ``clip=accelerate``;
  - ``training_step``: micro-batches that do not end an accumulation run under
    ``opt.accumulating()``, so ``overlap=backward`` speculates only on the last;
    with ``activations=hipferry`` each runs under ``hipferry.offload_activations``;
  - ``train`` / ``_load_optimizer_and_scheduler``: with state on disk, resuming
    reopens the folder (``DiskOptions(resume=True)``), then restores the
    checkpoint's weights and ``optimizer.pt`` over it (the folder may hold
    later steps than the checkpoint).
Options: hipferry.integrations.options (docs/integrations.md).
"""
import contextlib
from typing import Any, Optional

from transformers import Trainer

from ..module_offload import offload_activations
from ..optim import OffloadAdamW
from ..optim.disk import holds_state
from .options import API, HipferryOptions, optimizer_kwargs, parse_options

ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's AcceleratedOptimizer (or itself)."""
    return getattr(optimizer, "optimizer", optimizer) if optimizer is not None else None


def check_optim_name(args: Any) -> None:
    """``args.optim`` must name AdamW: OffloadAdamW takes its place."""
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_NAMES:
        raise ValueError(f"{API}: TrainingArguments.optim must be one of {', '.join(ADAMW_NAMES)} (OffloadAdamW "
                         f"takes AdamW's place), got {optim!r}")


def check_args(args: Any) -> HipferryOptions:
    """The options in ``args.optim_args``, after check_optim_name."""
    check_optim_name(args)
    return parse_options(args.optim_args, "TrainingArguments.optim_args")


class HipferryTrainerMixin:
    """Trainer hooks for OffloadAdamW (module doc). Before Trainer in the bases.
    ``hipferry_options`` may be set before training (Axolotl's plugin does);
    otherwise it is read from ``args.optim_args``."""

    hipferry_options: Optional[HipferryOptions] = None
    hipferry_activations: Optional[offload_activations] = None
    _hipferry_resuming = False
    _hipferry_reopened = False

    def hipferry_precheck(self, args: tuple, kwargs: dict) -> None:
        """Checks the options of the ``args`` given to __init__ before Trainer's __init__ runs,
        so bad ones are refused before anything is built (None: Trainer's defaults, checked after)."""
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None and self.hipferry_options is None:
            self.hipferry_options = check_args(given)

    def hipferry_setup(self) -> None:
        """Reads and checks the options: call at the end of __init__ (or after setting
        ``hipferry_options``). activations=hipferry: the offload_activations context,
        entered by training_step, or by TRL's own training_step in place of its context."""
        if self.hipferry_options is None:
            self.hipferry_options = check_args(self.args)
        o = self.hipferry_options
        if o.activations == "hipferry" and self.hipferry_activations is None:
            self.hipferry_activations = offload_activations(min_bytes=o.activations_min_bytes)
            if hasattr(self, "maybe_activation_offload_context"):  # TRL's trainers enter it in training_step
                self.maybe_activation_offload_context = self.hipferry_activations

    # ------------------------------------------------------------ optimizer
    def get_optimizer_cls_and_kwargs(self, args: Any, model: Any = None):
        """Instance method over Trainer's static one: create_optimizer calls it on self."""
        options = self.hipferry_options or check_args(args)
        reopen = options.on_disk and self._hipferry_resuming and holds_state(options.state_dir)
        self._hipferry_reopened = reopen
        kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                      **optimizer_kwargs(options, resume=reopen))
        return OffloadAdamW, kwargs

    def hipferry_optimizer(self) -> Optional[OffloadAdamW]:
        opt = unwrap_optimizer(self.optimizer)
        return opt if isinstance(opt, OffloadAdamW) else None

    # ------------------------------------------------------------ clipping
    def _hipferry_clips(self, model: Any) -> Optional[OffloadAdamW]:
        from accelerate.utils import DistributedType
        opt = self.hipferry_optimizer()
        if opt is None or self.hipferry_options.clip != "hipferry":
            return None
        if self.accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_GPU):
            return None  # sharded gradients: the norm needs the shards' reduction (accelerate's)
        if self._has_mixed_mesh_grads(model):
            return None
        return opt

    def _clip_grad_norm(self, model):
        opt = self._hipferry_clips(model)
        if opt is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()  # GradScaler: what accelerator.clip_grad_norm_ does first
        return opt.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            opt = self._hipferry_clips(model)
            if opt is not None:  # max_grad_norm=0: the norm alone, from the same host copies
                self.accelerator.unscale_gradients()
                grad_norm = opt.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ------------------------------------------------------------ accumulation
    def training_step(self, *args, **kwargs):
        opt = self.hipferry_optimizer()
        accumulating = opt is not None and not self.accelerator.sync_gradients
        # not the last micro-batch: no speculative step (overlap=backward)
        with opt.accumulating() if accumulating else contextlib.nullcontext(), self._hipferry_activation_context():
            return super().training_step(*args, **kwargs)

    def _hipferry_activation_context(self):
        if self.hipferry_activations is None or hasattr(self, "maybe_activation_offload_context"):
            return contextlib.nullcontext()  # (none asked, or TRL's training_step enters it)
        return self.hipferry_activations

    # ------------------------------------------------------------ resume
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._hipferry_resuming = bool(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None and self._hipferry_reopened:
            # Reopening the folder set the parameters to its last step; the checkpoint may be older.
            # Its weights first, then optimizer.pt (whose load takes the master from the parameters).
            self._load_from_checkpoint(checkpoint)
        return super()._load_optimizer_and_scheduler(checkpoint)


class HipferryTrainer(HipferryTrainerMixin, Trainer):
    """``transformers.Trainer`` training with OffloadAdamW; options in ``args.optim_args``."""

    def __init__(self, *args, **kwargs):
        self.hipferry_precheck(args, kwargs)
        super().__init__(*args, **kwargs)
        self.hipferry_setup()


__all__ = ["HipferryTrainer", "HipferryTrainerMixin", "check_args", "check_optim_name", "unwrap_optimizer"]
