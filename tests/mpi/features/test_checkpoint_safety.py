"""Checkpoint, ``.npy`` and HDF5 files that others may have touched: metadata that names
other files, links or bad values (refused, field by field, with a CheckpointError on every
rank); saves through a link (the link replaced, its target kept); keys that collide; a save
while another one holds the lock; temporaries planted as links; permissions kept by a
re-save; failed writes that leave no temporaries; loads while another save replaces the
checkpoint (read again, or a clear error). Each test saves a small state and then plays the
part of the other job or of the one who crafted the files."""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import os
import re
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import xxhash
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ArgumentError, CheckpointError

WORLD = MPI.COMM_WORLD
R, S = dt.Replicate(), dt.Shard

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.mode_independent]  # file IO only



def _values(seed):
    a = np.random.default_rng(seed).standard_normal((4 * WORLD.size, 3)).astype(np.float32)
    return a, np.arange(4.0) + seed


def _save(path, seed=0):
    """Save ``{"w": S(0) DTensor, "b": array}`` from seed ``seed``; returns the arrays."""
    mesh = dt.init_device_mesh((WORLD.size,))
    a, b = _values(seed)
    dt.save({"w": dt.distribute_tensor(a, mesh, [S(0)]), "b": b}, path)
    return a, b


def _load(path):
    out = dt.load(path)
    return out["w"].full_tensor().numpy(), out["b"]


def _meta(path):
    with open(os.path.join(path, "metadata.json")) as fh:
        return json.load(fh)


def _on_rank0(fn):
    """``fn()`` on rank 0, between barriers (what another job or user does to the files)."""
    WORLD.Barrier()
    if WORLD.rank == 0:
        fn()
    WORLD.Barrier()


def _write_meta(path, meta):
    def write():
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            json.dump(meta, fh)

    _on_rank0(write)


def _tensor(meta, key):
    return next(t for t in meta["tensors"] if t["key"] == key)


def test_metadata_cannot_make_a_load_read_another_file(folder):
    """A block's file of a path outside the checkpoint (with checksums turned off by a
    negative chunk size) was read into the tensor; now each bad field is refused by name."""
    path = os.path.join(folder, "ck")
    _save(path)
    secret = os.path.join(folder, "secret")
    _on_rank0(lambda: np.arange(100, dtype=np.float64).tofile(secret))
    meta = _meta(path)
    where = re.escape(os.path.join(path, "metadata.json"))
    for name in (secret, "../secret", "../../" + secret, "data-00000.bin/../../secret",
                 "metadata.json", "data-0.bin", f"data-{WORLD.size + 7:05d}.bin", 7):
        bad = copy.deepcopy(meta)
        _tensor(bad, "b")["blocks"][0]["file"] = name
        bad["files"][name if isinstance(name, str) else "x"] = 800
        _write_meta(path, bad)
        with pytest.raises(CheckpointError, match=rf"load: '{where}': files\[|file is"):
            dt.load(path)
        del bad["files"][name if isinstance(name, str) else "x"]  # listed in files or not
        _write_meta(path, bad)
        with pytest.raises(CheckpointError, match=rf"load: '{where}': tensors\[\d\] \('b'\)"
                                                  r"\.blocks\[0\]\.file is"):
            dt.load(path)
    bad = copy.deepcopy(meta)
    bad["chunk_bytes"] = -1
    _write_meta(path, bad)
    with pytest.raises(CheckpointError, match=rf"'{where}': chunk_bytes is -1; expected an "
                                              "integer from 1"):
        dt.load(path)
    _write_meta(path, meta)
    assert np.array_equal(_load(path)[1], np.arange(4.0))  # the good metadata still loads


