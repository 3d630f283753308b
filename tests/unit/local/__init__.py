"""local/: the local strided Tensor (creation, views, strides, property tests), the math
kernels, the allocator, and their compiled twins (strides, kernels, block cache).
"""
