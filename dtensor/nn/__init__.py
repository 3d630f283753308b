"""``dt.nn``: models with PyTorch's names and semantics, over local Tensors and DTensors.

- :class:`Module` (:mod:`dtensor.nn.module`): registration of parameters, buffers and
  submodules, traversal, state dicts, train/eval, hooks; :class:`Parameter`
  (:mod:`dtensor.nn.parameter`: a mark on a Tensor or DTensor, not a subclass);
- layers (:mod:`dtensor.nn.layers`): Linear, Embedding, LayerNorm, RMSNorm, Dropout, GELU,
  SiLU, ReLU, CrossEntropyLoss, MSELoss; :func:`abstract_parameters` builds them with
  metadata-only parameters (models of any size, for planning); containers (:mod:`dtensor.nn.containers`):
  Sequential, ModuleList, ModuleDict;
- :mod:`dtensor.nn.functional`: ``torch.nn.functional``'s names over the op table;
- :mod:`dtensor.nn.init`: initialisations, the same global values on any layout;
- :mod:`dtensor.nn.utils`: ``clip_grad_norm_``;
- :func:`checkpoint_wrapper` (:mod:`dtensor.nn.checkpoint_wrapper`): a module whose calls
  are checkpointed (:func:`dtensor.utils.checkpoint`).

Modules hold Tensors or DTensors alike and know nothing of MPI: a model runs on DTensors
once its parameters are DTensors (the ops' sharding rules place everything else).
"""

from __future__ import annotations

from . import functional, init, utils
from .checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from .containers import ModuleDict, ModuleList, Sequential
from .layers import (
    GELU,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    MSELoss,
    ReLU,
    RMSNorm,
    SiLU,
    abstract_parameters,
)
from .module import Module, RemovableHandle
from .parameter import Parameter

__all__ = [
    "GELU",
    "CheckpointWrapper",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "Module",
    "ModuleDict",
    "ModuleList",
    "Parameter",
    "RMSNorm",
    "ReLU",
    "RemovableHandle",
    "Sequential",
    "SiLU",
    "abstract_parameters",
    "checkpoint_wrapper",
    "functional",
    "init",
    "utils",
]
