"""The scheduler that re-evaluates every LLMServing at its interval (in place of a daemon per object)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from batchknee.core.spread import phase
from batchknee.handlers import evaluation_interval, outranked
from batchknee.scheduling import Key, Scheduler, next_due


def test_evaluations_fall_on_the_objects_grid_half_to_one_and_a_half_intervals_apart() -> None:
    for last in (0.0, 7.3, 29.9, 30.0, 1234.5):
        for at in (0.0, 0.25, 0.999):
            due = next_due(last, 30.0, at)
            assert 15.0 <= due - last <= 45.0
            assert abs((due - at * 30.0) / 30.0 - round((due - at * 30.0) / 30.0)) < 1e-9


def test_a_fleet_found_at_once_is_spread_over_the_interval() -> None:
    keys = [(f"ns-{i % 10}", f"chat-{i:05d}") for i in range(1000)]
    first = [next_due(100.0 - 15.0, 30.0, phase(*key)) - 100.0 for key in keys]  # never evaluated
    assert all(0.0 <= d <= 30.0 for d in first)
    per_3s = Counter(int(d // 3) for d in first)  # ten slots of 3 s: about 100 each, none bunched
    assert max(per_3s.values()) < 150 and min(per_3s.values()) > 50


def test_the_interval_comes_from_the_spec() -> None:
    assert evaluation_interval({"tuning": {"evaluationIntervalSeconds": 5}}) == 5.0
    assert evaluation_interval({}) == 30.0
    assert evaluation_interval({"tuning": {"evaluationIntervalSeconds": "x"}}) == 30.0


class Fleet:
    """known() and the evaluations a scheduler made: a fake only of the reconcile itself."""

    def __init__(self, intervals: dict[Key, float], failing: set[Key] | None = None) -> None:
        self.intervals = intervals
        self.failing = failing or set()
        self.evaluated: Counter[Key] = Counter()
        self.last: dict[Key, float] = {}
        self.forgotten: list[Key] = []
        self.running = 0
        self.most_running = 0

    async def evaluate(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.last[key] = asyncio.get_running_loop().time()
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(0.01)
            self.evaluated[key] += 1
            if key in self.failing:
                raise RuntimeError("the apiserver said no")
        finally:
            self.running -= 1

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))
        self.last.pop((namespace, name), None)

    def scheduler(self, **kwargs: object) -> Scheduler:
        return Scheduler(
            evaluate=self.evaluate,
            known=lambda: self.intervals,
            last_evaluated=self.last.get,
            forget=self.forget,
            resync_s=0.02,
            **kwargs,  # type: ignore[arg-type]
        )


async def until(predicate: object, limit_s: float = 20.0) -> None:
    """Wait (bounded) for a condition; the assertion after it says what was expected."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate() and loop.time() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.01)


