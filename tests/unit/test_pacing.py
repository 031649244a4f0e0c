"""The places for engine rollouts of the operator's own template changes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from batchknee.pacing import Place, RolloutPacer

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OLD, NEW = Place("template-1", T0), Place("template-2", T0)
A, B, C, Z = ((name, name) for name in "abcz")  # each in its own namespace


def test_at_most_at_once_keys_hold_a_place_until_done() -> None:
    pacer = RolloutPacer(2)
    assert pacer.admit(A, OLD) and pacer.admit(B, OLD)
    assert not pacer.admit(C, OLD)
    assert pacer.admit(A, NEW)  # a key that holds a place keeps it, for its newer template
    assert pacer.place(A) == NEW and pacer.place(C) is None
    assert pacer.under_way() == 2
    pacer.done(A)
    pacer.done(A)  # twice, or a key without a place: nothing more frees
    pacer.done(Z)
    assert pacer.admit(C, OLD) and not pacer.admit(A, OLD)
    assert pacer.under_way() == 2
    assert pacer.waiting() == 1  # A; C, refused before, was admitted since
    pacer.not_waiting(A)  # its next evaluation needed no place
    assert pacer.waiting() == 0
    assert not pacer.admit(A, OLD)
    pacer.done(A)  # gone while it waited
    assert pacer.waiting() == 0


def test_zero_is_no_limit_and_holds_nothing() -> None:
    pacer = RolloutPacer(0)
    assert all(pacer.admit((str(key), "chat"), OLD) for key in range(1000))
    assert pacer.under_way() == 0 and pacer.place(("0", "chat")) is None
    with pytest.raises(ValueError, match="at_once"):
        RolloutPacer(-1)


def test_threads_admit_no_more_than_the_places() -> None:
    pacer = RolloutPacer(3)
    admitted: list[tuple[str, str]] = []
    start = threading.Barrier(16)

    def take(key: tuple[str, str]) -> None:
        start.wait()
        if pacer.admit(key, OLD):
            admitted.append(key)

    threads = [threading.Thread(target=take, args=((str(key), "chat"),)) for key in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 3 and pacer.under_way() == 3 and pacer.waiting() == 13


def test_a_rollout_under_way_resumes_its_place_even_past_the_limit() -> None:
    pacer = RolloutPacer(1)
    assert pacer.admit(A, OLD)
    pacer.resume(B, NEW)  # an earlier process gave it one: it is rolling whatever this one says
    assert pacer.under_way() == 2 and pacer.place(B) == NEW
    assert not pacer.admit(C, OLD)
    pacer.done(A)
    assert not pacer.admit(C, OLD)  # b still holds the one place there is
    unlimited = RolloutPacer(0)
    unlimited.resume(B, NEW)
    assert unlimited.place(B) is None


def test_a_namespace_holds_at_most_all_places_but_one() -> None:
    """A namespace whose rollouts never finish (its new pods cannot start) leaves a place to the rest."""
    pacer = RolloutPacer(3)
    assert pacer.admit(("stuck", "0"), OLD) and pacer.admit(("stuck", "1"), OLD)
    assert not pacer.admit(("stuck", "2"), OLD)  # a place is free, but not for this namespace
    assert pacer.admit(("other", "0"), OLD)
    pacer.done(("other", "0"))
    assert not pacer.admit(("stuck", "2"), OLD) and pacer.admit(("other", "1"), OLD)
    single = RolloutPacer(1)  # one place: a namespace may hold it
    assert single.admit(("stuck", "0"), OLD) and not single.admit(("other", "0"), OLD)


def test_a_free_place_goes_to_the_waiting_namespace_that_holds_fewer() -> None:
    pacer = RolloutPacer(4)
    stuck = [("stuck", str(n)) for n in range(3)]
    others = [("other", str(n)) for n in range(4)]
    assert pacer.admit(stuck[0], OLD) and pacer.admit(stuck[1], OLD)
    assert pacer.admit(others[0], OLD) and pacer.admit(others[1], OLD)
    assert not pacer.admit(stuck[2], OLD) and not pacer.admit(others[2], OLD)  # no place free
    pacer.done(others[0])  # "stuck" holds two, "other" one and waits: the place is other's
    assert not pacer.admit(stuck[2], OLD)
    assert pacer.admit(others[2], OLD)
    assert not pacer.admit(others[3], OLD)
    pacer.done(others[1])
    assert not pacer.admit(stuck[2], OLD)  # two against one still
    pacer.not_waiting(others[3])  # its next evaluation needed no place: "other" no longer waits
    assert pacer.admit(stuck[2], OLD)  # nobody else waits: up to its share, three
    pacer.done(stuck[2])
    assert pacer.admit(others[3], OLD)


def test_a_waiter_refused_long_ago_keeps_no_free_place_for_its_namespace() -> None:
    """An engine evaluated once an hour waits refused; a place that frees meanwhile is not kept
    for its namespace past WAITING_COUNTS_FOR."""
    from datetime import timedelta

    from batchknee.pacing import WAITING_COUNTS_FOR

    pacer = RolloutPacer(4)
    assert all(pacer.admit(key, OLD) for key in (("big", "0"), ("big", "1"), ("y", "0"), ("y", "1")))
    assert not pacer.admit(("slow", "0"), OLD)  # refused at T0
    pacer.done(("y", "0"))
    soon = Place("template-1", T0 + WAITING_COUNTS_FOR)
    assert not pacer.admit(("big", "2"), soon)  # "slow" holds none and waits: the place is its
    later = Place("template-1", T0 + WAITING_COUNTS_FOR + timedelta(seconds=1))
    assert pacer.admit(("big", "2"), later)  # its refusal is too old to keep the place


def test_safety_places_stay_within_twice_the_limit_after_a_restart() -> None:
    """A restarted operator resumes every rollout under way as one of the limit's places: places a
    safety decrease took over the limit before are among them, and no more are given."""
    pacer = RolloutPacer(2)
    for key in (("a", "1"), ("b", "1"), ("c", "1"), ("d", "1")):  # two of the limit's, two over
        pacer.resume(key, NEW)
    assert not pacer.admit_safety(("e", "1"), NEW)
    assert pacer.under_way() == 4

    pacer = RolloutPacer(3)  # a namespace's share: two of each kind, four in all
    for key in (("a", "1"), ("a", "2"), ("a", "3"), ("a", "4")):
        pacer.resume(key, NEW)
    assert not pacer.admit_safety(("a", "5"), NEW)
    assert pacer.admit_safety(("b", "1"), NEW)
