"""``loss_parallel``: the cross entropy of class-sharded logits without gathering them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from placements.errors import ShardingError

from ..dispatch.dispatcher import add_listener, remove_listener

__all__ = ["loss_parallel"]

#: The ops of a loss over class-sharded logits that must keep the class dim sharded.
_LOSS_OPS = frozenset({"cross_entropy", "log_softmax", "softmax"})


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within the block, the cross entropy (and log_softmax/softmax) of logits sharded on
    their class dim runs on the shards: two all-reduces of per-row figures, never a gather
    of the logits (PyTorch's ``torch.distributed.tensor.parallel.loss_parallel``).

    **Local** to enter. dtensor's cost model already prefers the class-sharded strategy
    for such logits; the block makes it a requirement: a call inside that would gather
    the class dim raises, naming the op and the placements. Run the backward inside the
    block too, as in PyTorch.

    Raises
    ------
    ShardingError
        Inside the block, a loss op whose chosen strategy moves the class-sharded input to
        another layout.
    """
    def check(entry, hit, values, mesh) -> None:
        if entry.name not in _LOSS_OPS:
            return
        for move in entry.moves:
            if move is None or getattr(move, "src", None) is None:
                continue
            src = move.src.placements
            if any(p.is_shard() for p in src) and move.dst.placements != src:
                raise ShardingError(
                    f"loss_parallel: {entry.name} would move its class-sharded input from "
                    f"{list(src)} to {list(move.dst.placements)}; shard the logits on the "
                    "class dim (the last) and keep the target Replicate"
                )

    add_listener(check)
    try:
        yield
    finally:
        remove_listener(check)
