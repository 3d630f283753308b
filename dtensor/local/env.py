"""Integer settings read from the environment: one parser and one error type
(:class:`~dtensor.errors.ConfigError`) for every ``DTENSOR_*`` count or size."""

from __future__ import annotations

import os

from placements.errors import ConfigError

__all__ = ["env_int"]


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
