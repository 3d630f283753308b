"""Checkpoints, ``.npy`` and HDF5 IO over MPI: ``dt.save``/``dt.load`` round trips of every
placement combination (1-D meshes, and 2x2 at 4 ranks), uneven and empty shards, several
dtypes and 0-d tensors; in-place loads onto other placements; the bytes each rank reads on
a resharding load; typed errors on corrupt, missing and mismatching files; leftovers of a
killed save; ``dt.from_npy``/``dt.to_npy``; ``dt.from_h5``/``dt.to_h5`` (h5py). Each test
saves once and loads a few times: one state holds every combination."""

from __future__ import annotations

import itertools
import json
import os
import sys
import zlib

import numpy as np
import pytest
from helpers.mpi import meshes_dp_tp as meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import (
    CheckpointError,
    DTypeError,
    MeshError,
    ShardingError,
    UnavailableError,
)

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
DTYPES = (np.float32, np.float64, np.int64, np.bool_, np.float16)
SHAPES = ((8, 6), (5, 3), (0, 4), (1, 7), ())



def options(ndim):
    return [R, P("sum"), P("max")] + [S(d) for d in range(ndim)]


def data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    return (rng.standard_normal(shape) * 10).astype(dtype)


def cases():
    """(key, mesh, placements, global array) for every mesh, placement combination and
    shape; dtypes cycle through DTYPES."""
    out = []
    n = 0
    for mi, mesh in enumerate(meshes()):
        for shape in SHAPES:
            for pl in itertools.product(options(len(shape)), repeat=mesh.ndim):
                dtype = DTYPES[n % len(DTYPES)]
                if np.dtype(dtype) == np.bool_ and any(p.is_partial("sum") for p in pl):
                    dtype = np.int64  # a bool P(sum) is an or; keep the test about IO
                out.append((f"m{mi}.{'x'.join(map(str, shape))}.{n}", mesh, pl,
                            data(shape, dtype, n)))
                n += 1
    return out


def full(x):
    return x.full_tensor().numpy()


@pytest.mark.mpi(min_size=1)
def test_round_trip_every_placement_and_reshard_in_place(folder):
    cs = cases()
    state = {"tensors": {k: dt.distribute_tensor(a, m, pl) for k, m, pl, a in cs}}
    path = os.path.join(folder, "ck")
    dt.save(state, path)
    # load(path) at the same world size: the saved mesh shape, names and placements
    out = dt.load(path)
    for k, mesh, pl, a in cs:
        got = out["tensors"][k]
        assert got.device_mesh.shape == mesh.shape
        assert got.device_mesh.mesh_dim_names == mesh.mesh_dim_names
        assert got.placements == tuple(R if p.is_partial() else p for p in pl), k
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(full(got), a, err_msg=k)
    # in place, each tensor onto the next case's mesh and placements (same shape)
    targets, locals_ = {}, {}
    for i, (k, mesh, pl, a) in enumerate(cs):
        _, mesh2, pl2, _ = next(c for c in cs[i + 1:] + cs[:i + 1] if c[3].shape == a.shape)
        if a.dtype == np.bool_ and any(p.is_partial("sum") for p in pl2):
            pl2 = [R if p.is_partial() else p for p in pl2]
        targets[k] = dt.distribute_tensor(np.zeros(a.shape, a.dtype), mesh2, pl2)
        locals_[k] = targets[k].to_local().numpy()
    same = dt.load({"tensors": targets}, path)
    assert same["tensors"] is targets
    for k, _, _, a in cs:
        assert locals_[k].size == 0 or np.shares_memory(targets[k].to_local().numpy(), locals_[k])
        np.testing.assert_array_equal(full(targets[k]), a, err_msg=k)


