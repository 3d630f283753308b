"""Per-rank bootstrap: ``python -m launch._rank (script.py | -m module) [args...]``.

This module owns what one rank of a launched job does around the user's program: run it
as ``__main__`` (like ``python script.py`` / ``python -m module``), and when it fails on
one rank, end the whole job at once instead of leaving the other ranks blocked in a
collective. Output is line-buffered, so lines of different ranks do not mix and
show up while the job runs. An uncaught exception prints its traceback once, each line prefixed with
``[rank R]``, and aborts the job with exit status 1; ``sys.exit(code)`` with a non-zero
code on any rank of a multi-rank job aborts it with that code, clamped to 1-255 (an exit
status has 8 bits: ``sys.exit(256)`` would otherwise read as success).

On Linux a rank dies with the process that started it (Hydra's proxy, ``slurmstepd``):
``PR_SET_PDEATHSIG``, armed before MPI starts, so that a proxy killed outright does not
leave its ranks running. Under ``python -m launch`` (``DTENSOR_LAUNCH_DIR`` set) each
rank also leaves two records in the job's private folder (:func:`record_start`,
:func:`record_exit`): its pid, host and the shared-memory files its MPI library made at
start, and the status it ends with through this bootstrap. From them the launcher tells a
rank really killed by a signal from output that only says so, and removes the MPI
library's shared-memory files that an aborted job leaves behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["LAUNCH_DIR_VAR", "die_with_parent", "main", "record_exit", "record_start"]

#: The variable that names the job's private folder of :func:`run_job
#: <launch._mpiexec.run_job>`, where the ranks leave their records.
LAUNCH_DIR_VAR = "DTENSOR_LAUNCH_DIR"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Make this process get SIGKILL when its parent ends (Linux's parent-death signal;
    nothing elsewhere), and end at once if the parent has ended already. **Local**."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _record(name: str, data: object) -> None:
    """Write ``data`` (JSON) as file ``name`` of the job's folder, created anew (never
    through a link); nothing when there is no such folder or it cannot be written."""
    folder = os.environ.get(LAUNCH_DIR_VAR)
    if not folder:
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(os.path.join(folder, name), flags, 0o600)
    except OSError:  # another host's folder, a folder removed under us: no record
        return
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)


def _mapped_shared_files() -> list[list[Any]]:
    """``[path, device, inode]`` of each file under /dev/shm that this process maps and that
    is still linked (the MPI library's segments, at start)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: dict[str, list[Any]] = {}
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/dev/shm/") and not parts[5].endswith(
                " (deleted)") and parts[5] not in found:
            try:
                st = os.stat(parts[5])
            except OSError:
                continue
            found[parts[5]] = [parts[5], st.st_dev, st.st_ino]
    return list(found.values())


def record_start(rank: int) -> None:
    """Leave this rank's start record in the job's folder (``DTENSOR_LAUNCH_DIR``): its
    pid, host and the shared-memory files it maps (its MPI library's). **Local**; call it
    once MPI has started, before the program runs."""
    _record(f"rank-{rank}.json", {"pid": os.getpid(), "host": socket.gethostname(),
                                  "shm": _mapped_shared_files()})


def record_exit(rank: int, status: int) -> None:
    """Leave this rank's exit record (the status it ends with) in the job's folder.
    **Local**."""
    _record(f"exit-{rank}.json", {"pid": os.getpid(), "status": status})


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the frames of this bootstrap and of runpy."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_globals is globals() or tb.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _exit_status(code: object) -> int:
    """The process exit status that ``sys.exit(code)`` produces: 0 for None and 0, an int
    clamped to 1-255 (the status has 8 bits: 256 would read as 0, -1 as 255), 1 for any
    other object (printed, as Python does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return 0 if code == 0 else min(max(code, 1), 255)
    print(code, file=sys.stderr)
    return 1


def _end_job(comm: Any, status: int) -> None:
    record_exit(comm.Get_rank(), status)
    sys.stdout.flush()
    sys.stderr.flush()
    if status != 0 and comm.Get_size() > 1:
        # let the process manager forward this rank's report before the abort ends the job
        time.sleep(0.5)
        comm.Abort(status)
    sys.exit(status)


def _run(target: Sequence[str]) -> None:
    if target[0] == "-m":
        module, args = target[1], target[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = target[0], target[1:]
        sys.argv = [script, *args]
        # As `python script.py` does: the script's folder replaces the current one.
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the target of this rank and end the job on failure.

    **Collective** on failure (``MPI_Abort`` of ``COMM_WORLD``); otherwise whatever the
    target does.

    Parameters
    ----------
    argv : sequence of str, optional
        ``[script, *args]`` or ``["-m", module, *args]``; default ``sys.argv[1:]``.
    """
    target = list(sys.argv[1:] if argv is None else argv)
    if not target or target == ["-m"]:
        sys.exit("usage: python -m launch._rank (script.py | -m module) [args...]")
    die_with_parent()
    from mpi4py import MPI  # lazy: MPI starts only once the rank dies with its parent

    comm = MPI.COMM_WORLD
    record_start(comm.Get_rank())
    # Whole lines, written as they come: output of the ranks interleaves by line only.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        _run(target)
    except SystemExit as exc:
        _end_job(comm, _exit_status(exc.code))
    except BaseException as exc:  # noqa: BLE001 - any failure (Ctrl-C too) ends the job
        prefix = f"[rank {comm.Get_rank()}] "
        text = _user_traceback(exc)
        sys.stderr.write("".join(prefix + line + "\n" for line in text.splitlines()))
        _end_job(comm, 1)


if __name__ == "__main__":
    main()
