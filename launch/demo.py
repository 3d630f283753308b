"""dtensor demo: ``python -m launch -n 4 launch/demo.py``.

Each rank makes a local ``dt.Tensor`` (its block of rows of a global ``(size * 2, 3)``
matrix), the blocks are gathered on every rank with mpi4py's buffer-based
``Allgather`` straight from the tensors' memory (``Tensor.numpy()`` is zero-copy), and
rank 0 prints the world size and the gathered tensor, checked against numpy.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import dtensor as dt

ROWS, COLS = 2, 3


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    # This rank's block: rows [ROWS * rank, ROWS * (rank + 1)) of arange(size*ROWS*COLS).
    local = dt.arange(rank * ROWS * COLS, (rank + 1) * ROWS * COLS, dtype=dt.float32)
    local = local.view(ROWS, COLS)

    gathered = np.empty((size * ROWS, COLS), dtype=np.float32)
    comm.Allgather(local.numpy(), gathered)
    result = dt.from_numpy(gathered)

    expected = np.arange(size * ROWS * COLS, dtype=np.float32).reshape(size * ROWS, COLS)
    np.testing.assert_array_equal(result.numpy(), expected)
    if rank == 0:
        print(f"world size: {size}")
        print(f"rank 0's local tensor, shape {tuple(local.shape)}:\n{local}")
        print(f"all-gathered on every rank, shape {tuple(result.shape)}:\n{result}")


if __name__ == "__main__":
    main()