@pytest.mark.mpi(min_size=1)
def test_python_values_local_tensors_and_arrays(folder):
    mesh = dt.init_device_mesh((WORLD.size,))
    state = {
        "step": 7, "lr": 0.5, "name": "run", "none": None, "flag": True,
        "odd": [float("inf"), float("nan")], "pair": (1, ("a", 2.5)),
        "arr": np.arange(10, dtype=np.int32).reshape(2, 5), "scalar": np.float16(1.5),
        "local": dt.tensor([[1.0, 2.0]]), "empty": np.zeros((0, 3)),
        "nested": [{"w": dt.distribute_tensor(np.ones((3, 2)), mesh, [S(0)])}],
    }
    path = os.path.join(folder, "ck")
    dt.save(state, path)
    out = dt.load(path)
    assert (out["step"], out["lr"], out["name"], out["none"], out["flag"]) == (
        7, 0.5, "run", None, True)
    assert out["odd"][0] == float("inf") and np.isnan(out["odd"][1])
    assert out["pair"] == (1, ("a", 2.5))
    assert out["arr"].dtype == np.int32 and np.array_equal(out["arr"], state["arr"])
    assert isinstance(out["scalar"], np.float16) and out["scalar"] == 1.5
    assert isinstance(out["local"], dt.Tensor)
    assert np.array_equal(out["local"].numpy(), [[1.0, 2.0]])
    assert out["empty"].shape == (0, 3)
    assert np.array_equal(full(out["nested"][0]["w"]), np.ones((3, 2)))
    # in place: tensors filled, python values and scalars replaced, extra keys untouched
    target = {"step": 0, "arr": np.zeros((2, 5), np.int32), "scalar": np.float16(0),
              "local": dt.zeros(1, 2), "pair": (0, 0)}
    arr = target["arr"]
    dt.load(target, path)
    assert target["step"] == 7 and target["arr"] is arr and arr[1, 4] == 9
    assert target["scalar"] == 1.5 and target["local"].numpy()[0, 1] == 2.0
    assert target["pair"] == (0, 0)  # tuples are immutable


@pytest.mark.mpi(min_size=1)
def test_resharding_load_reads_only_its_share(folder):
    mesh = dt.init_device_mesh((WORLD.size,))
    rows, cols = 4 * WORLD.size + 1, 8
    a = data((rows, cols), np.float64, 1)
    state = {"cols": dt.distribute_tensor(a, mesh, [S(1)]),
             "rep": dt.distribute_tensor(a, mesh, [R])}
    path = os.path.join(folder, "ck")
    dt.save(state, path, chunk_bytes=8)  # one checksum per element: no rounding up
    meta = read_meta(path)
    blocks = {t["key"]: t["blocks"] for t in meta["tensors"]}
    assert len(blocks["rep"]) == 1  # a replicated tensor is written once
    assert len(blocks["cols"]) == min(WORLD.size, cols)
    data_size = sum(os.path.getsize(os.path.join(path, f)) for f in meta["files"])
    assert sorted(meta["files"]) == sorted(f for f in os.listdir(path) if f.endswith(".bin"))
    assert data_size < 2 * a.nbytes + 64 * (WORLD.size + 1)
    meta_bytes = os.path.getsize(os.path.join(path, "metadata.json"))
    for key in ("cols", "rep"):
        target = dt.distribute_tensor(np.zeros_like(a), mesh, [S(0)])
        dt.load({key: target}, path)
        np.testing.assert_array_equal(full(target), a)
        stats = dt.checkpoint.last_load_stats()
        share = target.to_local().numpy().nbytes
        assert stats["data_bytes"] == stats["needed_bytes"] == share, (key, stats)
        assert stats["bytes_read"] == meta_bytes + share
        everyone = WORLD.allgather(stats["data_bytes"])
        assert sum(everyone) == a.nbytes  # no rank read another's rows
    # a Partial(sum) target: only coordinate 0 holds the value and reads it
    target = dt.distribute_tensor(np.zeros_like(a), mesh, [P("sum")])
    dt.load({"rep": target}, path)
    np.testing.assert_array_equal(full(target), a)
    read = dt.checkpoint.last_load_stats()["data_bytes"]
    assert read == (a.nbytes if WORLD.rank == 0 else 0)
    # default chunks: at most the chunks that hold the share
    dt.save(state, path)
    target = dt.distribute_tensor(np.zeros_like(a), mesh, [S(0)])
    dt.load({"rep": target}, path)
    stats = dt.checkpoint.last_load_stats()
    assert stats["needed_bytes"] == target.to_local().numpy().nbytes
    assert stats["data_bytes"] <= a.nbytes


