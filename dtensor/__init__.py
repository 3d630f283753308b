"""dtensor: a distributed tensor for mpirun programs.

The package is built in layers; imports point one way, down this list:

- :mod:`dtensor.local`: the local strided tensor (Storage/Tensor, strides, dtypes, the array
  backend, the caching allocator, random numbers, local factories and math kernels);
- :mod:`dtensor.distributed`: DeviceMesh, the GPU binding, DTensor, mesh-aware factories;
- :mod:`dtensor.ops`: the op table, one record per op;
- :mod:`dtensor.dispatch`: the dispatcher, the compiled front's glue and the installation
  of methods, operators and public functions from the table;
- this module (the public API), :mod:`dtensor.autograd`, :mod:`dtensor.debug`,
  :mod:`dtensor.checkpoint` (checkpoints, ``.npy`` files), :mod:`dtensor.utils`
  (activation checkpointing) and :mod:`dtensor.autoshard`.
"""

import typing as _typing

from placements import Partial, Placement, Replicate, Shard  # noqa: F401

from . import errors  # noqa: F401
from .errors import DTensorError  # noqa: F401

# --- local tensor
from .local.allocator import (  # noqa: F401
    empty_cache,
    memory_snapshot,
    memory_stats,
    reset_peak_memory_stats,
)
from .local.backend import Device  # noqa: F401
from .local.dlpack import from_dlpack, to_dlpack  # noqa: F401
from .local.dtypes import (  # noqa: F401
    bool_,
    cdouble,
    cfloat,
    complex64,
    complex128,
    double,
    float16,
    float32,
    float64,
    get_default_dtype,
    half,
    int8,
    int16,
    int32,
    int64,
    long,
    set_default_dtype,
    short,
    uint8,
    uint16,
    uint32,
    uint64,
)
from .local import dtypes as _local_dtypes
from .local.dtypes import bool_ as bool  # noqa: F401
from .local.dtypes import float32 as float  # noqa: F401
from .local.dtypes import int32 as int  # noqa: F401
from .local.factory import as_tensor, from_numpy, tensor  # noqa: F401
from .local.rng import get_rng_state, initial_seed, manual_seed, set_rng_state  # noqa: F401
from .local.tensor import Size, Storage, Tensor, is_tensor  # noqa: F401

# --- distributed
from .distributed.abstract import (  # noqa: F401
    AbstractDTensor,
    AbstractMesh,
    abstract_like,
    abstract_memory_stats,
    abstract_tensor,
    reset_abstract_peak,
)
from .distributed.dtensor import DTensor, distribute_tensor  # noqa: F401
from .distributed.factory import FACTORIES as _FACTORIES
from .distributed.mesh import DeviceMesh, init_device_mesh  # noqa: F401

# --- ops and dispatch: dt.<op> are the dispatching twins of the ops' local functions
from .dispatch import entry_points as _entry_points
from .dispatch.custom import register_op  # noqa: F401
from .dispatch.dispatcher import clear_caches  # noqa: F401
from .dispatch.escape import implicit_replication, local_map  # noqa: F401
from .dispatch.data_dependent import masked_select, nonzero  # noqa: F401

from . import autograd, debug  # noqa: F401  (autograd; the debug tools)
from . import nn, optim  # noqa: F401  (optimizers, clip_grad_norm_)
from . import utils  # noqa: F401  (activation checkpointing)
from .autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: F401
from . import checkpoint  # noqa: F401  (checkpoints and parallel file IO)
from .checkpoint import from_h5, from_npy, load, save, to_h5, to_npy  # noqa: F401
from . import autoshard  # noqa: F401  (whole-model sharding search)
from .autoshard import auto_shard  # noqa: F401
from . import parallel  # noqa: F401  (tensor/sequence parallel styles, fully_shard)
from . import pipelining  # noqa: F401  (pipeline stages and schedules)
from .parallel import (  # noqa: F401
    ColwiseParallel,
    FSDPModule,
    MixedPrecisionPolicy,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    distribute_module,
    fully_shard,
    loss_parallel,
    parallelize_module,
    replicate,
)
from .ring_attention import context_parallel  # noqa: F401  (ring attention, issue 34)

if _typing.TYPE_CHECKING:
    from .local.dtypes import bfloat16  # noqa: F401  (read lazily: __getattr__ below)

_LAZY = frozenset({"bfloat16"})


def __getattr__(name: str) -> object:
    # ``dt.bfloat16``, read lazily: ml_dtypes (0.8 s of CPU to import) is imported on first
    # use, not by every process that imports dtensor (placements.meta.bfloat16)
    if name in _LAZY:
        return getattr(_local_dtypes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)


globals().update(_FACTORIES)  # dt.zeros(...), also with device_mesh= and placements=
_entry_points.export(globals())
