"""launch/: the MPI test harness itself and the strategy sweeps."""
