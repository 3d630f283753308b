"""Internal package (a layer; its public names reach users through ``dtensor``): the
local strided tensor: Storage/Tensor and their views, dtypes, the array backend, the
caching allocator, counter-based random numbers, the local factories and the local math
kernels. This layer knows nothing about meshes or MPI."""
