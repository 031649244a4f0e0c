"""How many engines the operator restarts at once for a pod template change of its own.

A new operator version (or a changed operator setting, such as a default image) renders a new pod
template for every engine Deployment; applied as it is found, each Deployment rolls by its own
rolling update within one evaluation interval: every engine of the cluster restarts, and loads its
model, at once. Those rollouts — not a batch-limit decision (the rollout budget paces those) and not
an LLMServing's spec change (its writer asked for it) — take a place here first: at most
`at_once` are under way cluster-wide, each counted from its apply until its Deployment is seen
rolled out. A rollout that stalls keeps its place, so a template that does not start stops the
change at `at_once` engines instead of spreading through the fleet.

The places are this process's memory: after a restart, rollouts the last process started no longer
count (at most twice `at_once` roll for a while).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable


class RolloutPacer:
    def __init__(self, at_once: int = 0) -> None:
        if at_once < 0:
            raise ValueError("at_once must be 0 (no limit) or more")
        self.at_once = at_once
        self._under_way: set[Hashable] = set()
        self._waiting: set[Hashable] = set()  # asked and refused, not admitted or done since
        self._lock = threading.Lock()

    def admit(self, key: Hashable) -> bool:
        """May `key`'s engines roll now? True takes a place (kept until `done(key)`); a key that
        holds one already keeps it."""
        if self.at_once == 0:
            return True
        with self._lock:
            if key in self._under_way or len(self._under_way) < self.at_once:
                self._under_way.add(key)
                self._waiting.discard(key)
                return True
            self._waiting.add(key)
            return False

    def done(self, key: Hashable) -> None:
        """`key`'s rollout finished (or its object is gone): its place frees."""
        with self._lock:
            self._under_way.discard(key)
            self._waiting.discard(key)

    def holds(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._under_way

    def under_way(self) -> int:
        with self._lock:
            return len(self._under_way)

    def waiting(self) -> int:
        """Keys refused a place since their last admission or `done` (an estimate between
        evaluations: a key that no longer needs one leaves at its next)."""
        with self._lock:
            return len(self._waiting)
