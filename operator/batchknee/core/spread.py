"""Where in a period an object's periodic work falls: a hash of its name, so a fleet's work spreads
evenly over the period instead of bunching, and stays put across restarts and replicas."""

from __future__ import annotations

import hashlib


def phase(namespace: str, name: str, purpose: str = "") -> float:
    """A point of [0, 1) for the object `namespace/name`. Each `purpose` gets its own point, unrelated
    to the others' (two kinds of periodic work, each spread over the fleet on its own)."""
    key = f"{namespace}/{name}" if not purpose else f"{purpose}:{namespace}/{name}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()  # (crc32 bunches)
    return int.from_bytes(digest) / 2**64
