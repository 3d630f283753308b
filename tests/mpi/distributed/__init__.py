"""distributed/: DeviceMesh and its communicators, the DTensor API, abstract meshes,
GPU meshes, host conversions and Partial fills.
"""
