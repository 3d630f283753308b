"""Compiled fast paths of dtensor (an optional Cython extension).

This package owns the compiled modules, reports whether they were built, and decides which
base classes dtensor's ``Tensor`` and ``DTensor`` derive from. It never imports dtensor (nor
redistribute): dtensor and redistribute plug these modules in at their own import time (unless
``DTENSOR_FASTPATH=0``) and falls back to its pure-Python twins when they are missing. When
the extension was not built, importing this package says so once (a ``RuntimeWarning``).

Attributes
----------
strides : module or None
    ``fastpath._strides``, the compiled twin of ``dtensor.local.strides``; ``None`` when the
    extension was not built (no C compiler at install time, or ``DTENSOR_NO_EXT=1``).
dispatch : module or None
    ``fastpath._dispatch``, the compiled dispatch front (``None`` when not built).
redist : module or None
    ``fastpath._redist``, the compiled redistribute executor that the dispatch front runs
    one-step plans with, plugged in by ``redistribute.execute.compiled`` (``None`` when not
    built).
pool : module or None
    ``fastpath._pool``, the compiled front of the caching host allocator (``None`` when not
    built).
kernels : module or None
    ``fastpath._kernels``, compiled local kernels (relu, erf, gelu, softmax/log_softmax,
    layer_norm, last-dim sum/mean/amax; vectorised float32 loops) and the elementwise
    short-path condition (``None`` when not built).
AVAILABLE : bool
    Whether the compiled extensions can be imported.
ENABLED : bool
    Whether dtensor uses them: ``AVAILABLE`` and ``DTENSOR_FASTPATH`` is not ``0``. Fixed
    at import: it selects the base classes below; the dispatch front can still be turned
    off and on at runtime (``dtensor.debug.set_fastpath``).
IMPORT_ERROR : str or None
    Why they cannot be imported (the ``ImportError`` message), for diagnostics.
TensorBase, DTensorBase : type
    The bases of ``dtensor.Tensor`` and ``dtensor.DTensor``: the compiled classes when
    ``ENABLED``, otherwise plain classes with the same slots.
"""

from __future__ import annotations

import warnings
from importlib import import_module
from types import ModuleType

from placements.env import env_flag

strides: ModuleType | None
dispatch: ModuleType | None
redist: ModuleType | None
pool: ModuleType | None
kernels: ModuleType | None
IMPORT_ERROR: str | None

try:
    strides = import_module(f"{__name__}._strides")
    redist = import_module(f"{__name__}._redist")
    dispatch = import_module(f"{__name__}._dispatch")
    pool = import_module(f"{__name__}._pool")
    kernels = import_module(f"{__name__}._kernels")
except ImportError as exc:
    strides = dispatch = redist = pool = kernels = None
    IMPORT_ERROR = str(exc)
else:
    IMPORT_ERROR = None

AVAILABLE: bool = strides is not None
ENABLED: bool = AVAILABLE and env_flag("DTENSOR_FASTPATH", True)

if not AVAILABLE:
    warnings.warn(
        f"dtensor: the compiled fast path is not built ({IMPORT_ERROR}); running on the "
        "Python path",
        RuntimeWarning,
        stacklevel=2,
    )


if ENABLED:
    TensorBase = dispatch.TensorBase
    DTensorBase = dispatch.DTensorBase
else:

    def _unset_slot(self, name: str) -> None:
        # Reached only when normal lookup fails: ``_ag`` is None until set, as the compiled
        # bases' slot (so that no creation site has to set it).
        if name != "_ag":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    class TensorBase:
        """Slots of the local Tensor (pure-Python twin of the compiled base)."""

        __slots__ = ("__weakref__", "_ag", "_arr", "_std", "_storage")
        __getattr__ = _unset_slot

    class DTensorBase:
        """Slots of DTensor (pure-Python twin of the compiled base)."""

        __slots__ = ("__weakref__", "_ag", "_local", "_spec")
        __getattr__ = _unset_slot


__all__ = [
    "AVAILABLE",
    "ENABLED",
    "IMPORT_ERROR",
    "DTensorBase",
    "TensorBase",
    "dispatch",
    "kernels",
    "redist",
    "strides",
]
