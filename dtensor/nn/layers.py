"""The layers of ``dt.nn``: Linear, Embedding, LayerNorm, RMSNorm, Dropout, the activations
GELU/SiLU/ReLU and the losses CrossEntropyLoss/MSELoss, with PyTorch's arguments, default
initialisations (through :mod:`dtensor.nn.init`, so reproducible for a seed) and reprs.

Each ``forward`` is one call of :mod:`dtensor.nn.functional`; a layer holds local Tensors
until its parameters are replaced by DTensor ones (then the ops' sharding rules place the
outputs). ``device`` arguments are left out: parameters are created on the CPU, and a
DTensor parameter lives where its mesh does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from placements.errors import ArgumentError, MeshError

from ..distributed.abstract import AbstractMesh
from ..distributed.factory import FACTORIES
from ..local.grad_engine import no_grad
from . import functional as F
from . import init
from .module import Module
from .parameter import Parameter

__all__ = [
    "GELU",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "RMSNorm",
    "ReLU",
    "SiLU",
    "abstract_parameters",
]


#: The abstract mesh of :func:`abstract_parameters` while one is active (else None).
_ABSTRACT: ContextVar[Any] = ContextVar("abstract_parameters", default=None)


def _empty(*shape: int, dtype: Any = None) -> Any:
    mesh = _ABSTRACT.get()
    if mesh is not None:
        return FACTORIES["empty"](*shape, dtype=dtype, device_mesh=mesh)
    return FACTORIES["empty"](*shape, dtype=dtype)


@contextlib.contextmanager
def abstract_parameters(mesh: Any = None) -> Iterator[Any]:
    """Build models with metadata-only parameters: a model of any size for planning, without
    memory. **Local**.

    Inside the ``with`` block, the layers of ``dt.nn`` (Linear, Embedding, LayerNorm,
    RMSNorm) create their parameters as :class:`~dtensor.AbstractDTensor` s replicated on
    ``mesh``, and their initialisations (and any ``dt.nn.init`` call on them) run on
    metadata only. Such a model runs forward, backward and optimizer steps as the programs
    of :mod:`dtensor.autoshard` do on abstract meshes: every op's sharding decision,
    collectives (``CommDebugMode``), and per-rank memory (:func:`dtensor.abstract_memory_stats`),
    no kernel. Values (``.numpy()``, ``.item()``) are refused.

    Parameters
    ----------
    mesh : AbstractMesh, optional
        Without ``coord``. Default ``AbstractMesh((1,))``: one process's model, whose
        parameters stand for local tensors.

    Yields
    ------
    AbstractMesh
        The mesh the parameters live on.

    Raises
    ------
    MeshError
        ``mesh`` is not an AbstractMesh without ``coord``.
    """
    mesh = AbstractMesh((1,)) if mesh is None else mesh
    if not isinstance(mesh, AbstractMesh) or not mesh._abstract:
        raise MeshError(f"abstract_parameters: mesh must be an AbstractMesh without coord, got "
                        f"{mesh!r}")
    token = _ABSTRACT.set(mesh)
    try:
        yield mesh
    finally:
        _ABSTRACT.reset(token)


def _shape(normalized_shape: int | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


class Linear(Module):
    """``y = x W^T + b``, PyTorch's ``nn.Linear``. **Local** to build.

    ``weight`` ``(out_features, in_features)`` starts as ``kaiming_uniform_(a=sqrt(5))``
    (values in ``+-1/sqrt(in_features)``) and ``bias`` ``(out_features,)`` uniform in the
    same bounds, from the global generator (``dt.manual_seed``).

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
    dtype : dtype, optional
        Default: the default float dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Any = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(_empty(out_features, in_features, dtype=dtype))
        if bias:
            self.bias = Parameter(_empty(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default initialisation (see the class docstring). **Local**."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Any) -> Any:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of size ``embedding_dim``, PyTorch's
    ``nn.Embedding``. **Local** to build.

    ``weight`` starts as N(0, 1) draws from the global generator, with the row
    ``padding_idx`` zero (its gradient is zero too).

    Parameters
    ----------
    num_embeddings, embedding_dim : int
    padding_idx : int, optional
        May be negative (counted from the end).
    dtype : dtype, optional

    Raises
    ------
    ArgumentError
        A ``padding_idx`` outside ``[-num_embeddings, num_embeddings)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ArgumentError(
                    f"Embedding: padding_idx must be within num_embeddings ({num_embeddings}), "
                    f"got {padding_idx}"
                )
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.weight = Parameter(_empty(num_embeddings, embedding_dim, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 1) values, the padding row zero. **Local**."""
        init.normal_(self.weight)
        if self.padding_idx is not None:
            with no_grad():
                self.weight[self.padding_idx] = 0.0

    def forward(self, input: Any) -> Any:
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s if self.padding_idx is None else s + f", padding_idx={self.padding_idx}"


class _Norm(Module):
    """What LayerNorm and RMSNorm share: the normalized shape, eps, and the affine
    parameters named in ``params`` (created when their flag is set, else None): ``weight``
    ones and ``bias`` zeros."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None,
                 elementwise_affine: bool, dtype: Any, params: dict[str, bool]) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        for name, on in params.items():
            self.register_parameter(
                name, Parameter(_empty(*self.normalized_shape, dtype=dtype)) if on else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight ones, bias zeros. **Local**."""
        if self.weight is not None:
            init.ones_(self.weight)
        if self._parameters.get("bias") is not None:
            init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class LayerNorm(_Norm):
    """Normalisation over the trailing ``normalized_shape`` dims with an affine map,
    PyTorch's ``nn.LayerNorm``: ``weight`` ones and ``bias`` zeros (when
    ``elementwise_affine``; no bias with ``bias=False``). **Local** to build.

    Parameters
    ----------
    normalized_shape : int or sequence of int
    eps : float
    elementwise_affine, bias : bool
    dtype : dtype, optional
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, dtype: Any = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, dtype,
                         {"weight": elementwise_affine, "bias": elementwise_affine and bias})

    def forward(self, input: Any) -> Any:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(_Norm):
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims, scaled
    by ``weight`` (ones), PyTorch's ``nn.RMSNorm``. **Local** to build; needs the op
    ``rms_norm`` (see :func:`dtensor.nn.functional.rms_norm`).

    Parameters
    ----------
    normalized_shape : int or sequence of int
    eps : float, optional
        Default: the machine epsilon of the input's dtype.
    elementwise_affine : bool
    dtype : dtype, optional
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, dtype: Any = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, dtype,
                         {"weight": elementwise_affine})

    def forward(self, input: Any) -> Any:
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)


