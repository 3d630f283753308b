"""The collective watchdog (``DTENSOR_WATCHDOG=seconds`` or :func:`set_watchdog`; off by
default).

This module owns the watchdog: each blocking collective records its start time and
fingerprint in a per-process slot (:func:`redistribute.comm.spmd.enter`); a daemon thread
reports to stderr a collective that has not returned after the timeout (kind,
communicator, mesh dim, fingerprint, how long) together with the state of the other ranks
on this node, which each watchdog thread writes to a small file (mode 0600, never through a
symlink) in a private per-job folder (:func:`job_dir`: ``DTENSOR_WATCHDOG_DIR``, which
``python -m launch`` sets; else a folder of this user, mode 0700, under the temporary
directory, refused when someone else made it); ``DTENSOR_WATCHDOG_ABORT=1`` then aborts
the job. The running watchdog is :data:`redistribute.comm.hooks.HOOKS` ``.watchdog``.
"""

from __future__ import annotations

import atexit
import os
import stat
import sys
import tempfile
import threading
import time
from typing import Any

from mpi4py import MPI

from placements.env import env_flag, env_seconds
from placements.errors import ConfigError

from .hooks import HOOKS, update
from .spmd import fingerprint, members

__all__ = ["job_dir", "read_env", "set_watchdog"]


def job_dir() -> str:
    """The folder of this job's watchdog state on this node, shared by its ranks there.
    **Local**.

    ``DTENSOR_WATCHDOG_DIR`` when set (``python -m launch`` sets it to a private folder
    it makes for the job and removes when the job ends); otherwise a folder of this user
    under the temporary directory, named after the Slurm job step or after the process that
    started the ranks of this node.
    """
    env = os.environ
    explicit = env.get("DTENSOR_WATCHDOG_DIR")
    if explicit:
        return explicit
    if "SLURM_JOB_ID" in env:
        key = f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    else:  # ranks started by one mpiexec proxy on this node share their parent process
        key = f"ppid-{os.getppid()}"
    return os.path.join(tempfile.gettempdir(), f"dtensor-watchdog-{os.geteuid()}-{key}")


