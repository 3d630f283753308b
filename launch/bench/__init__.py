"""The benchmarks of dtensor (``python -m launch -n 2 launch/bench/<name>.py``; see each).

Importing this package (every benchmark imports :mod:`launch.bench._common`) checks that the
dtensor it measures runs on the compiled fast path: from a source checkout whose extension
was never built (``python -m launch.bench...`` from the repository root imports the source
tree), a benchmark would measure the Python path, about 5x slower at small sizes, and
report it as the library's speed. It refuses to run then (exit status 2, saying why and how
to build the extension); ``DTENSOR_FASTPATH=0`` measures the Python path on purpose.
"""

from __future__ import annotations

import sys

from launch._info import fastpath_off_by_accident

_PROBLEM = fastpath_off_by_accident()
if _PROBLEM is not None:
    sys.stderr.write(f"launch.bench: refusing to measure. {_PROBLEM}\n")
    raise SystemExit(2)
