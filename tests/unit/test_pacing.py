"""The places for engine rollouts of the operator's own template changes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from batchknee.pacing import Place, RolloutPacer

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OLD, NEW = Place("template-1", T0), Place("template-2", T0)


def test_at_most_at_once_keys_hold_a_place_until_done() -> None:
    pacer = RolloutPacer(2)
    assert pacer.admit("a", OLD) and pacer.admit("b", OLD)
    assert not pacer.admit("c", OLD)
    assert pacer.admit("a", NEW)  # a key that holds a place keeps it, for its newer template
    assert pacer.place("a") == NEW and pacer.place("c") is None
    assert pacer.under_way() == 2
    pacer.done("a")
    pacer.done("a")  # twice, or a key without a place: nothing more frees
    pacer.done("z")
    assert pacer.admit("c", OLD) and not pacer.admit("a", OLD)
    assert pacer.under_way() == 2
    assert pacer.waiting() == 1  # "a"; "c", refused before, was admitted since
    pacer.not_waiting("a")  # its next evaluation needed no place
    assert pacer.waiting() == 0
    assert not pacer.admit("a", OLD)
    pacer.done("a")  # gone while it waited
    assert pacer.waiting() == 0


def test_zero_is_no_limit_and_holds_nothing() -> None:
    pacer = RolloutPacer(0)
    assert all(pacer.admit(key, OLD) for key in range(1000))
    assert pacer.under_way() == 0 and pacer.place(0) is None
    with pytest.raises(ValueError, match="at_once"):
        RolloutPacer(-1)


def test_threads_admit_no_more_than_the_places() -> None:
    pacer = RolloutPacer(3)
    admitted: list[int] = []
    start = threading.Barrier(16)

    def take(key: int) -> None:
        start.wait()
        if pacer.admit(key, OLD):
            admitted.append(key)

    threads = [threading.Thread(target=take, args=(key,)) for key in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 3 and pacer.under_way() == 3 and pacer.waiting() == 13


def test_a_rollout_under_way_resumes_its_place_even_past_the_limit() -> None:
    pacer = RolloutPacer(1)
    assert pacer.admit("a", OLD)
    pacer.resume("b", NEW)  # an earlier process gave it one: it is rolling whatever this one says
    assert pacer.under_way() == 2 and pacer.place("b") == NEW
    assert not pacer.admit("c", OLD)
    pacer.done("a")
    assert not pacer.admit("c", OLD)  # b still holds the one place there is
    unlimited = RolloutPacer(0)
    unlimited.resume("b", NEW)
    assert unlimited.place("b") is None
