"""``visualize_sharding``: index ranges per rank, uneven and empty shards, replicas, partials.

Specs are built over a :class:`placements.spec.MeshShape` (no MPI): the tool reads metadata
only. Expected ranges are written out from ``torch.chunk``'s rule (ceil-sized chunks).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor.debug._visualize import shard_blocks, visualize_sharding
from placements import Partial, Replicate, Shard
from placements.spec import DTensorSpec, MeshShape

R = Replicate()


def spec(mesh, placements, shape):
    return DTensorSpec(MeshShape(mesh), placements, shape, "float32")


def rows_of(text):
    """The per-rank table rows: {rank: [coord, ranges..., local shape]}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank  coord"))
    out = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = [c for c in line.split("  ") if c.strip()]
        out[int(cells[0])] = [c.strip() for c in cells[1:]]
    return out


def test_uneven_2d_tensor_on_2d_mesh():
    text = visualize_sharding(spec((2, 2), [Shard(0), Shard(1)], (5, 3)))
    assert text.splitlines()[0] == "shape (5, 3) float32, mesh 2x2, placements [S(0), S(1)]"
    rows = rows_of(text)
    # 5 rows over 2: 3 + 2; 3 cols over 2: 2 + 1
    assert rows == {
        0: ["(0, 0)", "0:3", "0:2", "(3, 2)"],
        1: ["(0, 1)", "0:3", "2:3", "(3, 1)"],
        2: ["(1, 0)", "3:5", "0:2", "(2, 2)"],
        3: ["(1, 1)", "3:5", "2:3", "(2, 1)"],
    }
    grid = text.split("\n\n")[1].splitlines()
    assert grid[0].split() == ["cols", "0:2", "cols", "2:3"]
    assert grid[2].split() == ["rows", "0:3", "rank", "0", "rank", "1"]
    assert grid[3].split() == ["rows", "3:5", "rank", "2", "rank", "3"]


def test_empty_shards_are_shown():
    # 2 elements over 3 ranks: chunks of 1, 1, 0
    text = visualize_sharding(spec((3,), [Shard(0)], (2,)))
    rows = rows_of(text)
    assert rows[0] == ["(0,)", "0:1", "(1,)"]
    assert rows[2] == ["(2,)", "2:2 (empty)", "(0,)"]
    assert text.splitlines()[-1] == "empty shards: rank 2"
    # 5 over 4: chunks of 2, 2, 1, 0
    rows = rows_of(visualize_sharding(spec((4,), [Shard(0)], (5, 2))))
    assert [r[1] for r in rows.values()] == ["0:2", "2:4", "4:5", "5:5 (empty)"]


def test_replicas_share_a_grid_cell_and_partials_are_marked():
    text = visualize_sharding(spec((2, 2), [Partial("sum"), Shard(0)], (3, 4)), "my header")
    lines = text.splitlines()
    assert lines[0] == "my header"
    assert "partial values (sum)" in text
    rows = rows_of(text)
    assert rows[0][1] == rows[2][1] == "0:2" and rows[1][1] == rows[3][1] == "2:3"
    assert "rank 0,2 P" in text and "rank 1,3 P" in text
    text = visualize_sharding(spec((2,), [R], (4, 4)))
    assert "rank 0,1" in text and "partial" not in text


def test_1d_tensor_on_2d_mesh_nests_the_shards():
    # tensor dim 0 split by mesh dim 0 first, then by mesh dim 1: 10 -> 5 + 5 -> 3 + 2 each
    rows = rows_of(visualize_sharding(spec((2, 2), [Shard(0), Shard(0)], (10,))))
    assert [r[1] for r in rows.values()] == ["0:3", "3:5", "5:8", "8:10"]


def test_mesh_dim_names_and_ranks_of_a_mesh_object():
    class Mesh:
        shape = (2, 2)
        ndim = 2
        mesh = np.array([[3, 2], [1, 0]])
        mesh_dim_names = ("dp", "tp")

        def __hash__(self):
            return 1

    text = visualize_sharding(DTensorSpec(Mesh(), [Shard(0), R], (4,), "int64"))
    assert "mesh 2x2 (dp, tp)" in text
    rows = rows_of(text)
    assert rows[3][0] == "(0, 0)" and rows[0][0] == "(1, 1)"


def test_rejects_other_objects_and_png_without_matplotlib():
    with pytest.raises(TypeError, match="expected a DTensor or a DTensorSpec"):
        visualize_sharding(np.ones(3))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs matplotlib"):
            visualize_sharding(spec((2,), [Shard(0)], (4,)), png="x.png")


@settings(deadline=None)  # examples: the profile's count
@given(
    mesh=st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (3, 2)]),
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=2).map(tuple),
    data=st.data(),
)
def test_blocks_tile_the_tensor_once_per_replica(mesh, shape, data):
    choices = [R, *(Shard(d) for d in range(len(shape)))]
    placements = [data.draw(st.sampled_from(choices)) for _ in mesh]
    blocks = shard_blocks(spec(mesh, placements, shape))
    assert len(blocks) == math.prod(mesh)
    count = np.zeros(shape, dtype=int)
    for b in blocks:
        for o, n, full in zip(b["offsets"], b["shape"], shape):
            assert 0 <= o and o + n <= full
        count[tuple(slice(o, o + n) for o, n in zip(b["offsets"], b["shape"]))] += 1
    replicas = math.prod(k for k, p in zip(mesh, placements) if p == R)
    assert (count == replicas).all()
    text = visualize_sharding(spec(mesh, placements, shape))
    assert len(rows_of(text)) == math.prod(mesh)
    coords = [b["coord"] for b in blocks]
    assert coords == list(itertools.product(*(range(k) for k in mesh)))


def test_png_is_written(tmp_path):
    # matplotlib is a test dependency (the [test] extra): the PNG is always drawn here
    out = tmp_path / "shards.png"
    text = visualize_sharding(spec((2, 2), [Shard(0), Shard(1)], (5, 3)), png=str(out))
    assert "rank" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
