"""``python -m dtensor.validate [--quick] [--op NAME ...]``: the strategy validator, which
checks every candidate of every sharding rule on data (:mod:`dtensor.debug.validate`; the
sample calls are the op families' own, :mod:`dtensor.ops.samples`). It prints one row per op
and a summary line, and exits non-zero on any mismatch. This module is its public face:
:func:`validate`, :func:`sample_calls` and the command line's :func:`main`. **Local**: no MPI
anywhere.
"""

from __future__ import annotations

import sys

from .debug.validate import Report, SampleCall, main, sample_calls, validate

__all__ = ["Report", "SampleCall", "main", "sample_calls", "validate"]

if __name__ == "__main__":
    sys.exit(main())
