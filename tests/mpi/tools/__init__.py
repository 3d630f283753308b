"""tools/: CommDebugMode, explain and strict mode, SPMD divergence checks."""
