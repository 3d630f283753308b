"""Unit tests: one process, no MPI (the test runner runs this folder with plain pytest).

One sub-folder per layer of the project (README, "What it is"); ``tests/mpi`` has the same
names where a layer has MPI tests.
"""