def read_meta(path):
    with open(os.path.join(path, "metadata.json")) as fh:
        return json.load(fh)


def _save_small(folder):
    mesh = dt.init_device_mesh((WORLD.size,))
    a = data((4 * WORLD.size, 3), np.float32, 2)
    state = {"w": dt.distribute_tensor(a, mesh, [S(0)]), "b": np.arange(4.0)}
    path = os.path.join(folder, "ck")
    dt.save(state, path)
    return path, mesh, a


@pytest.mark.mpi(min_size=1)
def test_flipped_byte_raises_checkpoint_error_naming_file_and_tensor(folder):
    path, _, _ = _save_small(folder)
    meta = read_meta(path)
    last = next(t for t in meta["tensors"] if t["key"] == "w")["blocks"][-1]
    if WORLD.rank == 0:
        with open(os.path.join(path, last["file"]), "r+b") as fh:
            fh.seek(last["offset"] + 5)
            byte = fh.read(1)
            fh.seek(last["offset"] + 5)
            fh.write(bytes([byte[0] ^ 0x40]))
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match=r"load: checksum mismatch in .*data-\d{5}\.bin.* 'w'"):
        dt.load(path)
    # the other tensor is intact and loads alone
    b = np.zeros(4)
    dt.load({"b": b}, path)
    assert np.array_equal(b, np.arange(4.0))


@pytest.mark.mpi(min_size=1)
def test_checkpoints_name_their_checksum_and_crc32_ones_still_load(folder):
    """A save records XXH3-64 digests; a checkpoint whose metadata names CRC-32 (and holds
    CRC-32 digests) loads and is verified; an unknown algorithm is refused by name."""
    path, mesh, a = _save_small(folder)
    meta = read_meta(path)
    WORLD.Barrier()  # every rank has read it before rank 0 rewrites it
    assert meta["checksum"] == "xxh3_64"
    chunk = meta["chunk_bytes"]
    if WORLD.rank == 0:
        for t in meta["tensors"]:
            for block in t["blocks"]:
                with open(os.path.join(path, block["file"]), "rb") as fh:
                    fh.seek(block["offset"])
                    raw = fh.read(block["nbytes"])
                del block["xxh3_64"]
                block["crc32"] = [zlib.crc32(raw[i : i + chunk])
                                  for i in range(0, len(raw), chunk)]
        meta["checksum"] = "crc32"
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            json.dump(meta, fh)
    WORLD.Barrier()
    w = dt.distribute_tensor(np.zeros_like(a), mesh, [dt.Replicate()])
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(w.full_tensor().numpy(), a)
    if WORLD.rank == 0:  # a wrong CRC-32 is caught too
        meta["tensors"][0]["blocks"][0]["crc32"][0] ^= 1
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            json.dump(meta, fh)
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match="checksum mismatch.*stored crc32"):
        dt.load(path)
    WORLD.Barrier()
    if WORLD.rank == 0:
        meta["checksum"] = "md5"
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            json.dump(meta, fh)
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match="names checksum 'md5'.*'crc32', 'xxh3_64'"):
        dt.load(path)


