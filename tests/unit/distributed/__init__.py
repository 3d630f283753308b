"""distributed/: meshes (abstract, GPU stand-in, settings in real jobs), DTensor's
metadata semantics against the local Tensor, SPMD hazards of real jobs.
"""
