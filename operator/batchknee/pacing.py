"""How many engines the operator restarts at once for a pod template change of its own.

A new operator version (or a changed operator setting, such as a default image) renders a new pod
template for every engine Deployment; applied as it is found, each Deployment rolls by its own
rolling update within one evaluation interval: every engine of the cluster restarts, and loads its
model, at once. Those rollouts — not a batch-limit decision (the rollout budget paces those) and not
an LLMServing's spec change (its writer asked for it) — take a place here first: at most
`at_once` are under way cluster-wide, each counted from its apply until its Deployment is seen
rolled out with as many pods available as before. A rollout whose pods do not start keeps its
place, so a template that does not start stops the change at `at_once` engines instead of spreading
through the fleet.

An engine that waits for a place holds its batch limit meanwhile (the template rolls out first,
alone), but for a safety decrease — its running limit breaks the TPOT target, or exceeds the KV-cache
pool: that does not wait for a free place. The template rolls with it, in one restart, in a place
taken ahead of the waiters: a free one, or one of `at_once` more that the limit's waiters do not
count (`admit_safety`), so a template that does not start reaches at most twice `at_once` engines,
and one namespace holds no more than its share of either kind.

Namespaces share the places: one holds at most `at_once - 1` of them (one, when `at_once` is 1),
and a free place goes to a namespace that holds no more than any other namespace waiting for one.
A tenant whose new pods cannot start (on purpose or not: a quota with no room for a surge pod)
keeps the places it holds, so it slows the rest of the fleet's change, but cannot stop it.

The places are this process's memory; a Deployment that rolled with one records its template, and
after a restart a rollout still replacing pods, past its progress deadline, or with no pod
available yet, takes its place again (`resume`), whether or not one is free.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

Key = tuple[str, str]  # an LLMServing's namespace and name
# A waiter refused longer ago than this (an hour-long evaluation interval) keeps no free place for
# its namespace: the place would sit free until its next evaluation.
WAITING_COUNTS_FOR = timedelta(minutes=2)


@dataclass(frozen=True)
class Place:
    """What a place was given for: the pod template (its hash), when, and how many pods were
    available."""

    template: str
    since: datetime
    available: int = 0  # the workload's pods available then: its rollout must leave as many


class RolloutPacer:
    def __init__(self, at_once: int = 0) -> None:
        if at_once < 0:
            raise ValueError("at_once must be 0 (no limit) or more")
        self.at_once = at_once
        self._under_way: dict[Key, Place] = {}
        # places a safety decrease took over the limit: as many again, apart (`admit_safety`)
        self._extra: set[Key] = set()
        self._waiting: dict[Key, datetime] = {}  # refused at their last evaluation, and when
        self._lock = threading.Lock()

    def admit(self, key: Key, place: Place) -> bool:
        """May `key`'s engines roll onto `place.template` now? True takes a place (kept until
        `done(key)`; a key that holds one keeps it, for the new template); False: it waits."""
        if self.at_once == 0:
            return True
        with self._lock:
            held = self._under_way.get(key)
            if held is None and (
                len(self._under_way) - len(self._extra) >= self.at_once
                or self._another_namespace_first(key, place.since)
            ):
                self._waiting[key] = place.since
                return False
            if held is None or held.template != place.template:  # else: since it was first given
                self._under_way[key] = place
            self._waiting.pop(key, None)
            return True

    def _another_namespace_first(self, key: Key, now: datetime) -> bool:
        """`key`'s namespace holds its share of the places already, or more than another namespace
        that waits (refused lately): the free place is another's."""
        namespace = key[0]
        holding = self._holding(extra=False)
        if holding[namespace] == 0:
            return False
        if holding[namespace] >= max(1, self.at_once - 1):
            return True
        return any(
            waiter[0] != namespace
            and holding[waiter[0]] < holding[namespace]
            and now - since <= WAITING_COUNTS_FOR
            for waiter, since in self._waiting.items()
        )

    def _holding(self, *, extra: bool) -> Counter[str]:
        """Places held per namespace: the limit's (extra False) or those over it."""
        return Counter(key[0] for key in self._under_way if (key in self._extra) == extra)

    def admit_safety(self, key: Key, place: Place) -> bool:
        """May `key`'s safety decrease roll `place.template` with it now? It goes ahead of the
        engines that wait: into a free place of the limit's, else into one of as many again over
        it, which the limit's waiters never count (a fleet of one namespace holds its share of the
        limit's places with its own template rollouts), each time while its namespace holds fewer
        than its share of those places. True takes a place (kept until `done(key)`; a key that holds
        one keeps it, for the new template); False: it waits."""
        if self.at_once == 0:
            return True
        share = max(1, self.at_once - 1)
        with self._lock:
            held = self._under_way.get(key)
            if held is None:
                normal, extra = self._holding(extra=False), self._holding(extra=True)
                if sum(normal.values()) >= self.at_once or normal[key[0]] >= share:
                    # over the limit; places resumed after a restart all count as the limit's, so
                    # the bounds hold on the places in all too
                    if (
                        len(self._extra) >= self.at_once
                        or extra[key[0]] >= share
                        or len(self._under_way) >= 2 * self.at_once
                        or normal[key[0]] + extra[key[0]] >= 2 * share
                    ):
                        self._waiting[key] = place.since
                        return False
                    self._extra.add(key)
            if held is None or held.template != place.template:  # else: since it was first given
                self._under_way[key] = place
            self._waiting.pop(key, None)
            return True

    def resume(self, key: Key, place: Place) -> None:
        """`key`'s rollout for `place` is under way already (an earlier process gave it a place): it
        holds one again, whether or not one is free."""
        if self.at_once == 0:
            return
        with self._lock:
            self._under_way[key] = place
            self._waiting.pop(key, None)

    def done(self, key: Key) -> None:
        """`key`'s rollout finished (or its object is gone): its place frees."""
        with self._lock:
            self._under_way.pop(key, None)
            self._extra.discard(key)
            self._waiting.pop(key, None)

    def not_waiting(self, key: Key) -> None:
        """`key` no longer waits (its evaluation needed no place, or had one)."""
        with self._lock:
            self._waiting.pop(key, None)

    def place(self, key: Key) -> Place | None:
        with self._lock:
            return self._under_way.get(key)

    def under_way(self) -> int:
        with self._lock:
            return len(self._under_way)

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)
