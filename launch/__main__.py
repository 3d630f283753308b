"""Command line of the launcher: ``python -m launch`` (also installed as ``dtensor-run``).

This module owns parsing the launcher's own options, which end at the script (or at
``-m module``); everything after that belongs to the program. ``python -m launch test``
runs the test suite (:mod:`launch.runtests`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._mpiexec import find_mpiexec, host_args, job_command, rank_env, run_job

__all__ = ["main"]

USAGE = """\
python -m launch [-n N] [--timeout S] [options] script.py [args...]
       python -m launch [-n N] [--timeout S] [options] -m module [args...]
       python -m launch test [--quick] [--ranks 1,2,3,4] [-k EXPR] [--timeout S]"""

# Launcher options that take a value: the value is not the start of the program's part.
_VALUE_OPTIONS = ("-n", "-np", "--timeout", "--mpiexec", "--hosts", "--hostfile", "--mpiexec-arg")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch",
        usage=USAGE,
        description="Run a Python program on N MPI ranks with the mpiexec of the MPI that "
        "mpi4py loads. When a rank raises, its traceback is printed and the whole job is "
        "aborted; the job's exit status is forwarded.",
    )
    p.add_argument(
        "-n",
        "-np",
        dest="nprocs",
        type=int,
        default=1,
        metavar="N",
        help="number of ranks (default 1)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="kill the whole job after S seconds and exit with status 124 (default: no limit)",
    )
    p.add_argument(
        "--mpiexec",
        default=None,
        metavar="PATH",
        help="mpiexec to use (default: $DTENSOR_MPIEXEC, else the one next to "
        "this Python, else PATH)",
    )
    p.add_argument(
        "--hosts",
        default=None,
        metavar="H1,H2,...",
        help="comma-separated hosts, passed to mpiexec",
    )
    p.add_argument("--hostfile", default=None, metavar="FILE", help="host file, passed to mpiexec")
    p.add_argument(
        "--mpiexec-arg",
        dest="mpiexec_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra option for mpiexec (repeat for several)",
    )
    p.add_argument(
        "-m",
        dest="module",
        default=None,
        metavar="MODULE",
        help="run a module as __main__ (like python -m)",
    )
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's options and the program's ``[script, *args]``."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if token == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not token.startswith("-") or token == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if token in _VALUE_OPTIONS else 1
    return list(argv), []


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher and return the job's exit status.

    **Local** (it starts an MPI job of ``-n`` ranks and waits for it).

    Parameters
    ----------
    argv : sequence of str, optional
        The command line without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The job's exit status: the failing rank's status when a rank failed, 124 on
        timeout, 2 for a bad command line.
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["test"]:
        from . import runtests

        return runtests.main(args_in[1:])
    parser = _parser()
    own, program = _split(args_in)
    opts = parser.parse_args(own)
    if opts.module is not None:
        target = ["-m", opts.module, *program]
    elif program:
        target = program
        if not os.path.exists(target[0]):
            parser.error(f"script not found: {target[0]}")
    else:
        parser.error("give a script or -m module to run")
    if opts.nprocs < 1:
        parser.error(f"-n must be at least 1, got {opts.nprocs}")
    if opts.timeout is not None and opts.timeout <= 0:
        parser.error(f"--timeout must be positive, got {opts.timeout:g}")
    try:
        mpiexec = find_mpiexec(opts.mpiexec)
        extra = host_args(mpiexec, opts.hosts, opts.hostfile) + opts.mpiexec_args
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    cmd = job_command(mpiexec, opts.nprocs, target, extra)
    return run_job(cmd, env=rank_env(), timeout=opts.timeout)


if __name__ == "__main__":
    sys.exit(main())
