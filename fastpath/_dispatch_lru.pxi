# The front's counters and its LRU bookkeeping for the Python cache: the generation that
# invalidates front entries, the queued touches of hits (_touch) and their replay (flush).

# counters and the LRU touches pending for the Python cache
cdef unsigned long long _hits = 0
cdef unsigned long long _fills = 0
cdef unsigned long long _tick = 0
cdef long _generation = 0
cdef list _pending = []


def invalidate():
    """Forget every front entry (the Python cache evicted or dropped entries). **Local**."""
    global _generation
    _generation += 1


def _tick_of(fe):
    return (<FrontEntry>fe).tick


def flush(data):
    """Replay the pending LRU touches of front hits on the Python cache ``data`` (an
    OrderedDict), oldest first. **Local**."""
    global _pending
    if not _pending:
        return
    pending = _pending
    _pending = []
    pending.sort(key=_tick_of)
    cdef FrontEntry fe
    for fe in pending:
        fe.pending = False
        if data.get(fe.key) is fe.entry:
            data.move_to_end(fe.key)


cdef unsigned long long _moved_hits = 0    # front hits whose input moves it ran itself


def stats():
    """``{"hits": front hits, "fills": front entries made, "redistributes": redistributes
    run from compiled code (``DTensor.redistribute`` and ops' input moves), "moved": front
    hits that moved inputs themselves (not handed to the Python dispatcher)}`` since the
    last reset. **Local**."""
    return {"hits": _hits, "fills": _fills, "redistributes": run_count(),
            "moved": _moved_hits}


def reset_stats():
    """Zero the counters of :func:`stats` and ``fastpath._redist.redistribute_kinds`` (the
    Python cache was cleared). **Local**."""
    global _hits, _fills, _moved_hits
    _hits = 0
    _fills = 0
    _moved_hits = 0
    reset_counts()


cdef inline FrontEntry _touch(FrontEntry fe):
    """Count a front hit of ``fe`` and queue its LRU touch for the Python cache."""
    global _hits, _tick
    _hits += 1
    _tick += 1
    fe.tick = _tick
    if not fe.pending:
        fe.pending = True
        _pending.append(fe)
    return fe