class Dropout(Module):
    """Zero each element with probability ``p`` in training mode and scale the others by
    ``1 / (1 - p)``; the identity in evaluation mode and for ``p == 0`` (the input itself is
    returned). PyTorch's ``nn.Dropout``.

    Raises
    ------
    ArgumentError
        A ``p`` outside ``[0, 1]``.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ArgumentError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace

    def forward(self, input: Any) -> Any:
        if not self.training or self.p == 0:  # the input itself, as the kernel returns it
            return input  # (a DTensor too: no dispatch, no graph node, no new handle)
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class GELU(Module):
    """``x * Phi(x)`` (``approximate='tanh'``: PyTorch's tanh form), ``nn.GELU``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, input: Any) -> Any:
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class _InplaceActivation(Module):
    """An activation with PyTorch's ``inplace`` flag (written into its input when set)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class SiLU(_InplaceActivation):
    """``x * sigmoid(x)``, ``nn.SiLU``."""

    def forward(self, input: Any) -> Any:
        return F.silu(input, inplace=self.inplace)


class ReLU(_InplaceActivation):
    """``max(x, 0)``, ``nn.ReLU``."""

    def forward(self, input: Any) -> Any:
        return F.relu(input, inplace=self.inplace)


class CrossEntropyLoss(Module):
    """Cross-entropy between logits and class indices or probabilities,
    ``nn.CrossEntropyLoss`` (see :func:`dtensor.nn.functional.cross_entropy`). ``weight``
    (per class) is a buffer. The options after ``weight`` are keyword only (PyTorch's
    deprecated ``size_average``/``reduce`` are not taken).
    """

    def __init__(self, weight: Any = None, *, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, input: Any, target: Any) -> Any:
        return F.cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class MSELoss(Module):
    """Mean squared error (``reduction`` 'mean', 'sum' or 'none'), ``nn.MSELoss``."""

    def __init__(self, *, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, input: Any, target: Any) -> Any:
        return F.mse_loss(input, target, reduction=self.reduction)
