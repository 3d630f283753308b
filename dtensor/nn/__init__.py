"""``dt.nn``: training utilities with PyTorch's names (:mod:`dtensor.nn.utils`)."""

from __future__ import annotations

from . import utils

__all__ = ["utils"]
