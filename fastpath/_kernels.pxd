# Declarations of fastpath._kernels shared with the other compiled modules (cimport).

cdef class Unary:
    cdef int kind
    cdef readonly str name
    cdef readonly object fallback
    cdef object apply(self, object a, object out)

cdef object copy_c_order(object a, object out)
