"""``checkpoint_wrapper``: a module whose calls are checkpointed (PyTorch's
``CheckpointWrapper``): its forward runs the wrapped module through
:func:`dtensor.utils.checkpoint`, so none of the wrapped module's intermediates is kept
between forward and backward; backward recomputes them with the same random state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..utils import checkpoint
from .module import Module

__all__ = ["CheckpointWrapper", "checkpoint_wrapper"]


class CheckpointWrapper(Module):
    """A module whose calls are checkpointed: ``wrapper(*args)`` is ``checkpoint_fn(module,
    *args)`` (default :func:`dtensor.utils.checkpoint`). **Local** (as the wrapped module).

    The wrapped module is a submodule, ``_checkpoint_wrapped_module`` (its parameters are
    the wrapper's, under that prefix, as in PyTorch); other attributes are read from it
    (``wrapper.weight``).
    """

    def __init__(self, module: Module, checkpoint_fn: Callable | None = None,
                 **checkpoint_fn_kwargs: Any) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module
        self._checkpoint_fn = checkpoint if checkpoint_fn is None else checkpoint_fn
        self._checkpoint_fn_kwargs = checkpoint_fn_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's call, checkpointed. **Local** (as the module)."""
        return self._checkpoint_fn(self._checkpoint_wrapped_module, *args,
                                   **self._checkpoint_fn_kwargs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_checkpoint_wrapped_module":
                raise
            return getattr(self._checkpoint_wrapped_module, name)


def checkpoint_wrapper(module: Module, checkpoint_fn: Callable | None = None,
                       **checkpoint_fn_kwargs: Any) -> CheckpointWrapper:
    """``module`` wrapped so that its calls are checkpointed (PyTorch's
    ``checkpoint_wrapper``, non-reentrant). **Local**.

    Parameters
    ----------
    module : Module
        The module (a block of a model, typically).
    checkpoint_fn : callable, optional
        What runs each call, ``checkpoint_fn(module, *args, **kwargs)``; default
        :func:`dtensor.utils.checkpoint`.
    **checkpoint_fn_kwargs
        Passed to it on every call (``preserve_rng_state=False``...).
    """
    return CheckpointWrapper(module, checkpoint_fn, **checkpoint_fn_kwargs)
