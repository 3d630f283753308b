# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, binding=True, embedsignature=True
"""Compiled local kernels for host arrays of float32 and float64.

This module owns the loops that numpy has no single ufunc for, or whose numpy form costs
several passes over memory or more call overhead than arithmetic on a small array: ``relu``
(``maximum(x, 0)``: NaN stays NaN, -0 becomes 0), ``erf``, ``gelu`` (exact and tanh forms),
``softmax`` / ``log_softmax`` along the last axis, and for float32 only ``layer_norm`` over
the trailing dims and the ``sum`` / ``mean`` / ``amax`` of rows (the last axis, or the whole
array). The backward side: ``gelu_backward`` (both forms) and ``layer_norm_backward`` (one
fused pass per row instead of a dozen array passes), and ``adam_step``, the whole Adam(W)
update of one parameter in one pass (float32 and float64 each). Each kernel serves C-contiguous, aligned, native-order numpy arrays of the dtypes it
names; the elementwise ones write into an optional output array of the same kind, shape and
dtype, the row ones into an array from the caller's allocator. Any other input (another
dtype, strides, a cupy array) goes to the array-module twin the kernel was built with, or
the kernel answers None and the caller runs its twin, so callers never need to check.
Loops over large arrays release the GIL.

float32 runs the vectorised C loops of ``_kernels_simd.pxi`` (exp, erf and tanh written as
polynomials, accurate to 1-2 ulp; ``sum`` and ``mean`` in 16 float32 lanes with float64
block totals: about as accurate as numpy's pairwise sum, not its bits); float64 runs
scalar loops on libm.

It also holds the compiled twins of the elementwise kernels' short-path condition
(:func:`fast_path`, and :func:`short_binary`, which applies it to two arrays and runs the
ufunc; their references are in ``dtensor.local.kernels.pointwise``).

dtensor's local math uses these kernels when the compiled extension is enabled; with
``DTENSOR_FASTPATH=0`` (or without the extension) it runs the array-module twins, so both
forms are exercised by the test suite. The row sums and means are the exception: their
summation order is not numpy's, so dtensor runs them wherever the extension is built (in
both dispatch modes, which then give identical bytes); only an install without the
extension sums with numpy (equal within float32 rounding). Every function here is
**Local**.
"""

cimport cython
cimport numpy as cnp
from libc.math cimport erf, exp, log, tanh, sqrt

cnp.import_array()

include "_kernels_simd.pxi"

__all__ = ["Unary", "adam_step", "fast_path", "gelu_backward", "layer_norm",
           "layer_norm_backward", "reduce_lastdim", "short_binary", "softmax_lastdim"]

cdef Py_ssize_t NOGIL_MIN = 65536    # elements from which a loop releases the GIL

cdef double SQRT1_2 = sqrt(0.5)
cdef double SQRT_2_PI = sqrt(2.0 / 3.141592653589793)
cdef double GELU_C = 0.044715

_KINDS = {"relu": DTK_RELU, "erf": DTK_ERF, "gelu": DTK_GELU, "gelu_tanh": DTK_GELU_TANH}
_REDUCTIONS = {"sum": DTK_SUM, "mean": DTK_MEAN, "amax": DTK_MAX}


cdef inline bint _plain(object a):
    """A C-contiguous, aligned, native-order float32/float64 numpy array."""
    if type(a) is not cnp.ndarray:
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    cdef int t = cnp.PyArray_TYPE(arr)
    return (t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT64) and cnp.PyArray_ISCARRAY_RO(arr)


