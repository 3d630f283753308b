"""Sharding rules: one module per op family, all registered in one table.

Importing this package registers every family's rules (:mod:`.pointwise`,
:mod:`.reduction`, :mod:`.matmul`, :mod:`.view`, :mod:`.tensor`, :mod:`.nn`,
:mod:`.index`); the
framework (:mod:`._core`) gives the rule of an op (:func:`get_rule`) and expands one mesh
dim's candidates into the cheapest N-D strategy (:func:`propagate`). Pure metadata: numpy
only, no MPI, no data.
"""

from __future__ import annotations

from . import index, matmul, nn, pointwise, reduction, tensor, view  # noqa: F401  (register rules)
from ._core import *  # the framework's public names, as listed in _core.__all__
from ._core import __all__  # noqa: F401
