"""The allocator adapter gives freed memory back (glibc only; elsewhere it does nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchknee.adapters import allocator

OPERATOR_SOURCE = Path(__file__).resolve().parents[2] / "operator"

pytestmark = pytest.mark.skipif(allocator._LIBC is None, reason="not glibc")

FREED_IN_A_THREAD = textwrap.dedent(
    """
    import sys, threading
    from batchknee.adapters import allocator

    def rss_mib():
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    kept = []
    def parse_a_burst():  # like a refresh: 150 MB of bodies, a hundredth kept
        bodies = [bytes(1500) + str(i).encode() for i in range(100_000)]
        kept.extend(bodies[::100])

    thread = threading.Thread(target=parse_a_burst)
    thread.start()
    thread.join()
    before = rss_mib()
    allocator.trim()
    print(before, rss_mib())
    """
)


def test_a_trim_hands_back_what_a_thread_freed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FREED_IN_A_THREAD],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(OPERATOR_SOURCE)},
    )
    before, after = map(float, done.stdout.split())
    assert before > 100  # the freed burst still counted
    assert after < before / 3


def test_a_users_malloc_arena_max_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert allocator.limit_arenas(2) is False
