"""``loss_parallel``: the cross entropy of class-sharded logits without gathering them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..dispatch.dispatcher import keep_shards

__all__ = ["loss_parallel"]

#: The ops of a loss over class-sharded logits (forward and backward) that keep the class
#: dim sharded.
_LOSS_OPS = frozenset({"cross_entropy", "log_softmax", "softmax"})


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within the block, the cross entropy (and log_softmax/softmax) of logits sharded on
    their class dim runs on the shards: per-row all-reduces, never a gather of the logits
    (PyTorch's ``torch.distributed.tensor.parallel.loss_parallel``).

    **Local** to enter. Outside it, dtensor's cost model picks the class-sharded strategy
    where it is cheaper (large vocabularies) and may gather small logits; inside, those ops
    keep every sharded input's shards whatever the cost. Run the backward inside the block
    too, as in PyTorch. The shard of the logits must be on the class dim and the target
    Replicate (or sharded on the batch dim like the logits).

    Raises
    ------
    ShardingError
        Inside the block, a loss op whose rule has no strategy that keeps its sharded
        input's shards, naming the op and the placements.
    """
    prev = keep_shards(_LOSS_OPS)
    try:
        yield
    finally:
        keep_shards(prev)