@pytest.mark.mpi(min_size=1)
def test_missing_or_bad_files_raise_checkpoint_error(folder):
    path, _, _ = _save_small(folder)
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.remove(os.path.join(path, "data-00000.bin"))  # rank 0's: 'b' and a block of 'w'
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match=r"load: cannot open .*data-00000\.bin.*'b', 'w'"):
        dt.load(path)
    WORLD.Barrier()
    if WORLD.rank == 0:
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            fh.write("{not json")
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match=r"metadata\.json.* is not valid JSON"):
        dt.load(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        dt.load(os.path.join(folder, "nothing"))
    assert issubclass(CheckpointError, OSError)


@pytest.mark.mpi(min_size=1)
def test_truncated_data_file(folder):
    path, _, _ = _save_small(folder)
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.truncate(os.path.join(path, "data-00000.bin"), 10)
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match=r"data-00000\.bin' holds 10 bytes.*truncated tensors"):
        dt.load(path)


@pytest.mark.mpi(min_size=1)
def test_state_that_does_not_match_the_checkpoint(folder):
    path, mesh, a = _save_small(folder)
    with pytest.raises(CheckpointError, match="load: 'x' of the state is not in checkpoint"):
        dt.load({"x": np.zeros(3)}, path)
    with pytest.raises(ShardingError, match=r"load: 'b' has shape \(5,\)"):
        dt.load({"b": np.zeros(5)}, path)
    with pytest.raises(DTypeError, match="load: 'b' has dtype int64"):
        dt.load({"b": np.zeros(4, np.int64)}, path)
    with pytest.raises(DTypeError, match="save: the state's entry 'o' has type object"):
        dt.save({"o": object()}, path)
    if WORLD.size > 1:
        shape = (3,) if WORLD.rank == 0 else (4,)
        with pytest.raises(CheckpointError, match="save: the ranks pass different states"):
            dt.save({"b": np.zeros(shape)}, path)
    if WORLD.size == 4:
        tp = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        with pytest.raises(MeshError, match="save: 'w' is on a mesh of shape"):
            dt.save({"w": dt.DTensor.from_local(np.ones(2), tp, [S(0)], shape=(4,))}, path)
    # the checkpoint survived every refused save
    w = dt.distribute_tensor(np.zeros_like(a), mesh, [R])
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(full(w), a)
    if WORLD.rank == 0:
        with open(os.path.join(folder, "file"), "w") as fh:
            fh.write("x")
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match="is not a dtensor checkpoint"):
        dt.save({"b": np.zeros(2)}, os.path.join(folder, "file"))
    # an OSError of rank 0 alone is a CheckpointError on every rank
    with pytest.raises(CheckpointError, match="save: FileNotFoundError: .*No such file"):
        dt.save({"b": np.zeros(2)}, os.path.join(folder, "no", "ck"))


@pytest.mark.mpi(min_size=1)
def test_leftovers_of_a_killed_save(folder):
    path, mesh, a = _save_small(folder)
    tmp = os.path.join(folder, ".ck.dtensor-tmp")
    old = os.path.join(folder, ".ck.dtensor-old")
    WORLD.Barrier()
    if WORLD.rank == 0:  # killed while writing: a partial temporary folder
        os.mkdir(tmp)
        with open(os.path.join(tmp, "data-00000.bin"), "wb") as fh:
            fh.write(b"partial")
    WORLD.Barrier()
    w = dt.distribute_tensor(np.zeros_like(a), mesh, [S(0)])
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(full(w), a)
    WORLD.Barrier()
    if WORLD.rank == 0:  # killed between the two renames: only the previous one is there
        os.rename(path, old)
    WORLD.Barrier()
    dt.load({"w": w}, path)
    assert dt.checkpoint.last_load_stats()["path"] == old
    np.testing.assert_array_equal(full(w), a)
    # the next save replaces the leftovers
    dt.save({"w": dt.distribute_tensor(a + 1, mesh, [S(0)])}, path)
    assert not os.path.exists(tmp) and not os.path.exists(old)
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(full(w), a + 1)


