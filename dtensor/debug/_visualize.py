"""``visualize_sharding``: which rank holds which index range of a DTensor.

This module owns the text rendering of a DTensor's layout (from metadata only: its spec and
its mesh's ranks, through the layout math of :mod:`placements.layout`), and an optional
PNG drawing of the same layout when matplotlib is installed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from placements.errors import DTypeError, ShardingError
from placements.layout import local_offsets, local_shape
from placements.spec import DTensorSpec
from placements.types import Partial, placement_list

from ..distributed.dtensor import DTensor

__all__ = ["shard_blocks", "visualize_sharding"]


def _spec_of(x: DTensor | DTensorSpec) -> DTensorSpec:
    if isinstance(x, DTensor):
        return x._spec
    if isinstance(x, DTensorSpec):
        return x
    raise DTypeError(f"visualize_sharding: expected a DTensor or a DTensorSpec, got {type(x)}")


def _ranks(spec: DTensorSpec) -> np.ndarray:
    """The rank at every mesh coordinate (coordinates in row-major order without a mesh)."""
    grid = getattr(spec.mesh, "mesh", None)
    if grid is None:
        return np.arange(int(np.prod(spec.mesh_shape))).reshape(spec.mesh_shape)
    return np.asarray(grid)


def shard_blocks(x: DTensor | DTensorSpec) -> list[dict[str, object]]:
    """One record per mesh coordinate: its rank and the index ranges it holds. **Local**.

    Parameters
    ----------
    x : DTensor or DTensorSpec

    Returns
    -------
    list of dict
        In mesh-coordinate order, each with ``rank``, ``coord``, ``offsets`` and ``shape``
        (the block's global start and size per tensor dim; a size may be 0) and
        ``partial`` (the reduce ops of the Partial placements that apply, in mesh-dim order).
    """
    spec = _spec_of(x)
    ranks = _ranks(spec)
    partial = [p.reduce_op for p in spec.placements if isinstance(p, Partial)]
    out = []
    for coord in itertools.product(*(range(k) for k in spec.mesh_shape)):
        out.append(
            {
                "rank": int(ranks[coord]),
                "coord": coord,
                "offsets": local_offsets(spec.shape, spec.mesh_shape, spec.placements, coord),
                "shape": local_shape(spec.shape, spec.mesh_shape, spec.placements, coord),
                "partial": partial,
            }
        )
    return out


def _span(start: int, size: int) -> str:
    return f"{start}:{start + size}" + (" (empty)" if size == 0 else "")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _grid(spec: DTensorSpec, blocks: list[dict[str, object]]) -> list[str]:
    """A 1-D or 2-D tensor drawn as its blocks: rows x columns, each cell naming its ranks."""
    shape = spec.shape if len(spec.shape) == 2 else (1, *spec.shape)
    holders: dict[tuple, list[int]] = {}
    for b in blocks:
        offsets, sizes = b["offsets"], b["shape"]
        if len(spec.shape) == 1:
            offsets, sizes = (0, *offsets), (shape[0], *sizes)
        if 0 in sizes:
            continue
        key = ((offsets[0], sizes[0]), (offsets[1], sizes[1]))
        holders.setdefault(key, []).append(b["rank"])
    empty = [str(b["rank"]) for b in blocks if 0 in b["shape"]]
    empty_line = [f"empty shards: rank {', '.join(empty)}"] if empty else []
    if not holders:
        return empty_line
    row_spans = sorted({k[0] for k in holders})
    col_spans = sorted({k[1] for k in holders})
    tag = " P" if blocks and blocks[0]["partial"] else ""
    header = [""] + [f"cols {_span(*c)}" for c in col_spans]
    rows = [header]
    for r in row_spans:
        label = f"rows {_span(*r)}" if len(spec.shape) == 2 else "elements"
        cells = [label]
        for c in col_spans:
            ranks = holders.get((r, c))
            cells.append("-" if ranks is None else "rank " + ",".join(map(str, ranks)) + tag)
        rows.append(cells)
    if len(spec.shape) == 1:
        rows[0][1:] = [f"[{_span(*c)}]" for c in col_spans]
    return _table(rows) + empty_line


def visualize_sharding(
    x: DTensor | DTensorSpec, header: str = "", *, png: str | None = None
) -> str:
    """Which rank / mesh coordinate holds which index range of ``x``, as text. **Local**.

    Metadata only (nothing is communicated): call it on one rank and print the result
    (PyTorch's version prints on rank 0 itself).

    The text has a title line (shape, dtype, mesh, placements; a second line when values
    are partial), one table row per mesh
    coordinate (rank, coordinate, the global index range per tensor dim, the local
    shape; an empty shard shows ``n:n (empty)``), and for 1-D and 2-D tensors a grid of
    the distinct blocks with the ranks holding each (replicas share a cell; ``P`` marks
    blocks that hold partial values still to be reduced).

    Parameters
    ----------
    x : DTensor or DTensorSpec
        The tensor (or just its spec).
    header : str, optional
        A line printed first.
    png : str, optional
        Also draw the grid of a 1-D or 2-D tensor into this PNG file (needs matplotlib).

    Returns
    -------
    str
    """
    # Note: unlike PyTorch's visualize_sharding, which prints on rank 0, this returns the
    # text so that the caller chooses the rank that prints (``if rank == 0: print(...)``).
    spec = _spec_of(x)
    blocks = shard_blocks(spec)
    names = getattr(spec.mesh, "mesh_dim_names", None)
    mesh_text = "x".join(map(str, spec.mesh_shape)) + (f" ({', '.join(names)})" if names else "")
    title = (
        f"shape {spec.shape} {spec.dtype}, mesh {mesh_text}, "
        f"placements {placement_list(spec.placements)}"
    )
    dims = [f"dim {d}" for d in range(len(spec.shape))]
    rows = [["rank", "coord", *dims, "local shape"]]
    for b in blocks:
        ranges = [_span(o, n) for o, n in zip(b["offsets"], b["shape"])]
        rows.append([str(b["rank"]), str(b["coord"]), *ranges, str(b["shape"])])
    lines = ([header] if header else []) + [title]
    if blocks[0]["partial"]:
        ops = ", ".join(blocks[0]["partial"])
        lines.append(f"partial values ({ops}): blocks are still to be reduced over those mesh dims")
    lines += _table(rows)
    if 1 <= len(spec.shape) <= 2:
        lines += ["", *_grid(spec, blocks)]
    if png is not None:
        _draw_png(spec, blocks, png, header or title)
    return "\n".join(lines)


def _draw_png(spec: DTensorSpec, blocks: list[dict[str, object]], path: str, title: str) -> None:
    """Draw the blocks of a 1-D or 2-D tensor as labelled rectangles (matplotlib)."""
    if not 1 <= len(spec.shape) <= 2:
        raise ShardingError(
            f"visualize_sharding: png needs a 1-D or 2-D tensor, got shape {spec.shape}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("visualize_sharding(png=...) needs matplotlib installed") from exc
    rows_total, cols_total = spec.shape if len(spec.shape) == 2 else (1, spec.shape[0])
    holders: dict[tuple, list[int]] = {}
    for b in blocks:
        off, size = b["offsets"], b["shape"]
        if len(spec.shape) == 1:
            off, size = (0, *off), (rows_total, *size)
        if 0 not in size:
            holders.setdefault((*off, *size), []).append(b["rank"])
    fig, ax = plt.subplots(figsize=(6, 6 * max(rows_total, 1) / max(cols_total, 1) + 1))
    colors = plt.get_cmap("tab20")
    for i, ((r0, c0, nr, nc), ranks) in enumerate(sorted(holders.items())):
        ax.add_patch(plt.Rectangle((c0, r0), nc, nr, facecolor=colors(i % 20), edgecolor="k"))
        label = "rank " + ",".join(map(str, ranks))
        ax.text(c0 + nc / 2, r0 + nr / 2, label, ha="center", va="center")
    ax.set_xlim(0, max(cols_total, 1))
    ax.set_ylim(max(rows_total, 1), 0)
    ax.set_title(title)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
