"""Parsing quantities with units, as users type them."""

from __future__ import annotations

import math
import re

_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)(?:/s)?\s*$")
_BANDWIDTH_SCALE = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_bandwidth(text: str) -> float:
    """Bytes per second from `2.0TB/s`, `2039GB/s`, `2039 GB/s` or a plain number of bytes/s."""
    match = _BANDWIDTH.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _BANDWIDTH_SCALE:
        raise ValueError(f"{text!r} is not a bandwidth; write it like 2.0TB/s or 2039GB/s")
    value = float(match.group(1)) * _BANDWIDTH_SCALE[unit]
    if value <= 0:
        raise ValueError(f"{text!r}: bandwidth must be positive")
    if not math.isfinite(value):
        raise ValueError(f"{text!r}: bandwidth must be finite; write it like 2.0TB/s or 2039GB/s")
    return value
