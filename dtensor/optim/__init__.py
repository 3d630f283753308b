"""``dt.optim``: optimizers with PyTorch's names, arguments and update rules.

:class:`SGD` (momentum, dampening, weight decay, Nesterov, maximize), :class:`Adam` and
:class:`AdamW` (weight decay as L2 or decoupled, AMSGrad, maximize) update parameters that
are :class:`dtensor.Tensor` or :class:`dtensor.DTensor` objects, in place and without
recording for autograd. Each step is a chain of in-place elementwise ops on a parameter,
its gradient and its state, all laid out like the parameter (a DTensor leaf's ``.grad`` is
laid out like the leaf, see :mod:`dtensor.autograd`), so a step on DTensor parameters of
any placements moves no data between ranks. The state (momentum buffers, moment
estimates) is created like the parameter, on its mesh with its placements.

``state_dict()`` / ``load_state_dict()`` follow PyTorch's layout: ``{"state": {index:
{...}}, "param_groups": [{..., "params": [indices]}]}``, parameters numbered in group
order.

:mod:`dtensor.optim.lr_scheduler` holds the learning-rate schedulers (``LinearLR``,
``CosineAnnealingLR``, ``SequentialLR``, ...).
"""

from __future__ import annotations

from . import lr_scheduler
from ._optimizers import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler"]
