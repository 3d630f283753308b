"""Running subprocess jobs from the unit tests (launcher jobs, ``mpiexec`` programs).

A job runs in a session of its own, so that a job that outlives its limit is killed with
its whole process group (every rank) and the test fails instead of hanging.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

# where the imported dtensor lives (site-packages when installed): subprocesses use the same
PKG_ROOT = str(Path(importlib.util.find_spec("dtensor").origin).resolve().parents[1])
#: The mpiexec next to the running Python (where the mpich wheel puts it).
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def child_env(extra: Mapping[str, str] | None = None, drop: Iterable[str] = ()) -> dict:
    """This process's environment with ``PYTHONPATH`` set to :data:`PKG_ROOT`, ``extra``
    added and the variables in ``drop`` removed (unless ``extra`` sets them)."""
    env = dict(os.environ, PYTHONPATH=PKG_ROOT, **(extra or {}))
    for name in drop:
        if name not in (extra or {}):
            env.pop(name, None)
    return env


def job_cwd(cwd: Path | str, args: Sequence[str]) -> Path | str:
    """The folder to start a launcher job ``args`` in: ``python -m pkg.mod`` puts its working
    folder first on ``sys.path``, so a module job started in the checkout would import the
    source tree (whose extension may not be built) instead of the installed packages; such a
    job starts in the ``tests`` folder. Script jobs (``path.py``) keep ``cwd``."""
    from helpers import ROOT, TESTS  # lazy: helpers/__init__ is the package's own root

    if "-m" in args and Path(cwd).resolve() == ROOT:
        return TESTS
    return cwd


def run_group(
    argv: Sequence[str], cwd: Path | str, limit: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own process group and return its result (text output). If it
    outlives ``limit`` seconds, kill the whole group and fail the calling test."""
    argv = [str(a) for a in argv]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} did not end within {limit} s\n{out}\n{err}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` with :func:`child_env` plus ``env``; its result (text output)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
