"""The places for engine rollouts of the operator's own template changes."""

from __future__ import annotations

import threading

import pytest

from batchknee.pacing import RolloutPacer


def test_at_most_at_once_keys_hold_a_place_until_done() -> None:
    pacer = RolloutPacer(2)
    assert pacer.admit("a") and pacer.admit("b")
    assert not pacer.admit("c")
    assert pacer.admit("a")  # a key that holds a place keeps it
    assert pacer.under_way() == 2
    pacer.done("a")
    pacer.done("a")  # twice, or a key without a place: nothing more frees
    pacer.done("z")
    assert pacer.admit("c") and not pacer.admit("a")
    assert pacer.under_way() == 2
    assert pacer.waiting() == 1  # "a"; "c", refused before, was admitted since
    pacer.done("a")  # gone while it waited
    assert pacer.waiting() == 0


def test_zero_is_no_limit_and_holds_nothing() -> None:
    pacer = RolloutPacer(0)
    assert all(pacer.admit(key) for key in range(1000))
    assert pacer.under_way() == 0
    with pytest.raises(ValueError, match="at_once"):
        RolloutPacer(-1)


def test_threads_admit_no_more_than_the_places() -> None:
    pacer = RolloutPacer(3)
    admitted: list[int] = []
    start = threading.Barrier(16)

    def take(key: int) -> None:
        start.wait()
        if pacer.admit(key):
            admitted.append(key)

    threads = [threading.Thread(target=take, args=(key,)) for key in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 3 and pacer.under_way() == 3
