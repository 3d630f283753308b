"""Settings read from the environment: one strict parser per kind, one error type.

Every ``DTENSOR_*`` switch, count or duration goes through these functions, so a value
that means nothing (``DTENSOR_CHECK_SPMD=banana``, ``DTENSOR_WATCHDOG=-3``) raises a
:class:`~placements.errors.ConfigError` that names the variable, its value and what it
accepts, instead of counting silently as on or off. An unset or empty variable takes the
default. Lives in the lowest layer so that every package reads settings the same way.
"""

from __future__ import annotations

import os

from .errors import ConfigError

__all__ = ["env_flag", "env_int", "env_seconds"]

_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off"))


def env_flag(name: str, default: bool = False) -> bool:
    """The on/off environment variable ``name`` (``default`` when unset or empty). **Local**.

    Accepts 1/true/yes/on and 0/false/no/off, in any case.

    Raises
    ------
    ConfigError
        Any other value.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    word = text.lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(
        f"environment variable {name}={text!r} is not a switch: use 1, true, yes, on or "
        "0, false, no, off"
    )


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """The integer environment variable ``name`` (``default`` when unset or empty). **Local**.

    Raises
    ------
    ConfigError
        If it is not an integer or is below ``minimum`` (a ValueError).
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={text!r} must be at least {minimum}")
    return value


def env_seconds(name: str) -> float | None:
    """A duration in seconds from the environment variable ``name``; None when unset, empty,
    0 or off (the feature it times is off). **Local**.

    Raises
    ------
    ConfigError
        Not a number, negative, infinite or NaN.
    """
    text = os.environ.get(name, "").strip()
    if not text or text.lower() in _FALSE:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ConfigError(
            f"environment variable {name}={text!r} is not a number of seconds >= 0 "
            "(0 or off: off)"
        )
    return value or None
