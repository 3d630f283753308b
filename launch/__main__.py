"""Command line of the launcher: ``python -m launch`` (also installed as ``dtensor-run``).

This module owns parsing the launcher's own options, which end at the script (or at
``-m module``, or at ``--``); everything after that belongs to the program.
``python -m launch test`` runs the test suite (:mod:`launch.runtests`),
``python -m launch mutate`` checks that the suite catches wrong sharding rules and wrong
redistribute plans (:mod:`launch.mutate`) and ``python -m launch --info`` describes the MPI,
GPU and fast-path setup (:mod:`launch._info`).

Beyond one machine, MPI is the engine:

- hosts: ``--hosts a,b`` or ``--hostfile FILE`` are translated for the mpiexec in use
  (Hydra's ``-hosts``/``-f``, Open MPI's ``--host``/``--hostfile``); any other mpiexec option
  goes through ``--mpiexec-arg=OPT`` (repeatable);
- a system MPI: build mpi4py against it (``pip install --no-binary mpi4py mpi4py`` with its
  ``mpicc`` on ``PATH``) and point the launcher at its mpiexec with ``DTENSOR_MPIEXEC`` or
  ``--mpiexec``; ``--info`` shows which library mpi4py loaded;
- without the launcher: ``srun python prog.py`` or ``mpiexec -n 8 python prog.py`` runs a
  dtensor program like any mpi4py program (set ``OMP_NUM_THREADS=1`` yourself; to get the
  abort-on-failure behaviour run ``python -m launch._rank prog.py`` under them).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from ._mpiexec import JobInterrupted, find_mpiexec, host_args, job_command, rank_env, run_job

__all__ = ["main"]

USAGE = """\
python -m launch [-n N] [--mesh 2x2] [--timeout S] [options] script.py [args...]
       python -m launch [-n N] [--mesh 2x2] [--timeout S] [options] -m module [args...]
       python -m launch --info
       python -m launch test [--quick] [--ranks 1,2,3,4] [-k EXPR] [--timeout S]
       python -m launch mutate [--list] [--only NAME...] [--family F] [--timeout S]"""

# Launcher options that take a value: the value is not the start of the program's part.
_VALUE_OPTIONS = (
    "-n",
    "-np",
    "--mesh",
    "--timeout",
    "--mpiexec",
    "--hosts",
    "--hostfile",
    "--mpiexec-arg",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch",
        usage=USAGE,
        description="Run a Python program on N MPI ranks with the mpiexec of the MPI that "
        "mpi4py loads. When a rank raises, its traceback is printed and the whole job is "
        "aborted; the job's exit status is forwarded. Options for mpiexec that the "
        "launcher does not know go through --mpiexec-arg.",
    )
    p.add_argument(
        "--info",
        action="store_true",
        help="print the MPI library and version, CUDA-awareness, cupy/GPU presence and "
        "whether the compiled fast path is built, then exit",
    )
    p.add_argument(
        "-n",
        "-np",
        dest="nprocs",
        type=int,
        default=None,
        metavar="N",
        help="number of ranks (default: the product of --mesh, else 1)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="SHAPE",
        help="default mesh shape such as 2x2, exported as DTENSOR_MESH for "
        "dt.init_device_mesh() without a shape; -n defaults to its product",
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


def _mesh_shape(parser: argparse.ArgumentParser, text: str | None) -> tuple[int, ...]:
    """The ``--mesh`` shape (``2x2``, ``4``, ``2,2``); ``()`` when not given."""
    if text is None:
        return ()
    try:
        shape = tuple(int(p) for p in text.lower().replace(",", "x").split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        parser.error(f"--mesh must look like 2x2 (positive sizes), got {text!r}")
    return shape


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
        from . import runtests  # lazy: the launcher of a job imports no test machinery

        return runtests.main(args_in[1:])
    if args_in[:1] == ["mutate"]:
        from . import mutate  # lazy: the launcher of a job imports no test machinery

        return mutate.main(args_in[1:])
    parser = _parser()
    own, program = _split(args_in)
    opts = parser.parse_args(own)
    if opts.info:
        # lazy: only --info initialises MPI in the launcher's own process
        from ._info import collect_info, fastpath_off_by_accident, format_info

        print(format_info(collect_info()))
        problem = fastpath_off_by_accident()
        if problem is not None:
            bar = "!" * 79
            print(f"{bar}\n{problem}\n{bar}", file=sys.stderr)
        return 0
    mesh_shape = _mesh_shape(parser, opts.mesh)
    if opts.nprocs is None:
        opts.nprocs = math.prod(mesh_shape) if mesh_shape else 1
    if mesh_shape and math.prod(mesh_shape) != opts.nprocs:
        parser.error(
            f"--mesh {opts.mesh} needs {math.prod(mesh_shape)} ranks but -n is {opts.nprocs}"
        )
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
    overrides = {"DTENSOR_MESH": "x".join(map(str, mesh_shape))} if mesh_shape else {}
    try:
        return run_job(cmd, env=rank_env(**overrides), timeout=opts.timeout)
    except JobInterrupted as exc:  # the job is dead already
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
