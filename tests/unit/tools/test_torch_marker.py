"""Every test that imports torch is marked ``torch``, read from the sources with ``ast``, so
that ``-m "not torch"`` runs the suite where torch is not installed and the marker's skip
(``tests/conftest.py``) is the only way a missing torch shows.

A test reaches torch when its body imports it (``import torch``, ``from torch ...``,
``pytest.importorskip("torch")``) or calls, by name, a function of its module that does
(transitively). Such a test needs ``@pytest.mark.torch`` or a module ``pytestmark`` that
holds it.

Where torch is missing (simulated: ``sys.modules["torch"] = None``, so that importing it
fails and ``find_spec`` gives None), a file of torch tests runs: the marked tests skip with
the one expected reason, and ``-m "not torch"`` leaves them out and the rest passes.
"""

from __future__ import annotations

import ast
import json
import sys

import pytest
from helpers import TESTS
from helpers.jobs import child_env, run_group

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _imports_torch(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Import) and any(
                a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "torch"):
            return True
    return False


def _called_names(fn: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _is_torch_mark(node: ast.expr) -> bool:
    """``pytest.mark.torch`` (or a list/tuple holding it)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_torch_mark(e) for e in node.elts)
    return (isinstance(node, ast.Attribute) and node.attr == "torch"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def unmarked_torch_tests(source: str) -> list[str]:
    """The names of the tests in ``source`` that reach a torch import without the mark."""
    tree = ast.parse(source)
    module_marked = any(
        isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                          for t in n.targets) and _is_torch_mark(n.value)
        for n in tree.body)
    funcs = {n.name: n for n in tree.body if isinstance(n, _FUNCS)}
    reach = {name for name, fn in funcs.items() if _imports_torch(fn)}
    grown = True
    while grown:  # helpers that call helpers that import torch
        grown = False
        for name, fn in funcs.items():
            if name not in reach and _called_names(fn) & reach:
                reach.add(name)
                grown = True
    if module_marked:
        return []
    return sorted(name for name in reach if name.startswith("test")
                  and not any(_is_torch_mark(d) for d in funcs[name].decorator_list))


def test_every_test_that_imports_torch_is_marked_torch():
    missing = []
    for path in sorted(TESTS.rglob("test_*.py")):
        missing += [f"{path.relative_to(TESTS)}::{name}"
                    for name in unmarked_torch_tests(path.read_text())]
    assert not missing, "tests that import torch without @pytest.mark.torch:\n" + "\n".join(
        missing)


def test_the_check_finds_direct_and_helper_imports_and_accepts_marks():
    src = '''
import pytest

def _helper():
    import torch

def _outer():
    return _helper()

def test_direct():
    import torch.nn

def test_via_helpers():
    _outer()

def test_skip():
    pytest.importorskip("torch")

@pytest.mark.torch
def test_marked():
    from torch import nn

def test_plain():
    pass
'''
    assert unmarked_torch_tests(src) == ["test_direct", "test_skip", "test_via_helpers"]
    assert unmarked_torch_tests("import pytest\npytestmark = [pytest.mark.torch]\n" + src) == []


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # import torch fails; importlib.util.find_spec gives None
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("deselect", [False, True])
def test_without_torch_marked_tests_skip_or_are_deselected(tmp_path, deselect):
    report = tmp_path / "report.json"
    files = ["unit/features/test_optim.py", "unit/ops/test_torch_oracle_grads.py"]
    args = [sys.executable, "-c", _NO_TORCH, *files, "-q", "-p", "no:cacheprovider", "-rs",
            *(["-m", "not torch"] if deselect else [])]
    proc = run_group(args, TESTS, 300, child_env({"DTENSOR_TEST_REPORT": str(report)}))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    counts = json.loads(report.read_text())
    assert counts["failed"] == 0 and counts["passed"] > 0, counts
    if deselect:
        assert counts["skipped"] == 0 and "deselected" in out, out
    else:  # every test of the oracle file skipped, with the reason tests/skips.py expects
        assert counts["skipped"] > 100, counts
        assert counts["unexpected"] == 0 and "torch is not installed" in out, out