cdef inline bint _plain32(object a):
    """A C-contiguous, aligned, native-order float32 numpy array."""
    return _plain(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_FLOAT32


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


cdef void _loop(int kind, const double* x, double* y, Py_ssize_t n) noexcept nogil:
    """One elementwise kernel over ``n`` float64 elements, on libm."""
    cdef Py_ssize_t i
    cdef double v
    if kind == DTK_RELU:
        for i in range(n):
            v = x[i]
            y[i] = v if (v > 0 or v != v) else 0
    elif kind == DTK_ERF:
        for i in range(n):
            y[i] = erf(x[i])
    elif kind == DTK_GELU:
        for i in range(n):
            v = x[i]
            y[i] = (erf(v * SQRT1_2) + 1) * v * 0.5
    else:
        for i in range(n):
            v = x[i]
            y[i] = (tanh((v * v * GELU_C + 1) * v * SQRT_2_PI) + 1) * v * 0.5


cdef inline void _unary(int kind, bint f32, void* x, void* y, Py_ssize_t n) noexcept nogil:
    if f32:
        dtk_unary_f32(kind, <const float*>x, <float*>y, n)
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


cdef void _softmax_rows(const double* x, double* y, Py_ssize_t rows, Py_ssize_t n,
                        bint take_log) noexcept nogil:
    """float64 softmax (or log_softmax) of ``rows`` contiguous rows of ``n``, on libm."""
    cdef Py_ssize_t r, i
    cdef double m, v, s, ls
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
                s += exp(x[i] - m)
            ls = log(s)
            for i in range(n):
                y[i] = (x[i] - m) - ls
        else:
            for i in range(n):
                v = exp(x[i] - m)
                y[i] = v
                s += v
            for i in range(n):
                y[i] = y[i] / s
        x += n
        y += n


cdef inline void _softmax(bint f32, void* x, void* y, Py_ssize_t rows, Py_ssize_t n,
                          bint take_log) noexcept nogil:
    if f32:
        dtk_softmax_f32(<const float*>x, <float*>y, rows, n, take_log)
    else:
        _softmax_rows(<const double*>x, <double*>y, rows, n, take_log)


def softmax_lastdim(a, bint take_log, alloc=None):
    """``softmax`` (or ``log_softmax`` when ``take_log``) of ``a`` along its last axis, in
    its dtype, as a new array from ``alloc(shape, dtype, a)`` (the caller's output policy;
    ``alloc`` None or its answer None: numpy allocates); None when not served (``a`` must be
    a non-empty C-contiguous float32/float64 array of at least one dim): the caller computes
    it otherwise. **Local**.

    A slice holding NaN gives NaN; an all ``-inf`` slice gives NaN (as ``exp(x - max)``
    does). float32 sums accumulate in float32 lanes with float64 block totals
    (``_kernels_simd.pxi``), float64 ones in float64.
    """
    if not _plain(a):
        return None
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(x)
    cdef Py_ssize_t size = cnp.PyArray_SIZE(x)
    if nd == 0 or size == 0:
        return None
    y = _allocated(alloc, x, a.shape, size)
    if y is None:
        return None
    _softmax_into(x, <cnp.ndarray>y, take_log)
    return y


cdef void _softmax_into(cnp.ndarray x, cnp.ndarray y, bint take_log):
    """(log_)softmax of the plain non-empty array ``x`` along its last axis into ``y``."""
    cdef int nd = cnp.PyArray_NDIM(x)
    cdef Py_ssize_t size = cnp.PyArray_SIZE(x)
    cdef Py_ssize_t n = cnp.PyArray_DIMS(x)[nd - 1]
    cdef Py_ssize_t rows = size // n
    cdef bint f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
    cdef void* px = cnp.PyArray_DATA(x)
    cdef void* py = cnp.PyArray_DATA(y)
    if size >= NOGIL_MIN:
        with nogil:
            _softmax(f32, px, py, rows, n, take_log)
    else:
        _softmax(f32, px, py, rows, n, take_log)


cdef class LastDimSoftmax:
    """``f(a, out)`` of the compiled front's raw unary form for softmax (log_softmax when
    ``take_log``) along the last axis: the loop of :func:`softmax_lastdim` on a non-empty
    C-contiguous float32/float64 array of at least one dim, into ``out`` when it can take
    the result (else a new array); anything else goes to ``fallback(a, out)``. **Local**.
    """

    cdef bint take_log
    cdef object fallback

    def __init__(self, bint take_log, fallback):
        self.take_log = take_log
        self.fallback = fallback

    def __call__(self, a, out):
        cdef cnp.ndarray x
        cdef Py_ssize_t size
        if _plain(a):
            x = <cnp.ndarray>a
            size = cnp.PyArray_SIZE(x)
            if cnp.PyArray_NDIM(x) > 0 and size > 0:
                if out is None:
                    out = _allocated(None, x, a.shape, size)
                elif not _can_take(out, x, size):
                    return self.fallback(a, out)
                _softmax_into(x, <cnp.ndarray>out, self.take_log)
                return out
        return self.fallback(a, out)


cdef inline const float* _affine(object p, Py_ssize_t n, bint* ok):
    """The data of a layer_norm weight/bias ``p`` (NULL for None); ``ok`` false when ``p``
    is not a plain float32 array of ``n`` elements."""
    if p is None:
        return NULL
    if not _plain32(p) or cnp.PyArray_SIZE(<cnp.ndarray>p) != n:
        ok[0] = False
        return NULL
    return <const float*>cnp.PyArray_DATA(<cnp.ndarray>p)


def layer_norm(a, normalized_shape, weight, bias, double eps, alloc=None):
    """``layer_norm`` of the float32 array ``a`` over its trailing ``normalized_shape``
    (an int or a tuple/list of ints) with optional ``weight`` and ``bias`` arrays, as a new
    array from ``alloc(shape, dtype, a)`` (as for :func:`softmax_lastdim`); None when not
    served: ``a`` must be a non-empty C-contiguous float32 array whose trailing dims are
    ``normalized_shape``, ``weight`` / ``bias`` None or C-contiguous float32 arrays of that
    size. **Local**.

    ``(x - mean) * rsqrt(var + eps) * weight + bias`` per row, the biased variance taken
    from a second pass over ``x - mean``; its sums accumulate in float32 lanes with float64
    block totals (``_kernels_simd.pxi``).
    """
    if not _plain32(a):
        return None
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(x)
    cdef Py_ssize_t size = cnp.PyArray_SIZE(x)
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(x)
    cdef Py_ssize_t n = 1, k, i
    if type(normalized_shape) is int:
        normalized_shape = (normalized_shape,)
    elif type(normalized_shape) is not tuple and type(normalized_shape) is not list:
        return None
    k = len(normalized_shape)
    if size == 0 or k == 0 or k > nd:
        return None
    for i in range(k):
        v = normalized_shape[i]
        if type(v) is not int or v != dims[nd - k + i]:
            return None
        n *= dims[nd - k + i]
    cdef bint ok = True
    cdef const float* pw = _affine(weight, n, &ok)
    cdef const float* pb = _affine(bias, n, &ok)
    if not ok:
        return None
    y = _allocated(alloc, x, a.shape, size)
    if y is None:
        return None
    cdef const float* px = <const float*>cnp.PyArray_DATA(x)
    cdef float* py = <float*>cnp.PyArray_DATA(<cnp.ndarray>y)
    cdef Py_ssize_t rows = size // n
    if size >= NOGIL_MIN:
        with nogil:
            dtk_layer_norm_f32(px, py, rows, n, pw, pb, eps)
    else:
        dtk_layer_norm_f32(px, py, rows, n, pw, pb, eps)
    return y


cdef object _allocated(object alloc, cnp.ndarray a, tuple shape, Py_ssize_t size):
    """An array of ``shape`` (``size`` elements) in ``a``'s dtype from
    ``alloc(shape, dtype, a)``, or from numpy when ``alloc`` is None or answers None; None
    when ``alloc`` gives an array a loop cannot write (not a writeable C-contiguous array of
    that dtype and size)."""
    cdef cnp.npy_intp[64] dims        # NPY_MAXDIMS: 32 before numpy 2, 64 since
    cdef Py_ssize_t i
    y = None if alloc is None else alloc(shape, <object>cnp.PyArray_DESCR(a), a)
    if y is None:
        for i in range(len(shape)):
            dims[i] = shape[i]
        return cnp.PyArray_EMPTY(len(shape), dims, cnp.PyArray_TYPE(a), 0)
    return y if _can_take(y, a, size) else None


cdef inline bint _can_take(object y, cnp.ndarray a, Py_ssize_t size):
    """Whether a loop can write ``size`` elements of ``a``'s dtype into ``y``: a writeable
    C-contiguous array of that dtype and size."""
    return (_plain(y) and cnp.PyArray_TYPE(<cnp.ndarray>y) == cnp.PyArray_TYPE(a)
            and cnp.PyArray_SIZE(<cnp.ndarray>y) == size
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>y))