def test_links_inside_a_checkpoint_are_refused(folder):
    """A data file or the metadata replaced by a link (here to an identical copy, which
    the checksums pass) is refused: a load opens the checkpoint's own files only."""
    path = os.path.join(folder, "ck")
    _save(path)
    data = os.path.join(path, "data-00000.bin")
    copy_ = os.path.join(folder, "copy.bin")

    def link_data():
        shutil.copyfile(data, copy_)
        os.unlink(data)
        os.symlink(copy_, data)

    _on_rank0(link_data)
    with pytest.raises(CheckpointError, match=r"cannot open .*data-00000\.bin.* it is a symbolic "
                                              r"link.*'b', 'w'"):
        dt.load({"b": np.zeros(4)}, path)

    def link_meta():
        os.unlink(data)
        shutil.copyfile(copy_, data)
        meta = os.path.join(path, "metadata.json")
        shutil.copyfile(meta, os.path.join(folder, "meta.json"))
        os.unlink(meta)
        os.symlink(os.path.join(folder, "meta.json"), meta)

    _on_rank0(link_meta)
    with pytest.raises(CheckpointError, match=r"metadata\.json' \(read\): it is a symbolic link"):
        dt.load(path)

    def fifo():
        os.unlink(os.path.join(path, "metadata.json"))
        shutil.copyfile(os.path.join(folder, "meta.json"), os.path.join(path, "metadata.json"))
        os.unlink(data)
        os.mkfifo(data)

    _on_rank0(fifo)  # a FIFO: refused, not waited on
    with pytest.raises(CheckpointError, match=r"data-00000\.bin' \(read\): it is not a regular"):
        dt.load({"b": np.zeros(4)}, path)


# (what to change in the metadata, the field the error names)
BAD_VALUES = [
    (lambda m: m.update(chunk_bytes=0), r"chunk_bytes is 0"),
    (lambda m: m.update(chunk_bytes="4"), r"chunk_bytes is '4'"),
    (lambda m: m.update(chunk_bytes=True), r"chunk_bytes is True"),
    (lambda m: m.update(world_size=0), r"world_size is 0"),
    (lambda m: m.update(files=[]), r"files is \[\]"),
    (lambda m: m.update(tensors={}), r"tensors is \{\}"),
    (lambda m: m.update(save_id=3), r"save_id is 3"),
    (lambda m: _tensor(m, "w").update(placements=["P(sum)"]), r"\('w'\)\.placements is"),
    (lambda m: _tensor(m, "w").update(placements=["S(2)"]), r"\('w'\)\.placements is"),
    (lambda m: _tensor(m, "w").update(placements=["R", "R"]), r"\('w'\)\.placements is"),
    (lambda m: _tensor(m, "w").update(mesh_shape=[WORLD.size + 1]), r"\('w'\)\.mesh_shape is"),
    (lambda m: _tensor(m, "w").update(mesh_dim_names=[1]), r"\('w'\)\.mesh_dim_names is"),
    (lambda m: _tensor(m, "w").update(shape=[2**45, 3]), r"\('w'\)\.blocks do not tile"),
    (lambda m: _tensor(m, "w").update(shape=[2**62, 3]), r"\('w'\)\.shape \[.*\] of <f4 takes"),
    (lambda m: _tensor(m, "w").update(shape=[-4, 3]), r"\('w'\)\.shape\[0\] is -4"),
    (lambda m: _tensor(m, "w").update(shape=[4.5, 3]), r"\('w'\)\.shape\[0\] is 4\.5"),
    (lambda m: _tensor(m, "w").update(dtype="O"), r"\('w'\)\.dtype is 'O'"),
    (lambda m: _tensor(m, "w").update(dtype="nope"), r"\('w'\)\.dtype is 'nope'"),
    (lambda m: _tensor(m, "w").update(kind="file"), r"\('w'\)\.kind is 'file'"),
    (lambda m: _tensor(m, "b").update(key="w"), r"tensors\[\d\]\.key is 'w'"),
    (lambda m: _tensor(m, "w")["blocks"].pop(), r"\('w'\)\.blocks do not tile .* uncovered"),
    (lambda m: _tensor(m, "w")["blocks"].append(_tensor(m, "w")["blocks"][0]),
     r"\('w'\)\.blocks do not tile .* twice"),
    (lambda m: _tensor(m, "w")["blocks"][-1]["offsets"].__setitem__(0, 1),
     r"\('w'\)\.blocks.*(do not tile|outside)"),
    (lambda m: _tensor(m, "w")["blocks"][0]["offsets"].__setitem__(0, -1),
     r"\('w'\)\.blocks\[0\]\.offsets\[0\] is -1"),
    (lambda m: _tensor(m, "w")["blocks"][0]["lengths"].__setitem__(1, 9),
     r"\('w'\)\.blocks\[0\] \(offsets .*\) reaches outside"),
    (lambda m: _tensor(m, "w")["blocks"][0].update(nbytes=1), r"blocks\[0\]\.nbytes is 1"),
    (lambda m: _tensor(m, "w")["blocks"][0].update(offset=2**40),
     r"blocks\[0\]\.offset 1099511627776 plus"),
    (lambda m: _tensor(m, "w")["blocks"][0].update(xxh3_64=[]), r"blocks\[0\]\.xxh3_64 is \[\]"),
    (lambda m: _tensor(m, "w")["blocks"][0].update(xxh3_64=[-1]),
     r"blocks\[0\]\.xxh3_64\[0\] is -1"),
    (lambda m: _tensor(m, "w")["blocks"][0].update(writer=WORLD.size + 3),
     r"blocks\[0\]\.writer is"),
    (lambda m: m.update(structure={"dict": [["w", {"tensor": 1}], ["b", {"tensor": 1}]]}),
     r"structure\.dict\[0\] is \{'tensor': 1\}"),
    (lambda m: m.update(structure={"dict": [["w", {"value": 1}], ["b", {"tensor": 1}]]}),
     r"structure does not refer to tensors \[0\]"),
    (lambda m: m.update(structure={"eval": "x"}), r"structure is \{'eval': 'x'\}"),
    (lambda m: m.update(structure=json.loads("[" * 50 + "]" * 50)), r"structure is \[\[\["),
]


