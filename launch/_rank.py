"""Per-rank bootstrap: ``python -m launch._rank (script.py | -m module) [args...]``.

This module owns what one rank of a launched job does around the user's program: run it
as ``__main__`` (like ``python script.py`` / ``python -m module``), and when it fails on
one rank, end the whole job at once instead of leaving the other ranks blocked in a
collective. Output is line-buffered, so lines of different ranks do not mix and
show up while the job runs. An uncaught exception prints its traceback once, each line prefixed with
``[rank R]``, and aborts the job with exit status 1; ``sys.exit(code)`` with a non-zero
code on any rank of a multi-rank job aborts it with that code.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from types import TracebackType

from mpi4py import MPI

__all__ = ["main"]


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the frames of this bootstrap and of runpy."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_globals is globals() or tb.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _exit_status(code: object) -> int:
    """The process exit status that ``sys.exit(code)`` produces."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _end_job(comm: MPI.Comm, status: int) -> None:
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
    comm = MPI.COMM_WORLD
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