def test_objects_are_re_evaluated_a_failure_never_stops_it_a_removed_one_is_forgotten() -> None:
    async def scenario() -> None:
        fleet = Fleet({("ml", "a"): 0.1, ("ml", "b"): 0.1, ("ml", "bad"): 0.1}, failing={("ml", "bad")})
        scheduler = fleet.scheduler()
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.3)
        assert not fleet.evaluated  # the create/resume handler evaluates first (it routes the object)
        for key in fleet.intervals:
            with contextlib.suppress(RuntimeError):
                await fleet.evaluate(*key)
        await until(lambda: min(fleet.evaluated[k] for k in fleet.intervals) >= 3)
        assert min(fleet.evaluated[k] for k in fleet.intervals) >= 3  # the failing one too, again
        del fleet.intervals[("ml", "b")]  # deleted, or no longer watched
        await until(lambda: ("ml", "b") in fleet.forgotten)
        assert ("ml", "b") in fleet.forgotten and ("ml", "b") not in scheduler.due
        count = fleet.evaluated[("ml", "b")]
        await until(lambda: fleet.evaluated[("ml", "a")] >= 6)
        assert fleet.evaluated[("ml", "b")] == count  # never evaluated again
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_in_flight_evaluations_are_bounded_and_nothing_runs_while_paused() -> None:
    async def scenario() -> None:
        fleet = Fleet({("ml", f"s{i}"): 0.05 for i in range(40)})
        fleet.last = dict.fromkeys(fleet.intervals, asyncio.get_running_loop().time())
        paused = [True]
        scheduler = fleet.scheduler(max_in_flight=4, paused=lambda: paused[0])
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.3)  # several intervals while another replica acts
        assert not fleet.evaluated
        paused[0] = False
        await until(lambda: len(fleet.evaluated) == 40)
        assert len(fleet.evaluated) == 40
        assert fleet.most_running <= 4
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_a_replica_pauses_when_a_live_peer_ranks_as_high() -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

    def peer(priority: int, seen_s_ago: float) -> dict[str, object]:
        return {
            "priority": priority,
            "lifetime": 60,
            "lastseen": (now - timedelta(seconds=seen_s_ago)).isoformat(),
        }

    assert not outranked([{"me": peer(10, 0)}], "me", 10, now)
    assert outranked([{"me": peer(10, 0), "other": peer(20, 5)}], "me", 10, now)
    assert outranked([{"me": peer(10, 0)}, {"other": peer(10, 5)}], "me", 10, now)  # a tie pauses both
    assert not outranked([{"other": peer(5, 5)}], "me", 10, now)
    assert not outranked([{"other": peer(20, 120)}], "me", 10, now)  # dead: not seen in its lifetime