cdef enum:
    OVER_NONE = 0    # a dim the loop does not serve (the caller's numpy path decides)
    OVER_LAST = 1
    OVER_ALL = 2


cdef int _over(object dim, int nd) except -1:
    """Which axes of an ``nd``-dim array (nd >= 1) the reduction ``dim`` names: the last
    (an int, or a tuple or list of one), every axis (None, empty, or a tuple or list naming
    each once), or neither (also for anything invalid: bools, other types, out of range,
    repeated), as PyTorch reads ``dim``."""
    cdef int d, count = 0, last = 0
    cdef unsigned long long seen = 0
    if dim is None:
        return OVER_ALL
    if type(dim) is int:
        return OVER_LAST if dim == -1 or dim == nd - 1 else OVER_NONE
    if (type(dim) is not tuple and type(dim) is not list) or nd > 64:
        return OVER_NONE
    if not dim:
        return OVER_ALL
    for v in dim:
        if type(v) is not int or not -nd <= v < nd:
            return OVER_NONE
        d = v + nd if v < 0 else v
        if seen >> d & 1:
            return OVER_NONE
        seen |= 1ULL << d
        count += 1
        last = d
    if count == nd:
        return OVER_ALL
    return OVER_LAST if count == 1 and last == nd - 1 else OVER_NONE


