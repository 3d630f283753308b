"""Finding and running ``mpiexec``: the launcher's process handling.

This module owns the choice of ``mpiexec`` (the one of the MPI that mpi4py loads), the
environment given to the ranks, the command line of a job and running that command: with
a timeout that kills the whole process group, tied to the launcher's life (the job dies
with it, even by SIGKILL), in a private folder made for the job and removed after it, and
with the exit status of a rank killed by a signal reported as ``128 + signal``. It uses
the standard library only and never initialises MPI.

Every process of a job carries the job's token in ``DTENSOR_JOB_TOKENS`` (a nested job
adds its own), so that once the job ends, however it ends, the launcher ends whatever
still runs with it (on Linux, read from ``/proc``): the ranks of a proxy that died, the
processes a rank started in a session of its own. Each job's folder holds a lock held by
its launcher for the job's life; a launcher that starts removes the folders of earlier
launchers that died without removing theirs (SIGKILL), never one whose lock is held. The
ranks leave records there (:func:`launch._rank.record_start`, :func:`launch._rank.
record_exit`), from which a signal that Hydra reports is checked against the rank it names
(a program can print Hydra's words; it cannot fake a rank that never ended through the
bootstrap), and the shared-memory files of the ranks' MPI library that an aborted job
leaves in ``/dev/shm`` are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from ._rank import LAUNCH_DIR_VAR

try:
    import fcntl
except ImportError:  # not on POSIX: no locks, dead folders are left alone
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "JOB_DIR_VAR",
    "JOB_TOKENS_VAR",
    "LAUNCH_DIR_VAR",
    "TIMEOUT_EXIT_CODE",
    "JobInterrupted",
    "find_mpiexec",
    "host_args",
    "interruptible",
    "job_command",
    "rank_env",
    "run_job",
    "stop_job",
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

#: The variable that gives the ranks of a job their private folder (the watchdog keeps its
#: state there, see :mod:`redistribute.comm`).
JOB_DIR_VAR = "DTENSOR_WATCHDOG_DIR"

#: The variable that lists the tokens of the jobs a process belongs to (``:``-separated).
JOB_TOKENS_VAR = "DTENSOR_JOB_TOKENS"
#: Name prefix of the jobs' private folders (in the temporary folder).
_JOB_PREFIX = "dtensor-job-"
#: The lock file of a job's folder, held by its launcher while the job runs.
_LOCK = "lock"

_KILL_GRACE_S = 5.0
#: How long the output relay may take to drain once ``mpiexec`` has ended.
_DRAIN_S = 5.0
#: ``prctl`` option: the signal a process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1
#: Hydra's last lines when a rank was killed by a signal (its exit status is then the bare
#: signal number, the same as an ``exit(n)``): only the end of the output is matched.
_HYDRA_SIGNALED = re.compile(
    rb"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: [^\n]*\(signal (\d+)\)\r?\n"
    rb"This typically refers to a problem with your application\.\r?\n"
    rb"Please see the FAQ page for debugging suggestions\r?\n?\Z"
)
#: The process Hydra's report names (``PID 123 RUNNING AT host``).
_HYDRA_PID = re.compile(rb"=\s+PID (\d+) RUNNING AT (\S+)")


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


class JobInterrupted(Exception):
    """This process received SIGINT, SIGTERM or SIGHUP: the job it ran (if any) was killed,
    its whole process group, and the caller should stop (exit status :attr:`status`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def status(self) -> int:
        """``128 + signal``: the exit status of a process ended by the signal."""
        return 128 + self.signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise JobInterrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`JobInterrupted` (SIGINT raises
    KeyboardInterrupt as always); the previous handlers come back after it. **Local**.

    Only the main thread can set signal handlers: elsewhere the block changes nothing.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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


class _Relay(threading.Thread):
    """Copies the job's output to file descriptor ``out`` (default this process's stdout) as
    it comes, keeping the last few KiB for :func:`_signal_of`; a closed reader (a broken
    pipe) does not stop the draining."""

    TAIL = 4096

    def __init__(self, pipe: int, out: int = 1) -> None:
        super().__init__(name="launch-stdout", daemon=True)
        self.pipe, self.out, self.tail, self.open = pipe, out, b"", True

    def run(self) -> None:
        while chunk := os.read(self.pipe, 65536):
            self.tail = (self.tail + chunk)[-self.TAIL :]
            view = memoryview(chunk)
            while self.open and view:
                try:
                    view = view[os.write(self.out, view) :]
                except OSError:
                    self.open = False
        os.close(self.pipe)


def _records(folder: str) -> tuple[dict[int, dict], dict[int, dict]]:
    """The ranks' start and exit records in a job's folder (by world rank)."""
    starts: dict[int, dict] = {}
    exits: dict[int, dict] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return starts, exits
    for name in names:
        kind, _, rest = name.partition("-")
        if kind not in ("rank", "exit") or not rest.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name), "rb") as f:
                record = json.loads(f.read(1 << 20))
            rank = int(rest[: -len(".json")])
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            (starts if kind == "rank" else exits)[rank] = record
    return starts, exits