def test_a_new_or_changed_object_is_evaluated_at_once_in_turn() -> None:
    async def scenario() -> None:
        fleet = Fleet({("ml", f"s{i}"): 3600.0 for i in range(40)})
        scheduler = fleet.scheduler(max_in_flight=4)
        task = asyncio.create_task(scheduler.run())
        for key in fleet.intervals:  # a fleet found at once: none waits an hour, four at a time
            scheduler.soon(key)
        await until(lambda: len(fleet.evaluated) == 40)
        assert len(fleet.evaluated) == 40 and fleet.most_running <= 4
        scheduler.soon(("ml", "s0"))  # its spec changed: evaluated again, an hour before its tick
        await until(lambda: fleet.evaluated[("ml", "s0")] == 2)
        assert fleet.evaluated[("ml", "s0")] == 2
        assert sum(fleet.evaluated.values()) == 41
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_settled_is_called_once_when_every_object_found_has_been_evaluated() -> None:
    async def scenario() -> None:
        fleet = Fleet({("ml", f"s{i}"): 3600.0 for i in range(12)})
        settled: list[int] = []  # how many objects had been evaluated at the call
        scheduler = fleet.scheduler(max_in_flight=2, settled=lambda: settled.append(len(fleet.last)))
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.1)
        assert not settled  # nothing evaluated yet
        keys = list(fleet.intervals)
        for key in keys[:6]:  # kopf's index knows all twelve; half are queued first
            scheduler.soon(key)
        await until(lambda: len(fleet.evaluated) == 6)
        await asyncio.sleep(0.1)
        assert not settled  # six known ones not evaluated yet
        for key in keys[6:]:
            scheduler.soon(key)
        await until(lambda: len(settled) == 1)
        assert settled == [12]  # not before the last of them
        fleet.intervals[("ml", "new")] = 3600.0  # found later: no second call
        scheduler.soon(("ml", "new"))
        await until(lambda: fleet.evaluated[("ml", "new")] == 1)
        await asyncio.sleep(0.1)
        assert settled == [12]
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_one_lane_holds_at_most_its_limit_and_its_waiting_objects_hold_no_slot() -> None:
    """A tenant's Live LLMServings (one lane: their namespace) whose engines do not answer run at
    most `lane_limit` at a time; the rest of them wait parked, holding none of the scheduler's
    slots, so another tenant's objects are evaluated meanwhile; once the tenant's engines answer
    again, every one of its objects is evaluated."""

    async def scenario() -> None:
        wedged = [("tenant-a", f"live-{i}") for i in range(10)]
        others = [("tenant-b", "live"), ("tenant-b", "plain"), ("tenant-c", "plain")]
        fleet = Fleet(dict.fromkeys(wedged + others, 3600.0))
        released = asyncio.Event()
        running: Counter[str] = Counter()
        most: Counter[str] = Counter()
        plain = fleet.evaluate

        async def evaluate(namespace: str, name: str) -> None:
            running[namespace] += 1
            most[namespace] = max(most[namespace], running[namespace])
            try:
                if namespace == "tenant-a":
                    await released.wait()
                await plain(namespace, name)
            finally:
                running[namespace] -= 1

        fleet.evaluate = evaluate  # type: ignore[method-assign]
        live = {*wedged, ("tenant-b", "live")}
        scheduler = fleet.scheduler(max_in_flight=6, lane=lambda key: key[0] if key in live else None)
        task = asyncio.create_task(scheduler.run())
        for key in wedged + others:  # the wedged tenant's objects are due first
            scheduler.soon(key)
        await until(lambda: all(fleet.evaluated[key] == 1 for key in others))
        assert all(fleet.evaluated[key] == 1 for key in others)  # though six slots, ten wedged
        assert running["tenant-a"] == 2 and not any(fleet.evaluated[key] for key in wedged)
        released.set()
        await until(lambda: all(fleet.evaluated[key] == 1 for key in wedged))
        assert all(fleet.evaluated[key] == 1 for key in wedged)
        assert most["tenant-a"] == 2
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_the_lanes_together_hold_at_most_half_the_slots() -> None:
    """Eight tenants whose Live engines answer slowly, two evaluations each, held all sixteen slots:
    a lane's parked objects came back due before anyone else, so the objects of no lane (the
    operator's own Prometheus, restarts) were not evaluated again while the tenants' backlog lasted.
    The lanes together now hold at most half the slots; the rest keep their interval."""

    async def scenario() -> None:
        slow = [(f"tenant-{t}", f"live-{i}") for t in range(8) for i in range(5)]
        plain = [("team-z", f"plain-{i}") for i in range(8)]
        fleet = Fleet(dict.fromkeys(slow + plain, 0.2))
        running_laned = 0
        most_laned = 0
        quick = fleet.evaluate

        async def evaluate(namespace: str, name: str) -> None:
            nonlocal running_laned, most_laned
            if namespace.startswith("tenant-"):
                running_laned += 1
                most_laned = max(most_laned, running_laned)
                try:
                    await asyncio.sleep(0.3)  # longer than the interval: their backlog only grows
                    await quick(namespace, name)
                finally:
                    running_laned -= 1
            else:
                await quick(namespace, name)

        fleet.evaluate = evaluate  # type: ignore[method-assign]
        scheduler = fleet.scheduler(max_in_flight=16, lane=lambda key: key[0] if key in slow else None)
        task = asyncio.create_task(scheduler.run())
        for key in slow + plain:  # the slow tenants' objects are due first
            scheduler.soon(key)
        await asyncio.sleep(3.0)
        await scheduler.stop()
        await task
        assert most_laned == 8
        # every 0.2-s object of no lane, about once per interval (0.1–0.3 s apart) over 3 s
        assert min(fleet.evaluated[key] for key in plain) >= 8, fleet.evaluated

    asyncio.run(scenario())


