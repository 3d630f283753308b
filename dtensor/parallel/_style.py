"""The tensor and sequence parallel styles (PyTorch's ``torch.distributed.tensor.parallel``).

A style turns one module into its parallel form on a 1-D mesh: its parameters become
DTensors (:func:`dtensor.distribute_tensor`, the same global values), and forward
pre-hooks and hooks move its inputs and outputs between layouts with ``redistribute``
(or wrap local tensors with ``DTensor.from_local``). No style adds a collective of its
own: every one that runs is a redistribute or an op's, so ``CommDebugMode`` sees them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from placements import Placement, Replicate, Shard
from placements.errors import ArgumentError, MeshError

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.tensor import Tensor
from ..nn import Embedding, LayerNorm, Linear, Module, Parameter, RMSNorm

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


def _layouts(value: Placement | Sequence | None, default: tuple, what: str) -> tuple:
    """``value`` as a tuple of layouts (one per input/output; None entries allowed)."""
    if value is None:
        return default
    if isinstance(value, Placement):
        return (value,)
    value = tuple(value)
    for v in value:
        if v is not None and not isinstance(v, Placement):
            raise ArgumentError(f"{what}: a layout must be a Placement or None, got {v!r}")
    return value


def _to_dtensor(x: Any, mesh: Any, layout: Placement, desired: Placement, what: str,
                size: int | None = None) -> Any:
    """``x`` as a DTensor of ``desired`` placement: a local tensor is first taken as this
    rank's shard of ``layout`` (``from_local``), a DTensor is redistributed (**Collective**
    when the layouts differ). For a Shard layout the global size of the sharded dim is
    ``size`` when the module knows it (a rowwise Linear's in_features: no exchange);
    otherwise the ranks exchange their local shapes (**Collective**, a few ints), so uneven
    shards are taken exactly (PyTorch assumes even ones)."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise MeshError(f"{what}: an input DTensor lives on {x.device_mesh!r}, not on {mesh!r}")
        current = x
    elif isinstance(x, Tensor):
        shape = None
        if not layout.is_shard():
            shape = tuple(x.shape)
        elif size is not None and x.ndim:
            shape = list(x.shape)
            shape[layout.dim % len(shape)] = size
            shape = tuple(shape)
        current = DTensor.from_local(x, mesh, [layout], run_check=False, shape=shape)
    else:
        return x
    if current.placements != (desired,):
        current = current.redistribute(mesh, [desired])
    return current


def _distribute_param(module: Module, name: str, mesh: Any, placement: Placement) -> None:
    """Replace parameter ``name`` of ``module`` by its DTensor of ``placement`` on ``mesh``
    (the same global values; requires_grad kept). **Collective** (it scatters)."""
    p = getattr(module, name)
    if p is None:
        return
    if isinstance(p, DTensor):
        d = p.redistribute(mesh, [placement]) if p.placements != (placement,) else p
    else:  # the values of the mesh's first rank, as PyTorch's group rank 0
        d = distribute_tensor(p.detach(), mesh, [placement],
                              src_data_rank=int(mesh.mesh.flat[0]))
    module.register_parameter(name, Parameter(d.detach(), requires_grad=p.requires_grad))


class ParallelStyle:
    """What a parallel style does to one module (:func:`dtensor.parallelize_module`)."""

    #: the module classes the style knows how to shard (None: any module)
    kinds: tuple[type, ...] | None = None

    def check(self, module: Module, path: str) -> None:
        """Raise if the style cannot apply to ``module`` (at ``path``), changing nothing.
        **Local**."""
        if self.kinds is not None and not isinstance(module, self.kinds):
            names = ", ".join(k.__name__ for k in self.kinds)
            raise ArgumentError(
                f"parallelize_module: {type(self).__name__} at {path!r} expects one of "
                f"{names}, got {type(module).__name__}"
            )

    def apply(self, module: Module, mesh: Any) -> Module:
        """Make ``module`` parallel on ``mesh`` (after :meth:`check`). **Collective**."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _ShardedLinear(ParallelStyle):
    """The part Colwise and Rowwise share: layouts, and the hooks that move inputs and
    outputs."""

    kinds = (Linear, Embedding)
    _input_default: tuple
    _output_default: tuple

    def __init__(self, *, input_layouts: Placement | Sequence | None = None,
                 output_layouts: Placement | Sequence | None = None,
                 use_local_output: bool = True) -> None:
        name = type(self).__name__
        self.input_layouts = _layouts(input_layouts, self._input_default, name)
        self.output_layouts = _layouts(output_layouts, self._output_default, name)
        self.use_local_output = bool(use_local_output)

    def _desired_input(self, module: Module) -> Placement:
        raise NotImplementedError

    def _placements(self, module: Module) -> dict[str, Placement]:
        raise NotImplementedError

    def apply(self, module: Module, mesh: Any) -> Module:
        for name, placement in self._placements(module).items():
            _distribute_param(module, name, mesh, placement)
        layout, desired = self.input_layouts[0], self._desired_input(module)
        what = f"{type(self).__name__} input"
        # a Linear's input is sharded (if at all) on its features: in_features globally
        size = module.in_features if isinstance(module, Linear) else None

        def pre_hook(mod: Module, args: tuple) -> tuple:
            return (_to_dtensor(args[0], mesh, layout, desired, what, size), *args[1:])

        out_layout, local = self.output_layouts[0], self.use_local_output

        def hook(mod: Module, args: tuple, output: Any) -> Any:
            if isinstance(output, DTensor) and output.placements != (out_layout,):
                output = output.redistribute(mesh, [out_layout])
            return output.to_local() if local and isinstance(output, DTensor) else output

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(hook)
        return module


class ColwiseParallel(_ShardedLinear):
    """Shard a ``Linear`` by its output features (weight ``Shard(0)``, bias ``Shard(0)``)
    or an ``Embedding`` by its embedding dim (weight ``Shard(1)``).

    **Collective** to apply (parameters are scattered). The input is expected
    ``input_layouts`` (default ``Replicate()``; a local tensor is taken as this rank's part
    of it) and is moved to Replicate; the output is ``Shard(-1)`` and is moved to
    ``output_layouts`` (default ``Shard(-1)``), then returned as a local tensor when
    ``use_local_output`` (default True).
    """

    _input_default = (Replicate(),)
    _output_default = (Shard(-1),)

    def _desired_input(self, module: Module) -> Placement:
        return Replicate()

    def _placements(self, module: Module) -> dict[str, Placement]:
        if isinstance(module, Embedding):
            return {"weight": Shard(1)}
        return {"weight": Shard(0), "bias": Shard(0)}


class RowwiseParallel(_ShardedLinear):
    """Shard a ``Linear`` by its input features (weight ``Shard(1)``, bias ``Replicate``)
    or an ``Embedding`` by its rows, the vocabulary (weight ``Shard(0)``).

    **Collective** to apply. A Linear's input is expected ``input_layouts`` (default
    ``Shard(-1)``, the output of a ColwiseParallel) and an Embedding's ``Replicate()``;
    the output is ``Partial(sum)`` and is moved to ``output_layouts`` (default
    ``Replicate()``: one all-reduce; ``Shard(1)`` for sequence parallelism: one
    reduce-scatter), then returned as a local tensor when ``use_local_output``.
    """

    _input_default = (None,)
    _output_default = (Replicate(),)

    def _desired_input(self, module: Module) -> Placement:
        return Replicate() if isinstance(module, Embedding) else Shard(-1)

    def apply(self, module: Module, mesh: Any) -> Module:
        if self.input_layouts == (None,):
            self.input_layouts = (self._desired_input(module),)
        return super().apply(module, mesh)

    def _placements(self, module: Module) -> dict[str, Placement]:
        if isinstance(module, Embedding):
            return {"weight": Shard(0)}
        return {"weight": Shard(1), "bias": Replicate()}


class SequenceParallel(ParallelStyle):
    """Run a norm (``LayerNorm``, ``RMSNorm``) or any module without parameters that
    works row by row (``Dropout``, activations) on the sequence shard of its input.

    **Collective** to apply (parameters are replicated). The input is expected
    ``Shard(sequence_dim)`` (a local tensor is taken as this rank's sequence shard); the
    output stays ``Shard(sequence_dim)``, a DTensor unless ``use_local_output``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = int(sequence_dim)
        self.use_local_output = bool(use_local_output)

    def check(self, module: Module, path: str) -> None:
        params = [n for n, _ in module.named_parameters(recurse=False)]
        if params and not isinstance(module, (LayerNorm, RMSNorm)):
            raise ArgumentError(
                f"parallelize_module: SequenceParallel at {path!r} takes a LayerNorm, an "
                f"RMSNorm or a module without parameters; {type(module).__name__} has "
                f"{params}"
            )

    def apply(self, module: Module, mesh: Any) -> Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _distribute_param(module, name, mesh, Replicate())
        shard = Shard(self.sequence_dim)

        def pre_hook(mod: Module, args: tuple) -> tuple:
            return (_to_dtensor(args[0], mesh, shard, shard, "SequenceParallel input"),
                    *args[1:])

        module.register_forward_pre_hook(pre_hook)
        if self.use_local_output:
            module.register_forward_hook(
                lambda mod, args, out: out.to_local() if isinstance(out, DTensor) else out)
        return module


class PrepareModuleInput(ParallelStyle):
    """Move a module's inputs between layouts before its forward (no parameter changes).

    **Local** to apply. ``input_layouts``: the layout each positional input has (None: leave
    that input alone; a local tensor is taken as this rank's part of it);
    ``desired_input_layouts``: where each goes (redistribute, **Collective** when they
    differ); the same by keyword for ``input_kwarg_layouts`` /
    ``desired_input_kwarg_layouts``; ``use_local_output`` hands the forward local tensors.
    """

    def __init__(self, *, input_layouts: Placement | Sequence | None = None,
                 desired_input_layouts: Placement | Sequence | None = None,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _layouts(input_layouts, (), "PrepareModuleInput")
        self.desired_input_layouts = _layouts(desired_input_layouts, (),
                                              "PrepareModuleInput")
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ArgumentError(
                "PrepareModuleInput: input_layouts and desired_input_layouts must have the "
                f"same length, got {len(self.input_layouts)} and "
                f"{len(self.desired_input_layouts)}"
            )
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ArgumentError(
                "PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts "
                "must name the same keywords"
            )
        self.use_local_output = bool(use_local_output)

    def _move(self, x: Any, mesh: Any, layout: Placement | None, desired: Placement | None):
        if layout is None or desired is None:
            return x
        out = _to_dtensor(x, mesh, layout, desired, "PrepareModuleInput")
        return out.to_local() if self.use_local_output and isinstance(out, DTensor) else out

    def apply(self, module: Module, mesh: Any) -> Module:
        pairs = list(zip(self.input_layouts, self.desired_input_layouts))

        def pre_hook(mod: Module, args: tuple, kwargs: dict) -> tuple:
            if len(args) < len(pairs):
                raise ArgumentError(
                    f"PrepareModuleInput: {len(pairs)} input layouts for {len(args)} inputs"
                )
            moved = tuple(self._move(a, mesh, *pairs[i]) if i < len(pairs) else a
                          for i, a in enumerate(args))
            kw = {k: self._move(v, mesh, self.input_kwarg_layouts.get(k),
                                self.desired_input_kwarg_layouts.get(k))
                  for k, v in kwargs.items()}
            return moved, kw

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Move a module's outputs between layouts after its forward (no parameter changes).

    **Local** to apply. ``output_layouts``: the layout of each output (a local tensor is
    taken as this rank's part of it); ``desired_output_layouts``: where each goes
    (**Collective** when they differ); ``use_local_output`` (default True) returns local
    tensors.
    """

    def __init__(self, *, output_layouts: Placement | Sequence,
                 desired_output_layouts: Placement | Sequence,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _layouts(output_layouts, (), "PrepareModuleOutput")
        self.desired_output_layouts = _layouts(desired_output_layouts, (),
                                               "PrepareModuleOutput")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ArgumentError(
                "PrepareModuleOutput: output_layouts and desired_output_layouts must have "
                f"the same length, got {len(self.output_layouts)} and "
                f"{len(self.desired_output_layouts)}"
            )
        self.use_local_output = bool(use_local_output)

    def apply(self, module: Module, mesh: Any) -> Module:
        pairs = list(zip(self.output_layouts, self.desired_output_layouts))

        def move(x: Any, layout: Placement, desired: Placement) -> Any:
            out = _to_dtensor(x, mesh, layout, desired, "PrepareModuleOutput")
            return out.to_local() if self.use_local_output and isinstance(out, DTensor) else out

        def hook(mod: Module, args: tuple, output: Any) -> Any:
            if isinstance(output, tuple):
                if len(output) != len(pairs):
                    raise ArgumentError(
                        f"PrepareModuleOutput: {len(pairs)} output layouts for "
                        f"{len(output)} outputs"
                    )
                return tuple(move(o, *p) for o, p in zip(output, pairs))
            return move(output, *pairs[0])

        module.register_forward_hook(hook)
        return module
