"""Where the collective watchdog keeps its state, against a hostile temporary directory.

One process (``COMM_WORLD`` of size 1), the watchdog started and stopped in-process. Its
folder is private (mode 0700, owned by this user, not a symlink: a folder that fails this
is refused with :class:`ConfigError` and nothing is written), its state files are 0600 and
written without following symlinks planted in the folder, and stopping the watchdog
removes them.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time

import pytest

from dtensor.errors import ConfigError
from redistribute import comm as C
from redistribute.comm import watchdog as CW

#: Limit of the waits for the watchdog thread's first write (it writes within a second).
LIMIT_S = 30

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """The temporary directory of this test stands in for /tmp; no folder from outside."""
    for name in ("DTENSOR_WATCHDOG_DIR", "SLURM_JOB_ID", "DTENSOR_WATCHDOG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        yield tmp_path
    finally:
        C.set_watchdog(None)
        C.configure_from_env()


def _victim(tmp_path, name="victim"):
    path = tmp_path / name
    path.write_text("precious")
    return path


def _poll(condition, what):
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {LIMIT_S} s")
        time.sleep(0.05)


@pytest.mark.parametrize("attack", ["symlink", "foreign owner", "open to others"])
def test_a_planted_folder_is_refused_and_nothing_is_written(tmp_root, attack):
    folder = CW.job_dir()
    assert os.path.dirname(folder) == str(tmp_root)
    victim = _victim(tmp_root)
    planted = tmp_root / "planted"
    planted.mkdir()
    os.symlink(victim, planted / "rank0.tmp")
    os.symlink(victim, planted / "rank0")
    if attack == "symlink":
        os.symlink(planted, folder)
    elif attack == "foreign owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        os.chown(planted, 65534, 65534)
        os.rename(planted, folder)
    else:
        planted.chmod(0o777)
        os.rename(planted, folder)
    with pytest.raises(ConfigError, match="watchdog") as info:
        C.set_watchdog(60.0)
    assert folder in str(info.value)
    assert C.HOOKS.watchdog is None
    assert victim.read_text() == "precious"


def test_state_is_private_and_removed_when_the_watchdog_stops(tmp_root):
    C.set_watchdog(60.0)
    folder = C.HOOKS.watchdog.dir
    state = os.path.join(folder, "rank0")
    _poll(lambda: os.path.exists(state), "the watchdog wrote no state")
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(state).st_mode) == 0o600
    assert os.listdir(folder) == ["rank0"]  # no temporary file left behind
    C.set_watchdog(None)
    assert not os.path.exists(folder)


def test_symlinks_planted_in_the_folder_are_not_followed(tmp_root, monkeypatch):
    folder = tmp_root / "given"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("DTENSOR_WATCHDOG_DIR", str(folder))
    victims = [_victim(tmp_root, "victim-tmp"), _victim(tmp_root, "victim-state")]
    os.symlink(victims[0], folder / "rank0.tmp")
    os.symlink(victims[1], folder / "rank0")
    C.set_watchdog(60.0)
    state = folder / "rank0"

    def written() -> bool:
        touched = any(v.read_text() != "precious" for v in victims)
        return touched or (state.is_file() and not state.is_symlink())

    _poll(written, "the watchdog wrote no state")
    assert [v.read_text() for v in victims] == ["precious", "precious"]
    assert stat.S_IMODE(os.lstat(state).st_mode) == 0o600
