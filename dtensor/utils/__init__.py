"""``dt.utils``: PyTorch's ``torch.utils`` helpers for training: activation checkpointing
(:func:`checkpoint`, ``dt.utils.checkpoint(fn, *args)``, and the module wrapper
:func:`checkpoint_wrapper`; see :mod:`dtensor.utils.checkpoint`)."""

from __future__ import annotations

from .checkpoint import CheckpointWrapper, checkpoint, checkpoint_wrapper

__all__ = ["CheckpointWrapper", "checkpoint", "checkpoint_wrapper"]
