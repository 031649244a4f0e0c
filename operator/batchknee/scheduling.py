"""One scheduler that re-evaluates every watched LLMServing at its own evaluation interval.

In place of a kopf daemon per object (an asyncio task per object, and a kopf finalizer that every
object must carry and every delete must wait on), one loop keeps a heap of due times:

- each object's evaluations fall on its own grid, `phase·interval + k·interval`, the phase a hash of
  its name, at least half an interval after its last evaluation (whatever triggered that: a create,
  a spec change, a Deployment's rollout) — so a fleet found at once, or changed at once, still ticks
  spread evenly over the interval instead of in bursts;
- an object just found, or whose spec changed, is evaluated as soon as a slot frees (`soon()`), in
  turn with those due; periodic evaluations start once it has been evaluated;
- the interval is read live (`known()` is kopf's index of the watched objects and their intervals);
- at most `max_in_flight` scheduled evaluations run at once; the others wait their turn in due order;
- at most `lane_limit` of them in one lane (`lane(key)`: a Live LLMServing's namespace, whose
  evaluations wait on the tenant's own engine pods): the rest of that lane is parked outside the
  heap until one of its evaluations ends, so a tenant whose engines answer slowly holds neither the
  others' slots nor a busy loop; and at most half the slots for all lanes together, parked alike,
  so as many slow tenants as half the slots over two still leave the other half to the unlaned;
- an object that leaves `known()` (deleted, deleting, no longer watched) has its state freed;
- a failing evaluation is logged and the object is scheduled again, and so is a failing turn of
  the loop itself; nothing stops the loop but `stop()`;
- while `paused()` (another replica outranks this one) nothing is evaluated;
- `settled()` is called once, the first time every object known at a resync has been evaluated
  (the fleet found at startup is in memory: its long-lived state can be frozen out of the
  collector).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batchknee.core.spread import phase

log = logging.getLogger("batchknee")

Key = tuple[str, str]


def next_due(last: float, interval: float, at: float) -> float:
    """The first point of the grid `at·interval + k·interval` at least half an interval after
    `last` (so two evaluations are between half and one and a half intervals apart)."""
    offset = at * interval
    return offset + math.ceil((last + interval / 2 - offset) / interval) * interval


@dataclass
class Scheduler:
    evaluate: Callable[[str, str], Awaitable[Any]]  # one evaluation (it records last_evaluated)
    known: Callable[[], Mapping[Key, float]]  # watched objects → evaluation interval, live
    last_evaluated: Callable[[Key], float | None]  # loop time of the object's last evaluation
    forget: Callable[[str, str], None]  # free the object's state
    max_in_flight: int = 16
    paused: Callable[[], bool] = lambda: False
    settled: Callable[[], None] = lambda: None  # once, when every known object has been evaluated
    resync_s: float = 1.0  # how often known() is compared with the schedule
    lane: Callable[[Key], Hashable | None] = lambda key: None  # None: no lane, only max_in_flight
    lane_limit: int = 2  # evaluations of one lane at once
    laned_share: float = 0.5  # of max_in_flight, for every lane together
    due: dict[Key, tuple[float, float]] = field(default_factory=dict)  # key → (due, interval)
    urgent: set[Key] = field(default_factory=set)  # evaluate when a slot frees, whatever the grid says
    in_flight: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    _lanes: dict[Key, Hashable] = field(default_factory=dict)  # in flight → its lane at launch
    _parked: dict[Hashable, list[tuple[float, Key]]] = field(default_factory=dict)  # due, lane full
    _parked_laned: list[tuple[float, Key]] = field(default_factory=list)  # due, the lanes' share full
    _heap: list[tuple[float, Key]] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _stopped: bool = False
    _settled: bool = False

    def _schedule(self, key: Key, interval: float, now: float) -> None:
        last = self.last_evaluated(key)
        if last is None:
            return  # its first evaluation is kopf's create/resume handler's, which brings its spec
        when = next_due(last, interval, phase(*key))
        self.due[key] = (when, interval)
        heapq.heappush(self._heap, (when, key))

    def soon(self, key: Key) -> None:
        """Evaluate `key` as soon as a slot is free (it was just found, or its spec changed), in turn
        with the others due: a thousand objects found at once wait in this heap, not as a thousand
        parked coroutines."""
        self.urgent.add(key)
        if key not in self.in_flight:
            now = asyncio.get_running_loop().time()
            # an earlier turn is kept: events faster than the queue drains must not keep it at the back
            when = min(now, self.due.get(key, (now, 0.0))[0])
            self.due[key] = (when, self.known().get(key, 30.0))
            heapq.heappush(self._heap, (when, key))
        self._wake.set()

    def _resync(self, now: float) -> None:
        known = self.known()
        if (
            not self._settled
            and known
            and not self.urgent
            and all(self.last_evaluated(key) is not None for key in known)
        ):
            self._settled = True
            self.settled()
        for key in [key for key in self.due if key not in known]:
            del self.due[key]
            self.urgent.discard(key)
            self.forget(*key)
        for key, interval in known.items():
            scheduled = self.due.get(key)
            if key in self.in_flight:
                continue
            if key in self.urgent:
                if scheduled is None:  # its turn was lost (a failure between its run and its next)
                    self.due[key] = (now, interval)
                    heapq.heappush(self._heap, (now, key))
                continue
            if scheduled is None or scheduled[1] != interval:
                self._schedule(key, interval, now)

    async def _run_one(self, key: Key) -> None:
        try:
            await self.evaluate(*key)
        except Exception as error:  # the next evaluation reads the world again
            log.exception("%s/%s: scheduled evaluation failed: %s", key[0], key[1], error)

    def _done(self, key: Key) -> None:
        self.in_flight.pop(key, None)
        lane = self._lanes.pop(key, None)
        if lane is not None:
            for entry in [*self._parked.pop(lane, []), *self._parked_laned]:
                heapq.heappush(self._heap, entry)  # their turn again, in due order
            self._parked_laned.clear()
        interval = self.known().get(key)
        if interval is None:
            self.urgent.discard(key)
            self.forget(*key)
        elif key in self.urgent:  # its spec changed while it was being evaluated
            now = asyncio.get_running_loop().time()
            self.due[key] = (now, interval)
            heapq.heappush(self._heap, (now, key))
        elif not self._stopped:
            self._schedule(key, interval, asyncio.get_running_loop().time())
        self._wake.set()

    def _lane_of(self, key: Key) -> Hashable | None:
        """The key's lane; one whose lane cannot be told is laned by its namespace (the loop goes on
        for every other key)."""
        try:
            return self.lane(key)
        except Exception:
            log.exception("%s/%s: no lane could be told; evaluated in its namespace's lane", *key)
            return key[0]

    def _launch_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now and len(self.in_flight) < self.max_in_flight:
            when, key = heapq.heappop(self._heap)
            scheduled = self.due.get(key)
            if scheduled is None or scheduled[0] != when:
                continue  # superseded by a newer entry
            lane = self._lane_of(key)
            if lane is not None and list(self._lanes.values()).count(lane) >= self.lane_limit:
                self._parked.setdefault(lane, []).append((when, key))
                continue
            if lane is not None and len(self._lanes) >= max(1, int(self.max_in_flight * self.laned_share)):
                self._parked_laned.append((when, key))
                continue
            del self.due[key]
            interval = scheduled[1]
            last = self.last_evaluated(key)
            if key in self.urgent:
                self.urgent.discard(key)
            elif last is not None and next_due(last, interval, phase(*key)) > now:
                self._schedule(key, interval, now)  # evaluated meanwhile (a rollout's event)
                continue
            task = asyncio.get_running_loop().create_task(self._run_one(key), name=f"evaluate {key}")
            self.in_flight[key] = task
            if lane is not None:
                self._lanes[key] = lane
            task.add_done_callback(lambda _, key=key: self._done(key))  # type: ignore[misc]

    async def run(self) -> None:
        """Evaluate until stop(); never returns early on a failing evaluation."""
        loop = asyncio.get_running_loop()
        next_resync = 0.0
        while not self._stopped:
            now = loop.time()
            soonest = now + self.resync_s
            try:
                if now >= next_resync:
                    self._resync(now)
                    next_resync = now + self.resync_s
                paused = self.paused()
                if not paused:
                    self._launch_due(now)
                soonest = next_resync
                if self._heap and len(self.in_flight) < self.max_in_flight and not paused:
                    soonest = min(soonest, self._heap[0][0])
            except Exception:  # (kopf's index, a state callback): the loop is every object's evaluations
                log.exception("scheduler: this turn failed; trying again in %.0f s", self.resync_s)
                next_resync = now + self.resync_s
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(soonest - loop.time(), 0.001))

    async def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        tasks = list(self.in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
