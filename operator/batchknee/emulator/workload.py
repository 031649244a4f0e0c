"""The offered load: request arrivals and their lengths, deterministic for a seed.

A `LoadSpec` is what `--request-rate/--prompt-tokens/--output-tokens`, `POST /load` and a load file
describe; `LoadGenerator` turns a spec (or a `Schedule` of specs over time) into arrivals:
- open loop: Poisson arrivals at `request_rate` per second;
- closed loop: `concurrency` requests always in flight, a new one arriving as one finishes;
and lengths fixed, uniform (± spread × mean) or lognormal (mean, sigma = spread). Pure: the
simulated time comes in as arguments.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

Distribution = Literal["fixed", "uniform", "lognormal"]
DISTRIBUTIONS: tuple[str, ...] = ("fixed", "uniform", "lognormal")

MAX_REQUEST_RATE = 10_000.0  # requests per simulated second
MAX_CONCURRENCY = 100_000
MAX_TOKENS = 1 << 20


class LoadError(ValueError):
    """A load description that cannot be used; the message names the field."""

    def for_command_line(self) -> str:
        """The message naming the command-line option of its field (`promptTokens: …` is
        `--prompt-tokens: …`), as the emulator and simulate take the load."""
        field, _, problem = str(self).partition(": ")
        if not problem or not field.isalpha():
            return str(self)
        option = "--" + "".join(f"-{c.lower()}" if c.isupper() else c for c in field)
        return f"{option}: {problem.removesuffix(' or null')}"


@dataclass(frozen=True)
class LoadSpec:
    """One phase of offered load. JSON field names are the camelCase forms (`requestRate`, …);
    snake_case (`request_rate`) is accepted too."""

    request_rate: float = 0.0
    prompt_tokens: int = 512
    output_tokens: int = 128
    prompt_distribution: Distribution = "fixed"
    output_distribution: Distribution = "fixed"
    prompt_spread: float = 0.5
    output_spread: float = 0.5
    prefix_sharing: float = 0.0  # a share of each prompt (a system prompt), not of the context
    concurrency: int | None = None

    def __post_init__(self) -> None:
        rate = self.request_rate
        if not (isinstance(rate, int | float) and math.isfinite(rate) and 0.0 <= rate <= MAX_REQUEST_RATE):
            raise LoadError(f"requestRate: must be a number within [0, {MAX_REQUEST_RATE:g}] per second")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
                raise LoadError(f"{_camel(name)}: must be a whole number within [1, {MAX_TOKENS}]")
        for name in ("prompt_distribution", "output_distribution"):
            if getattr(self, name) not in DISTRIBUTIONS:
                raise LoadError(f"{_camel(name)}: must be one of {', '.join(DISTRIBUTIONS)}")
        for name in ("prompt_spread", "output_spread"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 4.0):
                raise LoadError(f"{_camel(name)}: must be a number within [0, 4]")
        share = self.prefix_sharing
        if not (isinstance(share, int | float) and 0.0 <= share < 1.0):
            raise LoadError("prefixSharing: must be a number within [0, 1)")
        if self.concurrency is not None and (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or not 0 <= self.concurrency <= MAX_CONCURRENCY
        ):
            raise LoadError(f"concurrency: must be a whole number within [0, {MAX_CONCURRENCY}] or null")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def mean_context_tokens(self) -> float:
        """The average context a decoding sequence holds: prompt + half the output."""
        return self.prompt_tokens + self.output_tokens / 2.0

    def to_json(self) -> dict[str, Any]:
        return {_camel(f.name): getattr(self, f.name) for f in fields(self)}

    def merged(self, document: Mapping[str, Any]) -> LoadSpec:
        """This spec with the fields `document` names replaced (camelCase or snake_case keys)."""
        if not isinstance(document, Mapping):
            raise LoadError("the load must be a JSON object")
        known = {f.name for f in fields(self)}
        changes: dict[str, Any] = {}
        for key, value in document.items():
            name = _snake(str(key))
            if name not in known:
                raise LoadError(
                    f"{key}: unknown field (known: {', '.join(sorted(_camel(k) for k in known))})"
                )
            if name in ("prompt_tokens", "output_tokens", "concurrency") and isinstance(value, float):
                if not value.is_integer():
                    raise LoadError(f"{_camel(name)}: must be a whole number")
                value = int(value)
            if name in ("request_rate", "prompt_spread", "output_spread", "prefix_sharing"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise LoadError(f"{_camel(name)}: must be a number")
                value = float(value)
            changes[name] = value
        return replace(self, **changes)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).replace("-", "_")


def sample_length(distribution: str, mean: int, spread: float, rng: random.Random) -> int:
    """One length ≥ 1 drawn around `mean`."""
    if distribution == "fixed" or spread == 0.0:
        return mean
    if distribution == "uniform":
        low = max(1, round(mean * (1.0 - min(spread, 1.0))))
        return rng.randint(low, max(low, round(mean * (1.0 + min(spread, 1.0)))))
    # lognormal with the given mean: mu = ln(mean) - sigma²/2
    mu = math.log(mean) - spread * spread / 2.0
    return max(1, min(MAX_TOKENS, round(math.exp(rng.gauss(mu, spread)))))


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    closed_loop: bool


class Schedule:
    """Load phases over simulated time: `[(start_s, spec), …]`, the first starting at 0."""

    def __init__(self, phases: Iterable[tuple[float, LoadSpec]]) -> None:
        self.phases = sorted(phases, key=lambda phase: phase[0])
        if not self.phases or self.phases[0][0] != 0.0:
            raise LoadError("a schedule needs a phase starting at 0")

    def spec_at(self, time: float) -> LoadSpec:
        spec = self.phases[0][1]
        for start, phase in self.phases:
            if start > time:
                break
            spec = phase
        return spec

    def next_change_after(self, time: float) -> float:
        for start, _ in self.phases:
            if start > time:
                return start
        return math.inf


class LoadGenerator:
    """Arrivals in time order, drawn lazily: `next_time`, then `pop()`. The engine tells it when a
    closed-loop request is done (`request_done`), which schedules the replacement."""

    def __init__(
        self,
        load: LoadSpec | Schedule,
        rng: random.Random,
        *,
        start_s: float = 0.0,
        closed_loop_ramp_s: float = 0.0,
    ) -> None:
        self._rng = rng
        self._schedule = load if isinstance(load, Schedule) else Schedule([(0.0, load)])
        self._ramp_s = closed_loop_ramp_s
        self._stopped = False
        self._next_poisson = math.inf
        self._closed_pending: list[float] = []  # times of closed-loop arrivals not yet popped
        self._closed_in_flight = 0  # closed-loop requests popped and not yet done
        self._spec = self._schedule.spec_at(start_s)
        self._phase_end = self._schedule.next_change_after(start_s)
        self._enter(self._spec, start_s, first=True)

    @property
    def spec(self) -> LoadSpec:
        return self._spec

    @property
    def stopped(self) -> bool:
        return self._stopped

    def set_load(self, spec: LoadSpec, now: float) -> None:
        """Replace the load from simulated time `now` on (ends any schedule)."""
        self._schedule = Schedule([(0.0, spec)])
        self._phase_end = math.inf
        self._enter(spec, now, first=False)

    def stop(self) -> None:
        """No more arrivals (drain)."""
        self._stopped = True
        self._next_poisson = math.inf
        self._closed_pending.clear()

    def _enter(self, spec: LoadSpec, now: float, *, first: bool) -> None:
        self._spec = spec
        self._next_poisson = math.inf
        if spec.concurrency is not None:
            wanted = spec.concurrency - self._closed_in_flight - len(self._closed_pending)
            if wanted < 0:  # fewer wanted: drop pending arrivals; in-flight ones are not replaced
                self._closed_pending = sorted(self._closed_pending)[
                    : max(0, len(self._closed_pending) + wanted)
                ]
            ramp = self._ramp_s if first else 0.0
            for _ in range(max(0, wanted)):
                self._closed_pending.append(now + (self._rng.random() * ramp if ramp > 0 else 0.0))
            self._closed_pending.sort()
        else:
            self._closed_pending.clear()
            self._draw_poisson(now)

    def _draw_poisson(self, now: float) -> None:
        rate = self._spec.request_rate
        self._next_poisson = now + self._rng.expovariate(rate) if rate > 0 else math.inf

    def _advance_phase(self) -> None:
        # Cross every phase boundary that comes before the next arrival (memoryless: redraw there).
        while not self._stopped and self._phase_end <= min(self._next_poisson, self._closed_head()):
            start = self._phase_end
            self._phase_end = self._schedule.next_change_after(start)
            self._enter(self._schedule.spec_at(start), start, first=False)

    def _closed_head(self) -> float:
        return self._closed_pending[0] if self._closed_pending else math.inf

    @property
    def next_time(self) -> float:
        if self._stopped:
            return math.inf
        if self._phase_end < math.inf:
            self._advance_phase()
        return min(self._next_poisson, self._closed_head())

    def pop(self) -> Arrival:
        time = self.next_time
        if time == math.inf:
            raise IndexError("no arrival pending")
        spec = self._spec
        closed = bool(self._closed_pending) and self._closed_pending[0] == time
        if closed:
            self._closed_pending.pop(0)
            self._closed_in_flight += 1
        else:
            self._draw_poisson(time)
        rng = self._rng
        prompt = sample_length(spec.prompt_distribution, spec.prompt_tokens, spec.prompt_spread, rng)
        output = sample_length(spec.output_distribution, spec.output_tokens, spec.output_spread, rng)
        shared = math.floor(spec.prefix_sharing * prompt)
        return Arrival(time, prompt, output, shared, closed)

    def request_done(self, now: float) -> None:
        """A closed-loop request finished (or was turned away): its replacement arrives now."""
        self._closed_in_flight = max(0, self._closed_in_flight - 1)
        if self._stopped or self._spec.concurrency is None:
            return
        if self._closed_in_flight + len(self._closed_pending) < self._spec.concurrency:
            self._closed_pending.append(now)
            self._closed_pending.sort()