def reduce_lastdim(str op, a, dim, bint keepdim, dtype, alloc=None):
    """``op`` (``"sum"``, ``"mean"`` or ``"amax"``) of the float32 array ``a`` over its last
    axis (``dim`` an int, or a tuple or list of one, naming it) or over every axis (``dim``
    None, ``()``, or a tuple or list of ints naming each axis once), as a new array from ``alloc(shape, dtype, a)`` (as for
    :func:`softmax_lastdim`); None when not served: ``a`` must be a non-empty C-contiguous
    float32 array of at least one dim, and ``dtype`` None or float32 itself. **Local**.

    A sum runs the lanes summation of ``_kernels_simd.pxi`` (float32 lanes, float64 block
    totals, rounded once: within float32 rounding of numpy's pairwise ``np.add.reduce``,
    not bit for bit) and a mean is that sum divided by the count in float32, as
    ``np.mean`` divides its sum; a maximum is NaN where a NaN is reduced.
    """
    if not _plain32(a):
        return None
    if dtype is not None and dtype is not <object>cnp.PyArray_DESCR(<cnp.ndarray>a):
        return None
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(x)
    cdef Py_ssize_t size = cnp.PyArray_SIZE(x)
    if nd == 0 or size == 0:
        return None
    cdef Py_ssize_t n
    cdef tuple shape
    cdef int over = _over(dim, nd)
    if over == OVER_ALL:
        n = size
        shape = (1,) * nd if keepdim else ()
    elif over == OVER_LAST:
        n = cnp.PyArray_DIMS(x)[nd - 1]
        shape = a.shape[:nd - 1] + (1,) if keepdim else a.shape[:nd - 1]
    else:
        return None
    cdef int kind = _REDUCTIONS[op]
    cdef Py_ssize_t rows = size // n
    y = _allocated(alloc, x, shape, rows)
    if y is None:
        return None
    _reduce_rows(kind, x, <cnp.ndarray>y, rows, n)
    return y


cdef class LastDimReduce:
    """``ufunc.reduce``'s call ``(a, axes, dtype, out, keepdims)`` for one reduction
    (``"sum"`` or ``"amax"``): over the last axis or every axis of a non-empty C-contiguous
    float32 array (``dtype`` None or float32) it runs the compiled loop of
    :func:`reduce_lastdim` (its lanes sum, the bytes the local kernels give in both
    dispatch modes; the NaN-propagating maximum), into ``out`` when ``out`` is a writeable C-contiguous float32 array of the
    result's size; everything else goes to ``fallback`` (``np.add.reduce``,
    ``np.maximum.reduce``) unchanged. **Local**.
    """

    cdef int kind
    cdef object fallback

    def __init__(self, str op, fallback):
        if op not in ("sum", "amax"):
            raise ValueError(f"LastDimReduce: op must be 'sum' or 'amax', got {op!r}")
        self.kind = _REDUCTIONS[op]
        self.fallback = fallback

    def __call__(self, a, tuple axes, dtype, out, bint keepdims):
        cdef cnp.ndarray x
        cdef int nd
        cdef Py_ssize_t size, n, rows
        cdef tuple shape
        if _plain32(a) and (dtype is None or dtype is <object>cnp.PyArray_DESCR(<cnp.ndarray>a)):
            x = <cnp.ndarray>a
            nd = cnp.PyArray_NDIM(x)
            size = cnp.PyArray_SIZE(x)
            if nd > 0 and size > 0 and len(axes) == 1 and axes[0] == nd - 1:
                n = cnp.PyArray_DIMS(x)[nd - 1]
                shape = a.shape[:nd - 1] + (1,) if keepdims else a.shape[:nd - 1]
            elif nd > 0 and size > 0 and len(axes) == nd:
                n = size
                shape = (1,) * nd if keepdims else ()
            else:
                return self.fallback(a, axes, dtype, out, keepdims)
            rows = size // n
            if out is None:
                out = _allocated(None, x, shape, rows)
            elif not _can_take(out, x, rows):
                return self.fallback(a, axes, dtype, out, keepdims)
            _reduce_rows(self.kind, x, <cnp.ndarray>out, rows, n)
            return out
        return self.fallback(a, axes, dtype, out, keepdims)


cdef void _reduce_rows(int kind, cnp.ndarray x, cnp.ndarray y, Py_ssize_t rows, Py_ssize_t n):
    """The compiled reduce loop of ``x`` (``rows`` x ``n`` float32) into ``y`` (``rows``)."""
    cdef const float* px = <const float*>cnp.PyArray_DATA(x)
    cdef float* py = <float*>cnp.PyArray_DATA(y)
    if rows * n >= NOGIL_MIN:
        with nogil:
            dtk_reduce_f32(kind, px, py, rows, n)
    else:
        dtk_reduce_f32(kind, px, py, rows, n)


