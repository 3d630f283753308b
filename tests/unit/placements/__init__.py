"""placements/: placement types, specs, shard layout math, PyTorch's metadata semantics,
index plans, sharding rules, the shared caches and the DTENSOR_* settings.
"""
