"""Module offload: blocks' weights in pinned host memory with look-ahead
prefetch (:func:`offload_layers`), and saved activations offloaded during
training (:class:`offload_activations`)."""
from .activations import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MIN_BYTES, NothingOffloadedWarning, keep_reason, \
    offload_activations
from .block_layout import default_layers, plan_blocks
from .layer_offload import LayerOffload
from .layers import offload_layers

__all__ = ["offload_layers", "LayerOffload", "offload_activations", "NothingOffloadedWarning",
           # for the planner, which estimates what these would move:
           "DEFAULT_MIN_BYTES", "DEFAULT_MAX_IN_FLIGHT", "keep_reason", "default_layers", "plan_blocks"]
