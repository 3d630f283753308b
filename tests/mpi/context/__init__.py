"""context/: context parallelism (``dt.context_parallel``) and ring attention."""
