"""redistribute/: the collectives, the executor, shared-memory exchanges, asynchronous
redistributes and max/min reductions, below dtensor.
"""