def test_bad_metadata_values_raise_checkpoint_error_naming_the_field(folder):
    path = os.path.join(folder, "ck")
    _save(path)
    meta = _meta(path)
    where = re.escape(os.path.join(path, "metadata.json"))
    for change, field in BAD_VALUES:
        bad = copy.deepcopy(meta)
        change(bad)
        _write_meta(path, bad)
        with pytest.raises(CheckpointError, match=rf"load: '{where}': .*{field}"):
            dt.load(path)
        with pytest.raises(CheckpointError, match=rf"load: '{where}': .*{field}"):
            dt.load({"b": np.zeros(4)}, path)

    def nested():  # deeper than the JSON parser goes
        with open(os.path.join(path, "metadata.json"), "w") as fh:
            fh.write("[" * 100_000 + "]" * 100_000)

    _on_rank0(nested)
    with pytest.raises(CheckpointError, match=rf"load: '{where}' is not valid JSON"):
        dt.load(path)


def test_a_huge_consistent_shape_raises_checkpoint_error(folder):
    """Metadata whose every field agrees on a tensor of 2^45 float32 (128 TiB): load(path)
    cannot allocate it or finds the data file short, and says so as a CheckpointError."""
    path = os.path.join(folder, "ck")
    _save(path)
    meta = _meta(path)
    huge = 2**45
    meta["chunk_bytes"] = 4 * huge  # one checksum per block
    meta["files"]["data-00000.bin"] = 4 * huge
    w = _tensor(meta, "w")
    w.update(shape=[huge, 3], placements=["S(1)"], placements_given=["S(1)"])
    w["blocks"] = [{"offsets": [0, i], "lengths": [huge, 1], "file": "data-00000.bin",
                    "offset": 0, "nbytes": 4 * huge, "xxh3_64": [0]} for i in range(3)]
    _write_meta(path, meta)
    with pytest.raises(CheckpointError, match=r"load: .*('w'|data-00000\.bin)"):
        dt.load(path)


def test_a_checksum_error_does_not_show_the_digest_of_what_was_read(folder):
    path = os.path.join(folder, "ck")
    _save(path)
    block = _tensor(_meta(path), "b")["blocks"][0]
    name = os.path.join(path, block["file"])

    def flip():
        with open(name, "r+b") as fh:
            fh.seek(block["offset"])
            fh.write(b"\xff")

    _on_rank0(flip)
    with open(name, "rb") as fh:
        fh.seek(block["offset"])
        read = xxhash.xxh3_64_intdigest(fh.read(block["nbytes"]))
    with pytest.raises(CheckpointError, match=r"checksum mismatch .* 'b'") as info:
        dt.load({"b": np.zeros(4)}, path)
    assert f"{read:#x}" not in str(info.value) and f"{read:x}" not in str(info.value)


