"""The process's memory: the C allocator, asked to hand freed memory back to the system, and
Python's cyclic collector, kept off what lives as long as the process.

glibc gives each thread that allocates its own arena (up to 8 per core), and an arena keeps what its
thread freed for that thread. The operator's reconcile, query and kopf threads each parse large
bodies now and then, so at 1,000 LLMServings the freed memory parked in their arenas outweighed what
was live. Two arenas and a trim after each burst (a Prometheus refresh) keep RSS near the live heap.

Python's full collection walks every container object the process holds, and holds the interpreter
while it does: at 1,000 LLMServings one took 300–585 ms, every 5–10 s, and every reconcile in flight
waited it out. The imports and the state of the fleet found at startup live on; frozen out of the
collector (`freeze_long_lived`), a full collection walks only what came after (15–90 ms there).

Nothing here is needed for correctness: without glibc (musl, macOS) the allocator calls do nothing.
"""

from __future__ import annotations

import asyncio.sslproto
import ctypes
import gc
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


def limit_tls_read_buffer(size: int) -> bool:
    """Read each TLS connection of the event loop through a buffer of at most `size` bytes. asyncio
    gives every one a buffer of its own (`SSLProtocol.max_size`, 256 KiB on CPython 3.11), and a
    long-lived stream fills all of it in time: kopf's watches (one per watched namespace and kind,
    forty at ten namespaces) held 10 MiB that way. Smaller reads do the same work in more steps.
    True when the limit was set here (False where asyncio keeps no such buffer)."""
    protocol = getattr(asyncio.sslproto, "SSLProtocol", None)
    if protocol is None or not isinstance(getattr(protocol, "max_size", None), int):
        return False
    protocol.max_size = min(protocol.max_size, size)
    return True


def freeze_long_lived() -> int:
    """Collect what is garbage now, then move every object left out of the cyclic collector's
    reach for good (`gc.freeze`): for what lives as long as the process (the imports, the fleet's
    state once it is found). Objects freed later by reference counting still go; one in a
    reference cycle that becomes garbage later stays (a one-time cost, bounded by what was frozen).
    Returns how many objects were frozen."""
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count() - before
