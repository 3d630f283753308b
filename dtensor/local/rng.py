"""Counter-based random numbers: the global generator and block generation.

This module owns the process-wide generator state ``(seed, offset)`` and the pure
function that turns ``(seed, counter)`` into random bits. A random tensor of N elements
takes the counter range ``[offset, offset + N)`` (element ``k`` in row-major order gets
counter ``offset + k``) and advances the offset by N. Each value is a keyed hash of its
counter (two rounds of the splitmix64 finaliser in uint64 arithmetic), so any block of
a tensor can be generated on its own with exactly the values of the full tensor: the
distributed factories generate each shard this way and match the local factories for
the same seed on any mesh and placements.

The default seed is a constant, so every MPI rank starts with the same state.
"""

from __future__ import annotations

import threading

import numpy as np

from placements.errors import ArgumentError, DTypeError
from placements.meta import DtypeTable

from . import allocator as _allocator
from . import backend
from .tensor import Tensor, wrap_array

__all__ = [
    "get_rng_state",
    "initial_seed",
    "manual_seed",
    "random_block",
    "set_rng_state",
]

DEFAULT_SEED = 67280421310721  # PyTorch's default CPU seed
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
# significand bits of each floating dtype: a uniform value is a multiple of 2**-bits, exact
# in the dtype (bfloat16's 8 bits, as PyTorch draws it; normal values round to it)
_FLOAT_BITS = DtypeTable({np.dtype(np.float16): 11, np.dtype(np.float32): 24,
                         np.dtype(np.float64): 53}, lambda bf16: {bf16: 8})

_lock = threading.Lock()
_seed = DEFAULT_SEED
_offset = 0


def manual_seed(seed: int) -> None:
    """Seed the global generator and reset its counter offset to 0.

    **Local** (process-wide state; seed every rank identically).

    Parameters
    ----------
    seed : int
        In ``[-2**63, 2**64)``; negative seeds are taken modulo ``2**64``.
    """
    global _seed, _offset
    seed = int(seed)
    if not -(1 << 63) <= seed <= _MASK64:
        raise ArgumentError(
            f"manual_seed: seed must be within [-0x8000_0000_0000_0000, "
            f"0xffff_ffff_ffff_ffff], got {seed}"
        )
    with _lock:
        _seed, _offset = seed & _MASK64, 0


def initial_seed() -> int:
    """The seed of the global generator. **Local.**"""
    return _seed


def get_rng_state() -> Tensor:
    """The generator state as a 16-byte uint8 tensor (seed, offset; little-endian).

    **Local.**
    """
    out = _allocator.empty_array((16,), np.dtype(np.uint8), backend.CPU)
    out[:] = np.array([_seed, _offset], dtype="<u8").view(np.uint8)
    return wrap_array(out)


def set_rng_state(new_state) -> None:
    """Restore a state returned by :func:`get_rng_state`. **Local.**

    Parameters
    ----------
    new_state : Tensor, array or bytes
        16 bytes: seed and offset as little-endian uint64.
    """
    global _seed, _offset
    if isinstance(new_state, Tensor):
        new_state = new_state.numpy(force=True)
    if isinstance(new_state, np.ndarray):
        raw = np.ascontiguousarray(new_state, dtype=np.uint8).tobytes()
    else:
        raw = bytes(new_state)
    if len(raw) != 16:
        raise ArgumentError(f"set_rng_state: expected a 16-byte state, got {len(raw)} bytes")
    seed, offset = (int(v) for v in np.frombuffer(raw, dtype="<u8"))
    with _lock:
        _seed, _offset = seed, offset


def _reserve(numel: int) -> tuple[int, int]:
    """Take ``numel`` counters from the global generator; returns ``(seed, offset)``.

    **Local.** Every rank that calls this in the same order gets the same range.
    """
    global _offset
    with _lock:
        offset = _offset
        _offset = (offset + numel) & _MASK64
        return _seed, offset


