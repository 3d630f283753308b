"""The containers of ``dt.nn``: :class:`Sequential`, :class:`ModuleList` and
:class:`ModuleDict`, with PyTorch's indexing, naming (``"0"``, ``"1"``... for positions)
and mutation methods. Every method is **Local**."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from placements.errors import DimError

from .module import Module

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ModuleDict", "ModuleList", "Sequential"]


def _index(idx: Any, n: int) -> int:
    """``idx`` (an int, negative from the end) as a position in ``[0, n)``."""
    idx = operator.index(idx)
    if not -n <= idx < n:
        raise DimError(f"index {idx} is out of range")
    return idx % n


class _Indexed(Module):
    """What Sequential and ModuleList share: submodules named by their positions."""

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def _key(self, idx: Any) -> str:
        return list(self._modules)[_index(idx, len(self._modules))]

    def __setitem__(self, idx: int, module: Module) -> None:
        setattr(self, self._key(idx), module)

    def __delitem__(self, idx: int | slice) -> None:
        keys = list(self._modules)
        for key in keys[idx] if isinstance(idx, slice) else [self._key(idx)]:
            delattr(self, key)
        self._renumber(list(self._modules.values()))

    def _renumber(self, modules: list[Module]) -> None:
        """Hold ``modules`` (registered ones), named ``"0"``, ``"1"``... in that order."""
        self._modules.clear()
        self._modules.update((str(i), m) for i, m in enumerate(modules))

    def append(self, module: Module) -> Self:
        """Add ``module`` at the end; returns self."""
        self.add_module(str(len(self)), module)
        return self


class Sequential(_Indexed):
    """Modules called in order, each on the previous one's output, PyTorch's
    ``nn.Sequential``: ``Sequential(m0, m1, ...)`` (named ``"0"``, ``"1"``...) or
    ``Sequential(OrderedDict([(name, module), ...]))``."""

    def __init__(self, *args: Module) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for idx, module in enumerate(args):
                self.add_module(str(idx), module)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        return self._modules[self._key(idx)]

    def forward(self, input: Any) -> Any:
        for module in self:
            input = module(input)
        return input


class ModuleList(_Indexed):
    """A list of submodules (registered, so their parameters are the list's), PyTorch's
    ``nn.ModuleList``. It has no ``forward``: iterate over it."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        return self._modules[self._key(idx)]

    def __iadd__(self, modules: Iterable[Module]) -> Self:
        return self.extend(modules)

    def extend(self, modules: Iterable[Module]) -> Self:
        """Append every module of ``modules``; returns self."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: Module) -> None:
        """Insert ``module`` before position ``index``."""
        self.append(module)  # checked and registered, then moved into place
        modules = list(self._modules.values())
        modules.insert(index, modules.pop())
        self._renumber(modules)


class ModuleDict(Module):
    """A dict of submodules (registered, in insertion order), PyTorch's ``nn.ModuleDict``.
    It has no ``forward``."""

    def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None
                 ) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def clear(self) -> None:
        """Remove every submodule."""
        self._modules.clear()

    def pop(self, key: str) -> Module:
        """Remove the submodule ``key`` and return it."""
        return self._modules.pop(key)

    def keys(self) -> Iterable[str]:
        """The names."""
        return self._modules.keys()

    def items(self) -> Iterable[tuple[str, Module]]:
        """``(name, module)`` pairs."""
        return self._modules.items()

    def values(self) -> Iterable[Module]:
        """The submodules."""
        return self._modules.values()

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        """Add or replace submodules from a mapping or from ``(name, module)`` pairs."""
        pairs = modules.items() if isinstance(modules, Mapping) else modules
        for key, module in pairs:
            self[key] = module