@pytest.mark.mpi(min_size=1)
def test_npy_round_trips_every_placement(folder):
    # every third case: each mesh, shape, dtype and placement kind still comes up
    cs = [c for c in cases() if c[0].split(".")[1] != "1x7"][::3]
    names = []
    for i, (k, mesh, pl, a) in enumerate(cs):
        name = os.path.join(folder, f"{i}.npy")
        names.append(name)
        if WORLD.rank == 0:
            np.save(name, np.asfortranarray(a) if i % 3 == 1 else a)
    WORLD.Barrier()
    for name, (k, mesh, pl, a) in zip(names, cs):
        x = dt.from_npy(name, mesh, pl)
        assert x.placements == tuple(pl) and x.dtype == a.dtype
        np.testing.assert_array_equal(full(x), a, err_msg=k)
        out = name + ".out.npy"
        dt.to_npy(x, out)
        got = np.load(out)
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(got, a, err_msg=k)
    dt.to_npy(np.arange(3), os.path.join(folder, "local.npy"))
    assert np.array_equal(np.load(os.path.join(folder, "local.npy")), np.arange(3))
    big_endian = os.path.join(folder, "be.npy")
    if WORLD.rank == 0:
        np.save(big_endian, np.arange(6.0).astype(">f8"))
    WORLD.Barrier()
    x = dt.from_npy(big_endian, meshes()[0], [P("sum")])
    assert x.to_local().numpy().dtype.isbuiltin  # native, and the type MPI reductions take
    np.testing.assert_array_equal(full(x), np.arange(6.0))
    assert not [f for f in os.listdir(folder) if f.startswith(".")]  # temporaries renamed


@pytest.mark.mpi(min_size=1)
def test_npy_errors(folder):
    mesh = dt.init_device_mesh((WORLD.size,))
    with pytest.raises(CheckpointError, match=r"from_npy: cannot read .*missing\.npy"):
        dt.from_npy(os.path.join(folder, "missing.npy"), mesh, [S(0)])
    bad = os.path.join(folder, "bad.npy")
    short = os.path.join(folder, "short.npy")
    if WORLD.rank == 0:
        with open(bad, "wb") as fh:
            fh.write(b"not an npy file")
        np.save(short, np.arange(100))
        os.truncate(short, 200)
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match="is not a .npy file"):
        dt.from_npy(bad, mesh, [S(0)])
    with pytest.raises(CheckpointError, match=r"holds 200 bytes; its header \(shape \(100,\)"):
        dt.from_npy(short, mesh, [S(0)])
    with pytest.raises(DTypeError, match="to_npy: expected a DTensor"):
        dt.to_npy([1, 2], os.path.join(folder, "x.npy"))
    if WORLD.size == 4:
        tp = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        x = dt.DTensor.from_local(np.ones(2), tp, [S(0)], shape=(4,))
        with pytest.raises(MeshError, match="to_npy: a DTensor on a mesh of shape"):
            dt.to_npy(x, os.path.join(folder, "x.npy"))


@pytest.mark.mpi(min_size=1)
def test_save_without_a_writer_thread(folder, monkeypatch):
    # an MPI library without MPI_THREAD_SERIALIZED: the writes run on the main thread
    import dtensor.checkpoint._dcp as dcp

    monkeypatch.setattr(dcp, "threads_allowed", lambda: False)
    path, mesh, a = _save_small(folder)
    w = dt.distribute_tensor(np.zeros_like(a), mesh, [R])
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(full(w), a)


