"""Where in a period an object's periodic work falls: a hash of its name, so a fleet's work spreads
evenly over the period instead of bunching, and stays put across restarts and replicas; and the
slots such a period divides time into."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime


def phase(namespace: str, name: str, purpose: str = "") -> float:
    """A point of [0, 1) for the object `namespace/name`. Each `purpose` gets its own point, unrelated
    to the others' (two kinds of periodic work, each spread over the fleet on its own)."""
    key = f"{namespace}/{name}" if not purpose else f"{purpose}:{namespace}/{name}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()  # (crc32 bunches)
    return int.from_bytes(digest) / 2**64


def same_slot(earlier: datetime, later: datetime, period_s: float, offset_s: float) -> bool:
    """Whether two times fall in the same slot (`period_s` long, starting at `offset_s` mod
    `period_s`); a time without a zone is UTC's, as Kubernetes writes them."""
    if period_s <= 0:
        return False
    earlier_s, later_s = (t.replace(tzinfo=t.tzinfo or UTC).timestamp() - offset_s for t in (earlier, later))
    return earlier_s // period_s == later_s // period_s