def _splitmix(x: int) -> int:
    """splitmix64 of one python int (used to derive stream keys from the seed)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _finalise(z, xp):
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(_MUL1)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(_MUL2)
    return z ^ (z >> xp.uint64(31))


def _bits(counters, seed: int, stream: int, xp):
    """64 random bits per counter of stream ``stream`` of ``seed``."""
    k1 = _splitmix(seed ^ (2 * stream))
    k2 = _splitmix(k1 ^ (2 * stream + 1))
    z = _finalise(counters * xp.uint64(_GOLDEN) + xp.uint64(k1), xp)
    return _finalise(z ^ xp.uint64(k2), xp)


def _counters(global_shape, starts, sizes, offset: int, xp):
    """uint64 counters ``offset + row-major flat index`` of a block, flattened (1-D).

    Kept 1-D so that the arithmetic is array arithmetic (which wraps silently) even for
    a 0-d tensor.
    """
    ndim = len(global_shape)
    out = xp.full((), offset & _MASK64, dtype=xp.uint64)
    stride = 1
    for d in range(ndim - 1, -1, -1):
        idx = xp.arange(starts[d], starts[d] + sizes[d], dtype=xp.uint64)
        out = out + (idx * xp.uint64(stride)).reshape((-1,) + (1,) * (ndim - 1 - d))
        stride *= global_shape[d]
    return out.reshape(-1)


def random_block(
    kind: str,
    global_shape: tuple,
    starts: tuple,
    sizes: tuple,
    dtype,
    seed: int,
    offset: int,
    xp,
    *,
    low: int = 0,
    high: int | None = None,
):
    """Random values of the block ``[starts, starts + sizes)`` of a tensor of ``global_shape``.

    **Local.** The values depend only on ``(seed, offset + global row-major index)``,
    so blocks generated separately equal the matching slices of the whole tensor.

    Parameters
    ----------
    kind : {"uniform", "normal", "randint"}
        ``uniform``: [0, 1) with the full significand of ``dtype``; ``normal``: standard
        normal by Box-Muller from two independent streams; ``randint``: integers in
        ``[low, high)``.
    global_shape, starts, sizes : tuple of int
        The whole tensor's sizes and the block's first index and extent per dim.
    dtype : numpy.dtype
        Output dtype (floating for ``uniform``/``normal``).
    seed, offset : int
        Generator seed and the counter of the whole tensor's first element.
    xp : module
        ``numpy`` or ``cupy``; the result is an array of this module.
    low, high : int
        Bounds for ``randint``.

    Returns
    -------
    ndarray of shape ``sizes``
    """
    dtype = np.dtype(dtype)
    counters = _counters(global_shape, starts, sizes, offset, xp)
    return _values(kind, counters, dtype, seed, xp, low, high).reshape(tuple(sizes))


def _values(kind: str, counters, dtype: np.dtype, seed: int, xp, low: int, high: int | None):
    """Random values of ``kind`` for a 1-D array of counters."""
    if kind == "uniform":
        nbits = _FLOAT_BITS.get(dtype)
        if nbits is None:
            raise DTypeError(f"uniform random values need a floating dtype, got {dtype}")
        top = _bits(counters, seed, 0, xp) >> xp.uint64(64 - nbits)
        return top.astype(dtype) * dtype.type(2.0**-nbits)
    if kind == "normal":
        if dtype not in _FLOAT_BITS:
            raise DTypeError(f"normal random values need a floating dtype, got {dtype}")
        scale = 2.0**-53
        u1 = ((_bits(counters, seed, 0, xp) >> xp.uint64(11)) + xp.uint64(1)) * scale  # (0, 1]
        u2 = (_bits(counters, seed, 1, xp) >> xp.uint64(11)) * scale  # [0, 1)
        return (xp.sqrt(-2.0 * xp.log(u1)) * xp.cos(2.0 * np.pi * u2)).astype(dtype)
    if kind == "randint":
        if high is None or low >= high:
            raise ArgumentError(
                f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}"
            )
        span = high - low
        if span > _MASK64:
            raise ArgumentError(f"randint: range [{low}, {high}) is wider than 2**64")
        draws = _bits(counters, seed, 0, xp) % xp.uint64(span)
        # Wrapping int64 arithmetic gives low + draw exactly for any range inside int64.
        return (draws.astype(np.int64) + np.int64(low)).astype(dtype)
    raise ArgumentError(f"random_block: unknown kind {kind!r} (uniform, normal or randint)")
