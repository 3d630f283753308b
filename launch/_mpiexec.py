"""Finding and running ``mpiexec``: the launcher's process handling.

This module owns the choice of ``mpiexec`` (the one of the MPI that mpi4py loads), the
environment given to the ranks, the command line of a job and running that command
with a timeout that kills the whole process group. It uses the standard library only
and never initialises MPI.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = [
    "TIMEOUT_EXIT_CODE",
    "find_mpiexec",
    "host_args",
    "job_command",
    "rank_env",
    "run_job",
]

#: Exit status of a job that ran past its timeout (the convention of coreutils' timeout).
TIMEOUT_EXIT_CODE = 124

#: Variables set for every rank unless the caller already set them: one BLAS/OpenMP
#: thread per rank, since the ranks already occupy the cores.
RANK_ENV_DEFAULTS: Mapping[str, str] = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

_KILL_GRACE_S = 5.0


def _executable(path: str | os.PathLike[str]) -> str | None:
    p = Path(path)
    return str(p) if p.is_file() and os.access(p, os.X_OK) else None


def find_mpiexec(explicit: str | None = None) -> str:
    """Path of the ``mpiexec`` that matches the MPI library mpi4py loads.

    **Local.** The order is: ``explicit`` (the launcher's ``--mpiexec``), the
    ``DTENSOR_MPIEXEC`` environment variable, the ``mpiexec`` next to the running Python
    (where the ``mpich`` wheel installs it in a virtual environment), the scripts folder
    of this Python installation, then ``mpiexec`` and ``mpirun`` on ``PATH``.

    Parameters
    ----------
    explicit : str, optional
        A path or a command name looked up on ``PATH``.

    Returns
    -------
    str
        An executable path.

    Raises
    ------
    FileNotFoundError
        When no candidate exists, or when ``explicit``/``DTENSOR_MPIEXEC`` names
        something that is not an executable.
    """
    env_choice = os.environ.get("DTENSOR_MPIEXEC")
    for source, chosen in (("--mpiexec", explicit), ("DTENSOR_MPIEXEC", env_choice)):
        if chosen:
            found = _executable(chosen) or shutil.which(chosen)
            if found is None:
                raise FileNotFoundError(f"{source}={chosen!r} is not an executable file")
            return found
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        found = _executable(folder / "mpiexec")
        if found is not None:
            return found
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise FileNotFoundError(
        "no mpiexec found next to the Python interpreter or on PATH: install the MPICH "
        "wheel (pip install mpich), or point DTENSOR_MPIEXEC (or --mpiexec) at the "
        "mpiexec of the MPI that mpi4py was built for"
    )


def _flavor(mpiexec: str) -> str:
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "prte" in text.lower():
        return "openmpi"
    return "unknown"


def host_args(mpiexec: str, hosts: str | None, hostfile: str | None) -> list[str]:
    """``mpiexec`` options that place the ranks on ``hosts`` or the hosts of ``hostfile``.

    **Local.** MPICH/Intel (Hydra) spell them ``-hosts``/``-f``, Open MPI
    ``--host``/``--hostfile``; the flavour is read from ``mpiexec --version``, only when
    one of the two is given.

    Raises
    ------
    ValueError
        When the flavour of ``mpiexec`` is not recognised (pass the options through
        ``--mpiexec-arg`` instead).
    """
    if hosts is None and hostfile is None:
        return []
    flavor = _flavor(mpiexec)
    spellings = {"hydra": ("-hosts", "-f"), "openmpi": ("--host", "--hostfile")}
    if flavor not in spellings:
        raise ValueError(
            f"cannot tell how {mpiexec} takes a host list; pass its own options with "
            "--mpiexec-arg (e.g. --mpiexec-arg=--hostfile --mpiexec-arg=hosts.txt)"
        )
    host_opt, file_opt = spellings[flavor]
    args: list[str] = []
    if hosts is not None:
        args += [host_opt, hosts]
    if hostfile is not None:
        args += [file_opt, hostfile]
    return args


def job_command(
    mpiexec: str, nprocs: int, target: Sequence[str], mpiexec_args: Sequence[str] = ()
) -> list[str]:
    """The ``mpiexec`` command line that runs ``target`` on ``nprocs`` ranks.

    **Local.** Each rank runs ``python -m launch._rank *target``, the bootstrap that turns
    an uncaught exception on one rank into an abort of the whole job.

    Parameters
    ----------
    mpiexec : str
        From :func:`find_mpiexec`.
    nprocs : int
        Number of ranks.
    target : sequence of str
        ``[script, *args]`` or ``["-m", module, *args]``.
    mpiexec_args : sequence of str
        Extra options for ``mpiexec`` (hosts, binding, ...), placed before ``-n``.
    """
    return [
        mpiexec,
        *mpiexec_args,
        "-n",
        str(nprocs),
        sys.executable,
        "-m",
        "launch._rank",
        *target,
    ]


def rank_env(base: Mapping[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """Environment for the ranks: ``base`` (default ``os.environ``), the defaults, overrides.

    **Local.** ``RANK_ENV_DEFAULTS`` fill only what ``base`` leaves unset; ``overrides``
    always win.
    """
    env = dict(os.environ if base is None else base)
    for key, value in RANK_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env.update(overrides)
    return env


class _Terminated(Exception):
    """The launcher itself received SIGTERM or SIGHUP while a job ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _Terminated(signum)


def _kill_group(proc: subprocess.Popen[bytes], first: int) -> None:
    """Send ``first`` to the job's process group; SIGKILL what is left after a grace period."""
    for sig in (first, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def run_job(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    output: IO[bytes] | None = None,
) -> int:
    """Run ``cmd`` in its own process group and return its exit status.

    **Local** (from the caller's side; the command itself may be an MPI job). The job's
    output goes straight to this process's stdout/stderr, or, with ``output`` (a file open
    for binary writing), stdout and stderr both go to that file. When ``timeout`` seconds pass,
    the whole process group (``mpiexec`` and every rank it started) gets SIGTERM, then
    SIGKILL, and the result is ``TIMEOUT_EXIT_CODE`` (124). Ctrl-C, SIGTERM and SIGHUP
    sent to this process also end the whole group (exit status 128 + signal).

    Returns
    -------
    int
        The exit status; a job killed by signal ``s`` gives ``128 + s``.
    """
    previous = {}
    proc = subprocess.Popen(
        list(cmd),
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
        stdout=output,
        stderr=None if output is None else subprocess.STDOUT,
    )
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"launch: the job ran past its timeout of {timeout:g} s; killing it\n")
        sys.stderr.flush()
        _kill_group(proc, signal.SIGTERM)
        return TIMEOUT_EXIT_CODE
    except KeyboardInterrupt:
        _kill_group(proc, signal.SIGINT)
        return 128 + signal.SIGINT
    except _Terminated as exc:
        _kill_group(proc, signal.SIGTERM)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc
