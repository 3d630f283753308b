# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, binding=True, embedsignature=True
"""Compiled local kernels for host arrays of float32 and float64.

This module owns the loops that numpy has no single ufunc for, or whose ufunc call costs
more than the arithmetic on a small array: ``relu`` (``maximum(x, 0)``: NaN stays NaN, -0
becomes 0), ``erf``, ``gelu`` (exact and tanh forms), and ``softmax`` / ``log_softmax``
along the last axis. Each kernel serves C-contiguous, aligned, native-order float32 and
float64 numpy arrays (and an optional output array of the same kind, shape and dtype); any
other input (another dtype, strides, a cupy array) goes to the array-module twin the kernel
was built with, so callers never need to check. Loops over large arrays release the GIL.

It also holds the compiled twins of the elementwise kernels' short-path condition
(:func:`fast_path`, and :func:`short_binary`, which applies it to two arrays and runs the
ufunc; their references are in ``dtensor.local.kernels.pointwise``).

dtensor's local math uses these kernels when the compiled extension is enabled; with
``DTENSOR_FASTPATH=0`` (or without the extension) it runs the array-module twins, so both
forms are exercised by the test suite. Every function here is **Local**.
"""

cimport cython
cimport numpy as cnp
from cython cimport floating
from libc.math cimport erf, erff, exp, expf, log, tanh, tanhf, sqrt

cnp.import_array()

__all__ = ["Unary", "fast_path", "short_binary", "softmax_lastdim"]

cdef enum:
    K_RELU = 0
    K_ERF = 1
    K_GELU = 2
    K_GELU_TANH = 3

cdef Py_ssize_t NOGIL_MIN = 65536    # elements from which a loop releases the GIL

cdef double SQRT1_2 = sqrt(0.5)
cdef double SQRT_2_PI = sqrt(2.0 / 3.141592653589793)
cdef double GELU_C = 0.044715

_KINDS = {"relu": K_RELU, "erf": K_ERF, "gelu": K_GELU, "gelu_tanh": K_GELU_TANH}


cdef inline bint _plain(object a):
    """A C-contiguous, aligned, native-order float32/float64 numpy array."""
    if type(a) is not cnp.ndarray:
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    cdef int t = cnp.PyArray_TYPE(arr)
    return (t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT64) and cnp.PyArray_ISCARRAY_RO(arr)


cdef inline cnp.ndarray _output(cnp.ndarray a, object out):
    """``out`` when it can take the result of an elementwise kernel on ``a``, a new array
    shaped like ``a`` when ``out`` is None, else None (the caller falls back)."""
    if out is None:
        return cnp.PyArray_EMPTY(cnp.PyArray_NDIM(a), cnp.PyArray_DIMS(a),
                                 cnp.PyArray_TYPE(a), 0)
    if not _plain(out):
        return None
    cdef cnp.ndarray o = <cnp.ndarray>out
    if (cnp.PyArray_TYPE(o) != cnp.PyArray_TYPE(a) or cnp.PyArray_SIZE(o) != cnp.PyArray_SIZE(a)
            or not cnp.PyArray_ISWRITEABLE(o)):
        return None
    return o


cdef inline floating _erf(floating v) noexcept nogil:
    if floating is float:
        return erff(v)
    else:
        return erf(v)


cdef inline floating _tanh(floating v) noexcept nogil:
    if floating is float:
        return tanhf(v)
    else:
        return tanh(v)


cdef inline floating _exp(floating v) noexcept nogil:
    if floating is float:
        return expf(v)
    else:
        return exp(v)


cdef void _loop(int kind, const floating* x, floating* y, Py_ssize_t n) noexcept nogil:
    """One elementwise kernel over ``n`` elements, in the precision of ``floating``."""
    cdef Py_ssize_t i
    cdef floating v
    cdef floating s1 = <floating>SQRT1_2, s2 = <floating>SQRT_2_PI, c = <floating>GELU_C
    cdef floating half = <floating>0.5
    if kind == K_RELU:
        for i in range(n):
            v = x[i]
            y[i] = v if (v > 0 or v != v) else 0
    elif kind == K_ERF:
        for i in range(n):
            y[i] = _erf(x[i])
    elif kind == K_GELU:
        for i in range(n):
            v = x[i]
            y[i] = (_erf(v * s1) + 1) * v * half
    else:
        for i in range(n):
            v = x[i]
            y[i] = (_tanh((v * v * c + 1) * v * s2) + 1) * v * half


cdef inline void _unary(int kind, bint f32, void* x, void* y, Py_ssize_t n) noexcept nogil:
    if f32:
        _loop(kind, <const float*>x, <float*>y, n)
    else:
        _loop(kind, <const double*>x, <double*>y, n)


