"""``dt.utils``: PyTorch's ``torch.utils`` helpers for training: activation checkpointing,
``dt.utils.checkpoint(fn, *args)`` (:mod:`dtensor.utils.checkpoint`; the module wrapper is
``dt.nn.checkpoint_wrapper``)."""

from __future__ import annotations

from .checkpoint import checkpoint

__all__ = ["checkpoint"]
