"""No check in the test suite that cannot fail, read from the sources with ``ast``.

Every ``.py`` file under ``tests/`` is parsed, and each ``assert`` statement (and each call
of an ``assert*`` helper, such as ``np.testing.assert_array_equal``) is checked for forms
that hold whatever the code under test does:

- ``assert <literal>``: a true constant (``assert True``) or a non-empty display
  (``assert (x, "message")`` asserts a non-empty tuple);
- ``assert <name>`` where every binding of the name in its scope is a true literal;
- a comparison whose two sides are the same expression (``x == x``, ``hash(t) == hash(t)``,
  ``a is a``), or two literals (``1 == 1``);
- an ``assert*`` helper given the same expression twice.

Each finding is reported as ``path:line: what``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, TESTS

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _truthy_literal(node: ast.expr | None) -> bool:
    """Whether ``node`` is a literal that is always true."""
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.Constant) and v.value for v in node.values)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts)


def _same(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope`` outside its nested functions and classes."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _bindings(scope: ast.AST, name: str, parents: dict) -> list[ast.expr | None]:
    """What ``name`` is bound to in ``scope``: the assigned value of each plain assignment,
    ``None`` for any other binding (a parameter, a loop or ``with`` target, an import...)."""
    out: list[ast.expr | None] = []
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
        out += [None for p in params if p is not None and p.arg == name]
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            parent = parents[node]
            plain = isinstance(parent, (ast.Assign, ast.AnnAssign)) and node is not parent.value
            out.append(parent.value if plain else None)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [None for a in node.names if (a.asname or a.name.split(".")[0]) == name]
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out += [None for n in node.names if n == name]
        elif isinstance(node, _SCOPES + (ast.ExceptHandler,)) and getattr(node, "name", 0) == name:
            out.append(None)
    return out


def _name_is_a_true_literal(name: str, scopes: list[ast.AST], parents: dict) -> bool:
    """Whether the innermost scope that binds ``name`` binds it to true literals only."""
    for scope in reversed(scopes):
        values = _bindings(scope, name, parents)
        if values:
            return all(_truthy_literal(v) for v in values)
    return False


def _compare_findings(node: ast.Compare) -> Iterator[str]:
    left = node.left
    for op, right in zip(node.ops, node.comparators):
        if _same(left, right):
            yield f"both sides of {type(op).__name__} are {ast.unparse(left)}"
        elif isinstance(left, ast.Constant) and isinstance(right, ast.Constant):
            yield f"compares two literals: {ast.unparse(left)}, {ast.unparse(right)}"
        left = right


def _helper_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def findings(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line: what`` (``path`` relative to ``root``) for each check in ``path`` that
    cannot fail, in line order."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    rel = path.relative_to(root)
    out = []

    def scopes_of(node: ast.AST) -> list[ast.AST]:
        chain = []
        while node in parents:
            node = parents[node]
            if isinstance(node, _SCOPES) and not isinstance(node, ast.ClassDef):
                chain.append(node)
        return [tree, *reversed(chain)]

    for node in ast.walk(tree):
        what: list[str] = []
        if isinstance(node, ast.Assert):
            test = node.test
            if _truthy_literal(test):
                what.append(f"asserts the literal {ast.unparse(test)[:60]}")
            elif isinstance(test, ast.Name) and _name_is_a_true_literal(
                test.id, scopes_of(node), parents
            ):
                what.append(f"asserts {test.id}, bound to a true literal only")
            for sub in ast.walk(test):
                if isinstance(sub, ast.Compare):
                    what += _compare_findings(sub)
        elif isinstance(node, ast.Call) and _helper_name(node).startswith("assert"):
            args = node.args
            if len(args) >= 2 and _same(args[0], args[1]):
                what.append(f"{_helper_name(node)} of {ast.unparse(args[0])} with itself")
        out += [(node.lineno, w) for w in what]
    return [f"{rel}:{line}: {w}" for line, w in sorted(out, key=lambda item: item[0])]


def _test_sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_check_that_cannot_fail():
    found = [line for path in _test_sources() for line in findings(path)]
    assert not found, "checks that cannot fail:\n" + "\n".join(found)


VACUOUS = """\
import numpy as np

FLAG = True


def test_it(x, t):
    ok = "yes"
    assert True
    assert (x, "message")
    assert ok
    assert FLAG
    assert x == x and hash(t) == hash(t)
    assert t is t
    assert 1 == 1
    np.testing.assert_array_equal(x.sum(), x.sum())
"""

SOUND = """\
import numpy as np

FLAG = True


def test_it(x, t, layout):
    ok = "yes"
    ok = x.ok()
    FLAG = x.flag()
    assert x
    assert ok
    assert FLAG
    assert layout
    assert x == t and hash(x) == hash(t) and x is not t
    assert [y for y in x]
    np.testing.assert_array_equal(x.sum(), t.sum())
"""


def test_the_scanner_reports_each_form_with_its_line(tmp_path):
    lines = {}
    for name, text in (("vacuous", VACUOUS), ("sound", SOUND)):
        (tmp_path / f"{name}.py").write_text(text)
        lines[name] = [f.split(": ", 1)[0] for f in findings(tmp_path / f"{name}.py", tmp_path)]
    assert lines["vacuous"] == [f"vacuous.py:{n}" for n in (8, 9, 10, 11, 12, 12, 13, 14, 15)]
    assert lines["sound"] == []