def _signal_of(output_tail: bytes, starts: Mapping[int, dict] | None = None,
               exits: Mapping[int, dict] | None = None) -> int | None:
    """The signal that killed a rank, from the end of Hydra's output; None when none did.

    Hydra's words are believed only where the ranks' records (``starts``, ``exits``) cannot
    contradict them: a report that names a process of this host that is no rank of the job,
    or a rank that ended through the bootstrap (its exit record), is a program's output.
    Without records (not run by :func:`run_job`, or ranks on other hosts) the words stand.
    """
    found = _HYDRA_SIGNALED.search(output_tail)
    if found is None:
        return None
    signum = int(found.group(1))
    if not starts:
        return signum
    here = socket.gethostname()
    ours = {int(r.get("pid", -1)): rank for rank, r in starts.items() if r.get("host") == here}
    named = _HYDRA_PID.findall(output_tail[: found.start()])
    if not named:
        return signum if any(rank not in (exits or {}) for rank in starts) else None
    pid, host = int(named[-1][0]), named[-1][1].decode(errors="replace")
    if pid in ours:
        return None if ours[pid] in (exits or {}) else signum
    if host.split(".")[0] != here.split(".")[0]:
        return signum  # a rank on another host: nothing here to check it against
    return None


def _clear_dead_job_dirs(base: str) -> None:
    """Remove the folders that launchers which died (SIGKILL) left in ``base``: this user's
    ``dtensor-job-*`` folders whose lock no process holds. A folder without a lock (being
    made, or of another version) and one whose lock is held are left alone."""
    if fcntl is None:
        return
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(_JOB_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(os.path.join(entry.path, _LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live job
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _make_job_dir() -> tuple[str, int | None]:
    """A private folder (0700) for one job, with its lock held: ``(path, lock fd)``. The
    lock is taken before its file gets its name, so no other launcher sees it free."""
    folder = tempfile.mkdtemp(prefix=_JOB_PREFIX)
    if fcntl is None:
        return folder, None
    tmp = os.path.join(folder, f"{_LOCK}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(tmp, os.path.join(folder, _LOCK))
    except BaseException:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, fd


def _job_processes(token: str) -> list[int]:
    """The pids of this user's processes whose environment lists job ``token`` (Linux:
    read from ``/proc``; none elsewhere), this process excepted."""
    mark = token.encode()
    me = os.getpid()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's
            continue
        for item in env.split(b"\0"):
            if item.startswith(JOB_TOKENS_VAR.encode() + b"=") and mark in item.split(b"=", 1)[
                    1].split(b":"):
                found.append(int(name))
                break
    return found


def _end_job_processes(token: str) -> None:
    """SIGKILL every process still carrying job ``token`` (rounds until none is left, as a
    process may start another meanwhile; a few at most)."""
    for _ in range(10):
        pids = _job_processes(token)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _remove_shared_leftovers(starts: Mapping[int, dict]) -> None:
    """Unlink the /dev/shm files that the job's ranks on this host mapped at start (their
    MPI library's segments) and that are still there, the same files (device and inode):
    an aborted job leaves them, unmapped, for good."""
    here = socket.gethostname()
    for record in starts.values():
        if record.get("host") != here:
            continue
        for item in record.get("shm") or ():
            try:
                path, dev, ino = str(item[0]), int(item[1]), int(item[2])
                if not path.startswith("/dev/shm/") or "/" in path[len("/dev/shm/"):]:
                    continue
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(path)
            except (OSError, ValueError, TypeError, IndexError):
                continue


def _die_with_this_thread() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the launching thread ends,
    the launcher killed by SIGKILL included (Linux's parent-death signal); None elsewhere.

    ``mpiexec`` killed this way takes its ranks with it: its process-manager proxies kill
    them when their connection to it drops (Hydra and Open MPI do).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def run_job(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    output: IO[bytes] | None = None,
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> int:
    """Run ``cmd`` in its own process group and return its exit status.

    **Local** (from the caller's side; the command itself may be an MPI job). The job's
    output goes to this process's stdout/stderr as it comes or, with ``output`` (a file open
    for binary writing), stdout and stderr both go to that file. When ``timeout`` seconds pass,
    the whole process group (``mpiexec`` and every rank it started) gets SIGTERM, then
    SIGKILL, and the result is ``TIMEOUT_EXIT_CODE`` (124). Ctrl-C (SIGINT), SIGTERM and
    SIGHUP sent to this process while the job runs end the whole group the same way (SIGINT
    or SIGTERM first), then raise :class:`JobInterrupted`, so that a caller running several
    jobs stops instead of starting the next; on Linux the job also dies when this process is
    killed outright (SIGKILL), or when the calling thread ends. When the job has ended,
    however it ended, every process still carrying its token (see the module docstring)
    is killed: ranks orphaned by a dead proxy, processes a rank started elsewhere. The job
    gets a private folder (mode 0700) in ``$DTENSOR_LAUNCH_DIR`` (and
    ``$DTENSOR_WATCHDOG_DIR`` unless ``env`` names one already), removed when the job
    ends, however it ends, together with the MPI library's shared-memory files the ranks
    left; the folders of earlier launchers that died are removed first. ``started`` gets
    the job's process as soon as it runs (another thread may then end the job early with
    :func:`stop_job`).

    Returns
    -------
    int
        The exit status; a job killed by signal ``s``, or whose rank was (as Hydra's
        ``mpiexec`` reports it, with a message naming the signal, checked against the
        ranks' records), gives ``128 + s``.

    Raises
    ------
    JobInterrupted
        This process received SIGINT, SIGTERM or SIGHUP while the job ran (the job was
        killed); its ``status`` is ``128 + signal``.
    """
    job_env = dict(os.environ if env is None else env)
    _clear_dead_job_dirs(tempfile.gettempdir())
    made, lock = _make_job_dir()
    token = secrets.token_hex(8)
    job_env[LAUNCH_DIR_VAR] = made
    if not job_env.get(JOB_DIR_VAR):
        job_env[JOB_DIR_VAR] = made
    job_env[JOB_TOKENS_VAR] = ":".join(filter(None, (job_env.get(JOB_TOKENS_VAR), token)))
    try:
        return _run(cmd, job_env, cwd, timeout, output, started, made)
    finally:
        _end_job_processes(token)
        _remove_shared_leftovers(_records(made)[0])
        shutil.rmtree(made, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def stop_job(proc: subprocess.Popen[bytes]) -> None:
    """End a job that :func:`run_job` started (its process from ``started``): SIGTERM to
    its whole process group, then SIGKILL after a grace period. **Local**."""
    _kill_group(proc, signal.SIGTERM)


def _run(
    cmd: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None,
    timeout: float | None,
    output: IO[bytes] | None = None,
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
    folder: str | None = None,
) -> int:
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            list(cmd),
            env=dict(env),
            cwd=cwd,
            stdout=write_end,
            stderr=None if output is None else write_end,
            start_new_session=True,
            # runs between fork and exec: one libc call looked up beforehand, no import,
            # no lock of this process taken, so the other threads (the relays) are no risk
            preexec_fn=_die_with_this_thread(),  # noqa: PLW1509
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    relay = _Relay(read_end, 1 if output is None else output.fileno())
    relay.start()
    if started is not None:
        started(proc)
    try:
        with interruptible():
            rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"launch: the job ran past its timeout of {timeout:g} s; killing it\n")
        sys.stderr.flush()
        _kill_group(proc, signal.SIGTERM)
        return TIMEOUT_EXIT_CODE
    except KeyboardInterrupt:
        _kill_group(proc, signal.SIGINT)
        raise JobInterrupted(signal.SIGINT) from None
    except JobInterrupted:
        _kill_group(proc, signal.SIGTERM)
        raise
    finally:
        relay.join(_DRAIN_S)
    if rc < 0:
        return 128 - rc
    signum = None
    if rc != 0:
        starts, exits = _records(folder) if folder is not None else ({}, {})
        signum = _signal_of(relay.tail, starts, exits)
    if signum is None:
        return rc
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "an unknown signal"
    sys.stderr.write(
        f"launch: a rank was killed by signal {signum} ({name}); exit status "
        f"{128 + signum} (128 + signal)\n"
    )
    sys.stderr.flush()
    return 128 + signum
