"""The local strided tensor: :class:`Storage`, :class:`Tensor` and their view machinery.

This module owns the three layers of a local tensor, as in PyTorch's c10:

* :class:`Storage` -- one flat byte buffer (a 1-D uint8 array), its size, device and the
  allocator that made it;
* the metadata -- sizes, strides and storage offset in *elements*, dtype and device,
  all read from
* the compute array ``Tensor._arr``: an ndarray (numpy, or cupy on a GPU) that *is* the
  strided view of the storage.

View ops (``view``, ``transpose``, ``select``, ``expand``, basic indexing ...) return new
handles over the same memory with PyTorch's sizes, strides and storage offsets. Their
argument checks and output shapes are those of :mod:`placements.meta`, which the sharding
rules use on global shapes, so a Tensor and a DTensor raise the same error for the same
bad call. A view's fast path takes only arguments whose answer is cheap to get and equal
to meta's (python ints in range, dims numpy's own call accepts) and hands everything else
to the meta function.

Copies (``clone``, ``contiguous``, ``reshape`` when no view exists, dtype/device
conversions) allocate through :func:`dtensor.local.allocator.empty_array` only. Output
arrays of other modules' kernels become tensors through :func:`wrap_array` (zero-copy, no
validation); the Storage of such a tensor is derived on first use from the array's memory
owner.
"""

from __future__ import annotations

import copy
import operator

import numpy as np

import fastpath as _fp
from placements.errors import (
    ArgumentError,
    AutogradError,
    DimError,
    DTypeError,
    ShardingError,
    ValueConversionError,
    ViewError,
)
from placements.meta import (
    chunk_sizes,
    expand_shape,
    flatten_shape,
    index_shape,
    is_bfloat16,
    is_floating,
    movedim_dims,
    narrow_args,
    nonscalar_dim,
    norm_dim,
    permute_dims,
    select_args,
    split_dim,
    split_sizes,
    squeeze_dims,
    t_dims,
    transpose_dims,
    unflatten_shape,
)

from . import allocator as _allocator
from . import backend
from . import dtypes as _dtypes
from . import strides as _strides
from .quiet import quiet_call

__all__ = ["Size", "Storage", "Tensor", "is_tensor", "wrap_array"]

# The stride math: the compiled twin (same functions, same errors) when the fast path is on.
_S = _fp.strides if _fp.ENABLED else _strides
#: The compiled C-order copy of a host array (a tiled transpose for ``x.mT`` layouts).
_COPY_C = _fp.kernels.copy_into if _fp.ENABLED else None

_VIEW_ERROR = (
    "view size is not compatible with input tensor's size and stride (at least one "
    "dimension spans across two contiguous subspaces). Use .reshape(...) instead."
)


class Size(tuple):
    """Sizes of a tensor: a tuple of ints with :meth:`numel` (like ``torch.Size``)."""

    __slots__ = ()

    def numel(self) -> int:
        """Product of the sizes. **Local.**"""
        n = 1
        for s in self:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"dt.Size({list(self)})"


class Storage:
    """One flat byte buffer that tensors view.

    Holds a 1-D uint8 array over the whole memory of an allocation (numpy on the host,
    cupy on a GPU) and the allocator that made it. Keeping a Storage alive keeps the
    allocation alive.
    """

    __slots__ = ("__weakref__", "_allocator", "_buf", "_ptr")

    def __init__(self, buf, allocator) -> None:
        self._buf = buf
        self._allocator = allocator
        self._ptr = backend.data_ptr(buf)

    def nbytes(self) -> int:
        """Size of the buffer in bytes. **Local.**"""
        return self._buf.nbytes

    size = nbytes

    def data_ptr(self) -> int:
        """Address of the first byte. **Local.**"""
        return self._ptr

    @property
    def device(self) -> backend.Device:
        """Device of the buffer."""
        return backend.device_of(self._buf)

    @property
    def allocator(self):
        """The allocator the buffer came from."""
        return self._allocator

    def __len__(self) -> int:
        return self._buf.nbytes

    def _view(self, shape: tuple, dtype, byte_offset: int, byte_strides: tuple):
        """Array over this buffer (raises ValueError if an element would lie outside)."""
        if 0 in shape:
            # Note: no element is addressed, but numpy wants a pointer inside the buffer, so
            # an empty view whose offset would lie past the storage gets the nearest one.
            byte_offset = min(max(byte_offset, 0), self._buf.nbytes)
        return backend.strided_view(self._buf, shape, dtype, byte_offset, byte_strides)

    def __deepcopy__(self, memo: dict) -> Storage:
        """A new Storage of the same size on the same device, from the allocator, holding a
        copy of the bytes (``copy.deepcopy`` makes one per memory, so the tensors that
        viewed this memory view the copy alike). **Local**."""
        # Storage handles are not unique per memory (a view may derive its own): the copy
        # is keyed by the memory, which the memo keeps alive for the deepcopy's duration
        key = ("dtensor.Storage", str(self.device), self._ptr, self._buf.nbytes)
        out = memo.get(key)
        if out is None:
            flat = _alloc((self._buf.nbytes,), np.uint8, self.device)
            _copy_into(flat, self._buf)
            out = memo[key] = Storage(*backend.storage_buffer(flat))
            memo.setdefault(id(memo), []).append(self)
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:
        return (
            f"Storage(nbytes={self._buf.nbytes}, device='{self.device}', "
            f"data_ptr=0x{self._ptr:x}, allocator={self._allocator!r})"
        )


def _storage_of(arr) -> Storage:
    return Storage(*backend.storage_buffer(arr))


_new = _fp.TensorBase.__new__

#: Called as ``hook(source, copy)`` after each deep copy of a Tensor or DTensor (the nn
#: layer keeps a parameter's mark through it, as PyTorch's deep-copied Parameter is one).
DEEPCOPY_HOOKS: list = []


