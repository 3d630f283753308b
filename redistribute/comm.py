"""MPI communicators for dtensor: with :mod:`redistribute.fileio` (MPI-IO files), the only
library modules that import mpi4py.

This module owns:

- :class:`Comm`, a thin wrapper over an mpi4py communicator whose methods move data with
  the *buffer-based* collectives only (``Allgatherv``, ``Allreduce``, ``Reduce_scatter``,
  ``Alltoallv``/``Alltoallw``, ``Scatterv``, ``Bcast``); the pickling lower-case calls are
  never used for data. Data movement is dtype-agnostic (buffers travel as bytes);
  reductions are typed.
- the mapping of reduce ops (``sum``, ``avg``, ``max``, ``min``, ``prod``) to MPI ops;
- derived datatypes that describe a strided block of a C-contiguous buffer
  (:func:`block_type`, :func:`free_types`), so received data lands in place;
- :func:`world`, :func:`world_ranks`, and the communicators of mesh dims:
  :func:`shared_mesh_comms` (what ``DeviceMesh`` uses: one communicator per distinct group
  of world ranks, shared by every mesh that asks for it and kept until exit, so identical
  meshes create no communicator; mesh creation starts with one all-gather in which the
  ranks agree on the grid, on those cache decisions and on the settings that decide which
  collectives run) and :func:`make_mesh_comms` (new communicators the caller owns);
- the observer registry of the communication debug mode (:func:`add_observer`);
- persistent all-gathers (MPI 4 ``Allgather_init``/``Allgatherv_init``,
  :class:`PersistentGather`): each communicator keeps a pool of them keyed by the byte
  counts per rank, made in the same order on every rank (their initialisation is a
  collective), kept oldest-made-first-out, and freed when dropped, when the communicator
  is freed and at exit (before MPI finalizes); off by default (on this machine an 8x8
  all-gather measured no faster persistent than blocking), ``DTENSOR_PERSISTENT=1`` or
  :func:`set_persistent` turns them on;
- :func:`request_c_api`: the MPI library's ``MPI_Start``/``MPI_Wait`` and mpi4py's
  request accessor, with which compiled code runs a persistent request without Python calls;
- the private duplicate of a communicator that asynchronous redistributes run on
  (:meth:`Comm.twin`), so that their collectives never meet the caller's in matching, and
  the nonblocking forms of the data collectives (``start=True``: ``Iallgather(v)``,
  ``Iallreduce``, ``Ireduce_scatter(_block)``, ``Ialltoallw``), which return their request
  (:mod:`redistribute.worker` completes them);
- two debug checks around every collective, both off by default (then their cost is one
  falsy check per collective):

  * the SPMD divergence check (``DTENSOR_CHECK_SPMD=1`` or :func:`set_check_spmd`): before
    each collective the ranks of its communicator agree on a *fingerprint* (kind, the op
    being dispatched, the caller's description ``what=``, the rank-invariant arguments such
    as counts, dtype and reduce op, and a per-communicator call counter). Each rank sends
    its fingerprint (text and a 64-bit hash of it) to the other ranks of the communicator,
    point to point over a private duplicate of ``COMM_WORLD``, and compares theirs; on a
    mismatch every rank raises :class:`CommError` showing its own and the others'
    fingerprints, instead of hanging or exchanging mismatched data. Between two ranks these
    messages form one ordered stream, whatever the communicator, so the exit of a
    ``dt.debug.check_spmd()`` block (:func:`leave_check_block`), which every rank announces
    to every other, is met by a rank still inside at its next checked collective, and both
    raise. The duplicate is made by the first checked point, a collective over
    ``COMM_WORLD``: with the check on, every rank of ``COMM_WORLD`` runs it.
  * the collective watchdog (``DTENSOR_WATCHDOG=seconds`` or :func:`set_watchdog`): each
    blocking collective records its start time and fingerprint in a per-process slot; a
    daemon thread reports to stderr a collective that has not returned after the timeout
    (kind, communicator, mesh dim, fingerprint, how long) together with the state of the
    other ranks on this node, which each watchdog thread writes to a small file (mode 0600,
    never through a symlink) in a private per-job folder (``DTENSOR_WATCHDOG_DIR``, which
    ``python -m launch`` sets; else a folder of this user, mode 0700, under the temporary
    directory, refused when someone else made it); ``DTENSOR_WATCHDOG_ABORT=1`` then
    aborts the job.

  Both settings are read from the environment at import and again at each mesh creation
  (:func:`make_mesh_comms`).

Counts and displacements of :class:`Comm` methods are in *elements* of the buffers' dtype,
except :meth:`Comm.alltoallw`, which follows MPI (counts in units of each datatype,
displacements in bytes).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import stat
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from placements.cache import LRUCache
from placements.env import env_flag, env_seconds
from placements.errors import CommError, ConfigError, DTypeError, MeshError

__all__ = [
    "BYTES",
    "REDUCE_OPS",
    "Comm",
    "PersistentGather",
    "add_observer",
    "block_type",
    "check_spmd_enabled",
    "configure_from_env",
    "cuda_aware",
    "free_types",
    "leave_check_block",
    "local_rank",
    "make_mesh_comms",
    "persistent_enabled",
    "remove_observer",
    "request_c_api",
    "set_check_spmd",
    "set_op_source",
    "set_persistent",
    "set_watchdog",
    "shared_mesh_comms",
    "thread_multiple",
    "world",
    "world_ranks",
]

BYTES = MPI.BYTE
"""The MPI datatype of raw bytes (a contiguous block of n bytes is ``n`` of these)."""

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")

# Observers of the communication debug mode, called as fn(kind, nbytes, comm) before a
# collective is issued. An empty list costs one falsy check per collective.
_observers: list[Callable[[str, int, Comm], None]] = []


def add_observer(fn: Callable[[str, int, Comm], None]) -> None:
    """Register ``fn(kind, nbytes, comm)``, called before every collective. **Local**.

    ``kind`` is one of ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"scatter"``, ``"broadcast"``, ``"barrier"`` and
    ``"all_gather_ints"`` (small metadata exchanges); ``nbytes`` is the larger of the bytes
    this rank passes into the collective and the bytes it gets out of it; ``comm`` is the
    :class:`Comm` the collective runs on (``comm.mesh_dim`` tells the mesh dim).
    """
    _observers.append(fn)


def remove_observer(fn: Callable[[str, int, Comm], None]) -> None:
    """Unregister an observer added with :func:`add_observer`. **Local**."""
    try:
        _observers.remove(fn)
    except ValueError:
        raise CommError(f"remove_observer: {fn!r} is not a registered observer") from None


def _notify(kind: str, nbytes: int, comm: Comm) -> None:
    for fn in tuple(_observers):
        fn(kind, int(nbytes), comm)


# -- debug checks: SPMD agreement and the collective watchdog -----------------------------

# True while the SPMD check or the watchdog is on: the one falsy check per collective.
_checks = False
_spmd_env = False  # DTENSOR_CHECK_SPMD
_spmd_forced: bool | None = None  # set_check_spmd; None follows the environment
_spmd = False
_FP_TEXT = 480  # bytes of fingerprint text sent to the peers (a hash covers the whole text)
_MSG = 9 + _FP_TEXT  # a check message: int64 hash, 1 if it announces a block exit, text
_HISTORY = 8  # fingerprints of this rank kept for the error message
_history: deque[tuple] = deque(maxlen=_HISTORY)
_counters: dict[int, int] = {}  # MPI communicator handle -> collectives checked on it
_members: dict[int, list[int]] = {}  # MPI communicator handle -> its ranks' COMM_WORLD ranks
# The private duplicate of COMM_WORLD that carries the check messages, made by the first
# checked point that has a peer.
_channel: Any = None
_me = 0  # this process's rank in COMM_WORLD, set with _channel
# World rank -> block exits of that rank met at a checked collective of this rank, each of
# which stands for that rank's side of this rank's next block exit.
_exits_met: dict[int, int] = {}
_LEAVE = "leave check_spmd block"


def _no_op() -> str | None:
    return None


_op_source: Callable[[], str | None] = _no_op


def set_op_source(fn: Callable[[], str | None] | None) -> None:
    """Register ``fn() -> op name or None``, asked for the op being dispatched. **Local**.

    The debug checks put that name into each collective's fingerprint (importing
    ``dtensor.debug`` registers the dispatcher's "current op"); ``None`` unregisters.
    """
    global _op_source
    _op_source = _no_op if fn is None else fn


def _update() -> None:
    global _spmd, _checks
    _spmd = _spmd_env if _spmd_forced is None else _spmd_forced
    _checks = _spmd or _watchdog is not None


def set_check_spmd(on: bool | None) -> bool | None:
    """Turn the SPMD divergence check on or off for this process. **Local**.

    Every rank of a communicator must have the same setting when it enters a collective
    (the check is itself a collective), so call this at the same point of the program on
    every rank. The call counter of a fingerprint counts the checked collectives of its
    communicator, so it stays equal across ranks that turn the check on together.

    Parameters
    ----------
    on : bool or None
        True or False forces the check; None follows ``DTENSOR_CHECK_SPMD``.

    Returns
    -------
    bool or None
        The previous forced setting (pass it back to restore).
    """
    global _spmd_forced
    prev, _spmd_forced = _spmd_forced, None if on is None else bool(on)
    _update()
    return prev


def check_spmd_enabled() -> bool:
    """Whether collectives check that all ranks agree before they run. **Local**."""
    return _spmd


def configure_from_env() -> None:
    """Read ``DTENSOR_CHECK_SPMD``, ``DTENSOR_PERSISTENT``, ``DTENSOR_WATCHDOG``,
    ``DTENSOR_WATCHDOG_ABORT``. **Local**.

    Called at import and at each mesh creation. ``DTENSOR_WATCHDOG`` is a timeout in
    seconds (unset, empty or 0: off); a forced SPMD setting (:func:`set_check_spmd`) wins
    over the environment.
    """
    global _spmd_env
    _spmd_env = env_flag("DTENSOR_CHECK_SPMD")
    _update_persistent()
    seconds = env_seconds("DTENSOR_WATCHDOG") or 0.0
    abort = env_flag("DTENSOR_WATCHDOG_ABORT")
    current = _watchdog
    same = current is not None and (current.timeout, current.abort) == (seconds, abort)
    if not same and (seconds > 0 or current is not None and current.from_env):
        set_watchdog(seconds or None, abort, from_env=True)
    else:
        _update()


def _render(what: object) -> str:
    if isinstance(what, tuple):
        return " ".join(str(w) for w in what)
    return str(what)


def _fingerprint(fp: tuple) -> str:
    """The text of a fingerprint tuple made by :func:`_enter`."""
    n, kind, what, op, detail, size, mesh_dim = fp
    parts = ([] if what is None else [_render(what)]) + ([] if op is None else [f"op {op}"])
    return (
        f"#{n} {kind} ({'; '.join([*parts, detail])}) on communicator size {size}, "
        f"mesh dim {mesh_dim}"
    )


def _enter(comm: Comm, kind: str, what: object, detail: str, wait: bool = True) -> None:
    """Start of a checked collective: fingerprint, watchdog slot, SPMD agreement.

    The fingerprint is kept as a tuple and only rendered as text for the SPMD check or a
    report, so the watchdog alone costs little. ``wait=False`` (only for a block exit)
    sends this rank's fingerprint without waiting for the others'.
    """
    key = comm.mpi.handle
    n = _counters.get(key, 0) + 1
    _counters[key] = n
    fp = (n, kind, what, _op_source(), detail, comm.size, comm.mesh_dim)
    if _watchdog is not None:
        _watchdog.enter(comm, kind, fp)
    if _spmd:
        try:
            _agree(comm, _fingerprint(fp), kind == _LEAVE, wait)
        except BaseException:
            _leave()
            raise
    _history.append(fp)


def _leave() -> None:
    if _watchdog is not None:
        _watchdog.slot = None


def _forget(_comm: Any, _keyval: int, key: int) -> None:
    _members.pop(key, None)


# Attached to each communicator whose ranks _members holds: freeing the communicator (by
# any means) drops the entry, since a later communicator may get its handle.
_MEMBERS_KEY = MPI.Comm.Create_keyval(delete_fn=_forget)


def _world_ranks(comm: Comm) -> list[int]:
    """The ``COMM_WORLD`` ranks of ``comm``'s ranks, in ``comm`` rank order (cached)."""
    key = comm.mpi.handle
    found = _members.get(key)
    if found is None:
        found = _members[key] = world_ranks(comm).tolist()
        comm.mpi.Set_attr(_MEMBERS_KEY, key)
    return found


