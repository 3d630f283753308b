"""Records of the reductions and scans (``sum``, ``mean``, ``amax``, ``var``, ``cumsum``...).

Every reduction is a function and a method; its rule (:mod:`placements.rules.reduction`)
reads the reduced dims, ``keepdim`` and (where it has one) the accumulation ``dtype``.
``mean`` and the extrema compute differently on a shard (:mod:`dtensor.ops.local_fns`).
"""

from __future__ import annotations

from ..local import kernels as K
from .derivatives import REDUCTION as D
from .local_fns import extreme_local, mean_local
from .table import declare

__all__: list[str] = []

for _name in ("sum", "prod", "norm"):
    declare(_name, getattr(K, _name), samples="reduce", backward=D[_name])
declare("mean", K.mean, local_fn=mean_local, samples="reduce", backward=D["mean"])
for _name in ("amax", "amin", "max", "min"):
    declare(_name, getattr(K, _name), local_fn=extreme_local, samples="reduce",
            backward=D[_name])
for _name in ("argmax", "argmin", "var", "std", "any", "all", "logsumexp"):
    declare(_name, getattr(K, _name), samples="reduce", backward=D[_name])
declare("count_nonzero", K.count_nonzero, samples="reduce", backward=D["count_nonzero"])
for _name in ("cumsum", "cumprod"):
    declare(_name, getattr(K, _name), samples="scan", backward=D[_name])