cdef extern from *:
    """
    /* D = transpose(S) for each of `batch` matrices: S is cols x rows and D rows x cols,
       both C-contiguous, elements of `isz` bytes.

       Blocks of one cache line a side (64 / isz elements) are gathered into an aligned
       buffer, then written out a whole line per row: every line read and every line
       written is touched once (a plain strided copy misses on every element of one side
       once a matrix outgrows the cache, and more so at power-of-two strides). With SSE2
       (every x86-64), 4- and 8-byte elements are gathered by 4x4 and 2x2 register
       transposes. Blocks run along the source's rows (sequential reads) inside tiles of
       DTK_TILE x DTK_TILE elements. Outputs of `stream` (the caller's size threshold)
       with 16-byte aligned rows are written by non-temporal stores: a large output then
       costs no read for ownership and does not evict the source from the cache. Edges
       that are not a whole block are copied element by element. */
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #define DTK_SSE2 1
    #endif
    #define DTK_TILE 64
    #define DTK_LINE 64

    static inline void dtk_put_line(char* d, const char* src, int nt) {
    #ifdef DTK_SSE2
        if (nt) {
            _mm_stream_si128((__m128i*)d, _mm_load_si128((const __m128i*)src));
            _mm_stream_si128((__m128i*)(d + 16), _mm_load_si128((const __m128i*)(src + 16)));
            _mm_stream_si128((__m128i*)(d + 32), _mm_load_si128((const __m128i*)(src + 32)));
            _mm_stream_si128((__m128i*)(d + 48), _mm_load_si128((const __m128i*)(src + 48)));
            return;
        }
    #endif
        memcpy(d, src, DTK_LINE);
    }

    /* the block at source row j, column i into blk (blk[ii][jj] = s[(j+jj)*rows + i+ii]) */
    #define DTK_GATHER_SCALAR(T, BK)                                                   \
        for (int jj = 0; jj < BK; jj++)                                                \
            for (int ii = 0; ii < BK; ii++)                                            \
                blk[ii][jj] = s[(j + jj) * rows + i + ii];
    #ifdef DTK_SSE2
    #define DTK_GATHER_4(T, BK)                                                        \
        for (int jj = 0; jj < BK; jj += 4)                                             \
            for (int ii = 0; ii < BK; ii += 4) {                                       \
                const T* q = s + (j + jj) * rows + i + ii;                             \
                __m128 r0 = _mm_loadu_ps((const float*)q);                             \
                __m128 r1 = _mm_loadu_ps((const float*)(q + rows));                    \
                __m128 r2 = _mm_loadu_ps((const float*)(q + 2 * rows));                \
                __m128 r3 = _mm_loadu_ps((const float*)(q + 3 * rows));                \
                _MM_TRANSPOSE4_PS(r0, r1, r2, r3);                                     \
                _mm_store_ps((float*)&blk[ii][jj], r0);                                \
                _mm_store_ps((float*)&blk[ii + 1][jj], r1);                            \
                _mm_store_ps((float*)&blk[ii + 2][jj], r2);                            \
                _mm_store_ps((float*)&blk[ii + 3][jj], r3);                            \
            }
    #define DTK_GATHER_8(T, BK)                                                        \
        for (int jj = 0; jj < BK; jj += 2)                                             \
            for (int ii = 0; ii < BK; ii += 2) {                                       \
                const T* q = s + (j + jj) * rows + i + ii;                             \
                __m128i r0 = _mm_loadu_si128((const __m128i*)q);                       \
                __m128i r1 = _mm_loadu_si128((const __m128i*)(q + rows));              \
                _mm_store_si128((__m128i*)&blk[ii][jj], _mm_unpacklo_epi64(r0, r1));   \
                _mm_store_si128((__m128i*)&blk[ii + 1][jj], _mm_unpackhi_epi64(r0, r1)); \
            }
    #else
    #define DTK_GATHER_4 DTK_GATHER_SCALAR
    #define DTK_GATHER_8 DTK_GATHER_SCALAR
    #endif

    #define DTK_TRANSPOSE_FN(NAME, T, GATHER)                                          \
    static void NAME(const T* src, T* dst, Py_ssize_t batch, Py_ssize_t rows,          \
                     Py_ssize_t cols, int stream) {                                    \
        enum { BK = DTK_LINE / sizeof(T) };                                            \
        T blk[BK][BK] __attribute__((aligned(64)));                                    \
        int nt = stream && ((uintptr_t)dst % 16 == 0) && ((cols * sizeof(T)) % 16 == 0); \
        for (Py_ssize_t b = 0; b < batch; b++) {                                       \
            const T* s = src + b * rows * cols;                                        \
            T* d = dst + b * rows * cols;                                              \
            for (Py_ssize_t i0 = 0; i0 < rows; i0 += DTK_TILE)                         \
            for (Py_ssize_t j0 = 0; j0 < cols; j0 += DTK_TILE) {                       \
                Py_ssize_t i1 = i0 + DTK_TILE < rows ? i0 + DTK_TILE : rows;           \
                Py_ssize_t j1 = j0 + DTK_TILE < cols ? j0 + DTK_TILE : cols;           \
                for (Py_ssize_t j = j0; j < j1; j += BK)                               \
                for (Py_ssize_t i = i0; i < i1; i += BK) {                             \
                    if (i + BK <= i1 && j + BK <= j1) {                                \
                        GATHER(T, BK)                                                  \
                        for (int ii = 0; ii < BK; ii++)                                \
                            dtk_put_line((char*)(d + (i + ii) * cols + j),             \
                                         (const char*)blk[ii], nt);                    \
                    } else {                                                           \
                        Py_ssize_t ie = i + BK < i1 ? i + BK : i1;                     \
                        Py_ssize_t je = j + BK < j1 ? j + BK : j1;                     \
                        for (Py_ssize_t ii = i; ii < ie; ii++)                         \
                            for (Py_ssize_t jj = j; jj < je; jj++)                     \
                                d[ii * cols + jj] = s[jj * rows + ii];                 \
                    }                                                                  \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }
    DTK_TRANSPOSE_FN(dtk_transpose_1, uint8_t, DTK_GATHER_SCALAR)
    DTK_TRANSPOSE_FN(dtk_transpose_2, uint16_t, DTK_GATHER_SCALAR)
    DTK_TRANSPOSE_FN(dtk_transpose_4, uint32_t, DTK_GATHER_4)
    DTK_TRANSPOSE_FN(dtk_transpose_8, uint64_t, DTK_GATHER_8)

    static void dtk_transpose_copy(const void* src, void* dst, Py_ssize_t batch,
                                   Py_ssize_t rows, Py_ssize_t cols, int isz, int stream) {
        switch (isz) {
        case 1: dtk_transpose_1((const uint8_t*)src, (uint8_t*)dst, batch, rows, cols, stream); break;
        case 2: dtk_transpose_2((const uint16_t*)src, (uint16_t*)dst, batch, rows, cols, stream); break;
        case 4: dtk_transpose_4((const uint32_t*)src, (uint32_t*)dst, batch, rows, cols, stream); break;
        case 8: dtk_transpose_8((const uint64_t*)src, (uint64_t*)dst, batch, rows, cols, stream); break;
        }
    #ifdef DTK_SSE2
        if (stream)
            _mm_sfence();
    #endif
    }
    """
    void dtk_transpose_copy(const void* src, void* dst, Py_ssize_t batch, Py_ssize_t rows,
                            Py_ssize_t cols, int isz, int stream) nogil


