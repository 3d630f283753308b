"""Source mutations of ``python -m launch mutate``: a one-line change of a product module.

This module owns :class:`SourcePatch` (replace one exact snippet of a module's source) and the
import hook that applies it. It imports nothing of the product: the test plugin
(:mod:`launch._mutant`) installs the hook before anything of ``dtensor``, ``placements``,
``redistribute`` or ``fastpath`` is imported, so every later import of the mutated module (in
every test process and every MPI rank) runs the mutated source.

How a patch is applied:

- The module's file is found under the checkout that holds this package (``a.b.c`` is
  ``a/b/c.py`` or ``a/b/c/__init__.py``), without importing anything.
- ``old`` must occur exactly once in the source; it is replaced by ``new``. The result must
  compile, the change must not lie inside a string (a docstring or a message), and the
  statement that holds the change must run inside a function or a lambda (a change that runs
  at import would fire in every process and prove nothing).
- Before that statement the hook inserts a call of a marker (``_dtensor_mutant_fired_()``, a
  global the loader puts into the module), so the runner learns that the mutated code ran:
  a mutation whose statement never ran is *invalid*, not a survivor.
- A meta-path finder serves the mutated module with a loader that compiles the edited source
  (never a cached ``.pyc``); every other module imports as usual.

Compiled code (the Cython extension in ``fastpath/``) is not mutated: mutations of kernels
change their array-module twins or the Python code that feeds the compiled loops; a patch with
``mode="python"`` runs its tests with ``DTENSOR_FASTPATH=0`` where only that path runs the twin.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MARKER", "MutationError", "SourcePatch", "module_file"]

#: The global the mutated module calls when the mutated statement runs.
MARKER = "_dtensor_mutant_fired_"
_ROOT = Path(__file__).resolve().parent.parent

Fired = Callable[[], None]


class MutationError(ValueError):
    """A source mutation that cannot be applied (module, snippet or statement)."""


def module_file(module: str) -> Path:
    """The source file of product module ``module`` in this checkout. **Local**.

    Raises MutationError when there is none.
    """
    base = _ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise MutationError(f"mutation: no source file for module {module!r} under {_ROOT}")


def _statement(tree: ast.Module, line: int) -> tuple[list[ast.stmt], int, bool]:
    """The innermost statement that holds source line ``line``: the list it is in, its
    index there, and whether it runs inside a function."""
    body: list[ast.stmt] = tree.body
    found: tuple[list[ast.stmt], int, bool] | None = None
    in_function = False
    while True:
        for i, stmt in enumerate(body):
            if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
                found = (body, i, in_function)
                break
        else:
            break
        # descend into the block of the statement that holds the line (if any holds it)
        blocks = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if
                  isinstance(getattr(stmt, f, None), list)]
        blocks += [h.body for h in getattr(stmt, "handlers", ())]
        blocks += [c.body for c in getattr(stmt, "cases", ())]
        inner = [b for b in blocks if b and b[0].lineno <= line <= (b[-1].end_lineno or 0)]
        if not inner:
            break
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function = True
        elif isinstance(stmt, ast.ClassDef):
            in_function = False
        body = inner[0]
    if found is None:
        raise MutationError(f"mutation: line {line} holds no statement")
    return found


def _lambda(tree: ast.Module, line: int, col: int) -> ast.Lambda | None:
    """The innermost lambda whose body holds position ``line``:``col`` (None when none)."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda):
            b = node.body
            if (b.lineno, b.col_offset) <= (line, col) < (b.end_lineno, b.end_col_offset) and (
                    best is None or (best.body.lineno, best.body.col_offset)
                    <= (b.lineno, b.col_offset)):
                best = node
    return best


@dataclass(frozen=True)
class SourcePatch:
    """Replace the snippet ``old`` (exactly one occurrence) of ``module``'s source by
    ``new``; ``mode`` ``"python"`` runs its tests with ``DTENSOR_FASTPATH=0``."""

    module: str
    old: str
    new: str
    mode: str | None = None

    def code(self) -> tuple[object, Path]:
        """Compile the mutated module with its marker call; the code object and the file.

        **Local.** Raises MutationError when the patch cannot be applied.
        """
        path = module_file(self.module)
        source = path.read_text()
        if self.old == self.new:
            raise MutationError(f"mutation of {self.module}: the new text is the old one")
        n = source.count(self.old)
        if n != 1:
            raise MutationError(
                f"mutation: {self.old!r} occurs {n} times in {self.module} (must be once)")
        start = source.index(self.old)
        mutated = source[:start] + self.new + source[start + len(self.old):]
        # the change proper: the first character where the new text differs from the old
        at = start + next((i for i, (a, b) in enumerate(zip(self.old, self.new)) if a != b),
                          min(len(self.old), len(self.new)))
        line = source.count("\n", 0, at) + 1
        try:
            tree = ast.parse(mutated, str(path))
        except SyntaxError as exc:
            raise MutationError(f"mutation of {self.module}: not valid Python: {exc}") from None
        col = at - (source.rfind("\n", 0, at) + 1)
        for node in ast.walk(tree):  # a docstring or message changes no behaviour
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    (node.lineno, node.col_offset) <= (line, col)
                    < (node.end_lineno, node.end_col_offset)):
                raise MutationError(
                    f"mutation of {self.module} line {line}: the change is inside a string")
        call = ast.Call(ast.Name(MARKER, ast.Load()), [], [])
        lam = _lambda(tree, line, col)
        if lam is not None:  # (marker(), body)[1]: the lambda's value, after the marker
            lam.body = ast.copy_location(ast.Subscript(
                ast.Tuple([call, lam.body], ast.Load()), ast.Constant(1), ast.Load()), lam.body)
        else:
            body, i, in_function = _statement(tree, line)
            stmt = body[i]
            if not in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.ClassDef)):
                raise MutationError(
                    f"mutation of {self.module} line {line}: the changed statement does not "
                    "run inside a function or lambda (it would run at import)")
            body.insert(i, ast.copy_location(ast.Expr(call), stmt))
        ast.fix_missing_locations(tree)
        return compile(tree, str(path), "exec", dont_inherit=True), path

    def install(self, fired: Fired) -> Callable[[], None]:
        """Install the import hook that serves the mutated module; return its removal.

        **Local.** Raises MutationError when the patch cannot be applied or the module is
        already imported (the hook would never run).
        """
        if self.module in sys.modules:
            raise MutationError(
                f"mutation: {self.module} was imported before the mutation was installed")
        code, path = self.code()
        finder = _Finder(self.module, path, code, fired)
        sys.meta_path.insert(0, finder)

        def remove() -> None:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)

        return remove


class _Loader(importlib.machinery.SourceFileLoader):
    """Loads the mutated module: its code object, with the marker in its globals."""

    def __init__(self, fullname: str, path: Path, code: object, fired: Fired) -> None:
        super().__init__(fullname, str(path))
        self._code = code
        self._fired = fired

    def get_code(self, fullname: str):
        return self._code

    def exec_module(self, module) -> None:
        setattr(module, MARKER, self._fired)
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the mutated module (and nothing else)."""

    def __init__(self, fullname: str, path: Path, code: object, fired: Fired) -> None:
        self.fullname = fullname
        self.path = path
        self.code = code
        self.fired = fired

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname:
            return None
        package = self.path.name == "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, self.path, loader=_Loader(fullname, self.path, self.code, self.fired),
            submodule_search_locations=[str(self.path.parent)] if package else None,
        )
