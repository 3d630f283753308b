"""The point-to-point constants of a calibration (:attr:`Calibration.p2p`): a ring step
(``Comm.sendrecv`` to the next rank, from the previous one) of float32 ``N x N`` blocks, as
a pipeline's stages and ring attention's blocks move them, fitted to ``alpha + bytes /
beta``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._calibrate import fit

__all__ = ["fit_p2p", "measure_p2p"]


def measure_p2p(mesh: Any, sizes: list[int], repeat: int = 7) -> list[tuple[int, float]]:
    """``[(bytes, seconds), ...]``: each rank sends a float32 ``N x N`` block to the next
    rank of the mesh's ranks and receives one from the previous (one ring step), for N in
    ``sizes``; the slowest rank's median. Empty on one rank. **Collective**."""
    from ._measure import _seconds  # lazy: _measure imports this module for calibrate()

    comm = mesh.get_group(None)
    if comm.size < 2:
        return []
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = []
    for n in sizes:
        send = np.ones((n, n), np.float32)
        recv = np.empty_like(send)
        seconds = _seconds(mesh, lambda s=send, r=recv: comm.sendrecv(s, nxt, r, prev, 7), repeat,
                           3)
        out.append((int(send.nbytes), seconds))
    return out


def fit_p2p(points: list[tuple[int, float]]) -> dict[str, float]:
    """``{"alpha_s", "beta_bytes_per_s"}`` of the points (empty without points). **Local**."""
    if not points:
        return {}
    alpha, beta = fit(points)
    return {"alpha_s": alpha, "beta_bytes_per_s": beta}
