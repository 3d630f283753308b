"""Running dtensor programs: the ``mpiexec`` launcher, the test runner, demo and tools.

``python -m launch -n 4 script.py`` runs a program on 4 ranks (:mod:`launch.__main__`),
``python -m launch test`` runs the whole test suite (:mod:`launch.runtests`),
``python -m launch mutate`` checks that it catches wrong sharding rules and plans
(:mod:`launch.mutate`) and ``launch/demo.py`` is the demo. Importing this package starts no MPI.
"""