def deepcopy_check_leaf(t, what: str, layout: str = "") -> None:
    """Raise unless ``t`` (a Tensor or DTensor, named ``what``, its ``layout`` for the
    message) is a leaf: only leaves are deep-copied, as in PyTorch. **Local**."""
    meta = t._ag
    if meta is not None and meta.grad_fn is not None:
        raise AutogradError(
            f"deepcopy: only leaf {what}s can be deep-copied; this {tuple(t.shape)} {t.dtype} "
            f"{what}{layout} was made by {meta.grad_fn.name()} (deep-copy t.detach() for its "
            "values)"
        )


def deepcopy_leaf_state(source, out, memo: dict):
    """Give ``out`` (the deep copy of ``source``'s values) ``source``'s leaf state: its
    ``requires_grad``, a deep copy of its ``.grad``, and what :data:`DEEPCOPY_HOOKS` add;
    returns ``out``. **Local**."""
    meta = source._ag
    if meta is not None:
        if meta.requires_grad:
            out.requires_grad_()
        if meta.grad is not None:
            out.grad = copy.deepcopy(meta.grad, memo)
    for hook in DEEPCOPY_HOOKS:
        hook(source, out)
    return out


def wrap_array(arr, storage: Storage | None = None) -> Tensor:
    """Wrap an ndarray as a :class:`Tensor` without copying or validating.

    **Local.** ``arr`` must be a numpy/cupy ndarray (0-d arrays, not numpy scalars) of a
    supported dtype. ``storage`` is the Storage ``arr`` lives in when the caller knows it
    (views pass their parent's); otherwise it is derived on first use. A tensor's
    ``_arr`` is never reassigned: a different array means a new tensor.
    """
    t = _new(Tensor)
    t._arr = arr
    t._storage = storage
    t._std = None
    return t


def _is_standard(arr) -> bool:
    """True if ``arr`` has elements and exactly row-major strides (size-1 dims included).

    For such an array numpy's ``reshape`` returns exactly the strides of PyTorch's
    ``view``, so ``Tensor.view`` can use it directly.
    """
    if not (arr.size and arr.flags.c_contiguous):
        return False
    if 1 not in arr.shape:
        return True
    isz = arr.itemsize
    return arr.strides == tuple([s * isz for s in _S.contiguous_strides(arr.shape)])


def is_tensor(obj) -> bool:
    """True if ``obj`` is a local :class:`Tensor`. **Local.**"""
    return isinstance(obj, Tensor)


def _norm_dim(dim, ndim: int, op: str | None = None) -> int:
    """Wrap a possibly negative ``dim`` into ``[0, ndim)``, like PyTorch's ``maybe_wrap_dim``.

    **Local.** A 0-d tensor accepts dims 0 and -1 (as PyTorch does). In-range python ints
    are handled inline; the rest goes to :func:`placements.meta.norm_dim` (one dim check
    for local tensors and DTensors).

    Raises
    ------
    DimError
        ``op: Dimension out of range (expected to be in range of [-2, 1], but got 2)``
        (without ``op:`` when ``op`` is None).
    DTypeError
        If ``dim`` is not an integer (a TypeError).
    """
    if type(dim) is int:
        if 0 <= dim < ndim:
            return dim
        if -ndim <= dim < 0:
            return dim + ndim
    return norm_dim(dim, ndim, op)


def _nonscalar_dim(dim, ndim: int, op: str) -> int:
    """:func:`placements.meta.nonscalar_dim` (a dim of a tensor that must have one), with
    :func:`_norm_dim`'s inline path."""
    return _norm_dim(dim, ndim, op) if ndim else nonscalar_dim(dim, ndim, op)


def check_one_element(numel: int, op: str) -> None:
    """Raise PyTorch's error when a tensor of ``numel`` elements cannot become one python
    value: ``op`` is ``"bool"`` (truth value) or ``"item"`` (``item()``, ``float()``,
    ``int()``...). **Local**; DTensors check their global element count with it."""
    if numel != 1:
        if op == "bool":
            raise ValueConversionError(f"Boolean value of Tensor with {numel} values is ambiguous")
        raise ValueConversionError(f"a Tensor with {numel} elements cannot be converted to Scalar")


def _is_advanced(item) -> bool:
    """Whether an index entry asks for advanced indexing: a tensor, an array, a list or a
    bool."""
    # Note: a python bool index follows numpy (advanced indexing, a copy with a new dim),
    # where PyTorch returns a view.
    return isinstance(item, (Tensor, bool, np.bool_, list)) or backend.is_array(item)


def _index_error(exc: IndexError, shape: tuple, idx, op: str) -> IndexError:
    """The error to raise for index ``idx`` that numpy refused with ``exc``.

    A DimError of dtensor's own passes through. A basic index gets the error of
    :func:`placements.meta.index_shape` (the one a DTensor raises); an advanced one numpy's
    message in PyTorch's words ("dimension" and "tensor", not "axis" and "array"), naming
    ``op``.
    """
    if isinstance(exc, DimError):
        return exc
    if not any(_is_advanced(i) for i in (idx if type(idx) is tuple else (idx,))):
        try:
            index_shape(shape, idx, op)
        except IndexError as meta_exc:
            return meta_exc
    return DimError(f"{op}: {str(exc).replace('axis', 'dimension').replace('array', 'tensor')}")


def _is_int_like(x) -> bool:
    return isinstance(x, int) or hasattr(x, "__index__")


def _shape_arg(args: tuple) -> tuple:
    """Sizes given as varargs ``f(2, 3)`` or as one sequence ``f((2, 3))``."""
    if len(args) == 1 and not _is_int_like(args[0]):
        return tuple(args[0])
    return args


def _alloc(shape: tuple, dtype, device):
    """Uninitialised row-major array from the allocator (PyTorch's strides even if empty)."""
    out = _allocator.empty_array(shape, dtype, device)
    if out.size == 0:
        # Note: numpy gives arrays without elements zero strides; PyTorch reports the
        # contiguous ones (numpy kernels' empty outputs may still carry zero strides).
        isz = out.itemsize
        out = backend.restrided(
            out, out.shape, tuple([s * isz for s in _S.contiguous_strides(out.shape)])
        )
    return out


