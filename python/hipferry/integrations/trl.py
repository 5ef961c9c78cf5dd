"""``trl.SFTTrainer`` with hipferry's OffloadAdamW, and optionally hipferry's
activation offloading, switched on from the config.

    from hipferry.integrations.trl import HipferrySFTTrainer
    config = SFTConfig(..., optim_args="state=host8,activations=hipferry")
    HipferrySFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok).train()

The optimizer, clipping, accumulation and resume are HipferryTrainerMixin's
(hipferry.integrations.transformers; the options: .options). ``SFTConfig``
is a ``TrainingArguments``: ``optim_args`` carries the options the same way.

``activations=hipferry`` replaces the context TRL wraps each ``training_step``
in (``maybe_activation_offload_context``, TRL's own offloading when
``activation_offloading=True``) by ``hipferry.offload_activations``, built once
with ``min_bytes=activations_min_bytes``: saved tensors wait in hipferry's
pinned pool and come back ahead of backward. With it, TRL's
``activation_offloading`` is not needed (if it is also set, hipferry's context
is the one used). Its counters: ``trainer.hipferry_activations.stats()``.
"""
from trl import SFTTrainer

from .transformers import HipferryTrainerMixin


class HipferrySFTTrainer(HipferryTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` training with OffloadAdamW; options in ``args.optim_args``.
    (activations=hipferry: HipferryTrainerMixin.hipferry_setup puts the context in
    ``maybe_activation_offload_context``, which SFTTrainer.training_step enters.)"""

    def __init__(self, *args, **kwargs):
        self.hipferry_precheck(args, kwargs)
        super().__init__(*args, **kwargs)
        self.hipferry_setup()


__all__ = ["HipferrySFTTrainer"]