def test_save_through_a_link_replaces_the_link_and_keeps_its_target(folder):
    """``latest -> step100``: a save to ``latest`` deleted step100's data files, and every
    later save to ``latest`` failed. Now the link is swapped to a new folder beside it."""
    step100, latest = os.path.join(folder, "step100"), os.path.join(folder, "latest")
    a0, _ = _save(step100, 0)
    files = sorted(os.listdir(step100))
    _on_rank0(lambda: os.symlink("step100", latest))
    a1, _ = _save(latest, 1)
    assert os.path.islink(latest)
    first = os.readlink(latest)
    assert re.fullmatch(r"latest\.dtensor-[0-9a-f]{16}", first), first
    assert sorted(os.listdir(step100)) == files
    np.testing.assert_array_equal(_load(step100)[0], a0)  # the target, as it was
    np.testing.assert_array_equal(_load(latest)[0], a1)
    a2, _ = _save(latest, 2)  # the folder the first save made is replaced
    second = os.readlink(latest)
    assert second != first and not os.path.exists(os.path.join(folder, first))
    np.testing.assert_array_equal(_load(latest)[0], a2)
    np.testing.assert_array_equal(_load(step100)[0], a0)
    assert sorted(os.listdir(folder)) == sorted(["step100", "latest", second])
    # a link to what is not a checkpoint is refused, and nothing changes
    def elsewhere():
        os.unlink(latest)
        os.symlink("notes.txt", latest)
        with open(os.path.join(folder, "notes.txt"), "w") as fh:
            fh.write("x")

    _on_rank0(elsewhere)
    with pytest.raises(CheckpointError, match=r"latest' \(a link to 'notes\.txt'\) exists and "
                                              "is not a dtensor checkpoint"):
        _save(latest, 3)
    assert os.readlink(latest) == "notes.txt"


def test_keys_that_collide_are_refused_naming_both(folder):
    mesh = dt.init_device_mesh((WORLD.size,))
    x1 = dt.distribute_tensor(np.ones(WORLD.size), mesh, [S(0)])
    x2 = dt.distribute_tensor(np.zeros(WORLD.size), mesh, [S(0)])
    path = os.path.join(folder, "ck")
    with pytest.raises(ArgumentError, match=r"save: the state's entries state\['a\.b'\] and "
                                            r"state\['a'\]\['b'\] both have the key 'a\.b'"):
        dt.save({"a.b": x1, "a": {"b": x2}}, path)
    with pytest.raises(ArgumentError, match=r"state\['l'\]\[0\] and state\['l\.0'\] .* 'l\.0'"):
        dt.save({"l": [x1], "l.0": 3}, path)
    assert not os.listdir(folder)  # refused before anything was written


def test_a_save_while_another_holds_the_lock_fails_on_every_rank(folder):
    path = os.path.join(folder, "ck")
    a, _ = _save(path, 0)
    lock = os.path.join(folder, ".ck.dtensor-lock")
    held = None
    if WORLD.rank == 0:  # another job's save, in progress
        held = os.open(lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(held, fcntl.LOCK_EX)
    with pytest.raises(CheckpointError, match=r"save: another save to .*ck' is in progress"):
        _save(path, 1)
    np.testing.assert_array_equal(_load(path)[0], a)
    assert sorted(os.listdir(folder)) == [".ck.dtensor-lock", "ck"]
    if held is not None:
        os.close(held)
    a2, _ = _save(path, 2)
    np.testing.assert_array_equal(_load(path)[0], a2)
    assert os.listdir(folder) == ["ck"]  # the lock file goes with the save that held it


def test_npy_and_h5_temporaries_never_go_through_a_planted_link(folder):
    mesh = dt.init_device_mesh((WORLD.size,))
    a = np.arange(6.0 * WORLD.size).reshape(WORLD.size, 6)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    victim = os.path.join(folder, "victim")
    out_npy, out_h5 = os.path.join(folder, "x.npy"), os.path.join(folder, "x.h5")

    def plant():
        with open(victim, "w") as fh:
            fh.write("precious")
        for out in (out_npy, out_h5):  # at the fixed temporary names of earlier versions
            os.symlink(victim, os.path.join(folder, f".{os.path.basename(out)}.dtensor-tmp"))

    _on_rank0(plant)
    dt.to_npy(x, out_npy)
    np.testing.assert_array_equal(np.load(out_npy), a)
    assert not os.path.islink(out_npy)
    h5py = pytest.importorskip("h5py")
    dt.to_h5(x, out_h5, "x")
    dt.to_h5(x + 1, out_h5, "x")  # over an existing file: a copy of it
    with h5py.File(out_h5, "r") as f:
        np.testing.assert_array_equal(f["x"][()], a + 1)
    assert not os.path.islink(out_h5)
    with open(victim) as fh:
        assert fh.read() == "precious"


def test_a_resave_keeps_the_permissions(folder):
    """A private checkpoint (0700 folder, 0600 files), .npy or .h5 file stays private when
    written again (as np.save keeps a file's mode)."""
    path = os.path.join(folder, "ck")
    _save(path, 0)
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.ones((WORLD.size, 2)), mesh, [S(0)])
    npy, h5 = os.path.join(folder, "x.npy"), os.path.join(folder, "x.h5")
    dt.to_npy(x, npy)
    h5py = pytest.importorskip("h5py")
    dt.to_h5(x, h5, "x")

    read_only = os.path.join(folder, "r.npy")
    dt.to_npy(x, read_only)

    def private():
        os.chmod(path, 0o700)
        for name in os.listdir(path):
            os.chmod(os.path.join(path, name), 0o600)
        os.chmod(npy, 0o600)
        os.chmod(h5, 0o640)
        os.chmod(read_only, 0o444)

    _on_rank0(private)
    _save(path, 1)
    dt.to_npy(x + 1, npy)
    dt.to_h5(x + 1, h5, "x")
    dt.to_npy(x + 1, read_only)  # replaced (as np.save would not), and still read-only
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(os.path.join(path, n)).st_mode) for n in os.listdir(path)} == {
        0o600}
    assert stat.S_IMODE(os.stat(npy).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(h5).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(read_only).st_mode) == 0o444
    np.testing.assert_array_equal(np.load(read_only), np.full((WORLD.size, 2), 2.0))
    # a new checkpoint gets the default modes: a new folder's (the umask's)
    fresh, probe = os.path.join(folder, "fresh"), os.path.join(folder, "probe")
    _save(fresh, 2)
    if WORLD.rank == 0:
        os.mkdir(probe)
        assert stat.S_IMODE(os.stat(fresh).st_mode) == stat.S_IMODE(os.stat(probe).st_mode)
    with h5py.File(h5, "r") as f:
        np.testing.assert_array_equal(f["x"][()], np.full((WORLD.size, 2), 2.0))