def _message(text: str, leaving: bool) -> bytes:
    """A check message: the int64 hash of ``text``, 1 for a block exit else 0, the text
    (cut or padded to ``_FP_TEXT`` bytes)."""
    raw = text.encode()
    digest = zlib.crc32(raw) << 31 ^ zlib.adler32(raw)
    return struct.pack("<qB", digest, leaving) + raw[:_FP_TEXT].ljust(_FP_TEXT, b"\0")


def _agree(comm: Comm, text: str, leaving: bool = False, wait: bool = True) -> None:
    """This rank and the other ranks of ``comm`` compare their fingerprints; on a mismatch
    all of them raise.

    ``leaving`` marks the exit of a check_spmd block (``comm`` is then ``COMM_WORLD``). A
    rank that meets another's block exit at a collective raises, counts that exit (it pairs
    with this rank's own next block exit, where that rank is then skipped) and takes the
    collective off its call counter, since the collective does not run.
    """
    global _channel, _me
    if _channel is None:
        if MPI.COMM_WORLD.Get_size() == 1:
            return
        _channel, _me = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Get_rank()
    members = _world_ranks(comm)
    others = [w for w in members if w != _me]
    gone = [w for w in others if _exits_met.get(w)]
    if leaving:
        for w in gone:
            _exits_met[w] -= 1
    peers = [w for w in others if w not in gone]
    mine = _message(text, leaving)
    # every message posted before any wait: no order between the peers to get wrong
    requests = [_channel.Isend([mine, MPI.BYTE], w) for w in peers]
    theirs = [bytearray(_MSG) for _ in peers] if wait else []
    requests += [_channel.Irecv([buf, MPI.BYTE], w) for w, buf in zip(peers, theirs)]
    MPI.Request.Waitall(requests)
    differs = [buf != mine for buf in theirs]
    if not wait or not (any(differs) or (gone and not leaving)):
        return
    exits = [w for w, buf in zip(peers, theirs) if buf[8]]
    if not leaving and (gone or exits):
        _counters[comm.mpi.handle] -= 1
        for w in exits:
            _exits_met[w] = _exits_met.get(w, 0) + 1
    row = {w: i for i, w in enumerate(peers)}
    lines = []
    for r, w in enumerate(members):
        if w == _me:
            got, mark, note = text, " (this rank)", ""
        elif w in row:
            got = bytes(theirs[row[w]][9:]).rstrip(b"\0").decode(errors="replace")
            mark, note = "", "  <- differs from this rank" if differs[row[w]] else ""
        else:
            got, mark = "left a check_spmd block earlier (reported then)", ""
            note = "" if leaving else "  <- differs from this rank"
        lines.append(f"  comm rank {r}{mark}, world rank {w}: {got}{note}")
    before = "\n".join(f"    {_fingerprint(fp)}" for fp in _history) or "    (none)"
    raise CommError(
        "SPMD divergence: the ranks of a communicator entered different collectives (or "
        "the same one with different arguments), or left a check_spmd block at different "
        "points or in different ways; every rank raises instead of hanging.\n"
        "Fingerprints:\n" + "\n".join(lines) + "\nThis rank's previous checked collectives "
        "(oldest first):\n" + before
    )


