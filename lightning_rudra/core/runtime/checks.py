"""The checks every input of the runtime model makes: a bad value raises a ConfigurationError naming it and what
was expected, before any simulation runs."""

import math
from typing import Any

from lightning_rudra.core.errors import ConfigurationError


def positive(name: str, value: Any, allow_inf: bool = False) -> float:
    """``value`` as a float > 0 (finite unless ``allow_inf``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (not allow_inf and not math.isfinite(value)) or math.isnan(value):
        expected = "a number > 0 (math.inf: no limit)" if allow_inf else "a finite number > 0"
        raise ConfigurationError(f"{name}={value!r} is not valid: expected {expected}.")
    return float(value)


def non_negative(name: str, value: Any) -> float:
    """``value`` as a finite float >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name}={value!r} is not valid: expected a finite number >= 0.")
    return float(value)


def count(name: str, value: Any, least: int = 1) -> int:
    """``value`` as an int >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigurationError(f"{name}={value!r} is not valid: expected an integer >= {least}.")
    return value
