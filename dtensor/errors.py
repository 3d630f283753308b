"""Exception types of dtensor (re-exported from :mod:`placements.errors`, the lowest layer,
so that every package can raise them)."""

from __future__ import annotations

from placements.errors import *  # the catalogue, as listed in placements.errors.__all__
from placements.errors import __all__  # noqa: F401
