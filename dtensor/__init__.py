"""dtensor: a distributed tensor for mpirun programs."""

from . import errors  # noqa: F401
from .errors import DTensorError  # noqa: F401

# --- local tensor: _tensor, _factory, _dtypes, _random (one import block per module below)
from .local.backend import Device  # noqa: F401
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
from .local.dtypes import bool_ as bool  # noqa: F401
from .local.dtypes import float32 as float  # noqa: F401
from .local.dtypes import int32 as int  # noqa: F401
from .local.factory import (  # noqa: F401
    arange,
    as_tensor,
    empty,
    empty_like,
    eye,
    from_numpy,
    full,
    full_like,
    linspace,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randn,
    randn_like,
    tensor,
    zeros,
    zeros_like,
)
from .local.rng import get_rng_state, initial_seed, manual_seed, set_rng_state  # noqa: F401
from .local.tensor import Size, Storage, Tensor, is_tensor  # noqa: F401

# --- local math: _math
from .local.kernels import *  # the kernels listed in _math.__all__

# --- allocator: _allocator
from .local.allocator import (  # noqa: F401
    empty_cache,
    memory_snapshot,
    memory_stats,
    reset_peak_memory_stats,
)

# --- GPU: _cuda
from .distributed.gpu import from_dlpack, to_dlpack  # noqa: F401

# --- distributed: _mesh, _dtensor
from placements import Partial, Placement, Replicate, Shard  # noqa: F401

from .distributed.dtensor import DTensor, distribute_tensor  # noqa: F401
from .distributed.mesh import DeviceMesh, init_device_mesh  # noqa: F401
from .dispatch import install as _install

_install.export(globals())  # dt.<op>: the dispatching twins of the local functions
from . import debug  # noqa: F401

# --- custom ops: _custom_op
from .dispatch.custom import register_op  # noqa: F401
