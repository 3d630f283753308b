"""Compiled fast paths of dtensor (an optional Cython extension).

This package owns the compiled modules and reports whether they were built. It never
imports dtensor at module level: dtensor plugs these modules in at its own import time
(unless ``DTENSOR_FASTPATH=0``) and falls back to its pure-Python twins when
``AVAILABLE`` is false.

Attributes
----------
strides : module or None
    ``fastpath._strides``, the compiled twin of ``dtensor._strides``; ``None`` when the
    extension was not built (no C compiler at install time, or ``DTENSOR_NO_EXT=1``).
AVAILABLE : bool
    Whether the compiled extension can be imported.
IMPORT_ERROR : str or None
    Why it cannot (the ``ImportError`` message), for diagnostics.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

strides: ModuleType | None
IMPORT_ERROR: str | None

try:
    strides = import_module(f"{__name__}._strides")
except ImportError as exc:
    strides = None
    IMPORT_ERROR = str(exc)
else:
    IMPORT_ERROR = None

AVAILABLE: bool = strides is not None

__all__ = ["AVAILABLE", "IMPORT_ERROR", "strides"]
