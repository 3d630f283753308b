"""launch/: the launcher, its reliability and --info, the test runner and MPI harness,
failure handling of real jobs, the examples and scripts, the mutation check.
"""