cdef Py_ssize_t TRANSPOSE_MIN = 64     # elements from which the tiled copy pays (it beats
                                       # numpy's strided copy from 8x8 on)
# output bytes from which the tiled copy writes by non-temporal stores (beyond the 1-2 MiB
# of a core's L2 cache, where the output would only evict what is still to be read)
cdef Py_ssize_t TRANSPOSE_STREAM_MIN = 2 << 20


cdef object copy_c_order(object a, object out):
    """A C-order copy of the numpy array ``a`` into ``out`` (a new array when None), by a
    tiled transpose when ``a`` is the last-two-dims transpose of a C-contiguous array
    (``c.mT``: ``x.t().contiguous()``, attention's ``k.transpose(-2, -1)``) of elements of
    1, 2, 4 or 8 bytes and at least :data:`TRANSPOSE_MIN` elements, else by numpy. ``out``
    must be a C-contiguous array of ``a``'s shape and dtype. Returns ``out``."""
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(x)
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(x)
    cdef Py_ssize_t rows, cols, batch, i, step
    cdef int stream
    cdef cnp.npy_intp* dims
    cdef cnp.npy_intp* strides
    if (nd >= 2 and cnp.PyArray_SIZE(x) >= TRANSPOSE_MIN and isz in (1, 2, 4, 8)
            and cnp.PyArray_ISALIGNED(x) and cnp.PyArray_ISNOTSWAPPED(x)):
        dims = cnp.PyArray_DIMS(x)
        strides = cnp.PyArray_STRIDES(x)
        rows, cols = dims[nd - 2], dims[nd - 1]
        step = rows * cols * isz
        batch = 1
        ok = rows > 1 and cols > 1 and strides[nd - 2] == isz and strides[nd - 1] == rows * isz
        for i in range(nd - 3, -1, -1):
            if not ok:
                break
            ok = dims[i] == 1 or strides[i] == step * batch
            batch *= dims[i]
        if ok:
            if out is None:
                out = cnp.PyArray_EMPTY(nd, dims, cnp.PyArray_TYPE(x), 0)
            stream = step * batch >= TRANSPOSE_STREAM_MIN
            with nogil:
                dtk_transpose_copy(cnp.PyArray_DATA(x), cnp.PyArray_DATA(<cnp.ndarray>out),
                                   batch, rows, cols, <int>isz, stream)
            return out
    if out is None:
        return cnp.PyArray_NewCopy(x, cnp.NPY_CORDER)
    cnp.PyArray_CopyInto(<cnp.ndarray>out, x)
    return out