def test_an_object_triggered_faster_than_the_queue_drains_keeps_its_turn() -> None:
    """`soon()` moved a waiting object's turn to now at every trigger: one whose Deployment sent an
    event more often than a growing backlog drained went behind it each time and was not evaluated
    while the backlog lasted."""

    async def scenario() -> None:
        stream = [("team-a", f"x{i}") for i in range(100)]
        busy = ("team-b", "rolling")
        fleet = Fleet(dict.fromkeys([*stream, busy], 3600.0))
        quick = fleet.evaluate

        async def evaluate(namespace: str, name: str) -> None:
            await asyncio.sleep(0.02)
            await quick(namespace, name)

        fleet.evaluate = evaluate  # type: ignore[method-assign]
        scheduler = fleet.scheduler(max_in_flight=1)
        task = asyncio.create_task(scheduler.run())
        for i, key in enumerate(stream):  # new objects twice as fast as they are evaluated
            scheduler.soon(key)
            if i >= 10 and busy not in scheduler.in_flight:  # and an event of busy's at each
                scheduler.soon(busy)
            await asyncio.sleep(0.01)
        evaluated_while_it_lasted = fleet.evaluated[busy]
        await scheduler.stop()
        await task
        assert evaluated_while_it_lasted >= 1

    asyncio.run(scenario())


def test_a_lane_that_cannot_be_told_stops_no_other_evaluation() -> None:
    """The lane is asked of the object's spec and caches (its Prometheus URL, its scope): an error
    there lanes that object by its namespace and the loop goes on for every other object."""

    async def scenario() -> None:
        keys = [("tenant-a", "odd"), ("tenant-b", "chat"), ("tenant-c", "chat")]
        fleet = Fleet(dict.fromkeys(keys, 3600.0))

        def lane(key: Key) -> str | None:
            if key == ("tenant-a", "odd"):
                raise ValueError("Invalid IPv6 URL")
            return None

        scheduler = fleet.scheduler(lane=lane)
        task = asyncio.create_task(scheduler.run())
        for key in keys:
            scheduler.soon(key)
        await until(lambda: all(fleet.evaluated[key] == 1 for key in keys))
        assert all(fleet.evaluated[key] == 1 for key in keys)
        assert not task.done()
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_a_turn_that_fails_does_not_end_the_loop() -> None:
    """An error in the loop's own bookkeeping (kopf's index read mid-change, a state callback)
    ended the scheduler task silently: no object was evaluated again until a restart."""

    async def scenario() -> None:
        fleet = Fleet({("ml", "a"): 0.1})
        failing = [True]
        intervals = fleet.intervals

        def known() -> dict[Key, float]:
            if failing and failing.pop():
                raise RuntimeError("dictionary changed size during iteration")
            return intervals

        scheduler = fleet.scheduler()
        scheduler.soon(("ml", "a"))
        scheduler.known = known  # type: ignore[method-assign]
        task = asyncio.create_task(scheduler.run())
        await until(lambda: fleet.evaluated[("ml", "a")] >= 3)
        assert fleet.evaluated[("ml", "a")] >= 3 and not task.done()
        await scheduler.stop()
        await task

    asyncio.run(scenario())


def test_an_object_changed_while_evaluated_keeps_its_turn_through_a_failing_callback() -> None:
    """An object whose spec changed during its evaluation is queued again when it ends; an error
    there (kopf's index read mid-change) left it neither due nor running, and the resync skipped
    objects waiting for an urgent turn: it was never evaluated again."""

    async def scenario() -> None:
        key = ("ml", "a")
        fleet = Fleet({key: 0.1})
        scheduler = fleet.scheduler()
        intervals = fleet.intervals
        plain = fleet.evaluate
        failing = [True]

        async def evaluate(namespace: str, name: str) -> None:
            await plain(namespace, name)
            scheduler.urgent.add(key)  # its spec changed meanwhile

        def known() -> dict[Key, float]:
            # raised where the run has ended: neither running nor due (in its done callback)
            if key not in scheduler.in_flight and key not in scheduler.due and failing and failing.pop():
                raise RuntimeError("dictionary changed size during iteration")
            return intervals

        fleet.evaluate = evaluate  # type: ignore[method-assign]
        scheduler.evaluate = evaluate
        scheduler.soon(key)
        scheduler.known = known  # type: ignore[method-assign]
        task = asyncio.create_task(scheduler.run())
        await until(lambda: fleet.evaluated[key] >= 3, limit_s=5)
        assert fleet.evaluated[key] >= 3
        await scheduler.stop()
        await task

    asyncio.run(scenario())
