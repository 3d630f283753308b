"""Exception types of dtensor: one catalogue for every layer.

This module sits in the lowest layer (``placements``) so that every package can raise
these types; ``dtensor.errors`` re-exports it. Each subclass also subclasses the matching
builtin, so ``except ValueError`` keeps working for users who do not know our types.

Which type for which check:

- :class:`PlacementError`: a Shard dim out of range, placements whose count is not the
  mesh's ndim, an unknown Partial op, a value that is not a placement;
- :class:`MeshError`: a mesh that does not match the communicator (shape vs world size,
  duplicate ranks), bad mesh dim names, operands on different meshes;
- :class:`ShardingError`: shapes that do not broadcast or multiply (with the global shapes
  and the placements), local shards that do not match the global shape, an in-place op
  that would change its input's placements;
- :class:`DTypeError`: a dtype or an argument type the op does not accept (reductions
  included; ``dim`` that is not an int, a device that is not a str/Device/int, a DTensor
  where a local tensor is expected), and the TypeErrors of Python's protocols on a tensor
  (``len()`` or iteration of a 0-d tensor, ``__index__`` of a non-integer tensor);
- :class:`ArgumentError`: an argument value the op does not accept (an option name such as
  ``reduction='avg'``, a probability, a step, a count, a device string);
- :class:`SignatureError`: a call that does not match the op's signature (an unexpected
  keyword, a value given twice, a missing or an extra positional argument);
- :class:`ValueConversionError`: a tensor that cannot become a python value (``bool()`` or
  ``item()`` of a tensor with more than one element);
- :class:`ViewError`: ``view`` incompatible with the input's strides, a bad view size;
- :class:`DimError`: a tensor dim or an index out of range: every ``dim`` argument, local
  or distributed, goes through one check (``placements.meta.norm_dim``) whose
  message names the op, the value and the valid range, e.g. ``sum: Dimension out of range
  (expected to be in range of [-2, 1], but got 3)``; also indices (``x[10]`` of a DTensor,
  ``embedding``, ``cross_entropy`` targets) and what is not an index (``x[1.5]``). A Shard
  dim out of range raises :class:`ShardDimError`, both a PlacementError and a DimError;
- :class:`NoRuleError`: an op without a sharding rule or local kernel for its inputs;
- :class:`CommError`: a failure in, or an SPMD divergence before, a collective;
- :class:`ConfigError`: a bad setting (an environment variable such as
  ``DTENSOR_WATCHDOG`` or ``DTENSOR_PROP_CACHE_SIZE``, or a debug option);
  :class:`UnavailableError` (also a RuntimeError): a setting this build cannot honour
  (``set_fastpath(True)`` without the compiled extension);
- :class:`CheckpointError` (also an OSError): a checkpoint or ``.npy`` file that is missing,
  unreadable, truncated or corrupt (a checksum that does not match), or a state that does
  not match the checkpoint it is loaded from; the message names the op (``save``,
  ``load``, ``from_npy``, ``to_npy``), the file and the tensor's key.
- :class:`AutogradError` (also a RuntimeError, PyTorch's type for these): backward on a
  non-scalar output without a gradient, the gradient of a tensor that does not require
  grad, a second backward through freed nodes, an in-place op on a leaf that requires
  grad, an in-place change to a tensor saved for backward, an op without a backward
  formula, mismatched ``grad_placements``.
- :class:`AllocationError` (also a MemoryError): a tensor that cannot be allocated (more
  bytes than the address space, or than the memory the allocator can get); the message
  names the op, the shape, the dtype and the bytes (``dt.empty(2**62)``).
- :class:`MetadataOnlyError` (also a RuntimeError): a value asked of a DTensor on an
  abstract mesh (``dt.AbstractMesh``: metadata only, no data): ``to_local``,
  ``full_tensor``, ``item``, ``bool``, numpy conversion; the message names the op.
"""

from __future__ import annotations

__all__ = [
    "AllocationError",
    "ArgumentError",
    "AutogradError",
    "CheckpointError",
    "CommError",
    "ConfigError",
    "DTensorError",
    "DTypeError",
    "DimError",
    "MeshError",
    "MetadataOnlyError",
    "NoRuleError",
    "PipelineError",
    "PlacementError",
    "ShardDimError",
    "ShardingError",
    "SignatureError",
    "UnavailableError",
    "ValueConversionError",
    "ViewError",
]


class DTensorError(Exception):
    """Base class of every error raised by dtensor."""


class ShardingError(DTensorError, ValueError):
    """Inputs whose placements or shapes cannot be combined as asked."""


class PlacementError(DTensorError, ValueError):
    """An invalid placement: shard dim out of range, wrong count for the mesh, bad op."""


class MeshError(DTensorError, ValueError):
    """A device mesh that does not match the communicator, or a bad mesh dimension."""


class DTypeError(DTensorError, TypeError):
    """A dtype or an argument type the op does not accept."""


class ArgumentError(DTensorError, ValueError):
    """An argument value the op does not accept (an option name, a probability, a step, a
    count)."""


class SignatureError(DTensorError, TypeError):
    """A call that does not match the op's signature."""


class ValueConversionError(DTensorError, RuntimeError):
    """A tensor that cannot be converted to a python value: ``bool()`` or ``item()`` of a
    tensor with more than one element."""


class ViewError(DTensorError, RuntimeError):
    """A ``view`` whose size is not compatible with the input's size and stride."""


class NoRuleError(DTensorError, NotImplementedError):
    """An op that has no sharding rule (or no local kernel) for the given inputs."""


class CommError(DTensorError, RuntimeError):
    """A failure in, or a divergence before, a collective."""


class DimError(DTensorError, IndexError):
    """A tensor dim or an index out of range for the tensor's shape, or an index that is not
    a valid index (an IndexError, as in PyTorch and numpy, so ``except IndexError`` keeps
    working)."""


class ShardDimError(PlacementError, DimError):
    """A ``Shard(dim)`` whose dim is out of range for the tensor: both a PlacementError (a
    bad placement) and a DimError (a dim out of range), as numpy's AxisError is both a
    ValueError and an IndexError."""


class ConfigError(DTensorError, ValueError):
    """A bad setting: an environment variable or an option of a debug tool."""


class UnavailableError(ConfigError, RuntimeError):
    """A setting that this build cannot honour (the compiled fast path without the
    extension): also a RuntimeError, so ``except RuntimeError`` keeps working."""


class CheckpointError(DTensorError, OSError):
    """A checkpoint or ``.npy`` file that is missing, unreadable or corrupt, or a state that
    does not match the checkpoint: also an OSError, so ``except OSError`` keeps working."""


class AutogradError(DTensorError, RuntimeError):
    """A backward that cannot run as asked (the messages are PyTorch's, naming the op)."""


class PipelineError(ArgumentError):
    """A pipeline that cannot run as asked: a split leaving a stage empty, a micro-batch
    count that does not divide the batch, stages that do not match the ``pp`` mesh or the
    schedule. Raised on every rank of the ``pp`` mesh at once (the schedules check together)."""


class MetadataOnlyError(DTensorError, RuntimeError):
    """A value asked of a DTensor that has metadata only (on a ``dt.AbstractMesh``)."""


class AllocationError(DTensorError, MemoryError):
    """A tensor that cannot be allocated: also a MemoryError, so ``except MemoryError``
    keeps working."""