def _private_dir(path: str) -> str:
    """``path``, made a folder with mode 0700 when missing, after checking that only this
    user can change it: not a symlink, owned by this user, closed to everyone else.

    Raises
    ------
    ConfigError
        When ``path`` cannot be made or fails the check (someone else made it, maybe to
        make this job write through a link planted in it).
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"watchdog: cannot make its state folder {path}: {exc}") from None
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    else:
        return path
    raise ConfigError(
        f"watchdog: its state folder {path} {problem}; refusing to use it. Remove it, or "
        "set DTENSOR_WATCHDOG_DIR to a folder of yours with mode 0700"
    )


class _Watchdog:
    """The watchdog's state and its daemon thread (one per process)."""

    def __init__(self, timeout: float, abort: bool, from_env: bool) -> None:
        self.timeout, self.abort, self.from_env = timeout, abort, from_env
        # (seq, start time, kind, fingerprint tuple, world ranks of the communicator) or None
        self.slot: tuple | None = None
        self.seq = 0
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.dir = _private_dir(job_dir())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dtensor-watchdog", daemon=True)
        self.thread.start()

    def enter(self, comm: Any, kind: str, fp: tuple) -> None:
        self.seq += 1
        self.slot = (self.seq, time.monotonic(), kind, fp, members(comm))

    def close(self) -> None:
        """Stop the thread and remove this rank's state file."""
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)  # no state write after the removal
        for remove, path in ((os.remove, self._state_path(self.rank)), (os.rmdir, self.dir)):
            try:  # the state file, then the folder if this rank is the last to leave
                remove(path)
            except OSError:
                pass

    def _state_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}")

    def _write_state(self, slot: tuple | None) -> None:
        now = time.time()
        if slot is None:
            line = f"idle {now}"
        else:
            line = f"in {now - (time.monotonic() - slot[1])} {fingerprint(slot[3])}"
        # a new file of a random name (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600), renamed
        # over the state file: a link planted in the folder is never written through
        fd, tmp = tempfile.mkstemp(prefix=f"rank{self.rank}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(line)
            os.replace(tmp, self._state_path(self.rank))
        except OSError:
            os.unlink(tmp)
            raise

    def _peer_states(self, ranks: list[int]) -> list[str]:
        lines, now = [], time.time()
        for r in ranks:
            if r == self.rank:
                continue
            try:
                fd = os.open(self._state_path(r), os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd) as f:
                    state = f.read()
            except OSError:
                lines.append(f"  world rank {r}: no state (not on this node, or no watchdog)")
                continue
            head, _, rest = state.partition(" ")
            stamp, _, text = rest.partition(" ")
            if head == "in":
                lines.append(f"  world rank {r}: in {text} for {now - float(stamp):.1f} s")
            else:
                lines.append(f"  world rank {r}: not in a dtensor collective")
        return lines

    def _report(self, slot: tuple) -> None:
        _, start, kind, fp, ranks = slot
        waited = time.monotonic() - start
        lines = [
            (
                f"[dtensor watchdog] world rank {self.rank} (pid {os.getpid()}): stuck for "
                f"{waited:.1f} s (timeout {self.timeout:g} s) in {kind}: {fingerprint(fp)}; "
                f"communicator of world ranks {ranks}. Other ranks of that communicator:"
            ),
            *self._peer_states(ranks),
        ]
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        if self.abort:
            sys.stderr.write(f"[dtensor watchdog] world rank {self.rank}: aborting the job\n")
            sys.stderr.flush()
            # let the process manager forward the report before the abort kills the job
            time.sleep(1.0)
            MPI.COMM_WORLD.Abort(1)

    def _loop(self) -> None:
        tick = min(0.5, self.timeout / 4)
        written, reported = -1, -1
        while not self.stop.wait(tick):
            slot = self.slot
            seq = 0 if slot is None else slot[0]
            if seq != written:
                try:
                    self._write_state(slot)
                    written = seq
                except OSError:
                    pass
            late = slot is not None and time.monotonic() - slot[1] > self.timeout
            if late and seq != reported:
                reported = seq
                self._report(slot)


@atexit.register
def _close_watchdog() -> None:
    if HOOKS.watchdog is not None:
        HOOKS.watchdog.close()


def set_watchdog(seconds: float | None, abort: bool = False, *, from_env: bool = False) -> None:
    """Start (or stop, with ``seconds=None``) the collective watchdog. **Local**.

    Parameters
    ----------
    seconds : float or None
        Report a collective of this process that has not returned after this many seconds.
    abort : bool
        After the report, abort the whole job (``MPI_Abort``).
    from_env : bool
        Whether the setting comes from the environment (a later :func:`read_env` may then
        turn it off).

    Raises
    ------
    ConfigError
        If ``seconds`` is not positive, or the folder for the watchdog's state (see
        :func:`job_dir`) is refused: a symlink, someone else's, or open to other users.
        The watchdog is then off.
    """
    if seconds is not None and not seconds > 0:
        raise ConfigError(f"set_watchdog: the timeout must be > 0 seconds, got {seconds!r}")
    if HOOKS.watchdog is not None:
        HOOKS.watchdog.close()
        update(watchdog=None)
    if seconds is not None:
        update(watchdog=_Watchdog(float(seconds), bool(abort), from_env))


def read_env() -> None:
    """Start, change or stop the watchdog from ``DTENSOR_WATCHDOG`` (a timeout in seconds;
    unset, empty or 0: off) and ``DTENSOR_WATCHDOG_ABORT``. **Local**.

    A watchdog started by :func:`set_watchdog` (not from the environment) is kept when the
    variable is off.

    Raises
    ------
    ConfigError
        ``DTENSOR_WATCHDOG`` is not a number of seconds, or the watchdog's folder is refused.
    """
    seconds = env_seconds("DTENSOR_WATCHDOG") or 0.0
    abort = env_flag("DTENSOR_WATCHDOG_ABORT")
    current = HOOKS.watchdog
    same = current is not None and (current.timeout, current.abort) == (seconds, abort)
    if not same and (seconds > 0 or current is not None and current.from_env):
        set_watchdog(seconds or None, abort, from_env=True)
