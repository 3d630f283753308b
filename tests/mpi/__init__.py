"""MPI tests: pytest-mpi under ``mpiexec -n K`` (K = 1..4), every rank runs every test.

One sub-folder per layer of the project (README, "What it is"), named as in
``tests/unit``; a layer without MPI tests has no folder here.
"""
