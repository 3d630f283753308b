"""The SPMD divergence check, and the entry of every checked collective.

This module owns the check (``DTENSOR_CHECK_SPMD=1`` or :func:`set_check_spmd`; off by
default): before each collective the ranks of its communicator agree on a *fingerprint*
(kind, the op being dispatched, the caller's description ``what=``, the rank-invariant
arguments such as counts, dtype and reduce op, and a per-communicator call counter). Each
rank sends its fingerprint (text and a 64-bit hash of it) to the other ranks of the
communicator, point to point over a private duplicate of ``COMM_WORLD``, and compares
theirs; on a mismatch every rank raises :class:`CommError` showing its own and the others'
fingerprints, instead of hanging or exchanging mismatched data. Between two ranks these
messages form one ordered stream, whatever the communicator, so the exit of a
``dt.debug.check_spmd()`` block (:data:`LEAVE`, announced by
:func:`redistribute.comm.leave_check_block` to every other rank) is met by a rank still
inside at its next checked collective, and both raise. The duplicate is made by the first
checked point, a collective over ``COMM_WORLD``: with the check on, every rank of
``COMM_WORLD`` runs it.

:func:`enter` and :func:`leave` bracket every checked collective (while the SPMD check or
the watchdog is on): they count it, record its fingerprint (:func:`fingerprint`), fill and
release the watchdog's slot (:mod:`redistribute.comm.watchdog`) and run the agreement.
The setting lives in :data:`redistribute.comm.hooks.HOOKS` (``spmd``).
"""

from __future__ import annotations

import struct
import zlib
from collections import deque
from typing import Any

from mpi4py import MPI

from placements.env import env_flag
from placements.errors import CommError

from .hooks import HOOKS, render, update
from .process import world_ranks

__all__ = [
    "LEAVE",
    "check_spmd_enabled",
    "enter",
    "fingerprint",
    "forget",
    "leave",
    "members",
    "read_env",
    "set_check_spmd",
]

_spmd_env = False  # DTENSOR_CHECK_SPMD
_spmd_forced: bool | None = None  # set_check_spmd; None follows the environment
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
#: The kind of the checked exchange that announces the exit of a check_spmd block.
LEAVE = "leave check_spmd block"


def _update() -> None:
    update(spmd=_spmd_env if _spmd_forced is None else _spmd_forced)


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
    return HOOKS.spmd


def read_env() -> None:
    """Set the check from ``DTENSOR_CHECK_SPMD`` (unless :func:`set_check_spmd` forced it).
    **Local**."""
    global _spmd_env
    _spmd_env = env_flag("DTENSOR_CHECK_SPMD")
    _update()


def fingerprint(fp: tuple) -> str:
    """The text of a fingerprint tuple made by :func:`enter`. **Local**."""
    n, kind, what, op, detail, size, mesh_dim = fp
    parts = ([] if what is None else [render(what)]) + ([] if op is None else [f"op {op}"])
    return (
        f"#{n} {kind} ({'; '.join([*parts, detail])}) on communicator size {size}, "
        f"mesh dim {mesh_dim}"
    )


def enter(comm: Any, kind: str, what: object, detail: str, wait: bool = True) -> None:
    """Start of a checked collective of ``comm``: fingerprint, watchdog slot, SPMD
    agreement. **Collective** while the SPMD check is on, Local otherwise.

    The fingerprint is kept as a tuple and only rendered as text for the SPMD check or a
    report, so the watchdog alone costs little. ``wait=False`` (only for a block exit)
    sends this rank's fingerprint without waiting for the others'.
    """
    key = comm.mpi.handle
    n = _counters.get(key, 0) + 1
    _counters[key] = n
    fp = (n, kind, what, HOOKS.op_source(), detail, comm.size, comm.mesh_dim)
    watchdog = HOOKS.watchdog
    if watchdog is not None:
        watchdog.enter(comm, kind, fp)
    if HOOKS.spmd:
        try:
            _agree(comm, fingerprint(fp), kind == LEAVE, wait)
        except BaseException:
            leave()
            raise
    _history.append(fp)


def leave() -> None:
    """End of a checked collective (however its MPI call ended). **Local**."""
    watchdog = HOOKS.watchdog
    if watchdog is not None:
        watchdog.slot = None


def forget(handle: int) -> None:
    """Drop the call counter of a communicator being freed (a later communicator may reuse
    its ``handle``). **Local**."""
    _counters.pop(handle, None)


def _forget_members(_comm: Any, _keyval: int, key: int) -> None:
    _members.pop(key, None)


# Attached to each communicator whose ranks _members holds: freeing the communicator (by
# any means) drops the entry, since a later communicator may get its handle.
_MEMBERS_KEY = MPI.Comm.Create_keyval(delete_fn=_forget_members)


def members(comm: Any) -> list[int]:
    """The ``COMM_WORLD`` ranks of ``comm``'s ranks, in ``comm`` rank order (cached on the
    communicator's handle until it is freed). **Local**."""
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


def _agree(comm: Any, text: str, leaving: bool = False, wait: bool = True) -> None:
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
    ranks = members(comm)
    others = [w for w in ranks if w != _me]
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
    for r, w in enumerate(ranks):
        if w == _me:
            got, mark, note = text, " (this rank)", ""
        elif w in row:
            got = bytes(theirs[row[w]][9:]).rstrip(b"\0").decode(errors="replace")
            mark, note = "", "  <- differs from this rank" if differs[row[w]] else ""
        else:
            got, mark = "left a check_spmd block earlier (reported then)", ""
            note = "" if leaving else "  <- differs from this rank"
        lines.append(f"  comm rank {r}{mark}, world rank {w}: {got}{note}")
    before = "\n".join(f"    {fingerprint(fp)}" for fp in _history) or "    (none)"
    raise CommError(
        "SPMD divergence: the ranks of a communicator entered different collectives (or "
        "the same one with different arguments), or left a check_spmd block at different "
        "points or in different ways; every rank raises instead of hanging.\n"
        "Fingerprints:\n" + "\n".join(lines) + "\nThis rank's previous checked collectives "
        "(oldest first):\n" + before
    )
