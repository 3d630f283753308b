"""The automatic test selection of ``python -m launch mutate``: which tests judge a mutation.

This module owns the rule that picks, for the product module a mutation changes, the test
files that should notice, from a static reading (``ast``) of the test sources; no mutation
names a test. The rule, for mutated module ``M`` (``a.b.c``):

1. **imports** (level 3): the test file, or a module of ``tests/helpers`` it imports
   (transitively), imports ``M`` (``import a.b.c``, ``from a.b.c import x``,
   ``from a.b import c``);
2. **names** (level 2): it uses a public name that ``M`` defines at its top level (a function,
   a class, a constant not starting with ``_``): imported by name (``from a.b import name``)
   or read as an attribute (``dt.optim.SGD``, ``x.index_put_``). Local variables (bare names)
   and strings do not count: they are too often a test's own words;
3. **layer** (level 1): it lives in the test folder that mirrors ``M``'s layer
   (``tests/{unit,mpi}/<x>/`` for ``dtensor.<x>.*`` or the top package ``<x>``, e.g.
   ``tests/unit/placements`` for ``placements.*``), or imports a package above ``M`` other
   than the top-level one (``dtensor.checkpoint`` for ``dtensor.checkpoint._dcp``).

Files of no level are not selected. The tests of the mutation machinery itself
(``unit/launch/test_mutate.py``) are never selected. The selected files run cheapest first:
the unit files in one pytest process, ordered by level (highest first), then by how many of
``M``'s names the file uses (more first), then by size (the smaller file first: a proxy of its
run time), then the MPI files, in the same order, under
``mpiexec -n 2``, then again under ``mpiexec -n 3`` (uneven shards); the runner stops at the
first run that fails, and when the mutation's time budget is spent. New test files join the
selection by themselves: the scan reads the ``tests`` folder at every invocation.

A rule mutation (:class:`launch.mutations.RulePatch`) mutates the module of its rule family;
the strategy validator's groups of its ops (derived from the op names the patch names) are
prepended to its unit run, since the validator checks every candidate of those rules.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ._source import module_file

__all__ = ["EXCLUDED", "TestFile", "public_names", "scan", "select"]

#: Test files never selected (the tests of the mutation machinery itself).
EXCLUDED = frozenset({"unit/launch/test_mutate.py"})
_ROOT = Path(__file__).resolve().parent.parent
#: Top-level product packages: importing one of them is no evidence of testing a module.
TOP_PACKAGES = ("dtensor", "placements", "redistribute", "fastpath")


@dataclass(frozen=True)
class TestFile:
    """A test file (``path`` relative to the ``tests`` folder) and what it reads: the modules
    it imports, the names it imports from modules or reads as attributes, its size."""

    __test__ = False  # not a pytest class

    path: str
    imports: frozenset[str]
    names: frozenset[str]
    size: int
    helpers: frozenset[str] = field(default=frozenset())

    @property
    def suite(self) -> str:
        return self.path.split("/")[0]


def _read(path: Path) -> tuple[set[str], set[str], set[str]]:
    """Imported modules, used names (imported names and attributes), imported helpers."""
    tree = ast.parse(path.read_text(), str(path))
    imports: set[str] = set()
    names: set[str] = set()
    helpers: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                imports.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imports.add(node.module)
            for a in node.names:
                imports.add(f"{node.module}.{a.name}")
                names.add(a.name)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)

    for m in imports:
        if m == "helpers" or m.startswith("helpers."):
            helpers.add(m)
    return imports, names, helpers


@functools.lru_cache(maxsize=8)
def scan(tests_dir: Path) -> tuple[TestFile, ...]:
    """Every test file of ``tests/unit`` and ``tests/mpi``, with what it and the helpers it
    imports read. **Local**."""
    helper_info: dict[str, tuple[set[str], set[str], set[str]]] = {}
    for p in sorted((tests_dir / "helpers").glob("*.py")):
        name = "helpers" if p.stem == "__init__" else f"helpers.{p.stem}"
        helper_info[name] = _read(p)

    def closure(start: Iterable[str]) -> set[str]:
        seen: set[str] = set()
        todo = [h for h in start if h in helper_info]
        while todo:
            h = todo.pop()
            if h not in seen:
                seen.add(h)
                todo += [x for x in helper_info[h][2] if x in helper_info]
        return seen

    out = []
    for suite in ("unit", "mpi"):
        for p in sorted((tests_dir / suite).rglob("test_*.py")):
            rel = p.relative_to(tests_dir).as_posix()
            if rel in EXCLUDED:
                continue
            imports, names, helpers = _read(p)
            used = closure(helpers)
            for h in used:
                imports |= helper_info[h][0]
                names |= helper_info[h][1]
            out.append(TestFile(rel, frozenset(imports), frozenset(names), p.stat().st_size,
                                frozenset(used)))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def public_names(module: str) -> frozenset[str]:
    """The public names product module ``module`` defines at its top level. **Local**."""
    tree = ast.parse(module_file(module).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(n for n in names if not n.startswith("_") and n != "__all__")


def level(test: TestFile, module: str) -> int:
    """How strongly ``test`` reads ``module`` (3 imports, 2 names, 1 layer, 0 not). **Local**."""
    if module in test.imports:
        return 3
    if test.names & public_names(module):
        return 2
    parts = module.split(".")
    layer = parts[1] if parts[0] == "dtensor" and len(parts) > 2 else parts[0]
    if test.path.split("/")[1] == layer:
        return 1
    packages = {".".join(parts[:i]) for i in range(2, len(parts))}
    return 1 if packages & test.imports else 0


def select(tests_dir: Path, module: str) -> tuple[list[str], list[str]]:
    """The unit and the MPI test files (relative to ``tests_dir``) that judge a mutation of
    ``module``, each list in the order they run: by level, then the more of the module's
    names a file uses the earlier, then the smaller file first. **Local**."""
    chosen: dict[str, list[tuple[int, int, int, str]]] = {"unit": [], "mpi": []}
    names = public_names(module)
    for t in scan(tests_dir):
        lv = level(t, module)
        if lv:
            chosen[t.suite].append((-lv, -len(t.names & names), t.size, t.path))
    return ([p for *_, p in sorted(chosen["unit"])], [p for *_, p in sorted(chosen["mpi"])])
