"""Records of the view ops: the Tensor methods ``view``, ``reshape``, ``expand``,
``flatten``, ``permute``, ``transpose``, ``squeeze``, ``narrow``, ``select``, ``x[...]``,
``split``... (defined on the Tensor class; DTensor gets dispatching twins).

Ops whose output shape is a static argument receive the LOCAL output shape on a shard
(:func:`dtensor.ops.local_fns.shape_local`).
"""

from __future__ import annotations

from ..local.tensor import Tensor
from .derivatives import VIEW as D
from .local_fns import expand_as_local, getitem_local, shape_local, squeeze_local
from .table import Operator, declare_method

__all__: list[str] = []


# a view op: a method the Tensor class defines, with the validator's view samples
def view(name: str, *args: object, **kw: object) -> None:
    """Declare the view op ``name`` (its formula from the view family's)."""
    declare_method(name, *args, samples=kw.pop("samples", "view"), backward=D[name], **kw)


for _name in ("view", "reshape"):
    view(_name, ("input", "shape"), local_fn=shape_local("shape"))
view("expand", ("input", "sizes"), local_fn=shape_local("sizes"))
view("expand_as", ("input", "other"), tensors=("input", "other"), local_fn=expand_as_local,
     samples="expand_as")
view("flatten", ("input", "start_dim", "end_dim"),
     defaults={"start_dim": 0, "end_dim": -1})
view("unflatten", ("input", "dim", "sizes"), local_fn=shape_local("sizes"))
view("permute", ("input", "dims"))
for _name in ("transpose", "swapaxes", "swapdims"):
    view(_name, ("input", "dim0", "dim1"))
view("t", ("input",))
for _name in ("movedim", "moveaxis"):
    view(_name, ("input", "source", "destination"))
view("squeeze", ("input", "dim"), defaults={"dim": None}, local_fn=squeeze_local)
view("unsqueeze", ("input", "dim"))
view("narrow", ("input", "dim", "start", "length"))
# index is static so that the rule checks it against the global size (before any
# redistribution); one cache entry per index value
view("select", ("input", "dim", "index"))
view("getitem", ("input", "idx"), kernel=Tensor.__getitem__, method=False,
     local_fn=getitem_local, operators=(Operator("__getitem__", "method", Tensor.__getitem__),))
view("split", ("input", "split_size_or_sections", "dim"),
     defaults={"dim": 0})
view("chunk", ("input", "chunks", "dim"), defaults={"dim": 0})
view("unbind", ("input", "dim"), defaults={"dim": 0})