def _non_overlapping_and_dense(shape: tuple, strides: tuple) -> bool:
    """PyTorch's ``is_non_overlapping_and_dense`` (strides a permutation of dense ones)."""
    if len(shape) == 1:
        return shape[0] < 2 or strides[0] == 1
    # Size-0/1 dims go last; the others sort by stride (sorted() is stable like PyTorch).
    perm = sorted(range(len(shape)), key=lambda d: (shape[d] < 2, strides[d]))
    required = 1
    for d in perm:
        size = shape[d]
        if size < 2:
            return True
        if strides[d] != required:
            return False
        required *= size
    return True


def _infer_dense_strides(shape: tuple, strides: tuple) -> tuple:
    """PyTorch's ``infer_dense_strides``: dense strides whose order follows ``strides``
    (dims sorted by stride, a smaller size first among equal strides, a stride of 0 kept in
    place, by the insertion sort TensorIterator uses; a size-0 dim counts as 1)."""
    ndim = len(shape)
    if ndim < 2:
        return (1,) * ndim
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        s0, s1 = strides[d0], strides[d1]
        if s0 == 0 or s1 == 0:
            return 0
        if s0 != s1:
            return -1 if s0 < s1 else 1
        return 1 if shape[d0] > shape[d1] else 0

    for i in range(1, ndim):
        d1 = i
        for j in range(1, i + 1):
            d0 = i - j
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    out = [0] * ndim
    step = 1
    for d in perm:
        out[d] = step
        if shape[d] > 1:
            step *= shape[d]
    return tuple(out)


