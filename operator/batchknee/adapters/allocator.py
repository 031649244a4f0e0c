"""The C allocator, asked to hand freed memory back to the system.

glibc gives each thread that allocates its own arena (up to 8 per core), and an arena keeps what its
thread freed for that thread. The operator's reconcile, query and kopf threads each parse large
bodies now and then, so at 1,000 LLMServings the freed memory parked in their arenas outweighed what
was live. Two arenas and a trim after each burst (a Prometheus refresh) keep RSS near the live heap.

Nothing here is needed for correctness: without glibc (musl, macOS) both calls do nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def limit_arenas(arenas: int) -> bool:
    """At most `arenas` malloc arenas from now on, unless MALLOC_ARENA_MAX already says how many
    (glibc read it at startup). True when the limit was set here."""
    if _LIBC is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, arenas))


def trim() -> None:
    """Return the free pages of every arena to the system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
