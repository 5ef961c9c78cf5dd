"""Module offload: blocks' weights in pinned host memory with look-ahead
prefetch (:func:`offload_layers`), and saved activations offloaded during
training (:class:`offload_activations`)."""
from .activations import NothingOffloadedWarning, offload_activations
from .layer_offload import LayerOffload
from .layers import offload_layers

__all__ = ["offload_layers", "LayerOffload", "offload_activations", "NothingOffloadedWarning"]
