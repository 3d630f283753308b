"""Records of the neural-network ops: softmax, layer_norm, embedding, losses, dropout."""

from __future__ import annotations

from ..local import kernels as K
from .derivatives import NN as D
from .local_fns import class_sharded_local, dropout_local, embedding_local, mse_local
from .table import declare

__all__: list[str] = []

for _name in ("softmax", "log_softmax"):
    declare(_name, getattr(K, _name), local_fn=class_sharded_local, samples="nn",
            backward=D[_name])
declare("layer_norm", K.layer_norm, ("input", "weight", "bias"), method=False, samples="nn",
        backward=D["layer_norm"])
declare("embedding", K.embedding, ("input", "weight"), local_fn=embedding_local, method=False,
        samples="nn", backward=D["embedding"])
declare("cross_entropy", K.cross_entropy, ("input", "target", "weight"), method=False,
        local_fn=class_sharded_local, samples="nn", backward=D["cross_entropy"])
declare("mse_loss", K.mse_loss, ("input", "target"), local_fn=mse_local, method=False,
        samples="nn", backward=D["mse_loss"])
declare("dropout", K.dropout, local_fn=dropout_local, method=False, samples="nn",
        backward=D["dropout"])