def leave_check_block(exc: BaseException | None) -> None:
    """Agree on the exit of a ``dt.debug.check_spmd()`` block. **Collective** over
    ``COMM_WORLD`` while the SPMD check is on (a no-op otherwise).

    Every rank announces to every other how it leaves the block: normally (``exc`` None) or
    raising an exception of which type. Ranks that leave in different ways all raise
    :class:`CommError` here; a rank still inside the block meets the announcement at its
    next checked collective and raises there. ``exc`` that is not an :class:`Exception`
    (``KeyboardInterrupt``, ``SystemExit``) is announced without waiting for the others.
    """
    if not _spmd:
        return
    detail = "no exception" if exc is None else f"raising {type(exc).__name__}"
    _enter(Comm(MPI.COMM_WORLD), _LEAVE, None, detail, exc is None or isinstance(exc, Exception))
    _leave()


def _job_dir() -> str:
    """The folder of this job's watchdog state on this node, shared by its ranks there.

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
        self.dir = _private_dir(_job_dir())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dtensor-watchdog", daemon=True)
        self.thread.start()

    def enter(self, comm: Comm, kind: str, fp: tuple) -> None:
        self.seq += 1
        self.slot = (self.seq, time.monotonic(), kind, fp, _world_ranks(comm))

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
            line = f"in {now - (time.monotonic() - slot[1])} {_fingerprint(slot[3])}"
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

    def _peer_states(self, members: list[int]) -> list[str]:
        lines, now = [], time.time()
        for r in members:
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
        _, start, kind, fp, members = slot
        waited = time.monotonic() - start
        lines = [
            (
                f"[dtensor watchdog] world rank {self.rank} (pid {os.getpid()}): stuck for "
                f"{waited:.1f} s (timeout {self.timeout:g} s) in {kind}: {_fingerprint(fp)}; "
                f"communicator of world ranks {members}. Other ranks of that communicator:"
            ),
            *self._peer_states(members),
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


_watchdog: _Watchdog | None = None


@atexit.register
def _close_watchdog() -> None:
    if _watchdog is not None:
        _watchdog.close()


def set_watchdog(seconds: float | None, abort: bool = False, *, from_env: bool = False) -> None:
    """Start (or stop, with ``seconds=None``) the collective watchdog. **Local**.

    Parameters
    ----------
    seconds : float or None
        Report a collective of this process that has not returned after this many seconds.
    abort : bool
        After the report, abort the whole job (``MPI_Abort``).
    from_env : bool
        Whether the setting comes from the environment (a later :func:`configure_from_env`
        may then turn it off).

    Raises
    ------
    ConfigError
        If ``seconds`` is not positive, or the folder for the watchdog's state (see
        :func:`_job_dir`) is refused: a symlink, someone else's, or open to other users.
        The watchdog is then off.
    """
    global _watchdog
    if seconds is not None and not seconds > 0:
        raise ConfigError(f"set_watchdog: the timeout must be > 0 seconds, got {seconds!r}")
    if _watchdog is not None:
        _watchdog.close()
        _watchdog = None
    try:
        if seconds is not None:
            _watchdog = _Watchdog(float(seconds), bool(abort), from_env)
    finally:
        _update()


# -- reduce ops ---------------------------------------------------------------------------

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# Note: on bool data, sum and max are logical or, prod and min logical and (PyTorch and
# numpy agree: True + True is True for bool tensors).
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}


# Note: MPI's predefined MAX/MIN compare with ``>``/``<``, so a NaN survives or vanishes
# depending on which rank holds it. numpy and PyTorch propagate NaN through max and min:
# floating max/min use user-defined ops that reduce with np.maximum / np.minimum, which
# propagate NaN. One op per (op, dtype), created on first use and kept for the process.
_NAN_UFUNCS = {"max": np.maximum, "min": np.minimum}
_nan_ops: dict[tuple[str, str], Any] = {}


def _nan_propagating_op(op: str, dtype: np.dtype) -> Any:
    """The MPI op that reduces ``dtype`` data with ``op`` (max or min), NaN-propagating."""
    key = (op, dtype.char)
    found = _nan_ops.get(key)
    if found is None:
        ufunc = _NAN_UFUNCS[op]

        def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            acc = np.frombuffer(inoutbuf, dtype)
            ufunc(np.frombuffer(inbuf, dtype), acc, out=acc)

        found = _nan_ops[key] = MPI.Op.Create(reduce, commute=True)
    return found


# (dtype, op) -> (MPI datatype, MPI op) of the valid pairs: about a hundred at most, so the
# bound is never reached and recency does not matter. Every reducing collective looks its
# pair up, so it reads the entries through their bound ``get`` (a method call would cost
# 2-4% of a small all-reduce) and counts the hit itself.
_reductions = LRUCache("redistribute.reductions", 256)
_find_reduction = _reductions.data.get


def _reduction(dtype: np.dtype, op: str, kind: str, what: object) -> tuple[Any, Any]:
    """(MPI datatype, MPI op) for reducing ``dtype`` data with ``op``; raises on bad pairs
    (the message names ``kind`` and the caller's description ``what``)."""
    found = _find_reduction((dtype, op))
    if found is None:
        where = kind if what is None else f"{kind} ({_render(what)})"
        found = _check_reduction(dtype, op, where)
        _reductions.misses += 1
        _reductions.put((dtype, op), found)
    else:
        _reductions.hits += 1
    return found


def _check_reduction(dtype: np.dtype, op: str, where: str) -> tuple[Any, Any]:
    if op not in _MPI_OPS:
        raise DTypeError(f"{where}: unknown reduce op {op!r}; expected one of {REDUCE_OPS}")
    # mpi4py's own table of predefined types by typecode (float16 included); the
    # ``mpi4py.util.dtlib`` alternative returns duplicated types on which MPICH's predefined
    # ops are not defined. Non-native byte orders are not builtin and are refused.
    mpi_type = MPI._typedict.get(dtype.char) if dtype.isbuiltin else None
    if mpi_type is None or dtype.kind not in "biufc":
        raise DTypeError(f"{where}: cannot reduce dtype {dtype} with op {op!r}")
    if dtype.kind == "b":
        if op == "avg":
            raise DTypeError(f"{where}: reduce op 'avg' needs a floating dtype, got bool")
        return mpi_type, _BOOL_OPS[op]
    # Note: 'avg' of integer or bool data is refused, not floor-divided (no exact result).
    if op == "avg" and dtype.kind not in "fc":
        raise DTypeError(f"{where}: reduce op 'avg' needs a floating or complex dtype, got {dtype}")
    # Note: complex data has no max/min (PyTorch refuses; numpy would order lexicographically).
    if op in ("max", "min") and dtype.kind == "c":
        raise DTypeError(f"{where}: reduce op {op!r} is not defined for complex dtype {dtype}")
    if op in _NAN_UFUNCS and dtype.kind == "f":
        return mpi_type, _nan_propagating_op(op, dtype)
    return mpi_type, _MPI_OPS[op]


# -- derived datatypes --------------------------------------------------------------------


def block_type(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> tuple[int, Any]:
    """Describe a strided block (visited in C order) as an MPI datatype. **Local**.

    Parameters
    ----------
    shape, byte_strides : sequence of int
        The block's shape and its strides in bytes within the buffer (non-negative).
    itemsize : int
        Bytes per element.

    Returns
    -------
    (count, datatype)
        Pass ``count`` items of ``datatype`` to a collective. A contiguous block is
        ``(nbytes, BYTES)``; otherwise ``datatype`` is a committed derived type (nested
        hvectors over the block's contiguous runs) that the caller releases with
        :func:`free_types`.
    """
    dims = [(n, s) for n, s in zip(shape, byte_strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return 0, BYTES
    run = itemsize  # bytes of the innermost contiguous run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if not dims:
        return run, BYTES
    n, stride = dims.pop()
    dtype = BYTES.Create_hvector(n, run, stride)
    while dims:
        n, stride = dims.pop()
        outer = dtype.Create_hvector(n, 1, stride)
        dtype.Free()
        dtype = outer
    return 1, dtype.Commit()


def free_types(types: Sequence[Any]) -> None:
    """Release derived datatypes made by :func:`block_type`. **Local**.

    Predefined types are skipped, and nothing is done once MPI is finalized.
    """
    if MPI.Is_finalized():
        return
    for t in types:
        if t != MPI.DATATYPE_NULL and not t.is_predefined:
            t.Free()


# -- persistent all-gathers ----------------------------------------------------------------

# Persistent all-gathers kept per communicator; beyond this the oldest made is freed. The
# pool changes only when a request is made (a lookup that finds one changes nothing), so it
# evolves the same way on every rank of a communicator: all of them ask for the same counts
# in the same order, since each request stands for one collective call they all make.
_PERSISTENT_MAX = 64
# Whether this MPI has persistent collectives (MPI 4; one library, so the same on every rank)
_HAS_PERSISTENT = MPI.Get_version() >= (4, 0) and hasattr(MPI.Comm, "Allgather_init")
_persistent_forced: bool | None = None  # set_persistent; None follows DTENSOR_PERSISTENT
_persistent = False
# The pools that hold requests, freed at exit (registered after mpi4py's finalizer was, so
# this runs first)
_pools: list[dict] = []


def _update_persistent() -> None:
    global _persistent
    on = env_flag("DTENSOR_PERSISTENT", False) if _persistent_forced is None else _persistent_forced
    _persistent = _HAS_PERSISTENT and on


def persistent_enabled() -> bool:
    """Whether redistributes run their small all-gathers as persistent requests, after
    reading ``DTENSOR_PERSISTENT`` again (a :func:`set_persistent` setting wins). **Local**.

    Raises
    ------
    ConfigError
        ``DTENSOR_PERSISTENT`` is not an on/off value.
    """
    _update_persistent()
    return _persistent


def set_persistent(on: bool | None) -> bool | None:
    """Turn the persistent all-gathers of redistributes on or off for this process. **Local**.

    MPI does not match a persistent collective with a blocking one, so call this at the
    same point of the program on every rank (``DTENSOR_PERSISTENT`` is compared between
    the ranks at mesh creation). Without MPI 4 persistent collectives they stay off.

    Parameters
    ----------
    on : bool or None
        True or False forces the setting; None follows ``DTENSOR_PERSISTENT`` (default off).

    Returns
    -------
    bool or None
        The previous forced setting (pass it back to restore).
    """
    global _persistent_forced
    prev, _persistent_forced = _persistent_forced, None if on is None else bool(on)
    _update_persistent()
    return prev


class PersistentGather:
    """One persistent all-gather of fixed byte counts on one communicator, with its own
    send and receive buffers (bytes). Made by :meth:`Comm.persistent_gather`.

    Attributes
    ----------
    request : mpi4py.MPI.Prequest or None
        The persistent request (None once freed).
    send, recv : ndarray of uint8
        The buffers the request is bound to: this rank's block, and every rank's blocks in
        rank order.
    """

    __slots__ = ("recv", "request", "send")

    def __init__(self, mpi_comm: Any, counts: tuple[int, ...], rank: int) -> None:
        mine = counts[rank]
        self.send = np.empty(mine, np.uint8)
        self.recv = np.empty(sum(counts), np.uint8)
        if counts.count(mine) == len(counts):
            self.request = mpi_comm.Allgather_init([self.send, BYTES], [self.recv, BYTES])
        else:
            spec = [self.recv, list(counts), _displs(counts), BYTES]
            self.request = mpi_comm.Allgatherv_init([self.send, BYTES], spec)

    def run(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Gather the C-contiguous ``send`` of every rank into the C-contiguous ``recv``
        through the request. **Collective**. ``recv`` is a copy of the request's buffer, so
        an output handed out earlier is never written by a later start."""
        np.copyto(self.send, send.reshape(-1).view(np.uint8))
        self.request.Start()
        self.request.Wait()
        np.copyto(recv.reshape(-1).view(np.uint8), self.recv)

    def free(self) -> None:
        """Release the request (nothing once MPI is finalized). **Local**."""
        if self.request is not None and not MPI.Is_finalized():
            self.request.Free()
        self.request = None


def request_c_api() -> tuple | None:
    """What compiled code needs to start and wait for a persistent request without a Python
    call: ``(address of MPI_Start, address of MPI_Wait, mpi4py's PyMPIRequest_Get capsule,
    MPI.Exception)``, from the MPI library mpi4py runs on; None where one of them cannot be
    found (the caller then calls the request's ``Start`` and ``Wait``). Both functions take
    only pointers (``MPI_Request *``, ``MPI_Status *``), whatever the library's handle
    types. **Local**."""
    try:
        lib = ctypes.CDLL(MPI.__file__)
        start = ctypes.cast(lib.MPI_Start, ctypes.c_void_p).value
        wait = ctypes.cast(lib.MPI_Wait, ctypes.c_void_p).value
        get = MPI.__pyx_capi__["PyMPIRequest_Get"]
    except (OSError, AttributeError, KeyError):
        return None
    return start, wait, get, MPI.Exception


def _free_pool(pool: dict) -> None:
    for p in pool.values():
        p.free()
    pool.clear()


@atexit.register
def _free_pools() -> None:
    for pool in _pools:
        _free_pool(pool)


# -- the communicator ---------------------------------------------------------------------


def _bytes(values: Sequence[int], itemsize: int) -> list[int]:
    return [int(v) * itemsize for v in values]


def _displs(counts: Sequence[int]) -> list[int]:
    return np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).tolist()


def _traced(
    comm: Comm,
    kind: str,
    nbytes: int | None,
    what: object,
    detail: str,
    call: Callable[..., Any],
    *args: Any,
) -> Any:
    """Run ``call(*args)``, the MPI call of one collective of ``comm``, under the debug hooks;
    returns what it returns (the request of a nonblocking start).

    The observers are told ``(kind, nbytes)`` first (not when ``nbytes`` is None: an
    exchange they are not shown); then the debug checks enter the collective with the
    fingerprint ``(kind, what, detail)`` and leave it however the call ends. Every
    collective method runs its MPI call through here while an observer or a check is on,
    and calls it directly otherwise (``if _observers or _checks: _traced(...) else: call``),
    so that the common case builds no description and pays no extra call: passing the call
    on, even as ``call(*args)``, costs a measurable share of a small collective. For a
    nonblocking start the checks cover the start (the watchdog does not watch its wait).
    """
    if _observers and nbytes is not None:
        _notify(kind, nbytes, comm)
    if _checks:
        _enter(comm, kind, what, detail)
    try:
        return call(*args)
    finally:
        if _checks:
            _leave()


class Comm:
    """A communicator with buffer-based collectives.

    Attributes
    ----------
    mpi : mpi4py.MPI.Comm
        The raw communicator (for users who call MPI directly).
    rank, size : int
        This process's rank in the communicator and the communicator's size.
    mesh_dim : int or None
        The mesh dim this communicator spans, or None for a base communicator.
    async_op : bool
        Whether this is the private duplicate that asynchronous redistributes run on
        (:meth:`twin`); observers see it on the communicator they are passed.
    pool : dict
        This communicator's persistent all-gathers by byte counts per rank
        (:meth:`persistent_gather`).
    """

    __slots__ = ("_twin", "async_op", "mesh_dim", "mpi", "pool", "rank", "shared", "size")

    # Every collective method takes ``what=``: a description of the caller's purpose (a
    # string, or a tuple of parts joined with spaces when needed) that the debug checks put
    # into the collective's fingerprint; it is only rendered while a check is on.

    def __init__(self, mpi_comm: Any, mesh_dim: int | None = None) -> None:
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL:
            raise CommError(f"Comm: expected an mpi4py communicator, got {mpi_comm!r}")
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.mesh_dim = mesh_dim
        # whether the ranks can read each other's shared segments (redistribute.shm.probe);
        # None until a caller has asked
        self.shared: bool | None = None
        self.async_op = False
        self.pool: dict[tuple[int, ...], PersistentGather] = {}
        self._twin: Comm | None = None

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, size={self.size}, mesh_dim={self.mesh_dim})"

    def free(self) -> None:
        """Release the underlying communicator (not COMM_WORLD/COMM_SELF). **Collective**."""
        _free_pool(self.pool)
        if self._twin is not None:
            self._twin.free()
            self._twin = None
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            _counters.pop(self.mpi.handle, None)  # a later communicator may reuse the handle
            self.mpi.Free()

    def twin(self) -> Comm:
        """The private duplicate of this communicator that asynchronous redistributes run
        on (``async_op`` True, same ``mesh_dim``), made on first use and kept with this one.

        **Collective** the first time (``MPI_Comm_dup``), Local afterwards. Collectives on
        the twin never match the ones on this communicator, so work issued on it (in the
        same order on every rank, by whichever thread) may overlap with this communicator's.
        """
        if self._twin is None:
            twin = Comm(self.mpi.Dup(), self.mesh_dim)
            twin.async_op = True
            self._twin = twin
        return self._twin

    def persistent_gather(self, counts: tuple[int, ...]) -> PersistentGather:
        """This communicator's persistent all-gather of ``counts`` bytes per rank.

        **Collective** when it is made (the first time, or again after the pool dropped it:
        every rank of the communicator asks for the same counts in the same order, so all
        of them make it together), Local when the pool holds it.
        """
        pool = self.pool
        found = pool.get(counts)
        if found is None:
            if not pool:
                if not any(p is pool for p in _pools):
                    _pools.append(pool)
            elif len(pool) >= _PERSISTENT_MAX:
                pool.pop(next(iter(pool))).free()
            found = pool[counts] = PersistentGather(self.mpi, counts, self.rank)
        return found

    def allgatherv(
        self,
        send: np.ndarray,
        recv: np.ndarray,
        counts: Sequence[int],
        displs: Sequence[int] | None = None,
        what: object = None,
        start: bool = False,
    ) -> Any:
        """Gather every rank's ``send`` into ``recv``. **Collective**.

        Equal counts at the default displacements use ``Allgather``, other layouts
        ``Allgatherv``; with ``start``, their nonblocking forms (``Iallgather``,
        ``Iallgatherv``), whose request is returned (None otherwise): the buffers belong to
        MPI until it completes.

        Parameters
        ----------
        send : ndarray
            This rank's contiguous contribution (``counts[rank]`` elements).
        recv : ndarray
            Contiguous output; rank ``i``'s data lands at element ``displs[i]``.
        counts, displs : sequence of int
            Elements per rank and their offsets in ``recv`` (default: packed in rank order).
            Zero counts are legal.
        """
        isz = recv.itemsize
        counts = list(counts)
        mine = counts[self.rank] * isz
        send_spec = [send, mine, BYTES]
        # each variant returns from its own MPI call when no hook is on and the call blocks
        # (choosing the variant again after the hook test costs a small gather about 3%)
        if displs is None and counts.count(counts[self.rank]) == len(counts):
            recv_spec = [recv, mine, BYTES]  # counts per rank
            if not (_observers or _checks or start):
                self.mpi.Allgather(send_spec, recv_spec)
                return None
            call = self.mpi.Iallgather if start else self.mpi.Allgather
        else:
            bdispls = _bytes(_displs(counts) if displs is None else displs, isz)
            recv_spec = [recv, _bytes(counts, isz), bdispls, BYTES]
            if not (_observers or _checks or start):
                self.mpi.Allgatherv(send_spec, recv_spec)
                return None
            call = self.mpi.Iallgatherv if start else self.mpi.Allgatherv
        if not (_observers or _checks):
            return call(send_spec, recv_spec)
        nbytes = max(send.nbytes, sum(counts) * isz)
        detail = f"{isz}-byte items, counts {counts}"
        return _traced(self, "all_gather", nbytes, what, detail, call, send_spec, recv_spec)

    def allgather_persistent(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], what: object = None
    ) -> None:
        """:meth:`allgatherv` at the default displacements, for counts that repeat, through
        the persistent all-gather of this communicator's pool (:meth:`persistent_gather`).
        **Collective**; every rank of the communicator takes this form for the call (the
        redistribute executor does while :func:`persistent_enabled`). ``send`` and ``recv``
        are C-contiguous; observers see an ``all_gather`` as from :meth:`allgatherv`.
        """
        isz = recv.itemsize
        gather = self.persistent_gather(tuple([int(c) * isz for c in counts]))
        if _observers or _checks:
            nbytes = max(send.nbytes, recv.nbytes)
            detail = f"{isz}-byte items, counts {list(counts)}, persistent"
            _traced(self, "all_gather", nbytes, what, detail, gather.run, send, recv)
        else:
            gather.run(send, recv)

    def allreduce(
        self,
        send: np.ndarray,
        recv: np.ndarray | None = None,
        op: str = "sum",
        what: object = None,
        start: bool = False,
    ) -> Any:
        """Reduce ``send`` over all ranks into ``recv`` (in place when ``recv`` is None).

        **Collective**. ``op`` is one of sum, avg (sum, then divide by the size), max, min,
        prod. Buffers are contiguous and of the same shape and dtype. With ``start``, the
        nonblocking ``Iallreduce`` is started and its request returned (None otherwise); the
        caller divides an avg once it has completed.
        """
        mpi_type, mpi_op = _reduction(send.dtype, op, "all_reduce", what)
        if recv is None:
            send_spec, recv_spec = MPI.IN_PLACE, [send, send.size, mpi_type]
            recv = send
        else:
            send_spec, recv_spec = [send, send.size, mpi_type], [recv, recv.size, mpi_type]
        if not (_observers or _checks or start):
            self.mpi.Allreduce(send_spec, recv_spec, mpi_op)
        else:
            call = self.mpi.Iallreduce if start else self.mpi.Allreduce
            args = (send_spec, recv_spec, mpi_op)
            if _observers or _checks:
                detail = f"{send.size} x {send.dtype}, op {op}"
                request = _traced(self, "all_reduce", send.nbytes, what, detail, call, *args)
            else:
                request = call(*args)
            if start:
                return request
        if op == "avg":
            np.divide(recv, self.size, out=recv)
        return None

    def reduce_scatter(
        self,
        send: np.ndarray,
        recv: np.ndarray,
        counts: Sequence[int],
        op: str = "sum",
        what: object = None,
        start: bool = False,
    ) -> Any:
        """Reduce ``send`` over all ranks; rank ``i`` gets the ``i``-th block. **Collective**.

        ``send`` holds ``sum(counts)`` elements, the blocks in rank order; ``recv`` gets
        ``counts[rank]`` elements. Zero counts are legal. ``op`` as in :meth:`allreduce`.
        Equal counts use ``Reduce_scatter_block``, others ``Reduce_scatter``; with ``start``
        their nonblocking forms, as in :meth:`allreduce`.
        """
        mpi_type, mpi_op = _reduction(send.dtype, op, "reduce_scatter", what)
        counts = [int(c) for c in counts]
        mine = counts[self.rank]
        even = counts.count(mine) == len(counts)
        send_spec = [send, mine if even else sum(counts), mpi_type]  # even: counts per block
        recv_spec = [recv, mine, mpi_type]
        if not (_observers or _checks or start):
            if even:
                self.mpi.Reduce_scatter_block(send_spec, recv_spec, mpi_op)
            else:
                self.mpi.Reduce_scatter(send_spec, recv_spec, counts, mpi_op)
        else:
            mpi = self.mpi
            if even:
                call = mpi.Ireduce_scatter_block if start else mpi.Reduce_scatter_block
                args = (send_spec, recv_spec, mpi_op)
            else:
                call = mpi.Ireduce_scatter if start else mpi.Reduce_scatter
                args = (send_spec, recv_spec, counts, mpi_op)
            if _observers or _checks:
                detail = f"{send.dtype}, counts {counts}, op {op}"
                request = _traced(self, "reduce_scatter", send.nbytes, what, detail, call, *args)
            else:
                request = call(*args)
            if start:
                return request
        if op == "avg":
            np.divide(recv, self.size, out=recv)
        return None

    def alltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        what: object = None,
    ) -> None:
        """Send block ``j`` of ``send`` to rank ``j``; receive rank ``i``'s into ``recv``.

        **Collective**. Counts and displacements in elements; zero counts are legal.
        """
        isz = send.itemsize
        scounts, rcounts = _bytes(send_counts, isz), _bytes(recv_counts, isz)
        send_spec = [send, scounts, _bytes(send_displs, isz), BYTES]
        recv_spec = [recv, rcounts, _bytes(recv_displs, isz), BYTES]
        if _observers or _checks:
            nbytes = max(sum(scounts), sum(rcounts))
            detail = f"{isz}-byte items"  # counts differ between ranks
            call = self.mpi.Alltoallv
            _traced(self, "all_to_all", nbytes, what, detail, call, send_spec, recv_spec)
        else:
            self.mpi.Alltoallv(send_spec, recv_spec)

    def alltoallw(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        send_types: Sequence[Any],
        recv: np.ndarray,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        recv_types: Sequence[Any],
        kind: str = "all_to_all",
        what: object = None,
        nbytes: int | None = None,
        start: bool = False,
    ) -> Any:
        """Like :meth:`alltoallv` with one datatype per peer. **Collective**.

        Counts are in units of the peer's datatype (:data:`BYTES` or one from
        :func:`block_type`), displacements in bytes from the start of the buffer. ``kind``
        and ``nbytes`` are what observers are told: a caller that implements a larger
        collective with this exchange (an all-gather whose own block is copied locally)
        passes its kind and buffer size; by default the larger of the bytes sent and
        received. With ``start``, the nonblocking ``Ialltoallw`` is started and its request
        returned (None otherwise).
        """
        send_spec = [send, send_counts, send_displs, send_types]
        recv_spec = [recv, recv_counts, recv_displs, recv_types]
        if not (_observers or _checks or start):
            return self.mpi.Alltoallw(send_spec, recv_spec)
        call = self.mpi.Ialltoallw if start else self.mpi.Alltoallw
        if _observers or _checks:
            if nbytes is None:
                sent = sum(c * t.Get_size() for c, t in zip(send_counts, send_types))
                got = sum(c * t.Get_size() for c, t in zip(recv_counts, recv_types))
                nbytes = max(sent, got)
            detail = "alltoallw"  # counts and types differ between ranks
            return _traced(self, kind, nbytes, what, detail, call, send_spec, recv_spec)
        return call(send_spec, recv_spec)

    def scatterv(
        self,
        send: np.ndarray | None,
        counts: Sequence[int],
        displs: Sequence[int],
        recv: np.ndarray | None,
        root: int,
        what: object = None,
    ) -> None:
        """Rank ``i`` receives ``counts[i]`` elements of ``send`` (read on ``root`` only).

        **Collective**. ``recv=None`` on the root leaves the root's block in place (it is
        not copied); other ranks always pass a buffer (it may be empty).
        """
        if self.rank == root:
            isz = send.itemsize
            sendspec = [send, _bytes(counts, isz), _bytes(displs, isz), BYTES]
            recvspec = MPI.IN_PLACE if recv is None else [recv, recv.nbytes, BYTES]
        else:
            sendspec = None
            recvspec = [recv, recv.nbytes, BYTES]
        if _observers or _checks:
            nbytes = send.nbytes if self.rank == root else recv.nbytes
            detail = f"root {root}, counts {list(counts)}"
            call = self.mpi.Scatterv
            _traced(self, "scatter", nbytes, what, detail, call, sendspec, recvspec, root)
        else:
            self.mpi.Scatterv(sendspec, recvspec, root)

    def bcast_array(self, arr: np.ndarray, root: int = 0, what: object = None) -> np.ndarray:
        """Broadcast the contiguous ``arr`` from ``root`` in place; returns it. **Collective**."""
        spec = [arr, arr.nbytes, BYTES]
        if _observers or _checks:
            detail = f"root {root}, {arr.nbytes} bytes"
            _traced(self, "broadcast", arr.nbytes, what, detail, self.mpi.Bcast, spec, root)
        else:
            self.mpi.Bcast(spec, root)
        return arr

    def barrier(self, what: object = None) -> None:
        """Wait for every rank. **Collective**."""
        if _observers or _checks:
            _traced(self, "barrier", 0, what, "no data", self.mpi.Barrier)
        else:
            self.mpi.Barrier()

    def allgather_ints(self, values: Sequence[int] | np.ndarray, what: object = None) -> np.ndarray:
        """Exchange a few int64 values; row ``i`` of the result is rank ``i``'s. **Collective**.

        Every rank must pass the same number of values. For metadata (shapes, coordinates,
        consistency checks), not for data.
        """
        mine = np.ascontiguousarray(values, dtype=np.int64).ravel()
        nbytes = self.size * mine.nbytes
        return self._gather_ints(mine, "all_gather_ints", what, f"{mine.size} values", nbytes)

    def _gather_ints(
        self, mine: np.ndarray, kind: str, what: object, detail: str, nbytes: int | None
    ) -> np.ndarray:
        """The all-gather of int64 values of :meth:`allgather_ints` and
        :meth:`shared_exchange`; ``nbytes`` None hides it from the observers."""
        out = np.empty((self.size, mine.size), dtype=np.int64)
        send_spec, recv_spec = [mine, MPI.INT64_T], [out, MPI.INT64_T]
        if _observers or _checks:
            _traced(self, kind, nbytes, what, detail, self.mpi.Allgather, send_spec, recv_spec)
        else:
            self.mpi.Allgather(send_spec, recv_spec)
        return out

    def shared_exchange(
        self, values: Sequence[int], kind: str, what: object = None, detail: str = ""
    ) -> np.ndarray:
        """Exchange the descriptors of a shared-memory exchange of ``kind``. **Collective**.

        Like :meth:`allgather_ints`, but not shown to observers: the caller reports the
        exchange it stands for with :meth:`report` once it has run that way. ``detail``
        (the exchange's rank-invariant arguments, e.g. dtype and reduce op) joins the
        fingerprint of the SPMD check.
        """
        mine = np.ascontiguousarray(values, dtype=np.int64).ravel()
        return self._gather_ints(
            mine, kind, what, f"{detail}; shared descriptors, {mine.size} values", None
        )

    def report(self, kind: str, nbytes: int) -> None:
        """Tell the observers of a collective of ``kind`` over ``nbytes`` bytes that ran
        without an MPI call of that kind (a shared-memory exchange). **Local**."""
        if _observers:
            _notify(kind, nbytes, self)

    def all_true(self, flag: bool, what: object = None) -> bool:
        """Whether ``flag`` holds on every rank. **Collective**; not shown to observers (it
        ends a shared-memory exchange: no rank returns before every peer has read its data).
        """
        value = np.array([1 if flag else 0], np.int32)
        spec = [value, 1, MPI.INT]
        if _observers or _checks:
            detail = "shared exchange done"
            call = self.mpi.Allreduce
            _traced(self, "all_reduce", None, what, detail, call, MPI.IN_PLACE, spec, MPI.MIN)
        else:
            self.mpi.Allreduce(MPI.IN_PLACE, spec, MPI.MIN)
        return bool(value[0])


def thread_multiple() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (any thread may call it at
    any time). **Local**."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def world() -> Comm:
    """A :class:`Comm` over ``MPI.COMM_WORLD``. **Local**."""
    return Comm(MPI.COMM_WORLD)


def cuda_aware() -> bool:
    """Whether the loaded MPI library takes CUDA device buffers. **Local**.

    Asks ``MPIX_Query_cuda_support`` (MPICH, Open MPI, MVAPICH), found through mpi4py's
    extension module; False for a library without it.
    """
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


def local_rank(base: Comm) -> int:
    """This process's rank among the ranks of ``base`` on its node. **Collective** over
    ``base`` (a shared-memory split)."""
    node = base.mpi.Split_type(MPI.COMM_TYPE_SHARED, base.rank)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def world_ranks(comm: Comm) -> np.ndarray:
    """The COMM_WORLD rank of every rank of ``comm``, in ``comm``'s rank order. **Local**."""
    if comm.mpi == MPI.COMM_WORLD:
        return np.arange(comm.size, dtype=np.int64)
    group, world = comm.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(comm.size)), world)
    finally:
        group.Free()
        world.Free()
    return np.array(ranks, dtype=np.int64)


# The communicators of mesh dims, shared by every mesh whose dim groups the same world ranks
# in the same order: (mesh dim, its size, the dim's groups of world ranks in order of their
# first rank) -> this rank's Comm of that dim. Every rank of a group makes an entry in the
# same collective call, and no entry is dropped, so identical meshes split no communicator.
_shared_comms: dict[tuple[int, int, bytes], Comm] = {}
# The grids that got shared communicators, by (world ranks of the base communicator, grid
# shape, grid ranks), with what they derive locally (see _layout). Mesh creation looks them
# up instead of deriving them again.
_layouts: dict[tuple[bytes, tuple[int, ...], bytes], tuple] = {}
# A setting that could not be read on a rank (shown as "unreadable" when ranks differ)
_UNREADABLE = -(1 << 63)


def _as_grid(rank_grid: np.ndarray, what: str) -> np.ndarray:
    grid = np.asarray(rank_grid)
    if grid.dtype.kind not in "iu" or grid.ndim == 0:
        raise MeshError(
            f"{what}: rank_grid must be an integer array with at least one dim, "
            f"got dtype {grid.dtype} and shape {grid.shape}"
        )
    return np.ascontiguousarray(grid, dtype=np.int64)


def _grid_problem(base: Comm, grid: np.ndarray, full: bool) -> str | None:
    """Why ``grid`` is no mesh of ``base`` ranks (every rank of ``base`` when ``full``)."""
    flat = grid.ravel()
    if (
        flat.size == 0
        or np.unique(flat).size != flat.size
        or flat.min() < 0
        or flat.max() >= base.size
    ):
        return (
            f"rank_grid {grid.tolist()} must hold distinct ranks of a communicator of size "
            f"{base.size}"
        )
    if full and flat.size != base.size:
        return (
            f"rank_grid {grid.tolist()} must hold every rank of a communicator of size {base.size}"
        )
    return None


def _settings_text(name: str, column: np.ndarray, world: np.ndarray) -> str:
    """``NAME (world rank 0: a, world ranks [1, 2]: b)``: each value with its ranks."""
    groups: dict[int, list[int]] = {}
    for r, value in enumerate(column.tolist()):
        groups.setdefault(value, []).append(int(world[r]))
    parts = []
    for value, ranks in groups.items():
        who = f"world rank {ranks[0]}" if len(ranks) == 1 else f"world ranks {ranks}"
        parts.append(f"{who}: {'unreadable' if value == _UNREADABLE else value}")
    return f"{name} ({', '.join(parts)})"


def _digest(grid: np.ndarray) -> int:
    return zlib.crc32(np.asarray(grid.shape, dtype=np.int64).tobytes() + grid.tobytes())


def _agree_mesh(
    base: Comm,
    grid: np.ndarray,
    digest: int,
    hits: int,
    settings: Sequence[tuple[str, int | None]],
    what: str,
) -> int:
    """The agreement that starts every mesh creation. **Collective** over ``base``.

    One all-gather of this rank's grid ``digest`` (:func:`_digest`), the mask of the
    requested dims whose shared communicator it holds (``hits``, at most 64 dims) and its
    values of ``settings`` (the SPMD check's first; None: unreadable on this rank). It is a
    plain MPI call, neither shown to observers nor checked, because the ranks' debug checks
    may still differ.

    Raises
    ------
    ConfigError
        On every rank when the ranks' settings differ (naming each and its values by rank).
    MeshError
        On every rank when the ranks passed different grids.

    Returns
    -------
    int
        The dims every rank holds (the AND of the masks).
    """
    named = [("DTENSOR_CHECK_SPMD", int(_spmd)), *settings]
    values = [_UNREADABLE if v is None else int(v) for _, v in named]
    mine = [digest, hits & 0xFFFFFFFF, hits >> 32, *values]
    table = np.empty((base.size, len(mine)), dtype=np.int64)
    base.mpi.Allgather([np.array(mine, dtype=np.int64), MPI.INT64_T], [table, MPI.INT64_T])
    rows = table.tolist()  # a few values per rank: plain lists compare faster than arrays
    if all(row == mine for row in rows):
        return hits
    differ = [j for j in range(len(values)) if any(row[3 + j] != values[j] for row in rows)]
    if differ:
        world = world_ranks(base)
        texts = [_settings_text(named[j][0], table[:, 3 + j], world) for j in differ]
        raise ConfigError(
            f"{what}: the ranks differ in settings that decide which collectives run: "
            + "; ".join(texts)
            + ". Every rank must use the same value (an environment variable, or the call "
            "that overrides it in this process, such as set_check_spmd)."
        )
    if any(row[0] != digest for row in rows):
        raise MeshError(
            f"{what}: ranks passed different rank grids (this rank: shape "
            f"{grid.shape}, ranks {grid.ravel().tolist()})"
        )
    for row in rows:
        hits &= row[1] | row[2] << 32
    return hits


def _split(base: Comm, grid: np.ndarray, coord: tuple[int, ...] | None, m: int, what: str):
    """This rank's communicator of mesh dim ``m`` (None outside the grid). **Collective**."""
    if coord is None:
        color, key = MPI.UNDEFINED, 0
    else:
        rest = coord[:m] + coord[m + 1 :]
        rest_shape = grid.shape[:m] + grid.shape[m + 1 :]
        color = int(np.ravel_multi_index(rest, rest_shape)) if rest else 0
        key = coord[m]
    try:
        new = base.mpi.Split(color, key)
    except MPI.Exception as e:
        cause = str(e).strip().splitlines()[-1]
        raise MeshError(
            f"{what}: MPI could not create another communicator for mesh dim {m} of a mesh "
            f"of shape {grid.shape} ({cause}); this process holds {len(_shared_comms)} mesh "
            f"communicators for {len(_layouts)} distinct meshes (identical meshes "
            "share theirs; communicators that the program creates itself count against the "
            "same MPI limit)"
        ) from None
    return None if coord is None else Comm(new, mesh_dim=m)


def _coordinate(grid: np.ndarray, rank: int) -> tuple[int, ...] | None:
    hits = np.flatnonzero(grid.ravel() == rank)
    return tuple(int(c) for c in np.unravel_index(hits[0], grid.shape)) if hits.size else None


def make_mesh_comms(
    base: Comm, rank_grid: np.ndarray
) -> tuple[tuple[int, ...] | None, tuple[Comm, ...]]:
    """Split ``base`` into new communicators, one per mesh dim. **Collective** over ``base``.

    The caller owns (and frees) them; meshes use :func:`shared_mesh_comms` instead.

    Parameters
    ----------
    base : Comm
        The communicator whose ranks ``rank_grid`` holds.
    rank_grid : ndarray of int
        The mesh: ``rank_grid[coord]`` is the ``base`` rank at mesh coordinate ``coord``.
        Every rank must pass the same grid (checked); ranks of ``base`` missing from it take
        part in the splits but belong to no mesh.

    Returns
    -------
    (coord, comms)
        This rank's mesh coordinate and, for each mesh dim ``m``, a :class:`Comm` over the
        ranks that share every coordinate except the one along ``m``, ordered by that
        coordinate (so the comm rank is ``coord[m]``). Ranks outside the mesh get
        ``(None, ())``. Nothing is cached here.

    Raises
    ------
    MeshError
        On every rank for a bad or differing grid, or when MPI has no communicator left.
    ConfigError
        On every rank when the ranks differ in ``DTENSOR_CHECK_SPMD``.
    """
    what = "make_mesh_comms"
    configure_from_env()
    grid = _as_grid(rank_grid, what)
    _agree_mesh(base, grid, _digest(grid), 0, (), what)
    problem = _grid_problem(base, grid, full=False)
    if problem is not None:
        raise MeshError(f"{what}: {problem}")
    coord = _coordinate(grid, base.rank)
    comms = [_split(base, grid, coord, m, what) for m in range(grid.ndim)]
    return coord, tuple(c for c in comms if c is not None)


def shared_mesh_comms(
    base: Comm,
    rank_grid: np.ndarray,
    dims: Sequence[int] | None = None,
    settings: Sequence[tuple[str, int | None]] = (),
    what: str = "DeviceMesh",
) -> tuple[tuple[int, ...], tuple[Comm, ...]]:
    """The communicators of mesh dims, shared between meshes. **Collective** over ``base``.

    Like :func:`make_mesh_comms` for a grid that holds every rank of ``base``, but a mesh
    dim that groups the same world ranks in the same order as one asked for before (by
    any mesh, over any communicator) gets the same :class:`Comm`, so creating identical
    meshes again and again creates no communicator. The communicators live until exit:
    never free them.

    Every rank decides from its own cache, and the ranks agree on the decision in the
    all-gather that also compares their grids and ``settings``: a dim that some rank does
    not hold is split anew on every rank.

    Parameters
    ----------
    base : Comm
        The communicator whose ranks ``rank_grid`` holds.
    rank_grid : ndarray of int
        The mesh of ``base`` ranks, each exactly once; the same on every rank (checked).
    dims : sequence of int, optional
        The mesh dims to return communicators for (default: all, in order).
    settings : sequence of (name, int or None)
        Settings that must be equal on every rank (None: unreadable on this rank), checked
        together with ``DTENSOR_CHECK_SPMD``.
    what : str
        The caller, for error messages.

    Returns
    -------
    (coord, comms)
        This rank's mesh coordinate and one :class:`Comm` per dim of ``dims``.

    Raises
    ------
    ConfigError
        On every rank when the ranks' settings differ.
    MeshError
        On every rank for a bad or differing grid, or when MPI has no communicator left.
    """
    configure_from_env()
    grid = _as_grid(rank_grid, what)
    dims = tuple(range(grid.ndim)) if dims is None else tuple(int(d) for d in dims)
    name = (world_ranks(base).tobytes(), grid.shape, grid.tobytes())
    layout = _layouts.get(name)
    problem = None
    if layout is None:
        problem = _grid_problem(base, grid, full=True)
        if problem is None:
            layout = _layout(base, grid)
    hits = 0
    if layout is not None:
        for i, m in enumerate(dims):
            hits |= (layout[1][m] in _shared_comms) << i
    digest = _digest(grid) if layout is None else layout[2]
    held = _agree_mesh(base, grid, digest, hits, settings, what)
    if problem is not None:  # the grids agree: so do the problems
        raise MeshError(f"{what}: {problem}")
    coord, keys, _ = layout
    comms = []
    for i, m in enumerate(dims):
        if not held >> i & 1:
            _shared_comms[keys[m]] = _split(base, grid, coord, m, what)
        comms.append(_shared_comms[keys[m]])
    _layouts[name] = layout
    return coord, tuple(comms)


def _layout(base: Comm, grid: np.ndarray) -> tuple:
    """(this rank's coordinate, each dim's key in ``_shared_comms``, the grid's digest) for
    a grid of every rank of ``base``. A key is (dim, its size, the dim's groups of world
    ranks in order of their first rank). **Local**."""
    world = world_ranks(base)[grid]
    keys = []
    for m in range(grid.ndim):
        groups = np.moveaxis(world, m, -1).reshape(-1, world.shape[m])
        keys.append((m, world.shape[m], groups[np.argsort(groups[:, 0])].tobytes()))
    return _coordinate(grid, base.rank), tuple(keys), _digest(grid)


configure_from_env()