def test_a_failed_write_leaves_no_temporaries(folder, monkeypatch):
    """A full disk during dt.save, to_npy or to_h5: every rank raises, the temporaries
    are removed and the previous files are as they were."""
    from redistribute.fileio import File

    path = os.path.join(folder, "ck")
    a, _ = _save(path, 0)
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.ones((WORLD.size, 2)), mesh, [S(0)])
    npy, h5 = os.path.join(folder, "x.npy"), os.path.join(folder, "x.h5")
    dt.to_npy(x, npy)
    before = sorted(os.listdir(folder))

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(File, "write_at", full)
    monkeypatch.setattr(File, "write_block_all", full)
    with pytest.raises(CheckpointError, match="save: OSError: .*No space left on device"):
        _save(path, 1)
    with pytest.raises(CheckpointError, match="to_npy: OSError: .*No space left on device"):
        dt.to_npy(x + 1, npy)
    monkeypatch.undo()
    WORLD.Barrier()
    assert sorted(os.listdir(folder)) == before
    np.testing.assert_array_equal(_load(path)[0], a)
    np.testing.assert_array_equal(np.load(npy), np.ones((WORLD.size, 2)))
    h5py = pytest.importorskip("h5py")
    import dtensor.checkpoint._h5 as h5_module

    dt.to_h5(x, h5, "x")
    monkeypatch.setattr(h5_module, "_write_block", full)
    with pytest.raises(CheckpointError, match="to_h5: OSError: .*No space left on device"):
        dt.to_h5(x + 1, h5, "x")
    monkeypatch.undo()
    WORLD.Barrier()
    assert sorted(os.listdir(folder)) == sorted(before + ["x.h5"])
    with h5py.File(h5, "r") as f:
        np.testing.assert_array_equal(f["x"][()], np.ones((WORLD.size, 2)))


def _swap_in(path, new):
    """What another job's save does to ``path``: the previous checkpoint renamed away and
    its data files removed once the new one is in place."""
    old = path + ".previous"
    os.rename(path, old)
    os.rename(new, path)
    shutil.rmtree(old)


