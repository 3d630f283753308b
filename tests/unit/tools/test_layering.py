"""The import layering of the project (README, "What it is"), read from the sources by ast.

Every import statement of the library packages, module-level and function-level, becomes
an edge between two project modules. The test fails on an upward edge (a lower layer
importing a higher one), on any import cycle among the modules, and on a function-level
(lazy) import of a project module that does not say why it is lazy (``# lazy:`` on its line
or the line above). ``.pyx``/``.pxi`` files of the compiled extension are read for their
``import``/``cimport`` lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

PACKAGES = ("placements", "redistribute", "fastpath", "dtensor", "launch")

#: Layer of a module: the longest matching prefix decides. Imports may only point to the
#: same layer or a lower one; modules of two different packages on one layer (fastpath and
#: redistribute; two features) may not import each other: dtensor's compiled glue plugs
#: redistribute's hook state into the compiled executor (``fastpath._redist``). Above the
#: dispatch layer the levels are the tools (testing, then
#: debug with the validator, which uses it), then the features (utils' activation
#: checkpointing; checkpoint, optim, nn, which wraps utils' checkpoint in a module; then
#: autoshard, which uses optim, and the parallel styles, which use nn), then the face
#: (``dtensor/__init__.py``, ``autograd.py``, ``validate.py``). Features reach the tools
#: only through their faces (see the privacy rule below).
LAYERS = (
    ("placements", 0),
    ("fastpath", 1),
    ("redistribute", 1),
    ("dtensor.local", 3),
    ("dtensor.distributed", 4),
    ("dtensor.ops", 5),
    ("dtensor.dispatch", 6),
    ("dtensor.testing", 7),
    ("dtensor.debug", 8),
    ("dtensor.utils", 9),
    ("dtensor.checkpoint", 10),
    ("dtensor.optim", 10),
    ("dtensor.nn", 10),
    ("dtensor.autoshard", 11),
    ("dtensor.parallel", 11),
    ("dtensor.pipelining", 11),
    ("dtensor", 12),
    ("launch", 13),
)
#: The internal packages (layers, marked "Internal package" in their docstring): other
#: subpackages import their modules directly, public names only. Every other subpackage of
#: dtensor is a face: its ``__init__`` lists its public names (``__all__``), and other
#: subpackages import those from it, never from its ``_private`` modules.
INTERNAL = ("dtensor.local", "dtensor.distributed", "dtensor.ops", "dtensor.dispatch")
#: The library packages the privacy rule holds for (launch's benchmarks and mutation tool
#: reach into internals on purpose).
LIBRARY = ("placements", "redistribute", "fastpath", "dtensor")
#: At most this many ``.py`` files directly in ``dtensor/`` (the public modules).
MAX_TOP_LEVEL = 8


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.suffix in (".py", ".pyx", ".pxi") and "__pycache__" not in path.parts:
                out.setdefault(_module_name(path), path)
    return out


def _layer(module: str) -> tuple[str, int]:
    best = ("", -1)
    for prefix, layer in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[0]):
            best = (prefix, layer)
    return best


def _resolve(target: str, modules: set[str]) -> str | None:
    """The project module an import names (a name imported from a module resolves to the
    module)."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` statement in ``package`` names."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(path: Path, module: str, modules: set[str], text: str | None = None
           ) -> list[tuple[str, int, bool, str]]:
    """``(imported module, line, lazy, source line)`` of every project import in ``path``
    (or in ``text``, read as if it were that file)."""
    text = path.read_text() if text is None else text
    lines = text.splitlines()
    found = []
    if path.suffix in (".pyx", ".pxi"):
        for n, line in enumerate(lines, 1):
            m = re.match(r"\s*(?:from\s+([\w.]+)\s+c?import|c?import\s+([\w.]+))", line)
            if m:
                target = _resolve(m.group(1) or m.group(2), modules)
                if target:
                    found.append((target, n, line.startswith((" ", "\t")), line))
        return found
    tree = ast.parse(text)
    package = _package_of(path, module)
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = _from_module(node, package)
            names = [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target and target != module:
                lazy = id(node) not in top_level and not _guarded(tree, node)
                found.append((target, node.lineno, lazy, lines[node.lineno - 1]))
    return found


def _guarded(tree: ast.Module, node: ast.AST) -> bool:
    """An import inside a module-level ``try``/``if`` (a fallback), not inside a function."""
    for top in tree.body:
        if isinstance(top, (ast.Try, ast.If)) and any(n is node for n in ast.walk(top)):
            return True
    return False


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool, str]]]]:
    sources = _sources()
    modules = set(sources)
    return sources, {m: _edges(p, m, modules) for m, p in sources.items()}


def _upward(module: str, target: str) -> bool:
    (prefix, layer), (tprefix, tlayer) = _layer(module), _layer(target)
    return tlayer > layer or (tlayer == layer and tprefix != prefix)


