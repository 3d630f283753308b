"""Checkpoints and parallel file IO of DTensors.

- :func:`save` / :func:`load`: checkpoint folders of nested states (DTensors, local
  tensors, numpy arrays, python values), written once per distinct block with MPI-IO,
  crash-safe, checksummed, resharded on load onto any mesh, placements and world size
  (:mod:`dtensor.checkpoint._dcp` documents the format); :func:`last_load_stats`: the
  bytes this rank read in its last load.
- :func:`get_state_dict` / :func:`set_state_dict`: a model's and its optimizers' state keyed
  by parameter names, to save under one parallel layout and resume under another.
- :func:`from_npy` / :func:`to_npy`: one standard ``.npy`` file read or written by every
  rank's block with collective MPI-IO.
- :func:`from_h5` / :func:`to_h5`: one dataset of an HDF5 file, each rank reading its
  hyperslab, the writers taking turns on a temporary copy (h5py, optional: the ``hdf5``
  extra).
"""

from ._dcp import last_load_stats, load, save
from ._h5 import from_h5, to_h5
from ._npy import from_npy, to_npy
from ._state_dict import get_state_dict, set_state_dict

__all__ = ["from_h5", "from_npy", "get_state_dict", "last_load_stats", "load", "save",
           "set_state_dict", "to_h5", "to_npy"]
