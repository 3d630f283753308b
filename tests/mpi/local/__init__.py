"""local/: the caching allocator under MPI workloads."""