@cython.final
cdef class Unary:
    """An elementwise kernel ``kernel(a, out)`` (``out``: an array or None) with its
    array-module twin ``fallback(a, out)`` for inputs the loop does not serve. **Local**.

    ``kind`` is one of ``relu``, ``erf``, ``gelu`` (``x * Phi(x)`` through erf) and
    ``gelu_tanh`` (PyTorch's tanh approximation).
    """

    def __init__(self, str kind, fallback):
        if kind not in _KINDS:
            raise ValueError(f"Unary: unknown kernel {kind!r}; one of {sorted(_KINDS)}")
        self.kind = _KINDS[kind]
        self.name = kind
        self.fallback = fallback

    def __call__(self, a, out=None):
        return self.apply(a, out)

    cdef object apply(self, object a, object out):
        """The kernel on ``a`` (``out``: an array or None); C-level entry for other modules."""
        if not _plain(a):
            return self.fallback(a, out)
        cdef cnp.ndarray x = <cnp.ndarray>a
        cdef cnp.ndarray y = _output(x, out)
        if y is None:
            return self.fallback(a, out)
        cdef Py_ssize_t n = cnp.PyArray_SIZE(x)
        cdef bint f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
        cdef void* px = cnp.PyArray_DATA(x)
        cdef void* py = cnp.PyArray_DATA(y)
        if n >= NOGIL_MIN:
            with nogil:
                _unary(self.kind, f32, px, py, n)
        else:
            _unary(self.kind, f32, px, py, n)
        return y

    def __repr__(self):
        return f"<compiled kernel {self.name}>"


cdef void _softmax_rows(const floating* x, floating* y, Py_ssize_t rows, Py_ssize_t n,
                        bint take_log) noexcept nogil:
    """softmax (or log_softmax) of ``rows`` contiguous rows of ``n``; sums in double."""
    cdef Py_ssize_t r, i
    cdef floating m, v, ls
    cdef double s
    for r in range(rows):
        m = x[0]
        for i in range(1, n):
            v = x[i]
            if v > m or v != v:
                m = v
                if v != v:
                    break
        s = 0
        if take_log:
            for i in range(n):
                s += _exp(x[i] - m)
            ls = <floating>log(s)
            for i in range(n):
                y[i] = (x[i] - m) - ls
        else:
            for i in range(n):
                v = _exp(x[i] - m)
                y[i] = v
                s += v
            ls = <floating>s
            for i in range(n):
                y[i] = y[i] / ls
        x += n
        y += n


cdef inline void _softmax(bint f32, void* x, void* y, Py_ssize_t rows, Py_ssize_t n,
                          bint take_log) noexcept nogil:
    if f32:
        _softmax_rows(<const float*>x, <float*>y, rows, n, take_log)
    else:
        _softmax_rows(<const double*>x, <double*>y, rows, n, take_log)


def softmax_lastdim(a, bint take_log, out=None):
    """``softmax`` (or ``log_softmax`` when ``take_log``) of ``a`` along its last axis, in
    its dtype, written to ``out`` when given (an array of the same kind, size and dtype) or
    to a new array; None when ``a`` or ``out`` is not served (``a`` must be a non-empty
    C-contiguous float32/float64 array of at least one dim): the caller computes it
    otherwise. **Local**.

    A slice holding NaN gives NaN; an all ``-inf`` slice gives NaN (as ``exp(x - max)``
    does); sums accumulate in float64.
    """
    if not _plain(a):
        return None
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(x)
    cdef Py_ssize_t size = cnp.PyArray_SIZE(x)
    if nd == 0 or size == 0:
        return None
    cdef Py_ssize_t n = cnp.PyArray_DIMS(x)[nd - 1]
    cdef Py_ssize_t rows = size // n
    cdef cnp.ndarray y = _output(x, out)
    if y is None:
        return None
    cdef bint f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
    cdef void* px = cnp.PyArray_DATA(x)
    cdef void* py = cnp.PyArray_DATA(y)
    if size >= NOGIL_MIN:
        with nogil:
            _softmax(f32, px, py, rows, n, take_log)
    else:
        _softmax(f32, px, py, rows, n, take_log)
    return y


cdef inline bint _short(frozenset fast, Py_ssize_t limit, object a, object b) except -1:
    if a.ndim == 0 or a.nbytes >= limit:
        return False
    if b is not None and b.nbytes >= limit:
        return False
    return a.dtype in fast


def fast_path(frozenset fast, Py_ssize_t limit, a, b=None):
    """Whether an elementwise kernel takes its short path on ``a`` (and ``b``): ``a``'s dtype
    is in ``fast``, ``a`` is not 0-d, and ``a`` and ``b`` hold fewer than ``limit`` bytes.

    The compiled twin of ``dtensor.local.kernels.pointwise.fast_path_reference`` (same
    answer for any objects with ``dtype``, ``ndim`` and ``nbytes``).
    """
    return _short(fast, limit, a, b)


def short_binary(ufunc, frozenset fast, Py_ssize_t limit, a, b):
    """``ufunc(a, b)`` when two arrays of one dtype take the short path (:func:`fast_path`),
    else None: the hot path of ``t + u``, at the cost of the condition written inline."""
    if a.dtype is b.dtype and _short(fast, limit, a, b):
        return ufunc(a, b)
    return None
