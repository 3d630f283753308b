"""``parallelize_module``: apply parallel styles to the submodules a plan names;
``distribute_module``: lay out a module's parameters by a function and wrap its calls."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any

from placements import Replicate
from placements.errors import ArgumentError, MeshError
from redistribute import comm as _comm

from ..distributed.dtensor import DTensor, distribute_tensor
from ..distributed.mesh import init_device_mesh
from ..nn import Module, Parameter
from ._style import ParallelStyle

__all__ = ["distribute_module", "parallelize_module"]


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


def _replicate_local(module: Module, mesh: Any, done: dict) -> None:
    """Replicate every parameter and buffer of ``module`` itself that is still a local
    tensor (``done``: the DTensor made for each local parameter so far, by id, so that a
    parameter shared by two modules stays one). **Collective** (it scatters)."""
    first = int(mesh.mesh.flat[0])
    for pname, p in list(module._parameters.items()):
        if p is None or isinstance(p, DTensor):
            continue
        new = done.get(id(p))
        if new is None:
            d = distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim,
                                  src_data_rank=first)
            new = done[id(p)] = Parameter(d, requires_grad=p.requires_grad)
        module._parameters[pname] = new
    for bname, b in list(module._buffers.items()):
        if b is not None and not isinstance(b, DTensor):
            module._buffers[bname] = distribute_tensor(b, mesh, [Replicate()] * mesh.ndim,
                                                       src_data_rank=first)


def distribute_module(
    module: Module,
    device_mesh: Any = None,
    partition_fn: Callable[[str, Module, Any], None] | None = None,
    input_fn: Callable[[Module, Any, Any], Any] | None = None,
    output_fn: Callable[[Module, Any, Any], Any] | None = None,
) -> Module:
    """Lay out ``module``'s parameters with ``partition_fn`` and wrap its calls (PyTorch's
    ``torch.distributed.tensor.distribute_module``). **Collective** over ``device_mesh``
    (parameters are scattered from its first rank): call it on every rank alike.

    ``partition_fn(name, submodule, device_mesh)`` runs for every submodule (``name`` its
    path, ``""`` for ``module``) and replaces parameters by DTensors as it likes
    (``submodule.register_parameter(n, dt.nn.Parameter(dt.distribute_tensor(...)))``);
    parameters and buffers it leaves as local tensors are then replicated. Without it every
    parameter and buffer is replicated. A parameter shared by several submodules (a tied
    embedding and head) stays shared: where ``partition_fn`` replaced it in one, the others
    take that replacement. ``input_fn(module, inputs, device_mesh)`` runs
    before each forward (a forward pre-hook; it may return new inputs) and
    ``output_fn(module, outputs, device_mesh)`` after it (a value it returns replaces the
    outputs).

    The dispatcher then chooses every collective of the forward and the backward: with
    Megatron's placements (column-parallel weights ``Shard(0)``, row-parallel ``Shard(1)``)
    a model written without a reduce gets one all-reduce after each row-parallel layer and
    one per branch in backward.

    Returns
    -------
    Module
        ``module``, changed in place.

    Raises
    ------
    ArgumentError
        A ``partition_fn``, ``input_fn`` or ``output_fn`` that is not callable.
    MeshError
        A ``device_mesh`` that is not a mesh.
    """
    for what, fn in (("partition_fn", partition_fn), ("input_fn", input_fn),
                     ("output_fn", output_fn)):
        if fn is not None and not callable(fn):
            raise ArgumentError(f"distribute_module: {what} must be callable, got {fn!r}")
    if device_mesh is None:
        device_mesh = init_device_mesh((_comm.world().size,))
    if not hasattr(device_mesh, "ndim") or not hasattr(device_mesh, "get_group"):
        raise MeshError(f"distribute_module: device_mesh must be a DeviceMesh, got {device_mesh!r}")
    subs = list(module.named_modules())
    # where each parameter is held, so that a shared (tied) one stays shared
    sites: dict[int, list] = {}
    for _, sub in subs:
        for pname, p in sub._parameters.items():
            if p is not None:
                sites.setdefault(id(p), []).append((sub, pname, p))
    if partition_fn is not None:
        for name, sub in subs:
            partition_fn(name, sub, device_mesh)
    done: dict[int, Any] = {}
    for held in sites.values():
        if len(held) > 1:  # tied: every site takes the first replacement made
            new = next((s._parameters[n] for s, n, p in held if s._parameters[n] is not p),
                       None)
            if new is not None:
                done[id(held[0][2])] = new
    for _, sub in subs:
        _replicate_local(sub, device_mesh, done)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda m, args: input_fn(m, args, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda m, args, out: output_fn(m, out, device_mesh))
    return module
