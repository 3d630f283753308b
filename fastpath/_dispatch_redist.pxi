# DTensor.redistribute and an op's input moves from compiled code: the entries of the
# compiled executor (fastpath._redist, cimported: RedistEntry, new_entry, run) kept per
# (source spec, target placements) and run on a DTensor's local array. A plan that is one
# step of the kinds redistribute.execute.compiled_form describes runs there; every other
# plan, every call while a communication observer or check is on (_redist.traced), an
# asynchronous call and a pending DTensor (a subclass) go to the Python method, and so does
# a call whose local array is not C-contiguous where the step communicates.

cdef object _redist_form = None      # front.redistribute_form(dtensor, placements) -> tuple|None
cdef object _redist_py = None        # DTensor's Python redistribute method
cdef object _move_form = None        # front.move_form(move) -> tuple|None (an op's input move)
cdef object _move_input = None       # dispatcher.execute_move(dtensor, move, mesh) -> Tensor
cdef dict _redist = {}               # id(source spec) -> list of RedistEntry
cdef object _last = None             # the RedistEntry used last (checked before the table)
cdef Py_ssize_t REDIST_MAX = 4096    # source specs kept at most (then all are forgotten)


def install_redistribute(form, py_method, move_form=None, move_input=None):
    """Plug in what the compiled ``redistribute`` needs: the dispatcher's
    ``redistribute_form``, DTensor's Python method, ``move_form`` (the form of an op's input
    move, for :func:`move_local`) and the dispatcher's ``execute_move`` (an input move by the
    executor, for the moves the compiled path declines). The compiled executor itself is
    plugged in by ``redistribute.execute.compiled``. **Local**."""
    global _redist_form, _redist_py, _last, _move_form, _move_input
    _redist_form, _redist_py, _move_form, _move_input = form, py_method, move_form, move_input
    _redist.clear()
    _last = None


cdef inline bint _same_targets(tuple targets, object placements):
    """Whether ``placements`` (a list or tuple) holds exactly the interned ``targets``."""
    cdef Py_ssize_t n = len(targets), i
    if len(placements) != n:
        return False
    for i in range(n):
        if <object>PyTuple_GET_ITEM(targets, i) is not placements[i]:
            return False
    return True


cdef RedistEntry _redist_entry(object d, object spec, object placements):
    """The entry of ``(spec, placements)``, filled from the dispatcher on first use."""
    key = id(spec)
    cdef object chain = _redist.get(key)
    cdef RedistEntry e
    if chain is not None:
        for e in <list>chain:
            if e.spec is spec and e.generation == _generation and _same_targets(e.targets, placements):
                return e
    e = new_entry(spec, placements, _redist_form(d, placements), _generation)
    if chain is None or (<RedistEntry>(<list>chain)[0]).spec is not spec:
        if len(_redist) >= REDIST_MAX:
            _redist.clear()
        chain = []
        _redist[key] = chain
    else:  # entries of an older generation are never used again
        chain[:] = [x for x in <list>chain if (<RedistEntry>x).generation == _generation]
    (<list>chain).append(e)
    return e


cdef object _redist_run(object self, object spec, object device_mesh, object placements):
    """The compiled run of ``self.redistribute(device_mesh, placements)``: the output's
    local array (its spec is then ``_last.dst``), or None when the plan is not one the
    compiled path runs (nothing ran). ``self`` is a plain host DTensor and ``placements`` a
    list or tuple; no communication observer or check is on. **Collective** when it runs a
    plan that communicates."""
    global _last
    cdef RedistEntry e = <RedistEntry>_last
    if e is None or e.spec is not spec or e.generation != _generation or not _same_targets(
            e.targets, placements):
        if device_mesh is not None and device_mesh is not spec.mesh:
            return None
        e = _last = _redist_entry(self, spec, placements)
    elif device_mesh is not None and device_mesh is not e.mesh:
        return None
    return run(e, _local_arr(self))


def redistribute(self, device_mesh=None, placements=None, *, async_op=False):
    """``DTensor.redistribute`` (same signature and result) served from compiled code when
    the plan is one step of a kind it runs; else (and on the Python path, and for a DTensor
    with autograd state, whose move the Python method records) the Python method.
    **Collective**."""
    cdef DTensorBase d = <DTensorBase>self
    if (type(placements) is not list and type(placements) is not tuple) or async_op or (
            type(self) is not _DTensor) or _python_path or d._ag is not None:
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    if traced():
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    out = _redist_run(self, d._spec, device_mesh, placements)
    if out is None:
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    return _new_dtensor_arr(out, (<RedistEntry>_last).dst)


cdef inline RedistEntry _move_entry(object move):
    """The compiled entry of a dispatcher move (made on first use, kept on the move)."""
    e = move.fast
    if e is None or (<RedistEntry>e).generation != _generation:
        e = new_entry(move.src, move.dst.placements, _move_form(move), _generation)
        move.fast = e
    return <RedistEntry>e


cdef bint _run_moves(tuple moves, list values, object mesh) except -1:
    """Replace the DTensor inputs of a front entry in ``values`` by what its kernel gets on
    this rank (``moves``: see ``_entry_moves``): a one-step move from compiled code, or by
    the dispatcher's ``execute_move`` where the compiled path declines it. False (nothing
    ran, ``values`` unchanged) while a communication observer or check is on (the Python
    dispatcher then names the op of each collective) or when an input is not a plain
    DTensor. **Collective** when a move communicates."""
    if _move_form is None or _move_input is None or traced():
        return False
    cdef Py_ssize_t pi
    for pi, move in moves:
        if type(values[pi]) is not _DTensor:
            return False
    for pi, move in moves:
        v = values[pi]
        if move is None:
            values[pi] = _get_local(<DTensorBase>v)
            continue
        arr = run(_move_entry(move), _local_arr(v))
        values[pi] = _move_input(v, move, mesh) if arr is None else _new_tensor(arr, None)
    global _moved_hits
    _moved_hits += 1
    return True


def move_local(self, move):
    """This rank's local array of ``self`` moved as the dispatcher's ``move`` (a
    ``Redist``: one-step ``steps`` from its ``src`` spec, the spec of ``self``, to its
    ``dst``), run from compiled code; None when the compiled path does not run that move
    (nothing ran: the caller runs the executor), also while a communication observer or
    check is on, so that they see the executor's calls. The move keeps its entry in its
    ``fast`` slot. **Collective** when the move communicates."""
    if type(self) is not _DTensor or _move_form is None or traced():
        return None
    return run(_move_entry(move), _local_arr(self))