@pytest.mark.mpi(min_size=1)
def test_save_without_sync_calls_no_fsync(folder, monkeypatch):
    from redistribute.fileio import File

    def refuse(*_args, **_kwargs):
        raise OSError("fsync called")

    mesh = dt.init_device_mesh((WORLD.size,))
    a = data((3 * WORLD.size, 2), np.float64, 3)
    path = os.path.join(folder, "ck")
    dt.save({"w": dt.distribute_tensor(a, mesh, [S(0)])}, path)
    monkeypatch.setattr(os, "fsync", refuse)
    monkeypatch.setattr(File, "sync", refuse)
    with pytest.raises(CheckpointError, match="save: OSError: fsync called"):
        dt.save({"w": dt.distribute_tensor(a + 1, mesh, [S(0)])}, path)
    dt.save({"w": dt.distribute_tensor(a + 2, mesh, [S(0)])}, path, sync=False)
    monkeypatch.undo()
    w = dt.distribute_tensor(np.zeros_like(a), mesh, [R])
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(full(w), a + 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.mode_independent  # file IO, below the dispatch
def test_save_uncaches_and_removes_its_share_of_the_previous_checkpoint(folder, monkeypatch):
    mesh = dt.init_device_mesh((WORLD.size,))
    a = data((3 * WORLD.size, 2), np.float64, 4)
    path = os.path.join(folder, "ck")
    dt.save({"w": dt.distribute_tensor(a, mesh, [S(0)])}, path)
    mine = os.path.join(path, f"data-{WORLD.rank:05d}.bin")
    assert os.path.isfile(mine)
    advised, removed = [], []
    fadvise, unlink = os.posix_fadvise, os.unlink

    def record_fadvise(fd, offset, length, advice):
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        fadvise(fd, offset, length, advice)

    def record_unlink(name, *args, **kwargs):
        removed.append(os.fspath(name))
        unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "posix_fadvise", record_fadvise)
    monkeypatch.setattr(os, "unlink", record_unlink)
    dt.save({"w": dt.distribute_tensor(a + 1, mesh, [S(0)])}, path)
    monkeypatch.undo()
    # before writing: the replaced data file's pages dropped; after the swap: the file removed
    assert advised == [(mine, os.POSIX_FADV_DONTNEED)]
    assert [r for r in removed if r.endswith(".bin")] == [
        os.path.join(folder, ".ck.dtensor-old", os.path.basename(mine))]
    assert not os.path.exists(os.path.join(folder, ".ck.dtensor-old"))
    w = dt.distribute_tensor(np.zeros_like(a), mesh, [R])
    dt.load({"w": w}, path)
    np.testing.assert_array_equal(full(w), a + 1)


@pytest.mark.mpi(min_size=1)
@pytest.mark.mode_independent  # file IO, below the dispatch
def test_h5_round_trips_every_placement(folder):
    h5py = pytest.importorskip("h5py")
    # a sample: each mesh, shape (uneven, empty, 0-d), dtype and placement kind
    cs = [c for i, c in enumerate(cases()) if i % 9 == 1 or (c[1].ndim == 1 and i % 4 == 0)]
    src, out = os.path.join(folder, "in.h5"), os.path.join(folder, "out.h5")
    if WORLD.rank == 0:
        with h5py.File(src, "w") as f:
            for i, (_, _, _, a) in enumerate(cs):  # every fourth big-endian
                f.create_dataset(f"g/{i}", data=a.astype(a.dtype.newbyteorder(">"))
                                 if i % 4 == 1 else a)
    WORLD.Barrier()
    for i, (k, mesh, pl, a) in enumerate(cs):
        x = dt.from_h5(src, f"g/{i}", mesh, pl)
        assert x.placements == tuple(pl) and x.dtype == a.dtype
        np.testing.assert_array_equal(full(x), a, err_msg=k)
        dt.to_h5(x, out, f"d/{i}")  # into one file: the earlier datasets stay
    dt.to_h5(np.arange(3.0), out, "local")
    y = dt.distribute_tensor(cs[0][3] + 1, cs[0][1], [R] * cs[0][1].ndim)
    dt.to_h5(y, out, "d/0")  # an existing dataset is overwritten
    if WORLD.rank == 0:  # h5py reads the file on its own
        with h5py.File(out, "r") as f:
            assert sorted(f["d"], key=int) == [str(i) for i in range(len(cs))]
            for i, (k, _, _, a) in enumerate(cs):
                got = f[f"d/{i}"][()]
                assert got.dtype == a.dtype, k
                np.testing.assert_array_equal(got, a + 1 if i == 0 else a, err_msg=k)
            np.testing.assert_array_equal(f["local"][()], np.arange(3.0))
    assert not [f for f in os.listdir(folder) if f.startswith(".")]  # temporaries renamed


