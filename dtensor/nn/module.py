"""``dt.nn.Module``: the base class of models, with PyTorch's registration semantics.

A module is a plain Python object. Assigning a :class:`~dtensor.nn.Parameter` or a
module as an attribute registers it (``_parameters``, ``_modules``), as do
:meth:`Module.register_parameter`, :meth:`Module.register_buffer` and
:meth:`Module.add_module`; traversal (``parameters``, ``named_modules``...), state dicts,
train/eval, hooks and ``__call__`` follow ``torch.nn.Module``. Parameters and buffers are
local :class:`~dtensor.Tensor` or :class:`~dtensor.DTensor` objects alike: a module
knows nothing of meshes or MPI (only :meth:`Module.load_state_dict` looks at placements,
to lay a loaded value out like the tensor it replaces).

What differs from PyTorch: :meth:`Module.to` takes a dtype only (a DTensor's device
follows its mesh) and, since a tensor here cannot change its dtype in place, puts new
parameter objects in place of the old ones (PyTorch's
``torch.__future__.set_overwrite_module_params_on_conversion(True)`` behaviour): build an
optimizer after converting. Errors are dtensor's types (``DTypeError`` where PyTorch
raises TypeError, ``ArgumentError`` for its KeyError/ValueError/RuntimeError) with
PyTorch's messages; a missing attribute is an AttributeError, as Python requires.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from placements.errors import ArgumentError, DTypeError
from placements.meta import dtype_kind

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.dtypes import to_dtype
from ..local.grad_engine import no_grad, zero_grads
from ..local.tensor import Tensor
from .parameter import Parameter

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["IncompatibleKeys", "Module", "RemovableHandle"]

_TENSORS = (Tensor, DTensor)


class IncompatibleKeys(NamedTuple):
    """What :meth:`Module.load_state_dict` returns (PyTorch's ``_IncompatibleKeys``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class RemovableHandle:
    """The handle of a registered hook: :meth:`remove` unregisters it (also on leaving a
    ``with`` block). **Local**."""

    _ids = itertools.count()

    def __init__(self, *dicts: dict) -> None:
        self.id = next(RemovableHandle._ids)
        self._dicts = dicts

    def remove(self) -> None:
        """Unregister the hook (again: nothing). **Local**."""
        for d in self._dicts:
            d.pop(self.id, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _typename(value: object) -> str:
    return type(value).__name__


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    return "\n".join([lines[0]] + [" " * spaces + line for line in lines[1:]])


def _is_float(t: Any) -> bool:
    return dtype_kind(t.dtype) in "fc"


class Module:
    """Base class of models: subclass it, assign parameters, buffers and submodules as
    attributes in ``__init__`` (after ``super().__init__()``) and define ``forward``.

    Calling a module (``m(x)``) runs its forward pre-hooks, :meth:`forward` and its
    forward hooks. Every method is **Local** unless its docstring says otherwise; a
    module whose parameters are DTensors communicates only in the ops its forward runs.

    Attributes
    ----------
    training : bool
        Whether the module is in training mode (:meth:`train`, :meth:`eval`).
    """

    training: bool

    def __init__(self) -> None:
        sa = object.__setattr__
        sa(self, "training", True)
        sa(self, "_parameters", {})
        sa(self, "_buffers", {})
        sa(self, "_non_persistent_buffers_set", set())
        sa(self, "_modules", {})
        sa(self, "_forward_pre_hooks", OrderedDict())
        sa(self, "_forward_pre_hooks_with_kwargs", {})
        sa(self, "_forward_hooks", OrderedDict())
        sa(self, "_forward_hooks_with_kwargs", {})
        sa(self, "_forward_hooks_always_called", {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The computation of the module; subclasses define it (call the module, not this,
        so that hooks run)."""
        raise NotImplementedError(
            f'Module [{type(self).__name__}] is missing the required "forward" function'
        )

    # -- registration ---------------------------------------------------------------------
    def register_parameter(self, name: str, param: Any) -> None:
        """Register ``param`` (a :class:`Parameter` or None) as parameter ``name``.

        Raises
        ------
        DTypeError
            A name that is not a str, or a value that is not a Parameter or None.
        ArgumentError
            A name with a ``.``, empty, or of an attribute that is not a parameter; a
            non-leaf tensor.
        """
        self._check_new("_parameters", "parameter", name)
        if param is not None and not isinstance(param, Parameter):
            raise DTypeError(
                f"cannot assign '{_typename(param)}' object to parameter '{name}' "
                "(dt.nn.Parameter or None required)"
            )
        if param is not None and not param.is_leaf:
            raise ArgumentError(
                f"Cannot assign non-leaf Tensor to parameter '{name}'. Model parameters must "
                f"be created explicitly. To express '{name}' as a function of another Tensor, "
                "compute the value in the forward() method."
            )
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        """Register ``tensor`` (a Tensor, DTensor or None) as buffer ``name``: state that
        is not a parameter; in :meth:`state_dict` unless ``persistent=False``.

        Raises
        ------
        DTypeError
            A name that is not a str, or a value that is not a tensor or None.
        ArgumentError
            A name with a ``.``, empty, or of an attribute that is not a buffer.
        """
        self._check_new("_buffers", "buffer", name)
        if tensor is not None and not isinstance(tensor, _TENSORS):
            raise DTypeError(
                f"cannot assign '{_typename(tensor)}' object to buffer '{name}' "
                "(dt.Tensor, dt.DTensor or None required)"
            )
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Register ``module`` (a Module or None) as submodule ``name``.

        Raises
        ------
        DTypeError
            A name that is not a str, or a value that is not a Module or None.
        ArgumentError
            A name with a ``.``, empty, or of an attribute that is not a submodule.
        """
        if module is not None and not isinstance(module, Module):
            raise DTypeError(f"{_typename(module)} is not a Module subclass")
        self._check_new("_modules", "module", name)
        self._modules[name] = module

    register_module = add_module

    def _check_new(self, registry: str, kind: str, name: object) -> None:
        """PyTorch's checks of a name about to be registered as a ``kind``."""
        if registry not in self.__dict__:
            raise AttributeError(f"cannot assign {kind} before Module.__init__() call")
        if not isinstance(name, str):
            raise DTypeError(f"{kind} name should be a string. Got {_typename(name)}")
        if "." in name:
            raise ArgumentError(f'{kind} name can\'t contain ".", got: {name}')
        if name == "":
            raise ArgumentError(f'{kind} name can\'t be empty string ""')
        if hasattr(self, name) and name not in self.__dict__[registry]:
            raise ArgumentError(f"attribute '{name}' already exists")

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for kind in ("_parameters", "_buffers", "_modules"):
            entries = d.get(kind)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        params = d.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            self._forget(name, "_parameters")
            self.register_parameter(name, value)
            return
        if params is not None and name in params:
            if value is not None:
                raise DTypeError(
                    f"cannot assign '{_typename(value)}' as parameter '{name}' "
                    "(dt.nn.Parameter or None expected)"
                )
            params[name] = None
            return
        modules = d.get("_modules")
        if isinstance(value, Module):
            if modules is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            self._forget(name, "_modules")
            modules[name] = value
            return
        if modules is not None and name in modules:
            if value is not None:
                raise DTypeError(
                    f"cannot assign '{_typename(value)}' as child module '{name}' "
                    "(dt.nn.Module or None expected)"
                )
            modules[name] = None
            return
        buffers = d.get("_buffers")
        if buffers is not None and name in buffers:
            if value is not None and not isinstance(value, _TENSORS):
                raise DTypeError(
                    f"cannot assign '{_typename(value)}' as buffer '{name}' "
                    "(dt.Tensor, dt.DTensor or None expected)"
                )
            buffers[name] = value
            return
        object.__setattr__(self, name, value)

    def _forget(self, name: str, keep: str) -> None:
        """Remove ``name`` from every registry but ``keep`` and from the plain attributes."""
        self.__dict__.pop(name, None)
        for kind in ("_parameters", "_buffers", "_modules"):
            if kind != keep:
                self.__dict__[kind].pop(name, None)
        self._non_persistent_buffers_set.discard(name)

    def __delattr__(self, name: str) -> None:
        for kind in ("_parameters", "_buffers", "_modules"):
            entries = self.__dict__[kind]
            if name in entries:
                del entries[name]
                self._non_persistent_buffers_set.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted(
            set(super().__dir__()) | set(self._parameters) | set(self._buffers)
            | set(self._modules)
        )

    # -- traversal ------------------------------------------------------------------------
    def _named_members(self, kind: str, prefix: str, recurse: bool,
                       remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        modules = (self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
                   if recurse else [(prefix, self)])
        seen: set[int] = set()
        for module_prefix, module in modules:
            for name, value in module.__dict__[kind].items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{module_prefix}.{name}" if module_prefix else name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        """``(dotted name, parameter)`` of this module's parameters and (``recurse``) its
        submodules', each shared parameter once unless ``remove_duplicate=False``."""
        return self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        """The parameters (of the submodules too when ``recurse``), each once."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        """``(dotted name, buffer)`` of the buffers, as :meth:`named_parameters`."""
        return self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Any]:
        """The buffers (of the submodules too when ``recurse``), each once."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """``(name, module)`` of the direct submodules, each once."""
        seen: set[int] = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator[Module]:
        """The direct submodules, each once."""
        for _, module in self.named_children():
            yield module

    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Module]]:
        """``(dotted name, module)`` of this module (name ``prefix``) and all submodules,
        depth first, each once unless ``remove_duplicate=False``."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is not None:
                yield from module.named_modules(
                    memo, f"{prefix}.{name}" if prefix else name, remove_duplicate
                )

    def modules(self) -> Iterator[Module]:
        """This module and all submodules, each once."""
        for _, module in self.named_modules():
            yield module

    def get_submodule(self, target: str) -> Module:
        """The submodule at dotted path ``target`` (``""``: this module).

        Raises
        ------
        AttributeError
            When a step of the path is missing or not a Module.
        """
        module = self
        for item in target.split(".") if target else ():
            if not hasattr(module, item):
                raise AttributeError(f"{module._get_name()} has no attribute `{item}`")
            module = getattr(module, item)
            if not isinstance(module, Module):
                raise AttributeError(f"`{item}` is not an nn.Module")  # noqa: TRY004 (PyTorch's)
        return module

    def _get_member(self, target: str, kind: str, what: str) -> Any:
        module_path, _, name = target.rpartition(".")
        module = self.get_submodule(module_path)
        if not hasattr(module, name):
            raise AttributeError(f"{module._get_name()} has no attribute `{name}`")
        if name not in module.__dict__[kind]:
            raise AttributeError(f"`{name}` is not {what}")
        return getattr(module, name)

    def get_parameter(self, target: str) -> Any:
        """The parameter at dotted path ``target`` (``"block.linear.weight"``).

        Raises
        ------
        AttributeError
            When the path is missing or does not name a parameter.
        """
        return self._get_member(target, "_parameters", "an nn.Parameter")

    def get_buffer(self, target: str) -> Any:
        """The buffer at dotted path ``target``.

        Raises
        ------
        AttributeError
            When the path is missing or does not name a buffer.
        """
        return self._get_member(target, "_buffers", "a buffer")

    # -- state ----------------------------------------------------------------------------
    def _state_items(self, prefix: str) -> Iterator[tuple[str, Any, dict, str]]:
        """``(key, tensor, registry, name)`` of every entry of the state dict: parameters and
        persistent buffers that are not None, submodules' included (a shared one under every
        name, as PyTorch's state dict)."""
        for name, p in self._parameters.items():
            if p is not None:
                yield prefix + name, p, self._parameters, name
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers_set:
                yield prefix + name, b, self._buffers, name
        for name, module in self._modules.items():
            if module is not None:
                yield from module._state_items(f"{prefix}{name}.")

    def state_dict(self, *, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The module's state: an ordered dict from dotted names to its parameters and
        persistent buffers (detached, sharing memory; the tensors themselves with
        ``keep_vars=True``). DTensors stay DTensors (each rank holds its shards).

        Parameters
        ----------
        destination : dict, optional
            Filled and returned instead of a new OrderedDict.
        prefix : str
            Put in front of every key.
        keep_vars : bool
        """
        out = OrderedDict() if destination is None else destination
        for key, t, _, _ in self._state_items(prefix):
            out[key] = t if keep_vars else t.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> IncompatibleKeys:
        """Copy ``state_dict``'s values into the parameters and buffers, in place.

        Each value is laid out like the tensor it is copied into, which keeps its dtype,
        and, for a DTensor, its mesh and placements: a DTensor value on the same mesh is
        redistributed, a local value (the global data, the same on every rank) is sliced,
        a DTensor on another mesh is gathered first. So it is **Collective** when a
        DTensor value's placements (or mesh) differ from its target's, or a local target
        gets a DTensor value; **Local** otherwise. Everything is checked before anything
        is written: an error leaves the module unchanged.

        Parameters
        ----------
        state_dict : mapping
            From :meth:`state_dict` (of this module or one of the same structure).
        strict : bool
            Whether the keys must match this module's state dict exactly.
        assign : bool
            Put the given tensors themselves in place (as parameters when they replace
            parameters) instead of copying into the present ones.

        Returns
        -------
        IncompatibleKeys
            ``(missing_keys, unexpected_keys)``.

        Raises
        ------
        ArgumentError
            With ``strict``, missing or unexpected keys; always, a value whose shape differs
            from its target's.
        DTypeError
            A value that is not a Tensor or DTensor.
        """
        items = list(self._state_items(""))
        expected = {key for key, *_ in items}
        missing = [key for key, *_ in items if key not in state_dict]
        unexpected = [key for key in state_dict if key not in expected]
        errors = []
        if strict:
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in unexpected) + ". ")
            if missing:
                errors.append("Missing key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in missing) + ". ")
        for key, t, _, _ in items:
            value = state_dict.get(key)
            if value is None:
                continue
            if not isinstance(value, _TENSORS):
                raise DTypeError(
                    f'load_state_dict: while copying the parameter named "{key}", expected '
                    f"a dt.Tensor or dt.DTensor from the state dict but received "
                    f"{_typename(value)}"
                )
            if tuple(value.shape) != tuple(t.shape):
                errors.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                    f"{tuple(t.shape)}."
                )
        if errors:
            raise ArgumentError(
                f"Error(s) in loading state_dict for {self._get_name()}:\n\t"
                + "\n\t".join(errors)
            )
        with no_grad():
            for key, t, registry, name in items:
                value = state_dict.get(key)
                if value is None:
                    continue
                if assign:
                    registry[name] = (Parameter(value, t.requires_grad)
                                      if isinstance(t, Parameter) else value)
                else:
                    t.copy_(_laid_out_like(t, value))
        return IncompatibleKeys(missing, unexpected)

    # -- modes and in-place changes -------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Set training mode (``mode=True``) or evaluation mode on this module and every
        submodule (Dropout acts in training mode only); returns self.

        Raises
        ------
        ArgumentError
            A mode that is not a bool.
        """
        if not isinstance(mode, bool):
            raise ArgumentError("training mode is expected to be boolean")
        self.training = mode
        for module in self.children():
            module.train(mode)
        return self

    def eval(self) -> Module:
        """Evaluation mode: ``train(False)``; returns self."""
        return self.train(False)

    def apply(self, fn: Callable[[Module], None]) -> Module:
        """Call ``fn`` on every submodule (children first, depth first), then on this
        module; returns self (e.g. to initialise weights)."""
        for module in self.children():
            module.apply(fn)
        fn(self)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Set ``requires_grad`` of every parameter; returns self."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter: to None (default), or to zeros in
        place. **Local**."""
        zero_grads(self.parameters(), set_to_none)

    def to(self, dtype: Any) -> Module:
        """Cast the floating-point parameters and buffers (and the parameters' gradients)
        to ``dtype``; returns self. DTensors keep their mesh and placements. A cast
        parameter is a new :class:`Parameter` object in the module (see the module
        docstring), with the old one's ``requires_grad``; a parameter shared by several
        modules stays shared."""
        dtype = to_dtype(dtype)
        done: dict[int, tuple[Any, Any]] = {}  # id(old) -> (old, kept alive; new)
        with no_grad():
            for module in self.modules():
                for name, p in module._parameters.items():
                    if p is None or not _is_float(p) or p.dtype == dtype:
                        continue
                    if id(p) not in done:
                        new = Parameter(p.to(dtype), p.requires_grad)
                        if p.grad is not None:
                            new.grad = p.grad.to(dtype)
                        done[id(p)] = (p, new)
                    module._parameters[name] = done[id(p)][1]
                for name, b in module._buffers.items():
                    if b is not None and _is_float(b):
                        module._buffers[name] = b.to(dtype)
        return self

    # -- hooks and calling ----------------------------------------------------------------
    def register_forward_pre_hook(self, hook: Callable, *, prepend: bool = False,
                                  with_kwargs: bool = False) -> RemovableHandle:
        """Run ``hook(module, args)`` before every forward (``hook(module, args, kwargs)``
        with ``with_kwargs``). It may return new args (a non-tuple is made a 1-tuple) or,
        with ``with_kwargs``, a tuple ``(args, kwargs)``; None keeps them. ``prepend``:
        run it before the hooks registered so far.

        Returns
        -------
        RemovableHandle
        """
        handle = RemovableHandle(self._forward_pre_hooks, self._forward_pre_hooks_with_kwargs)
        self._forward_pre_hooks[handle.id] = hook
        if with_kwargs:
            self._forward_pre_hooks_with_kwargs[handle.id] = True
        if prepend:
            self._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle

    def register_forward_hook(self, hook: Callable, *, prepend: bool = False,
                              with_kwargs: bool = False,
                              always_call: bool = False) -> RemovableHandle:
        """Run ``hook(module, args, output)`` after every forward (``hook(module, args,
        kwargs, output)`` with ``with_kwargs``); a value it returns replaces the output.
        ``prepend``: run it before the hooks registered so far; ``always_call``: run it
        even when forward raises.

        Returns
        -------
        RemovableHandle
        """
        handle = RemovableHandle(self._forward_hooks, self._forward_hooks_with_kwargs,
                                 self._forward_hooks_always_called)
        self._forward_hooks[handle.id] = hook
        if with_kwargs:
            self._forward_hooks_with_kwargs[handle.id] = True
        if always_call:
            self._forward_hooks_always_called[handle.id] = True
        if prepend:
            self._forward_hooks.move_to_end(handle.id, last=False)
        return handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self._forward_pre_hooks or self._forward_hooks):
            return self.forward(*args, **kwargs)
        for hook_id, hook in list(self._forward_pre_hooks.items()):
            if hook_id in self._forward_pre_hooks_with_kwargs:
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise DTypeError(
                            "forward pre-hook must return None or a tuple of (new_args, "
                            f"new_kwargs), but got {result}."
                        )
                    args, kwargs = result
            else:
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        try:
            output = self.forward(*args, **kwargs)
        except BaseException:
            for hook_id, hook in list(self._forward_hooks.items()):
                if hook_id in self._forward_hooks_always_called:
                    self._run_forward_hook(hook_id, hook, args, kwargs, None)
            raise
        for hook_id, hook in list(self._forward_hooks.items()):
            result = self._run_forward_hook(hook_id, hook, args, kwargs, output)
            if result is not None:
                output = result
        return output

    def _run_forward_hook(self, hook_id: int, hook: Callable, args: tuple, kwargs: dict,
                          output: Any) -> Any:
        if hook_id in self._forward_hooks_with_kwargs:
            return hook(self, args, kwargs, output)
        return hook(self, args, output)

    # -- printing -------------------------------------------------------------------------
    def _get_name(self) -> str:
        return type(self).__name__

    def extra_repr(self) -> str:
        """The text inside this module's parentheses in its repr (subclasses define it)."""
        return ""

    def __repr__(self) -> str:
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        for name, module in self._modules.items():
            lines.append(f"({name}): " + _indent(repr(module), 2))
        main = self._get_name() + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"


def _laid_out_like(target: Any, value: Any) -> Any:
    """``value`` (a state dict entry of ``target``'s shape) as a tensor that ``target.copy_``
    takes: on ``target``'s mesh with its placements when ``target`` is a DTensor (**Local**
    for a local value, which is the global data: each rank keeps its slice; **Collective**
    for a DTensor value of other placements or another mesh), the global value (gathered,
    **Collective**) when ``target`` is local."""
    if not isinstance(target, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    mesh, placements = target.device_mesh, target.placements
    if isinstance(value, DTensor):
        if value.device_mesh is mesh:
            return value.redistribute(mesh, placements)
        value = value.full_tensor()
    return distribute_tensor(value.detach(), mesh, placements, src_data_rank=None)
