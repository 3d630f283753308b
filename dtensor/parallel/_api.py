"""``parallelize_module``: apply parallel styles to the submodules a plan names."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from placements.errors import ArgumentError, MeshError

from ..nn import Module
from ._style import ParallelStyle

__all__ = ["parallelize_module"]


def _matches(pattern: str, path: str) -> bool:
    """Whether module ``path`` matches plan key ``pattern`` segment by segment (``*`` and
    the other ``fnmatch`` wildcards match within one segment)."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def parallelize_module(
    module: Module,
    device_mesh: Any = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
) -> Module:
    """Apply parallel styles to ``module`` and its submodules (PyTorch's
    ``torch.distributed.tensor.parallel.parallelize_module``).

    **Collective** over ``device_mesh`` (the styles scatter parameters): call it on every
    rank with the same plan.

    Parameters
    ----------
    module : Module
        The model (or block) to parallelize; changed in place and returned.
    device_mesh : DeviceMesh
        A 1-D mesh (for a 2-D mesh pass its tensor-parallel dim, ``mesh["tp"]``).
    parallelize_plan : ParallelStyle or dict of str to ParallelStyle
        One style for ``module`` itself, or styles by submodule path; a path may use
        ``*`` wildcards per segment (``"layers.*.attn.wq"``).

    Raises
    ------
    ArgumentError
        A plan key that matches no submodule, or a style that cannot apply to the module
        it matches (e.g. ``ColwiseParallel`` on a module without a weight), naming the
        module path; checked for every key before anything is changed.
    MeshError
        A mesh that is not 1-D.
    """
    if device_mesh is None or getattr(device_mesh, "ndim", None) != 1:
        raise MeshError(
            "parallelize_module: tensor parallelism needs a 1-D mesh (pass mesh['tp'] of a "
            f"2-D mesh), got {device_mesh!r}"
        )
    if parallelize_plan is None:
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        plan = {"": parallelize_plan}
    elif isinstance(parallelize_plan, Mapping):
        plan = dict(parallelize_plan)
    else:
        raise ArgumentError(
            "parallelize_module: parallelize_plan must be a ParallelStyle or a dict of module "
            f"paths to styles, got {type(parallelize_plan).__name__}"
        )
    paths = {path: sub for path, sub in module.named_modules()}
    work = []
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ArgumentError(
                f"parallelize_module: the plan maps {key!r} to {style!r}, not a ParallelStyle"
            )
        found = [p for p in paths if (p == key if key == "" else p and _matches(key, p))]
        if not found:
            raise ArgumentError(
                f"parallelize_module: plan key {key!r} matches no submodule of "
                f"{type(module).__name__} (its submodules: {sorted(p for p in paths if p)[:12]})"
            )
        for path in found:
            style.check(paths[path], path or type(module).__name__)
            work.append((paths[path], style))
    for sub, style in work:
        style.apply(sub, device_mesh)
    return module
