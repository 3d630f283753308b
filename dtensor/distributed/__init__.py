"""Internal package (a layer; its public names reach users through ``dtensor``): the
distributed layer: DeviceMesh, the GPU binding of ranks, DTensor and its
construction and conversions, and the mesh-aware factories."""
