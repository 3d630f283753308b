"""``python -m launch._cputime FILE CMD [ARG...]``: run a command and write its CPU time.

Runs ``CMD`` (its output goes where this process's goes), then writes to ``FILE`` the CPU
seconds, user plus system, of ``CMD`` and of every process it and its descendants waited
for (an ``mpiexec`` job: the launcher, its proxies and every rank), and exits with ``CMD``'s
status (``128 + s`` when a signal ``s`` ended it). The test runner (``python -m launch
test``) wraps each stage in it for its summary's ``cpu`` column: the CPU time of a process's
descendants reaches only their parent, and the runner, which runs stages side by side in
threads, cannot tell its children's apart. A signal that ends this process ends the command
too (they share a process group), and nothing is written.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command, write its CPU seconds, return its exit status. **Local**."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        sys.stderr.write("usage: python -m launch._cputime FILE CMD [ARG...]\n")
        return 2
    path, cmd = args[0], args[1:]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    rc = subprocess.call(cmd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(path, "w") as out:
        out.write(f"{cpu:.3f}\n")
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # end like the command, no traceback
    sys.exit(main())
