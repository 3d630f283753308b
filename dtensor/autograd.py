"""``dt.autograd``: reverse-mode automatic differentiation (PyTorch's names and semantics).

The engine is :mod:`dtensor.local.grad_engine`; the backward formulas are in the op records
(``backward=`` in the family modules of :mod:`dtensor.ops`). Tensors and DTensors have ``requires_grad``,
``requires_grad_()``, ``grad``, ``grad_fn``, ``is_leaf`` and ``backward()``; factories
take ``requires_grad=``.

Choices where PyTorch has no DTensor answer (or a different one):

- a DTensor leaf's ``.grad`` is laid out like the leaf (the gradient is redistributed to
  the leaf's placements; a Partial placement becomes Replicate), so that an update
  ``p -= lr * p.grad`` needs no communication;
- the gradient of ``redistribute`` goes back to the input's placements (Partial as
  Replicate); ``to_local(grad_placements=)`` and ``from_local(..., grad_placements=)`` say
  how a local gradient is laid out;
- ``create_graph=True`` (``backward`` and ``grad``) runs the formulas as recorded ops, so
  gradients can be differentiated again (higher-order gradients; a gradient penalty
  ``g = grad(loss, x, create_graph=True); (g * g).sum().backward()``), on Tensors and
  DTensors alike (every formula is written with table ops). Not twice-differentiable: the
  value an in-place op reads of its own input (saved as a copy without history).
- ``getitem`` differentiates basic and advanced indices on Tensors and DTensors; an index
  with several integer arrays that names one element twice is refused (one array along
  one dim, as ``x[[0, 2, 0]]``, is not).

As in PyTorch, a node keeps only what its formula reads (declared with the formula), so a
training step's activations are freed as soon as the program and the graph let them go.
"""

from __future__ import annotations

from .local.grad_engine import (
    backward,
    enable_grad,
    grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)

__all__ = [
    "backward",
    "enable_grad",
    "grad",
    "is_grad_enabled",
    "no_grad",
    "set_grad_enabled",
]
