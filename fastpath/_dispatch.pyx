# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, binding=True, embedsignature=True
# cython: c_api_binop_methods=True
"""Compiled dispatch of ops on DTensors: the front of the propagation cache.

This module owns

* the compiled base classes of dtensor's local ``Tensor`` (:class:`TensorBase`: the slots
  ``_arr``, ``_std``, ``_storage``) and of ``DTensor`` (:class:`DTensorBase`: ``_local``,
  ``_spec``), so that compiled code creates and reads them at C speed;
* :class:`FastOp`: one op served from compiled code. A call binds its arguments (the twin
  of the Python binder), builds the cache key from metadata (the identity of each DTensor
  input's spec, each python scalar's type, the decision-relevant static values and the
  default float dtype), looks it up in a small identity-keyed front table and, on a hit,
  runs the stored entry: the local kernel (or, where the entry says so, the raw ndarray
  ufunc the kernel would call) on the local arrays, wrapped into the output Tensor and
  DTensor. Entries that redistribute inputs run their cached plan through the entry runner
  (a one-step move runs in the compiled executor, ``fastpath._redist``).
  A front miss goes to the Python dispatcher, whose propagation cache decides (and counts)
  the hit or miss; the front then remembers the entry;
* quiet raw forms: what the front runs for an op that computes, with numpy's floating-point
  errors ignored in the context dtensor plugs in (:func:`set_quiet`), as its kernels do.

The front only ever holds entries that are live in the Python cache: every eviction or
clear of that cache bumps a generation that invalidates the front. Hits served here touch
their entry for the LRU lazily (``flush`` replays the touches in order before the Python
cache is next used), so eviction order is exactly that of the Python path.

dtensor plugs this module in at import (:func:`install`); it never imports dtensor itself.
Every function here is **Local** unless the op it runs redistributes (then **Collective**).
"""

cimport cython
from numpy import asarray as _asarray
from numpy import ndarray as _ndarray
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM
from cpython.weakref cimport PyWeakref_NewRef
from cpython.object cimport PyObject, PyTypeObject
from libc.string cimport memcpy
from libc.stdint cimport uintptr_t
cimport numpy as cnp
from placements.meta import dtype_kind as _dtype_kind
from fastpath._kernels cimport Unary, copy_c_order
from fastpath._redist cimport RedistEntry, new_entry, reset_counts, run, run_count, traced

cnp.import_array()

__all__ = [
    "AutogradMeta",
    "DTensorBase",
    "FastOp",
    "TensorBase",
    "flush",
    "install_redistribute",
    "install_tensor",
    "invalidate",
    "make_function",
    "make_method",
    "make_operator",
    "NodeBase",
    "PLUG_FIELDS",
    "plug",
    "plugged",
    "recorder_served",
    "RecordPlan",
    "RAW_FORMS",
    "SLOT_TAGS",
    "set_flags",
    "set_slot_ops",
    "set_versions",
    "stats",
    "unsave",
    "move_local",
    "redistribute",
    "reset_stats",
    "wrap",
]

# The raw forms of an entry (chosen by the Python dispatcher's ``raw_form``): the front
# stores them (_dispatch_front.pxi), the runners run them (_dispatch_run.pxi).
cdef enum:
    RAW_NONE = 0
    RAW_BINARY = 1               # ufunc(local_a, local_b[, out=])
    RAW_SCALAR = 2               # ufunc(local_a, python scalar[, out=]); OverflowError, or an
                                 # int outside the entry's [lo, hi] -> the kernel
    RAW_UNARY = 3                # fn(local_a, out)
    RAW_VIEW = 4                 # local_a.reshape(local out shape) of a standard local_a
    RAW_T = 5                    # local_a.T (2-D)
    RAW_GETITEM = 6              # local_a[basic index] when it has elements
    RAW_REDUCE = 7               # ufunc.reduce(local_a, axes, dtype, out, keepdim) [* scale]
    RAW_COPY = 8                 # clone: a copy of a C-contiguous host local_a
    RAW_CONTIG = 9               # contiguous: a C-order copy of a non-C-contiguous host local_a

# The raw forms as Python values, for the dispatcher that chooses them.
RAW_FORMS = {
    "binary": RAW_BINARY, "scalar": RAW_SCALAR, "unary": RAW_UNARY, "view": RAW_VIEW,
    "t": RAW_T, "getitem": RAW_GETITEM, "reduce": RAW_REDUCE, "clone": RAW_COPY,
    "contiguous": RAW_CONTIG,
}

# The parts of the module, included in this order (textually, at module level).
include "_dispatch_bases.pxi"  # TensorBase, DTensorBase, operator slots, set_slot_ops
include "_dispatch_plugs.pxi"  # plug, install_tensor, plugged globals, wrap, constructors
include "_dispatch_quiet.pxi"  # set_quiet: raw forms with numpy's FP errors ignored
include "_dispatch_lru.pxi"    # counters, generation, queued touches: invalidate, flush, stats
include "_dispatch_keys.pxi"   # key markers, simple statics, hashes, _frozen, _same
include "_dispatch_front.pxi"  # FrontEntry and FastOp: binding, front table, lookup, fill
include "_dispatch_record.pxi" # the compiled recorder, AutogradMeta, NodeBase
include "_dispatch_run.pxi"    # runners: _raw_pair, _run (raw forms, kernel, entry runner)
include "_dispatch_guard.pxi"  # Guard: a Tensor method's autograd guard, a C type
include "_dispatch_entry.pxi"  # make_method, make_operator, make_function
include "_dispatch_redist.pxi" # redistribute and input moves by fastpath._redist, their plugs
