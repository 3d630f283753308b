"""``python -m launch --info``: what this installation runs on.

This module owns the facts the launcher reports about the environment: the MPI library that
mpi4py loads (name, version, its ``mpiexec``), whether that MPI is CUDA-aware, whether cupy
and a GPU are present and whether dtensor's compiled fast path is built. It initialises MPI
in this one process (a singleton job) to ask the library.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from typing import Any

from ._mpiexec import find_mpiexec

__all__ = ["collect_info", "fastpath_off_by_accident", "format_info"]


def fastpath_off_by_accident() -> str | None:
    """Why the dtensor this process imports runs on the Python path without being asked
    to, as a loud message; None when the compiled fast path is built, or turned off on
    purpose (``DTENSOR_FASTPATH=0``). **Local**.

    The usual cause: running from a source checkout whose extension was never built (its
    folder comes first on ``sys.path`` and shadows an installed build).
    """
    import fastpath  # lazy: the launcher imports the library only when asked

    if fastpath.AVAILABLE or os.environ.get("DTENSOR_FASTPATH", "").strip() == "0":
        return None
    where = os.path.dirname(os.path.abspath(fastpath.__file__))
    return (
        "WARNING: dtensor's compiled fast path is NOT BUILT in the copy imported from "
        f"{os.path.dirname(where)} ({fastpath.IMPORT_ERROR}): every op runs on the Python "
        "path, about 5x slower at small sizes. From a source checkout, build it in place "
        "(pip install -e . or python setup.py build_ext --inplace) or run from another "
        "folder so that the installed dtensor is imported; set DTENSOR_FASTPATH=0 to use "
        "the Python path on purpose."
    )


def _loaded_libmpi() -> str | None:
    """Path of the MPI shared library mapped into this process (Linux), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
    except OSError:
        return None
    # Open MPI maps libmpi.so and helper libraries (libmpi_*); the core library is shortest.
    return min(paths, key=len) if paths else None


def _cuda_aware(libpath: str | None) -> str:
    """``"yes"``, ``"no"`` or ``"unknown"`` from ``MPIX_Query_cuda_support`` of the library."""
    if libpath is None:
        return "unknown"
    try:
        query = ctypes.CDLL(libpath).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return "unknown"
    query.restype = ctypes.c_int
    return "yes" if query() else "no"


def _gpu() -> dict[str, Any]:
    """cupy's presence and version, and the number of CUDA devices it sees."""
    if importlib.util.find_spec("cupy") is None:
        return {"cupy": None, "gpus": 0}
    import cupy

    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver / no device: cupy raises its own types
        count = 0
    return {"cupy": cupy.__version__, "gpus": count}


def _gpu_comm(aware: str, gpus: int) -> str:
    """How device buffers reach MPI: ``cuda-aware``, ``staged`` (pinned host buffers), or why
    neither applies."""
    if not gpus:
        return "none (no GPU)"
    # lazy: the library's packages may initialise MPI; the launcher imports them for --info
    from placements.errors import CommError
    from redistribute.staging import select_path  # lazy: as above

    try:
        return select_path(aware == "yes")
    except CommError as exc:
        return f"invalid setting: {exc}"


def collect_info() -> dict[str, Any]:
    """The facts ``--info`` prints, as a dict. **Local** (initialises MPI in this process).

    Returns
    -------
    dict
        ``mpi_library`` (first line of ``MPI_Get_library_version``), ``mpi_standard``,
        ``mpi4py``, ``libmpi`` (path of the loaded library or None), ``mpiexec`` (what the
        launcher would run, or the reason none was found), ``cuda_aware_mpi`` (``yes``,
        ``no`` or ``unknown``), ``cupy`` (version or None), ``gpus``, ``gpu_comm`` (the
        path of collectives on device buffers: ``cuda-aware`` or ``staged``), ``fastpath``
        (``compiled``, ``disabled`` or ``not built: <reason>``), ``shared_memory`` (whether
        ranks on one node exchange large tensors through node-shared memory, and from which
        size; see ``redistribute.shm``), ``python``, ``numpy``.
    """
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    import fastpath  # lazy: the launcher imports the library only for --info
    from redistribute import shm  # lazy: as above (it would initialise MPI)

    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        mpiexec = f"not found ({exc})"
    if not fastpath.AVAILABLE:
        where = os.path.dirname(os.path.dirname(os.path.abspath(fastpath.__file__)))
        fast = f"NOT BUILT in {where}: {fastpath.IMPORT_ERROR} (the Python path runs)"
    elif not fastpath.ENABLED:
        fast = f"compiled, disabled by DTENSOR_FASTPATH={os.environ.get('DTENSOR_FASTPATH')}"
    else:
        fast = "compiled"
    if shm.enabled():
        shared = f"on (exchanges of tensors from {shm.MIN_BYTES} bytes; DTENSOR_SHM=0 turns it off)"
    elif not shm.requested():
        shared = f"off (DTENSOR_SHM={os.environ.get('DTENSOR_SHM')})"
    else:
        shared = "off (no memfd on this platform)"
    libpath = _loaded_libmpi()
    aware, gpu = _cuda_aware(libpath), _gpu()
    major, minor = MPI.Get_version()
    return {
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0].strip(),
        "mpi_standard": f"{major}.{minor}",
        "mpi4py": mpi4py.__version__,
        "libmpi": libpath,
        "mpiexec": mpiexec,
        "cuda_aware_mpi": aware,
        **gpu,
        "gpu_comm": _gpu_comm(aware, gpu["gpus"]),
        "fastpath": fast,
        "shared_memory": shared,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }


def format_info(info: dict[str, Any]) -> str:
    """``collect_info()`` as aligned ``key: value`` lines. **Local**."""
    labels = {
        "mpi_library": "MPI library",
        "mpi_standard": "MPI standard",
        "mpi4py": "mpi4py",
        "libmpi": "libmpi",
        "mpiexec": "mpiexec",
        "cuda_aware_mpi": "CUDA-aware MPI",
        "cupy": "cupy",
        "gpus": "GPUs",
        "gpu_comm": "GPU collectives",
        "fastpath": "fast path",
        "shared_memory": "shared memory",
        "python": "python",
        "numpy": "numpy",
    }
    width = max(len(v) for v in labels.values())
    lines = []
    for key, label in labels.items():
        value = info[key]
        shown = "not installed" if key == "cupy" and value is None else value
        lines.append(f"{label.ljust(width)}  {'unknown' if shown is None else shown}")
    return "\n".join(lines)