def test_a_load_while_another_save_replaces_the_checkpoint(folder, monkeypatch):
    """The checkpoint replaced between a load's metadata and its data reads: the load
    reads the new one (once), instead of a checksum mismatch; replaced on both tries, it
    says so."""
    import dtensor.checkpoint._dcp as dcp

    path = os.path.join(folder, "ck")
    _save(path, 0)
    news = [os.path.join(folder, f"new{i}") for i in range(3)]
    expected = [_save(new, i + 1) for i, new in enumerate(news)]
    fill, swaps = dcp._fill, []

    def fill_after_a_swap(*args, **kwargs):
        if swaps:
            new = swaps.pop(0)
            _on_rank0(lambda: _swap_in(path, new))
        return fill(*args, **kwargs)

    monkeypatch.setattr(dcp, "_fill", fill_after_a_swap)
    swaps[:] = [news[0]]
    w, b = _load(path)
    np.testing.assert_array_equal(w, expected[0][0])
    np.testing.assert_array_equal(b, expected[0][1])
    swaps[:] = [news[1], news[2]]  # replaced during both tries
    with pytest.raises(CheckpointError, match=r"load: the checkpoint at .*ck' was replaced by "
                                              "another save while this load read it, twice"):
        dt.load({"b": np.zeros(4)}, path)
    monkeypatch.undo()
    np.testing.assert_array_equal(_load(path)[0], expected[2][0])


def test_ranks_that_read_different_checkpoints_read_again(folder, monkeypatch):
    """The last rank reads the metadata of another checkpoint (as before a swap that the
    others saw done): the ranks see it and read again, rather than load a mix or create
    different meshes. At one rank there is nothing to compare: it loads what it read."""
    import dtensor.checkpoint._dcp as dcp

    path, other = os.path.join(folder, "ck"), os.path.join(folder, "other")
    a, _ = _save(path, 0)
    a_other, _ = _save(other, 1)
    open_folder, calls = dcp._open_folder, []

    def stale(p):
        calls.append(p)
        return open_folder(other if len(calls) == 1 else p)

    if WORLD.rank == WORLD.size - 1:
        monkeypatch.setattr(dcp, "_open_folder", stale)
    w, _ = _load(path)
    np.testing.assert_array_equal(w, a if WORLD.size > 1 else a_other)


def test_h5_data_kept_in_other_files_is_refused_unless_allowed(folder):
    """An HDF5 dataset with external raw storage names any file of the machine as its data;
    a virtual dataset maps datasets of other files. ``from_h5`` refuses both (naming the
    files) unless ``allow_external=True``; ``to_h5`` never writes through them."""
    h5py = pytest.importorskip("h5py")
    mesh = dt.init_device_mesh((WORLD.size,))
    src, raw = os.path.join(folder, "ext.h5"), os.path.join(folder, "secret.bin")
    other = os.path.join(folder, "other.h5")
    n = 4 * WORLD.size
    secret = np.arange(n, dtype=np.float32) * 3
    if WORLD.rank == 0:
        secret.tofile(raw)
        with h5py.File(other, "w") as f:
            f["y"] = secret + 1
        with h5py.File(src, "w") as f:
            f.create_dataset("x", shape=(n,), dtype="f4", external=[(raw, 0, 4 * n)])
            layout = h5py.VirtualLayout(shape=(n,), dtype="f4")
            layout[:] = h5py.VirtualSource(other, "y", shape=(n,))
            f.create_virtual_dataset("v", layout)
            f["plain"] = secret
    WORLD.Barrier()
    for name, words in (("x", "external raw storage in .*secret\\.bin"),
                        ("v", "a virtual dataset mapped from .*other\\.h5")):
        with pytest.raises(CheckpointError, match=f"from_h5: dataset '{name}' of .*ext\\.h5' "
                                                  f"keeps its data in other files \\({words}"):
            dt.from_h5(src, name, mesh, [S(0)])
    got = dt.from_h5(src, "x", mesh, [S(0)], allow_external=True).full_tensor().numpy()
    np.testing.assert_array_equal(got, secret)
    got = dt.from_h5(src, "v", mesh, [R], allow_external=True).full_tensor().numpy()
    np.testing.assert_array_equal(got, secret + 1)
    np.testing.assert_array_equal(dt.from_h5(src, "plain", mesh, [S(0)]).full_tensor().numpy(),
                                  secret)  # a dataset stored in the file itself reads as ever
    before = Path(raw).read_bytes()
    with pytest.raises(CheckpointError, match="to_h5: dataset 'x' of .* keeps its data in "
                                              "other files"):
        dt.to_h5(dt.distribute_tensor(np.zeros(n, np.float32), mesh, [S(0)]), src, "x")
    assert Path(raw).read_bytes() == before  # nothing written through the external file
    assert not [f for f in os.listdir(folder) if f.startswith(".")]  # no temporary left
