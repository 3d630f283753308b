# Declarations of fastpath._redist shared with the other compiled modules (cimport):
# the entry of one redistribute as compiled code runs it, and the calls that make and run one.

cimport cython


@cython.final
cdef class RedistEntry:
    cdef object spec                 # the source spec
    cdef object mesh                 # spec.mesh
    cdef tuple targets               # the target placements (interned)
    cdef object dst                  # the target spec
    cdef long generation             # the caller's generation when the entry was made
    cdef int kind
    cdef object comm                 # the redistribute.comm.Comm of the step
    cdef object mpi                  # its mpi4py communicator
    cdef object make                 # None (numpy allocates) or a callable returning the output
    cdef tuple shape
    cdef int typenum
    cdef object size                 # the group size (a python int: avg divides by it)
    # gather
    cdef Py_ssize_t mine             # send bytes (gather), elements received (reduce_scatter)
    cdef object counts               # byte counts (Allgatherv), element counts
                                     # (Reduce_scatter) or None (the _block forms)
    cdef object displs
    cdef Py_ssize_t stage            # bytes of the staging buffer (0: straight into the output)
    cdef object unstage              # blocks of the staging buffer into the output, or None
    cdef tuple key                   # byte counts per rank: the key of its persistent gather
    cdef object pers                 # that PersistentGather, or None until first use
    cdef object pers_req             # its request, its Start and Wait (bound), its buffers
    cdef object pers_start
    cdef object pers_wait
    cdef void* pers_handle           # the request's MPI_Request* (with the C functions)
    cdef char* pers_send
    cdef char* pers_recv
    cdef Py_ssize_t pers_recv_len
    # reductions
    cdef object mpi_type
    cdef object mpi_op
    cdef Py_ssize_t total            # elements sent (reduce_scatter) or reduced (all_reduce)
    cdef bint avg
    cdef object pack                 # blocks of the input into the send buffer, or None
    cdef Py_ssize_t pack_len         # bytes of the send buffer
    # all_to_all
    cdef object own                  # the block this rank keeps, input -> output
    cdef object scounts
    cdef object sdispls
    cdef object rcounts
    cdef object rdispls
    cdef object types
    # local
    cdef object index                # None (the input itself) or the index of the view

    cdef int fill(self, str kind, tuple f) except -1


cdef RedistEntry new_entry(object spec, object placements, object form, long generation)
cdef object run(RedistEntry e, object x)
cdef bint traced() except -1
cdef unsigned long long run_count() noexcept
cdef void reset_counts() noexcept