@pytest.mark.mpi(min_size=1)
@pytest.mark.mode_independent  # file IO, below the dispatch
def test_h5_errors_leave_the_file_as_it_was(folder, monkeypatch):
    h5py = pytest.importorskip("h5py")
    import dtensor.checkpoint._h5 as h5

    mesh = dt.init_device_mesh((WORLD.size,))
    src, bad = os.path.join(folder, "a.h5"), os.path.join(folder, "bad.h5")
    a = data((6, 4), np.float32, 5)
    if WORLD.rank == 0:
        with h5py.File(src, "w") as f:
            f["x"] = a
            f["g/y"] = a
            f["s"] = "text"
        with open(bad, "wb") as fh:
            fh.write(b"not hdf5")
    WORLD.Barrier()
    with pytest.raises(CheckpointError, match=r"from_h5: cannot open .*missing\.h5"):
        dt.from_h5(os.path.join(folder, "missing.h5"), "x", mesh, [S(0)])
    with pytest.raises(CheckpointError, match=r"from_h5: cannot open .*bad\.h5"):
        dt.from_h5(bad, "x", mesh, [S(0)])
    with pytest.raises(CheckpointError, match=r"has no dataset 'nope' \(its top level holds "
                                              r"\['g', 's', 'x'\]\)"):
        dt.from_h5(src, "nope", mesh, [S(0)])
    with pytest.raises(CheckpointError, match="'g' in .* is a Group, not a dataset"):
        dt.from_h5(src, "g", mesh, [S(0)])
    with pytest.raises(DTypeError, match="from_h5: dataset 's' of .* has dtype object"):
        dt.from_h5(src, "s", mesh, [R])
    x = dt.distribute_tensor(a, mesh, [S(0)])
    with pytest.raises(ShardingError, match=r"to_h5: dataset 'x' of .* has shape \(6, 4\)"):
        dt.to_h5(dt.distribute_tensor(np.zeros((5, 4), np.float32), mesh, [S(0)]), src, "x")
    with pytest.raises(DTypeError, match="to_h5: dataset 'x' of .* has dtype float32"):
        dt.to_h5(dt.distribute_tensor(a.astype(np.float64), mesh, [S(0)]), src, "x")
    with pytest.raises(CheckpointError, match="bad.h5' exists and is not an HDF5 file"):
        dt.to_h5(x, bad, "x")
    with pytest.raises(DTypeError, match="to_h5: expected a DTensor"):
        dt.to_h5([1.0], src, "x")
    # the last writer fails: every rank raises, the file is left as it was
    last = WORLD.allreduce(WORLD.rank if x.to_local().numpy().size else -1, op=MPI.MAX)

    def fail(*args):
        raise OSError("disk full")

    if WORLD.rank == last:
        monkeypatch.setattr(h5, "_write_block", fail)
    with pytest.raises(CheckpointError, match="to_h5: OSError: disk full"):
        dt.to_h5(x + 1, src, "x")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "h5py", None)  # h5py not installed
    with pytest.raises(UnavailableError, match="from_h5: HDF5 files need h5py"):
        dt.from_h5(src, "x", mesh, [S(0)])
    with pytest.raises(UnavailableError, match="to_h5: HDF5 files need h5py"):
        dt.to_h5(x, src, "x")
    monkeypatch.undo()
    np.testing.assert_array_equal(full(dt.from_h5(src, "x", mesh, [S(1)])), a)
    if WORLD.rank == 0:
        with open(bad, "rb") as fh:
            assert fh.read() == b"not hdf5"
    assert sorted(os.listdir(folder)) == ["a.h5", "bad.h5"]  # no temporary left
