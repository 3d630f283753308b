"""Every DTENSOR_* setting is parsed strictly by placements.env: a value that means
nothing raises ConfigError naming the variable and the value, instead of counting silently
as on or off (``DTENSOR_CHECK_SPMD=banana`` was on, ``DTENSOR_WATCHDOG=-3`` was off)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from placements.env import env_flag, env_int, env_seconds
from placements.errors import ConfigError
from redistribute import comm as _comm

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py


@pytest.mark.parametrize(
    "text,want",
    [("", False), ("1", True), ("on", True), ("TRUE", True), (" yes ", True), ("0", False),
     ("off", False), ("False", False), ("no", False)],
)
def test_env_flag_accepts_the_usual_spellings(monkeypatch, text, want):
    monkeypatch.setenv("DTENSOR_TEST_FLAG", text)
    assert env_flag("DTENSOR_TEST_FLAG") is want


@pytest.mark.parametrize("text", ["banana", "2", "-1", "onn", "y"])
def test_env_flag_refuses_anything_else(monkeypatch, text):
    monkeypatch.setenv("DTENSOR_TEST_FLAG", text)
    with pytest.raises(ConfigError, match=rf"DTENSOR_TEST_FLAG='{text}' is not a switch"):
        env_flag("DTENSOR_TEST_FLAG")


def test_env_flag_default_when_unset(monkeypatch):
    monkeypatch.delenv("DTENSOR_TEST_FLAG", raising=False)
    assert env_flag("DTENSOR_TEST_FLAG", True) is True
    assert env_flag("DTENSOR_TEST_FLAG") is False


@pytest.mark.parametrize("text,want", [("", None), ("0", None), ("off", None), ("2.5", 2.5),
                                       ("30", 30.0)])
def test_env_seconds(monkeypatch, text, want):
    monkeypatch.setenv("DTENSOR_TEST_S", text)
    assert env_seconds("DTENSOR_TEST_S") == want


@pytest.mark.parametrize("text", ["-3", "soon", "inf", "nan", "1e999"])
def test_env_seconds_refuses_negative_and_non_numbers(monkeypatch, text):
    monkeypatch.setenv("DTENSOR_TEST_S", text)
    with pytest.raises(ConfigError, match=rf"DTENSOR_TEST_S='{text}' is not a number"):
        env_seconds("DTENSOR_TEST_S")


def test_env_int(monkeypatch):
    monkeypatch.setenv("DTENSOR_TEST_N", "12")
    assert env_int("DTENSOR_TEST_N", 3) == 12
    monkeypatch.setenv("DTENSOR_TEST_N", "-1")
    with pytest.raises(ConfigError, match="must be at least 0"):
        env_int("DTENSOR_TEST_N", 3)


@pytest.mark.parametrize(
    "name,value", [("DTENSOR_CHECK_SPMD", "banana"), ("DTENSOR_WATCHDOG", "-3"),
                   ("DTENSOR_WATCHDOG_ABORT", "sometimes")],
)
def test_debug_switches_are_strict(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"{name}='{value}'"):
        _comm.configure_from_env()
    monkeypatch.delenv(name)
    _comm.configure_from_env()


@pytest.mark.parametrize(
    "name,value", [("DTENSOR_FASTPATH", "banana"), ("DTENSOR_SHM", "maybe"),
                   ("DTENSOR_SHM_MIN_BYTES", "-5"), ("DTENSOR_POOL_MIN_BYTES", "lots")],
)
def test_import_time_settings_are_strict(name, value):
    env = {"PATH": "/usr/bin:/bin", name: value}
    out = subprocess.run([sys.executable, "-c", "import dtensor"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert f"ConfigError: environment variable {name}='{value}'" in out.stderr, out.stderr
