"""tools/: visualize_sharding, dtensor.testing, and the checks that read the sources
(import layering, no vacuous asserts).
"""