def _empty_like_arr(arr, dtype, device):
    """Uninitialised array like ``arr`` with PyTorch's ``preserve_format`` (``empty_like``).

    A non-overlapping and dense ``arr`` keeps its strides exactly, size-1 dims included,
    and so does a tensor without elements (PyTorch calls it contiguous); an input with
    holes or overlaps gets dense strides in the order of its own, as PyTorch's
    ``infer_dense_strides`` gives them; one with a negative stride (which PyTorch has not)
    gets row-major strides.
    """
    shape = arr.shape
    if arr.flags.c_contiguous and arr.size and 1 not in shape:  # row-major strides
        return _alloc(shape, dtype, device)
    isz = arr.itemsize
    strides = tuple(s // isz for s in arr.strides)
    if arr.size and not _non_overlapping_and_dense(shape, strides):
        if min(strides) < 0:
            return _alloc(shape, dtype, device)
        strides = _infer_dense_strides(shape, strides)
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if arr.size else 0
    flat = _alloc((extent,), dtype, device)
    isz = flat.itemsize
    return backend.strided_view(flat, shape, flat.dtype, 0, tuple(s * isz for s in strides))


def _copy_into(dst, src) -> None:
    """Copy (broadcasting, casting) ``src`` (array or scalar, any device) into ``dst``; a
    cast that overflows gives inf or wraps, without numpy's warning (as in PyTorch)."""
    if isinstance(dst, np.ndarray):
        quiet_call(np.copyto, dst, _operand(src, np), casting="unsafe")
    else:
        cp = backend.array_module_of(dst)
        with dst.device:
            cp.copyto(dst, cp.asarray(src), casting="unsafe")


def _check_no_internal_overlap(arr, op: str) -> None:
    """Raise if ``arr`` repeats an element along a stride-0 dim (an expanded tensor).

    Only this simple case is detected, as in PyTorch; a tensor without elements never
    overlaps.
    """
    if (
        0 in arr.strides
        and arr.size
        and any(s == 0 and n > 1 for n, s in zip(arr.shape, arr.strides))
    ):
        raise ViewError(
            f"{op}: unsupported operation: more than one element of the written-to tensor "
            "refers to a single memory location. Please clone() the tensor before "
            "performing the operation."
        )


def _operand(value, xp):
    """``value`` as something ``xp`` arrays accept in assignments and copies."""
    if isinstance(value, Tensor):
        value = value._arr
    if xp is np:
        return backend.to_host(value) if backend.is_array(value) else value
    if isinstance(value, (np.ndarray, list, tuple)):
        return xp.asarray(value)
    return value


def _is_device_arg(a) -> bool:
    """True for what ``to()`` takes as a device: a Device, an int, or a device string."""
    if isinstance(a, str):
        return a.partition(":")[0] in ("cpu", "cuda")
    return isinstance(a, (backend.Device, int)) and not isinstance(a, bool)


def _transposer(op: str, doc: str):
    """The method ``op`` (``transpose`` or an alias): a view with dims ``dim0`` and
    ``dim1`` swapped, whose errors name ``op``."""

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        arr = self._arr
        ndim = arr.ndim
        if (
            type(dim0) is int and type(dim1) is int
            and -ndim <= dim0 < ndim and -ndim <= dim1 < ndim
        ):
            return wrap_array(arr.swapaxes(dim0, dim1), self._storage)
        return wrap_array(arr.transpose(transpose_dims(ndim, dim0, dim1, op)), self._storage)

    transpose.__name__, transpose.__qualname__ = op, f"Tensor.{op}"
    transpose.__doc__ = doc
    return transpose


class Tensor(_fp.TensorBase):
    """A local strided tensor (PyTorch semantics on a numpy or cupy array).

    Create tensors with :func:`dtensor.tensor`, :func:`dtensor.from_numpy` or a factory
    (``dt.zeros`` ...); ``Tensor(data)`` is ``dt.tensor(data)``. Many tensors can view
    one :class:`Storage`; writes through one view are seen by all of them. The view and
    copy methods are defined here; the constructor and ``new_*`` come from
    :mod:`dtensor.local.factory`, the math methods and operators from the op table.
    """

    # The slots ``_arr``, ``_std`` (caches _is_standard(_arr): None until first needed) and
    # ``_storage`` live in the base: compiled when the fast path is enabled.
    __slots__ = ()

    # Binary operators with an ndarray on the left defer to the tensor (as in PyTorch).
    __array_priority__ = 1000

    # ------------------------------------------------------------------ metadata

    @property
    def shape(self) -> Size:
        """Sizes of the tensor."""
        return Size(self._arr.shape)

    def size(self, dim: int | None = None):
        """Sizes (a :class:`Size`), or the size of one dim. **Local.**"""
        arr = self._arr
        if dim is None:
            return Size(arr.shape)
        return arr.shape[_nonscalar_dim(dim, arr.ndim, "size")]

    def stride(self, dim: int | None = None):
        """Strides in elements (a tuple), or the stride of one dim. **Local.**"""
        arr = self._arr
        isz = arr.itemsize
        if dim is None:
            return tuple([s // isz for s in arr.strides])
        return arr.strides[_nonscalar_dim(dim, arr.ndim, "stride")] // isz

    def storage_offset(self) -> int:
        """Offset of the first element in the storage, in elements. **Local.**"""
        arr = self._arr
        return (backend.data_ptr(arr) - self.untyped_storage()._ptr) // arr.itemsize

    def untyped_storage(self) -> Storage:
        """The :class:`Storage` this tensor views (derived once, then cached). **Local.**"""
        st = self._storage
        if st is None:
            st = self._storage = _storage_of(self._arr)
        return st

    def data_ptr(self) -> int:
        """Address of the first element. **Local.**"""
        return backend.data_ptr(self._arr)

    @property
    def dtype(self) -> np.dtype:
        """Element dtype (a ``numpy.dtype``)."""
        return self._arr.dtype

    @property
    def device(self) -> backend.Device:
        """Device holding the data."""
        return backend.device_of(self._arr)

    @property
    def is_cuda(self) -> bool:
        """True when the data is on a CUDA device."""
        return not isinstance(self._arr, np.ndarray)

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return self._arr.ndim

    def dim(self) -> int:
        """Number of dims. **Local.**"""
        return self._arr.ndim

    def numel(self) -> int:
        """Number of elements. **Local.**"""
        return self._arr.size

    def element_size(self) -> int:
        """Bytes per element. **Local.**"""
        return self._arr.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._arr.itemsize

    @property
    def nbytes(self) -> int:
        """``numel() * element_size()`` (not the storage size)."""
        return self._arr.nbytes

    def is_contiguous(self) -> bool:
        """PyTorch's rule: size-1 dims ignored, empty tensors contiguous. **Local.**"""
        # The ndarray flag implements exactly this rule (numpy and cupy relaxed strides).
        return self._arr.flags.c_contiguous

    def is_floating_point(self) -> bool:
        """True for floating dtypes (bfloat16 included). **Local.**"""
        return is_floating(self._arr.dtype)

    def is_complex(self) -> bool:
        """True for complex dtypes. **Local.**"""
        return self._arr.dtype.kind == "c"

    def __len__(self) -> int:
        arr = self._arr
        if arr.ndim == 0:
            raise DTypeError("len() of a 0-d tensor")
        return arr.shape[0]

    def __iter__(self):
        if self._arr.ndim == 0:
            raise DTypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def item(self):
        """The value of a one-element tensor as a python scalar (a float for bfloat16).
        **Local.**"""
        arr = self._arr
        check_one_element(arr.size, "item")
        value = arr.item()
        # ml_dtypes' bfloat16 items are its own scalars, not python floats
        return value if not is_bfloat16(arr.dtype) else float(value)

    def tolist(self):
        """Nested python lists (a python scalar for a 0-d tensor). **Local.**"""
        arr = backend.to_host(self._arr)
        return (arr if not is_bfloat16(arr.dtype) else arr.astype(np.float32)).tolist()

    def __bool__(self) -> bool:
        check_one_element(self._arr.size, "bool")
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __complex__(self) -> complex:
        return complex(self.item())

    def __index__(self) -> int:
        if self._arr.dtype.kind not in "iu":
            raise DTypeError(
                "only integer tensors of a single element can be converted to an index "
                f"(got a {self._arr.dtype} tensor)"
            )
        return self.item()

    def __reduce__(self):
        # Note: pickling keeps the values, not storage sharing (a view pickles compactly).
        return (wrap_array, (self._arr,))

    def __deepcopy__(self, memo: dict) -> Tensor:
        """``copy.deepcopy``: a tensor over a copy of this one's Storage, made from the
        allocator (so ``dt.memory_stats`` counts it) once per deepcopy: tensors that shared
        memory share the copy's, at the same offsets and strides, as in PyTorch. A leaf keeps
        ``requires_grad`` and gets a deep copy of its ``.grad``; a parameter's copy is a
        parameter (:data:`DEEPCOPY_HOOKS`). **Local**.

        Raises
        ------
        AutogradError
            A tensor made by a recorded op (not a leaf), as PyTorch's.
        """
        deepcopy_check_leaf(self, "tensor")
        st = self.untyped_storage()
        new = copy.deepcopy(st, memo)
        arr = self._arr
        view = new._view(arr.shape, arr.dtype, backend.data_ptr(arr) - st._ptr, arr.strides)
        out = memo[id(self)] = wrap_array(view, new)
        return deepcopy_leaf_state(self, out, memo)

    def __repr__(self) -> str:
        arr = backend.to_host(self._arr)
        dtype = arr.dtype
        if is_bfloat16(dtype):  # printed through float32, which holds its values exactly
            arr = arr.astype(np.float32)
        kwargs = {"prefix": "tensor(", "separator": ", "}
        if arr.dtype.kind in "fc":
            finite = arr[np.isfinite(arr)]
            integral = finite.size == 0 or bool(np.all(finite == np.round(finite)))
            kwargs.update(precision=4, floatmode="unique" if integral else "fixed")
        body = "[]" if arr.size == 0 else np.array2string(arr, **kwargs)
        extras = []
        if arr.size == 0 and arr.ndim != 1:
            extras.append(f"size={tuple(arr.shape)}")
        if not isinstance(self._arr, np.ndarray):
            extras.append(f"device='{self.device}'")
        if dtype not in (
            _dtypes.get_default_dtype(),
            _dtypes.default_complex_dtype(),
            _dtypes.int64,
            _dtypes.bool_,
        ):
            extras.append(f"dtype=dt.{dtype.name}")
        return "tensor(" + ", ".join([body, *extras]) + ")"

    # ------------------------------------------------------------ host / device / dtype

    def __dlpack__(self, stream=None, **kwargs):
        """DLPack export of the data (no copy); see ``dt.from_dlpack``. **Local.**"""
        return self._arr.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """DLPack (device type, index) of the data. **Local.**"""
        return self._arr.__dlpack_device__()

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ArgumentError(
                    f"__array__: converting {arr.dtype} to {np.dtype(dtype)} needs a copy"
                )
            return quiet_call(arr.astype, dtype)
        return arr.copy() if copy else arr

    def numpy(self, force: bool = False) -> np.ndarray:
        """The data as a numpy array: a zero-copy view on the CPU. **Local.**

        Parameters
        ----------
        force : bool
            Copy a GPU tensor to the host instead of raising.
        """
        arr = self._arr
        if isinstance(arr, np.ndarray):
            return arr.view()
        if force:
            return backend.to_host(arr)
        raise DTypeError(
            f"can't convert {self.device} tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )

    def to(self, *args, dtype=None, device=None, copy: bool = False) -> Tensor:
        """Convert dtype and/or device; returns ``self`` when nothing changes. **Local.**

        Accepts PyTorch's forms: ``to(dtype)``, ``to(device)``, ``to(device, dtype)``,
        ``to(other_tensor)`` and the keywords ``dtype=``, ``device=``, ``copy=``. A new
        tensor keeps the strides of a dense input (``preserve_format``).
        """
        for a in args:
            if isinstance(a, Tensor):
                dtype, device = a.dtype, a.device
            elif _is_device_arg(a):
                device = a
            else:
                dtype = a
        arr = self._arr
        cur = backend.device_of(arr)
        dev = cur if device is None else backend.as_device(device)
        new_dtype = arr.dtype if dtype is None else _dtypes.to_dtype(dtype)
        same_device = dev.type == cur.type and (dev.index is None or dev.index == cur.index)
        if same_device and new_dtype == arr.dtype and not copy:
            return self
        if same_device:
            dev = cur
        out = _empty_like_arr(arr, new_dtype, dev)
        _copy_into(out, arr)
        return wrap_array(out)

    def cpu(self) -> Tensor:
        """This tensor on the CPU (``self`` when already there). **Local.**"""
        return self.to(device=backend.CPU)

    def cuda(self, device=None) -> Tensor:
        """This tensor on a CUDA device (``self`` when already there). **Local.**"""
        return self.to(device="cuda" if device is None else device)

    def type_as(self, other: Tensor) -> Tensor:
        """This tensor converted to ``other``'s dtype and device. **Local.**"""
        return self.to(dtype=other.dtype, device=other.device)

    # ------------------------------------------------------------------ views

    def _restride(self, shape: tuple, strides: tuple, delta: int = 0) -> Tensor:
        """View with new sizes/strides whose first element is ``delta`` elements on.

        Sizes, strides and ``delta`` are in elements; every element of the view must lie
        in the storage.
        """
        arr = self._arr
        isz = arr.itemsize
        bstrides = tuple([s * isz for s in strides])
        out = None if delta else backend.restrided(arr, shape, bstrides)
        if out is None:
            st = self.untyped_storage()
            offset = backend.data_ptr(arr) - st._ptr + delta * isz
            out = st._view(shape, arr.dtype, offset, bstrides)
        return wrap_array(out, self._storage)

    def as_strided(self, size, stride, storage_offset: int | None = None) -> Tensor:
        """View of the same storage with the given sizes, strides and offset. **Local.**

        Raises
        ------
        ViewError
            When some element would lie outside the storage.
        """
        arr = self._arr
        st = self.untyped_storage()
        isz = arr.itemsize
        if storage_offset is None:
            storage_offset = self.storage_offset()
        size, stride = tuple(size), tuple(stride)
        if len(size) != len(stride):
            raise ViewError(
                f"as_strided: mismatch in length of strides and shape: {len(size)} vs {len(stride)}"
            )
        try:
            out = st._view(size, arr.dtype, storage_offset * isz, tuple(s * isz for s in stride))
        except ValueError as exc:
            raise ViewError(
                f"as_strided: sizes {list(size)}, strides {list(stride)}, storage offset "
                f"{storage_offset}, and itemsize {isz} are out of bounds for storage of "
                f"size {st.nbytes()}"
            ) from exc
        return wrap_array(out, st)

    def _view_general(self, shape: tuple) -> Tensor | None:
        """``view(shape)`` by PyTorch's computeStride, or ``None`` if no view exists."""
        arr = self._arr
        new = _S.infer_size(shape, arr.size)
        strides = _S.compute_view_strides(arr.shape, self.stride(), new)
        if strides is None:
            return None
        return self._restride(new, strides)

    def view(self, *shape) -> Tensor:
        """View with new sizes (one may be -1), or a reinterpretation as another dtype.

        **Local.** Never copies.

        Raises
        ------
        ViewError
            When the strides do not allow a view (PyTorch's message, use ``reshape``),
            or the sizes do not match the number of elements.
        """
        if len(shape) == 1 and type(shape[0]) is not int:
            arg = shape[0]
            if not isinstance(arg, (tuple, list)) and not hasattr(arg, "__index__"):
                return self._view_dtype(_dtypes.to_dtype(arg))
            shape = _shape_arg(shape)
        std = self._std
        if std is None:
            std = self._std = _is_standard(self._arr)
        if std:
            # Hot path, kept inline: numpy's reshape of a standard row-major array gives
            # exactly PyTorch's strides (and the result is standard again).
            try:
                out = self._arr.reshape(shape)
            except (ValueError, TypeError):
                pass  # a wrong element count or a size not an int: infer_size below raises
            else:
                # numpy infers any one negative size; PyTorch accepts only -1.
                if -1 in shape or out.shape == shape:
                    t = _new(Tensor)
                    t._arr = out
                    t._storage = self._storage
                    t._std = True
                    return t
        out = self._view_general(shape)
        if out is None:
            raise ViewError(_VIEW_ERROR)
        return out

    def _view_dtype(self, dtype: np.dtype) -> Tensor:
        arr = self._arr
        old, new = arr.itemsize, dtype.itemsize
        if old != new:
            msg = f"view: cannot view a tensor of {arr.dtype} as {dtype}"
            if arr.ndim == 0:
                raise ViewError(f"{msg}: a 0-dim tensor cannot change element size")
            if arr.strides[-1] != old:
                raise ViewError(f"{msg}: the last dim must have stride 1")
            if new > old:
                ratio = new // old
                if arr.shape[-1] % ratio:
                    raise ViewError(f"{msg}: size of the last dim must be divisible by {ratio}")
                if self.storage_offset() % ratio or any(s % new for s in arr.strides[:-1]):
                    raise ViewError(
                        f"{msg}: the storage offset and the strides of all dims but the "
                        f"last must be divisible by {ratio}"
                    )
        return wrap_array(arr.view(dtype), self._storage)

    def view_as(self, other: Tensor) -> Tensor:
        """``view(other.shape)``. **Local.**"""
        return self.view(other.shape)

    def reshape(self, *shape) -> Tensor:
        """A view when one exists, else a contiguous copy with the new sizes. **Local.**"""
        shape = _shape_arg(shape)
        if self._arr.flags.c_contiguous:
            return self.view(shape)  # a contiguous tensor can always be viewed
        out = self._view_general(shape)
        return self.contiguous().view(shape) if out is None else out

    def reshape_as(self, other: Tensor) -> Tensor:
        """``reshape(other.shape)``. **Local.**"""
        return self.reshape(other.shape)

    def contiguous(self) -> Tensor:
        """``self`` when contiguous, else a row-major copy. **Local.**"""
        arr = self._arr
        if arr.flags.c_contiguous:
            return self
        out = _alloc(arr.shape, arr.dtype, backend.device_of(arr))
        if _COPY_C is not None and type(arr) is np.ndarray:
            _COPY_C(out, arr)  # a tiled transpose for x.mT layouts
        else:
            _copy_into(out, arr)
        return wrap_array(out)

    transpose = _transposer("transpose", "View with two dims swapped. **Local.**")
    swapaxes = _transposer("swapaxes", "``transpose`` (numpy's name). **Local.**")
    swapdims = _transposer("swapdims", "``transpose``. **Local.**")

    def t(self) -> Tensor:
        """Transpose of a <= 2-D tensor (0-D and 1-D come back as they are). **Local.**"""
        arr = self._arr
        if arr.ndim == 2:
            t = _new(Tensor)  # wrap_array inlined: this is a hot path
            t._arr = arr.T
            t._storage = self._storage
            t._std = None
            return t
        return wrap_array(arr.transpose(t_dims(arr.ndim)), self._storage)

    @property
    def T(self) -> Tensor:
        """All dims reversed."""
        return wrap_array(self._arr.T, self._storage)

    @property
    def mT(self) -> Tensor:
        """The last two dims swapped (batches of matrices)."""
        arr = self._arr
        if arr.ndim < 2:
            raise ViewError(
                "tensor.mT is only supported on matrices or batches of matrices. "
                f"Got {arr.ndim}-D tensor."
            )
        return wrap_array(arr.swapaxes(-1, -2), self._storage)

    def permute(self, *dims) -> Tensor:
        """View with the dims reordered. **Local.**"""
        arr = self._arr
        dims = _shape_arg(dims)
        try:
            # numpy accepts a subset of the valid dims (ints, a permutation), same result
            out = arr.transpose(dims)
        except (TypeError, ValueError):
            out = arr.transpose(permute_dims(arr.ndim, dims))
        return wrap_array(out, self._storage)

    def movedim(self, source, destination) -> Tensor:
        """View with dims ``source`` moved to positions ``destination``. **Local.**"""
        arr = self._arr
        return wrap_array(arr.transpose(movedim_dims(arr.ndim, source, destination)), self._storage)

    moveaxis = movedim

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        """View of ``length`` entries of ``dim`` from ``start``. **Local.**"""
        arr = self._arr
        ndim = arr.ndim
        if (
            type(dim) is int and type(start) is int and type(length) is int
            and 0 <= dim < ndim and 0 <= start and 0 <= length
            and start + length <= arr.shape[dim]
        ):
            return self._narrow_view(dim, start, length)
        return self._narrow_view(*narrow_args(arr.shape, dim, start, length))

    def _narrow_view(self, dim: int, start: int, length: int) -> Tensor:
        arr = self._arr
        if length:
            return wrap_array(arr[(slice(None),) * dim + (slice(start, start + length),)], self._storage)
        # numpy does not move the data pointer for an empty slice; PyTorch moves the
        # storage offset by start * stride all the same.
        strides = self.stride()
        return self._restride(
            arr.shape[:dim] + (0,) + arr.shape[dim + 1 :], strides, start * strides[dim]
        )

    def select(self, dim: int, index: int) -> Tensor:
        """View of entry ``index`` of ``dim`` (the dim is removed). **Local.**"""
        arr = self._arr
        shape = arr.shape
        if not (
            type(dim) is int and type(index) is int
            and 0 <= dim < len(shape) and -shape[dim] <= index < shape[dim]
        ):
            dim, index = select_args(shape, dim, index)
        return wrap_array(arr[(slice(None),) * dim + (index, Ellipsis)], self._storage)

    def squeeze(self, dim=None) -> Tensor:
        """View without size-1 dims (all, or those of ``dim``: an int or tuple). **Local.**

        A listed dim whose size is not 1 is left alone (PyTorch's behaviour).
        """
        arr = self._arr
        if dim is None:  # every size-1 dim: numpy's squeeze() is squeeze_dims(shape)
            return wrap_array(arr.squeeze(), self._storage)
        shape = arr.shape
        if type(dim) is int and -len(shape) <= dim < len(shape):
            axes = (dim,) if shape[dim] == 1 else ()
        else:
            axes = squeeze_dims(shape, dim)
        return wrap_array(arr.squeeze(axes), self._storage)

    def unsqueeze(self, dim: int) -> Tensor:
        """View with a size-1 dim inserted at ``dim``. **Local.**"""
        arr = self._arr
        ndim = arr.ndim
        dim = _norm_dim(dim, ndim + 1, "unsqueeze")
        shape, strides = arr.shape, self.stride()
        new_stride = shape[dim] * strides[dim] if dim < ndim else 1
        return self._restride(
            shape[:dim] + (1,) + shape[dim:], strides[:dim] + (new_stride,) + strides[dim:]
        )

    def expand(self, *sizes) -> Tensor:
        """View broadcast to ``sizes`` (-1 keeps a size; new dims lead; stride 0). **Local.**"""
        arr = self._arr
        shape = arr.shape
        new_shape = expand_shape(shape, _shape_arg(sizes))
        # PyTorch's inferExpandGeometry strides: a kept dim keeps its stride, a broadcast
        # dim gets 0, a new leading dim of size 1 the stride of a dim just outside the next
        # one (0 for the last dim of a 0-d input, as PyTorch).
        byte_strides, isz = arr.strides, arr.itemsize
        ndim = len(new_shape)
        lead = ndim - len(shape)
        strides = [0] * ndim
        for i in range(ndim - 1, -1, -1):
            size = new_shape[i]
            if i >= lead:
                if size == shape[i - lead]:
                    strides[i] = byte_strides[i - lead] // isz
            elif size == 1 and i + 1 < ndim:
                strides[i] = new_shape[i + 1] * strides[i + 1]
        return self._restride(new_shape, tuple(strides))

    def expand_as(self, other: Tensor) -> Tensor:
        """``expand(other.shape)``. **Local.**"""
        return self.expand(other.shape)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        """Dims ``start_dim..end_dim`` merged into one (a view when possible). **Local.**"""
        arr = self._arr
        if (
            type(start_dim) is int and type(end_dim) is int
            and start_dim == 0 and end_dim == -1 and arr.ndim > 1
        ):
            return self.reshape(arr.size)  # the default: every dim merged
        new_shape = flatten_shape(arr.shape, start_dim, end_dim)
        if new_shape == arr.shape:  # nothing merged (start_dim == end_dim)
            return self
        return self.reshape(new_shape)

    def unflatten(self, dim: int, sizes) -> Tensor:
        """View with ``dim`` split into ``sizes`` (one may be -1). **Local.**"""
        shape = self._arr.shape
        if type(dim) is int and 0 <= dim < len(shape) and type(sizes) in (tuple, list) and sizes:
            # fast path: the sizes through the compiled infer_size; on any error,
            # unflatten_shape below raises its own
            try:
                inner = _S.infer_size(sizes, shape[dim])
            except (ViewError, TypeError):
                pass
            else:
                return self.view(shape[:dim] + inner + shape[dim + 1 :])
        return self.view(unflatten_shape(shape, dim, sizes))

    def unbind(self, dim: int = 0) -> tuple:
        """All slices along ``dim`` (views without that dim). **Local.**"""
        arr = self._arr
        dim = _nonscalar_dim(dim, arr.ndim, "unbind")
        lead = (slice(None),) * dim
        st = self._storage
        return tuple([wrap_array(arr[(*lead, i, Ellipsis)], st) for i in range(arr.shape[dim])])

    def _split_sizes(self, sizes, dim: int) -> tuple:
        out = []
        start = 0
        for n in sizes:
            out.append(self._narrow_view(dim, start, n))
            start += n
        return tuple(out)

    def split(self, split_size_or_sections, dim: int = 0) -> tuple:
        """Views of consecutive pieces along ``dim``. **Local.**

        An int gives pieces of that size (the last may be smaller); a sequence gives
        the size of each piece (they must add up to the dim's size).
        """
        arr = self._arr
        dim = split_dim(arr.ndim, dim, "split")
        return self._split_sizes(split_sizes(arr.shape[dim], split_size_or_sections, dim), dim)

    def chunk(self, chunks: int, dim: int = 0) -> tuple:
        """``torch.chunk``: pieces of ``ceil(size / chunks)`` (maybe fewer pieces). **Local.**"""
        arr = self._arr
        dim = split_dim(arr.ndim, dim, "chunk")
        return self._split_sizes(chunk_sizes(arr.shape[dim], chunks), dim)

    # --------------------------------------------------------------- indexing

    def _index(self, idx, op: str):
        """Convert an index to ndarray terms; returns ``(index_tuple, basic, consumed)``.

        ``basic`` is False when the index holds tensors, arrays, lists or bools
        (advanced indexing); ``consumed`` counts the ints and slices. A basic index ends
        with ``...`` so that a full integer index gives a 0-d array, not a scalar. An entry
        that is not an index, or a slice whose step is not positive, raises the error of
        :func:`placements.meta.index_shape`.
        """
        items = idx if type(idx) is tuple else (idx,)
        basic = True
        has_ellipsis = bad = False
        consumed = 0
        out = []
        for i in items:
            if isinstance(i, Tensor):
                i = i._arr
                basic = False
            elif isinstance(i, slice):
                if i.step is not None and i.step <= 0:
                    bad = True
                consumed += 1
            elif i is None:
                pass
            elif i is Ellipsis:
                has_ellipsis = True
            elif _is_advanced(i):
                basic = False
            else:
                try:
                    i = operator.index(i)
                except TypeError:
                    bad = True
                consumed += 1
            out.append(i)
        if bad:
            # meta's first pass raises for the first bad entry (advanced entries: stand-ins)
            index_shape(self._arr.shape, tuple([0 if _is_advanced(i) else i for i in items]), op)
        if basic and not has_ellipsis:
            out.append(Ellipsis)
        return tuple(out), basic, consumed

    def _basic_view(self, out, index: tuple, consumed: int) -> Tensor:
        """Redo numpy's basic-indexing view ``out`` where PyTorch differs.

        PyTorch unsqueezes for each ``None`` in turn, so the new dim's stride is
        size * stride of the source dim it lands before (1 past the last dim), where
        numpy uses 0; for an empty result PyTorch still moves the storage offset by
        every slice's start * stride, which numpy skips, and a slice's stride is its step
        times the source stride even when it selects nothing.
        """
        arr = self._arr
        shape, strides = arr.shape, self.stride()
        ndim = arr.ndim
        isz = arr.itemsize
        new_strides = [s // isz for s in out.strides]
        src = dst = delta = 0
        for i in index:
            if i is None:
                new_strides[dst] = shape[src] * strides[src] if src < ndim else 1
                dst += 1
            elif i is Ellipsis:
                span = ndim - consumed
                src += span
                dst += span
            elif isinstance(i, slice):
                start, _, step = i.indices(shape[src])
                delta += start * strides[src]
                new_strides[dst] = step * strides[src]  # numpy's stride of an empty slice differs
                src += 1
                dst += 1
            else:
                delta += (i % shape[src]) * strides[src]
                src += 1
        return self._restride(out.shape, tuple(new_strides), delta)

    def __getitem__(self, idx) -> Tensor:
        arr = self._arr
        try:
            if arr.ndim:
                # Fast paths of x[i] and x[a:b:c] (numpy's view is PyTorch's unless empty).
                if type(idx) is int:
                    return wrap_array(arr[idx, ...], self._storage)
                if type(idx) is slice and (idx.step is None or idx.step > 0):
                    out = arr[idx]
                    if out.size:
                        return wrap_array(out, self._storage)
            index, basic, consumed = self._index(idx, "__getitem__")
            if not basic:
                # Note: advanced indexing copies, into memory numpy allocates (the storage
                # then reports the host allocator), as numpy's indexing does not take an
                # output.
                return wrap_array(arr[index])
            out = arr[index]
        except IndexError as exc:
            raise _index_error(exc, arr.shape, idx, "__getitem__") from None
        if out.size and None not in index:
            return wrap_array(out, self._storage)
        return self._basic_view(out, index, consumed)

    def __setitem__(self, idx, value) -> None:
        arr = self._arr
        _check_no_internal_overlap(arr, "__setitem__")
        try:
            index = self._index(idx, "__setitem__")[0]
            quiet_call(arr.__setitem__, index, _operand(value, backend.array_module_of(arr)))
        except IndexError as exc:
            raise _index_error(exc, arr.shape, idx, "__setitem__") from None

    # ------------------------------------------------------------------ autograd hooks

    def _autograd_ones(self) -> Tensor:
        """Ones of this shape and dtype: the implicit gradient of a one-element tensor."""
        out = _alloc(self._arr.shape, self._arr.dtype, backend.device_of(self._arr))
        out.fill(1)
        return wrap_array(out)

    def _grad_layout(self) -> None:
        """The layout a leaf's gradient gets (none for a local tensor)."""

    # ------------------------------------------------------------------ copies

    def clone(self) -> Tensor:
        """Copy into a new Storage; a dense input keeps its strides. **Local.**"""
        arr = self._arr
        out = _empty_like_arr(arr, arr.dtype, backend.device_of(arr))
        _copy_into(out, arr)
        return wrap_array(out)

    def detach(self) -> Tensor:
        """A new handle on the same Storage. **Local.**"""
        return wrap_array(self._arr.view(), self._storage)

    def copy_(self, src) -> Tensor:
        """Copy ``src`` (broadcast to this shape, cast to this dtype) into ``self``.

        **Local.** Writes through views. ``src`` may be a tensor, array or scalar, on
        any device.

        Raises
        ------
        ShardingError
            If ``src`` does not broadcast to this tensor's shape (a ValueError).
        """
        arr = self._arr
        _check_no_internal_overlap(arr, "copy_")
        # Note: a source overlapping the destination is copied correctly (numpy buffers
        # it), where PyTorch raises for partial overlap.
        if isinstance(src, Tensor):
            src = src._arr
        try:
            _copy_into(arr, src)
        except ValueError as exc:
            raise ShardingError(
                f"copy_: source of shape {tuple(np.shape(src))} cannot be broadcast to "
                f"{tuple(arr.shape)}"
            ) from exc
        return self

    def fill_(self, value) -> Tensor:
        """Set every element to ``value`` (a scalar or one-element tensor). **Local.**"""
        arr = self._arr
        _check_no_internal_overlap(arr, "fill_")
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ArgumentError(
                    "fill_ only supports 0-dimension value tensor but got tensor with "
                    f"{value.ndim} dimensions."
                )
            value = value.item()
        quiet_call(arr.fill, value)
        return self

    def zero_(self) -> Tensor:
        """Set every element to zero. **Local.**"""
        return self.fill_(0)

    # ------------------------------------------------- dtype shorthands (PyTorch names)

    def float(self) -> Tensor:
        """``to(float32)``. **Local.**"""
        return self.to(_dtypes.float32)

    def double(self) -> Tensor:
        """``to(float64)``. **Local.**"""
        return self.to(_dtypes.float64)

    def half(self) -> Tensor:
        """``to(float16)``. **Local.**"""
        return self.to(_dtypes.float16)

    def bfloat16(self) -> Tensor:
        """``to(bfloat16)`` (rounded to nearest even). **Local.**"""
        return self.to(_dtypes.bfloat16)

    def int(self) -> Tensor:
        """``to(int32)``. **Local.**"""
        return self.to(_dtypes.int32)

    def long(self) -> Tensor:
        """``to(int64)``. **Local.**"""
        return self.to(_dtypes.int64)

    def short(self) -> Tensor:
        """``to(int16)``. **Local.**"""
        return self.to(_dtypes.int16)

    def char(self) -> Tensor:
        """``to(int8)``. **Local.**"""
        return self.to(_dtypes.int8)

    def byte(self) -> Tensor:
        """``to(uint8)``. **Local.**"""
        return self.to(_dtypes.uint8)

    def bool(self) -> Tensor:
        """``to(bool)``. **Local.**"""
        return self.to(_dtypes.bool_)


if _fp.ENABLED:
    # Outputs of every kernel become tensors through wrap_array: the compiled twin creates them.
    _fp.dispatch.install_tensor(Tensor)
    wrap_array = _fp.dispatch.wrap
