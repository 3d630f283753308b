"""Unit tests: one process, no MPI (the test runner runs this folder with plain pytest).

One sub-folder per layer of the project (DESIGN §1); ``tests/mpi`` has the same names
where a layer has MPI tests.
"""