def copy_into(out, a):
    """Copy the numpy array ``a`` into the C-contiguous array ``out`` of its shape and dtype
    (:func:`copy_c_order`: a tiled transpose for ``c.mT`` layouts); returns ``out``.
    **Local**."""
    if type(a) is not cnp.ndarray or type(out) is not cnp.ndarray:
        raise TypeError("copy_into: numpy arrays expected")
    if (out.shape != a.shape or out.dtype != a.dtype or not out.flags.c_contiguous
            or not out.flags.writeable):
        raise ValueError("copy_into: out must be a writeable C-contiguous array of a's "
                         f"shape and dtype; got {out.shape} {out.dtype} for {a.shape} {a.dtype}")
    return copy_c_order(a, out)


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


# -- backward kernels and the optimizer step --------------------------------------------------
cdef inline bint _same_plain(object a, cnp.ndarray x):
    """``a`` a plain array (:func:`_plain`) of ``x``'s dtype and size."""
    return (_plain(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.PyArray_TYPE(x)
            and cnp.PyArray_SIZE(<cnp.ndarray>a) == cnp.PyArray_SIZE(x))


def gelu_backward(grad, a, bint tanh_form, alloc=None):
    """The gradient of ``gelu`` at ``a`` times ``grad`` (exact form, or PyTorch's tanh
    approximation with ``tanh_form``), in one pass, as a new array from
    ``alloc(shape, dtype, a)`` (as for :func:`softmax_lastdim`); None when not served:
    ``a`` and ``grad`` must be C-contiguous float32/float64 arrays of one dtype and shape.
    **Local**.

    float32 evaluates the terms of the formula with the polynomial erf, exp and tanh of
    ``_kernels_simd.pxi`` (a few ulp from the numpy twin's); float64 with libm.
    """
    if not _plain(a):
        return None
    cdef cnp.ndarray x = <cnp.ndarray>a
    if not _same_plain(grad, x) or grad.shape != a.shape:
        return None
    cdef Py_ssize_t n = cnp.PyArray_SIZE(x)
    y = _allocated(alloc, x, a.shape, n)
    if y is None:
        return None
    cdef void* pg = cnp.PyArray_DATA(<cnp.ndarray>grad)
    cdef void* px = cnp.PyArray_DATA(x)
    cdef void* py = cnp.PyArray_DATA(<cnp.ndarray>y)
    cdef bint f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
    with nogil:
        if f32:
            dtk_gelu_backward_f32(tanh_form, <const float*>pg, <const float*>px, <float*>py, n)
        else:
            dtk_gelu_backward_f64(tanh_form, <const double*>pg, <const double*>px,
                                  <double*>py, n)
    return y


def layer_norm_backward(grad, a, weight, Py_ssize_t n, double eps, bint want_weight,
                        alloc=None):
    """The backward of ``layer_norm`` of ``a`` over rows of its trailing ``n`` elements
    (weight ``weight`` or None) at output gradient ``grad``: ``(grad_input, grad_weight)``,
    ``grad_weight`` (float64, ``n`` elements, the sum over rows of ``grad * xhat``) None
    unless ``want_weight``; ``grad_input`` from ``alloc`` (as for :func:`softmax_lastdim`).
    None when not served: ``a`` and ``grad`` C-contiguous float32/float64 arrays of one
    dtype and shape, non-empty, rows of ``n``; ``weight`` None or such an array of ``n``.
    **Local**.

    One row at a time: its mean and rstd as the forward takes them (float32: the forward's
    own sums, so the same values bit for bit), then two passes over the row (while it is in
    cache) for ``grad_input`` and the row's share of ``grad_weight``.
    """
    if not _plain(a):
        return None
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef Py_ssize_t size = cnp.PyArray_SIZE(x)
    if n <= 0 or size == 0 or size % n or not _same_plain(grad, x) or grad.shape != a.shape:
        return None
    if weight is not None and (not _plain(weight)
                               or cnp.PyArray_TYPE(<cnp.ndarray>weight) != cnp.PyArray_TYPE(x)
                               or cnp.PyArray_SIZE(<cnp.ndarray>weight) != n):
        return None
    y = _allocated(alloc, x, a.shape, size)
    if y is None:
        return None
    cdef cnp.ndarray gw_arr = None
    cdef double* gw = NULL
    cdef cnp.npy_intp dn = n
    if want_weight:
        gw_arr = cnp.PyArray_ZEROS(1, &dn, cnp.NPY_FLOAT64, 0)
        gw = <double*>cnp.PyArray_DATA(gw_arr)
    cdef const void* pw = NULL if weight is None else cnp.PyArray_DATA(<cnp.ndarray>weight)
    cdef char* pg = <char*>cnp.PyArray_DATA(<cnp.ndarray>grad)
    cdef char* px = <char*>cnp.PyArray_DATA(x)
    cdef char* py = <char*>cnp.PyArray_DATA(<cnp.ndarray>y)
    cdef Py_ssize_t rows = size // n, r, i, off
    cdef float m32, rs32
    cdef double m64, rs64, s
    cdef const double* xr
    with nogil:
        if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
            for r in range(rows):
                off = r * n * 4
                m32 = <float>(dtk_sum(<const float*>(px + off), n) / <double>n)
                rs32 = <float>(1.0 / sqrt(dtk_sumsq(<const float*>(px + off), n, m32)
                                          / <double>n + eps))
                dtk_layer_norm_backward_f32(<const float*>(pg + off), <const float*>(px + off),
                                            &m32, &rs32, <const float*>pw,
                                            <float*>(py + off), gw, 1, n)
        else:
            for r in range(rows):
                off = r * n * 8
                xr = <const double*>(px + off)
                s = 0.0
                for i in range(n):
                    s = s + xr[i]
                m64 = s / <double>n
                s = 0.0
                for i in range(n):
                    s = s + (xr[i] - m64) * (xr[i] - m64)
                rs64 = 1.0 / sqrt(s / <double>n + eps)
                dtk_layer_norm_backward_f64(<const double*>(pg + off), xr, &m64, &rs64,
                                            <const double*>pw, <double*>(py + off), gw, 1, n)
    return y, gw_arr


def adam_step(p, grad, exp_avg, exp_avg_sq, double sign, double l2, double decay,
              double beta1, double beta2, double step, double bc2_sqrt, double eps):
    """One Adam(W) update of parameter array ``p`` in place, with ``grad`` and the moments
    ``exp_avg`` / ``exp_avg_sq`` (updated in place), in one pass: ``g = sign * grad
    (+ l2 * p)``; ``p *= decay``; ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v +
    (1 - beta2) g g``; ``p -= step * m / (sqrt(v) / bc2_sqrt + eps)``. Returns True, or
    False (nothing written) unless all four are C-contiguous writeable (``grad``: readable)
    float32/float64 arrays of one dtype and size. **Local**.
    """
    if not _plain(p):
        return False
    cdef cnp.ndarray x = <cnp.ndarray>p
    if not (_same_plain(grad, x) and _same_plain(exp_avg, x) and _same_plain(exp_avg_sq, x)):
        return False
    if not (cnp.PyArray_ISWRITEABLE(x) and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>exp_avg)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>exp_avg_sq)):
        return False
    cdef Py_ssize_t n = cnp.PyArray_SIZE(x)
    cdef void* pp = cnp.PyArray_DATA(x)
    cdef void* pg = cnp.PyArray_DATA(<cnp.ndarray>grad)
    cdef void* pm = cnp.PyArray_DATA(<cnp.ndarray>exp_avg)
    cdef void* pv = cnp.PyArray_DATA(<cnp.ndarray>exp_avg_sq)
    cdef bint f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
    with nogil:
        if f32:
            dtk_adam_f32(<float*>pp, <const float*>pg, <float*>pm, <float*>pv, n, sign, l2,
                         decay, beta1, beta2, step, bc2_sqrt, eps)
        else:
            dtk_adam_f64(<double*>pp, <const double*>pg, <double*>pm, <double*>pv, n, sign,
                         l2, decay, beta1, beta2, step, bc2_sqrt, eps)
    return True