def test_no_upward_import():
    sources, graph = _graph()
    bad = []
    for module, edges in graph.items():
        layer = _layer(module)[1]
        for target, line, _, src in edges:
            if _upward(module, target):
                tlayer = _layer(target)[1]
                bad.append(f"{sources[module].relative_to(ROOT)}:{line}: {module} (layer "
                           f"{layer}) imports {target} (layer {tlayer}): {src.strip()}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def _cycles(adjacency: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adjacency.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in adjacency:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle():
    _, graph = _graph()
    cycles = _cycles({m: sorted({t for t, *_ in edges}) for m, edges in graph.items()})
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"], "e": ["e"]}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_every_lazy_import_says_why():
    sources, graph = _graph()
    bad = []
    for module, edges in graph.items():
        lines = sources[module].read_text().splitlines()
        for target, line, lazy, src in edges:
            if lazy and not any("# lazy:" in lines[n - 1] for n in (line, line - 1) if n > 0):
                bad.append(f"{sources[module].relative_to(ROOT)}:{line}: {src.strip()}")
    assert not bad, "function-level imports without a '# lazy:' reason:\n" + "\n".join(bad)


def test_dtensor_top_level_holds_only_the_public_modules():
    files = sorted(p.name for p in (ROOT / "dtensor").glob("*.py"))
    assert len(files) <= MAX_TOP_LEVEL, files


@pytest.mark.parametrize(
    ("source", "text", "upward", "lazy"),
    [
        ("placements/fake.py", "from dtensor.local import tensor\n", True, False),
        ("dtensor/local/fake.py", "from ..distributed import mesh\n", True, False),
        ("fastpath/fake.py", "import redistribute\n", True, False),
        ("redistribute/fake.py", "import fastpath\n", True, False),
        ("dtensor/ops/fake.py", "def f():\n    from ..local import tensor\n", False, True),
        ("dtensor/ops/fake.py",
         "try:\n    from ..local import tensor\nexcept ImportError:\n    pass\n", False, False),
        ("fastpath/fake.pyx", "from dtensor.local cimport tensor\n", True, False),
    ],
)
def test_the_checker_sees_each_kind_of_edge(source, text, upward, lazy):
    modules = set(_sources())
    path = ROOT / source
    module = _module_name(path)
    ((target, _, is_lazy, _),) = _edges(path, module, modules, text)
    assert _upward(module, target) is upward
    assert is_lazy is lazy


def _subpackage(module: str) -> str:
    """What privacy is judged by: a subpackage of dtensor, or a top-level package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "dtensor" and len(parts) > 1 else parts[0]


def _private_in(path: Path, module: str, modules: set[str], text: str | None = None
                ) -> list[str]:
    """Imports of a private name (``_x``), or from a private module, of another subpackage
    in ``path`` (or in ``text``, read as if it were that file)."""
    tree = ast.parse(path.read_text() if text is None else text)
    package = _package_of(path, module)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        prefix = _from_module(node, package)
        for a in node.names:
            target = _resolve(f"{prefix}.{a.name}", modules) or _resolve(prefix, modules)
            if target is None or _subpackage(target) == _subpackage(module):
                continue
            private_name = a.name.startswith("_") and not a.name.startswith("__")
            private_module = any(p.startswith("_") and not p.startswith("__")
                                 for p in f"{prefix}.{a.name}".split("."))
            if private_name or private_module:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module} imports "
                           f"{a.name} from {prefix}")
    return bad


def _private_imports() -> list[str]:
    """:func:`_private_in` of every ``.py`` module of the library packages."""
    sources = _sources()
    modules = set(sources)
    bad = []
    for module, path in sources.items():
        if path.suffix == ".py" and module.startswith(LIBRARY):
            bad += _private_in(path, module, modules)
    return bad


def test_no_private_name_crosses_a_subpackage():
    bad = _private_imports()
    assert not bad, "private imports across subpackages:\n" + "\n".join(bad)


def test_internal_packages_are_marked_and_faces_list_their_names():
    for pkg in sorted({p for p, _ in LAYERS if p.startswith("dtensor.")}):
        init = ROOT / pkg.replace(".", "/") / "__init__.py"
        if not init.exists():
            assert not (ROOT / (pkg.replace(".", "/") + ".py")).exists() or pkg in (
                "dtensor.testing",), pkg
            continue
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        if pkg in INTERNAL:
            assert doc.startswith("Internal package"), pkg
        else:
            assert not doc.startswith("Internal package"), pkg
            assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                         for t in n.targets)
                       for n in tree.body), f"{pkg}: a face lists its names in __all__"


def test_the_privacy_checker_sees_a_private_import():
    modules = set(_sources())
    path = ROOT / "dtensor" / "nn" / "fake.py"
    text = ("from ..debug._explain import explain\nfrom ..local.tensor import _x\n"
            "from ..debug import explain\nfrom . import _y\n")
    bad = _private_in(path, "dtensor.nn.fake", modules, text)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "dtensor.nn.fake imports explain from dtensor.debug._explain",
        "dtensor.nn.fake imports _x from dtensor.local.tensor",
    ]
