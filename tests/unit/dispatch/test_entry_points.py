"""Entry points built once (dtensor.dispatch.entry_points): nothing is installed again at run
time, functions taken early follow the autograd and fast-path flags, the compiled front is
plugged with every field, and the generated type stub is current."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

import dtensor as dt
import fastpath
from dtensor.dispatch import compiled, entry_points
from launch import stubs

needs_front = pytest.mark.skipif(
    not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)"
)


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ), check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_autograd_activation_installs_nothing_and_early_functions_record():
    out = _run("""
        import numpy as np, dtensor as dt
        before_t = dict(vars(dt.Tensor))
        before_d = dict(vars(dt.DTensor))
        add, mul, ssum = dt.add, dt.mul, dt.sum          # taken before autograd is active
        tadd = dt.Tensor.add
        x = dt.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
        y = dt.tensor(np.full((2, 3), 2.0, np.float32))
        assert add(x, y).grad_fn is None
        x.requires_grad_()                                 # autograd becomes active here
        assert {k: v for k, v in vars(dt.Tensor).items() if k != "__doc__"} == {
            k: v for k, v in before_t.items() if k != "__doc__"}
        assert dict(vars(dt.DTensor)) == before_d
        assert dt.Tensor.add is tadd and dt.add is add
        z = ssum(mul(add(x, y), y))
        assert z.grad_fn is not None
        z.backward()
        assert np.array_equal(x.grad.numpy(), np.full((2, 3), 2.0, np.float32))
        w = x.add(y).sum()                                 # the method taken before, too
        w.backward()
        assert np.array_equal(x.grad.numpy(), np.full((2, 3), 3.0, np.float32))
        x.grad = None
        x.T.sum().backward()                               # T records once active
        assert np.array_equal(x.grad.numpy(), np.ones((2, 3), np.float32))
        mesh = dt.init_device_mesh((1,))
        d = dt.distribute_tensor(np.ones((4, 2), np.float32), mesh, [dt.Shard(0)])
        d.requires_grad_()
        r = d.redistribute(mesh, [dt.Replicate()])         # recorded by the method itself
        assert r.grad_fn is not None
        (r * 3.0).sum().backward()
        assert np.array_equal(d.grad.full_tensor().numpy(), np.full((4, 2), 3.0, np.float32))
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_front
def test_the_compiled_front_is_plugged_with_every_field():
    fields = [f.name for f in dataclasses.fields(compiled.Plug)]
    assert tuple(fields) == fastpath.dispatch.PLUG_FIELDS
    plugged = fastpath.dispatch.plugged()
    assert set(plugged) == set(fields)
    for name in fields:
        assert plugged[name] is not None, name
    with pytest.raises(TypeError, match="missing fields"):
        fastpath.dispatch.plug(dtensor_cls=dt.DTensor)
    assert fastpath.dispatch.plugged() == plugged  # a refused plug changed nothing


@needs_front
def test_set_fastpath_flips_a_flag_read_per_call():
    try:
        assert fastpath.dispatch.set_flags() == (fastpath.dispatch.set_flags()[0], False)
        dt.debug.set_fastpath(False)
        assert fastpath.dispatch.set_flags()[1] is True
    finally:
        dt.debug.set_fastpath(True)
    assert fastpath.dispatch.set_flags()[1] is False


def test_the_type_stub_is_current_and_names_everything_installed():
    text = stubs.STUB_PATH.read_text()
    assert text == stubs.render(), "dtensor/__init__.pyi is stale: run python -m launch.stubs"
    names = entry_points.installed()
    defined = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("def "):
            defined.add(line[4:line.index("(")])
        elif line.startswith("from ") and " as " in line:
            defined.add(line.rsplit(" as ", 1)[1])
    for name in (*names["functions"], *names["Tensor"], *names["DTensor"]):
        assert name in defined, name
    public = {n for n in vars(dt) if not n.startswith("_")}
    assert public - defined - {"Tensor", "DTensor"} <= {
        n for n in public if isinstance(getattr(dt, n), type(dt))  # submodules are imported
    }


def test_only_the_compiled_module_of_dispatch_imports_fastpath():
    import ast
    from pathlib import Path

    import dtensor.dispatch as pkg

    importers = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ()
            if isinstance(node, ast.Import):
                names = tuple(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = (node.module or "",)
            if any(n == "fastpath" or n.startswith("fastpath.") for n in names):
                importers.add(path.name)
    assert importers == {"compiled.py"}


def test_raw_forms_are_named_by_the_records():
    from dtensor.ops import OPS

    forms = {name: info.raw for name, info in OPS.items() if info.raw is not None}
    pointwise = {n for n, f in forms.items() if f == "pointwise"}
    assert pointwise == {n for n, i in OPS.items() if getattr(i.function, "spec", None)
                         is not None and not i.inplace}
    assert {n: f for n, f in forms.items() if f != "pointwise"} == {
        "view": "view", "reshape": "view", "t": "t", "getitem": "getitem", "clone": "copy",
        "contiguous": "copy", "sum": "sum", "mean": "mean", "amax": "extreme",
        "amin": "extreme", "softmax": "softmax", "log_softmax": "softmax",
        "matmul": "matmul", "mm": "matmul",
    }
    assert {"add", "mul", "exp", "relu", "lt"} <= pointwise
    assert set(forms.values()) == set(compiled._DECIDERS)
