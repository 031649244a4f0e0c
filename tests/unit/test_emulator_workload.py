"""Offered load: the JSON contract of /load and load files, and the arrival processes."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from batchknee.emulator import LoadError, LoadGenerator, LoadSpec, Schedule
from batchknee.emulator.workload import sample_length


def test_json_fields_are_camel_case_and_snake_case_is_accepted() -> None:
    spec = LoadSpec().merged({"requestRate": 3, "prompt_tokens": 1000, "outputTokens": 64.0})
    assert (spec.request_rate, spec.prompt_tokens, spec.output_tokens) == (3.0, 1000, 64)
    assert spec.to_json() == {
        "requestRate": 3.0,
        "promptTokens": 1000,
        "outputTokens": 64,
        "promptDistribution": "fixed",
        "outputDistribution": "fixed",
        "promptSpread": 0.5,
        "outputSpread": 0.5,
        "prefixSharing": 0.0,
        "concurrency": None,
    }
    assert LoadSpec().merged(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"requestRate": -1}, "requestRate"),
        ({"requestRate": 1e9}, "requestRate"),
        ({"requestRate": "fast"}, "requestRate"),
        ({"promptTokens": 0}, "promptTokens"),
        ({"outputTokens": 2.5}, "outputTokens"),
        ({"promptDistribution": "zipf"}, "promptDistribution"),
        ({"prefixSharing": 1.0}, "prefixSharing"),
        ({"concurrency": -3}, "concurrency"),
        ({"qps": 3}, "qps"),
    ],
)
def test_bad_fields_are_named(document: dict[str, object], field: str) -> None:
    with pytest.raises(LoadError, match=field):
        LoadSpec().merged(document)


def test_poisson_arrivals_have_the_rate() -> None:
    generator = LoadGenerator(LoadSpec(request_rate=20.0), random.Random(1))
    times = []
    while generator.next_time < 500.0:
        times.append(generator.pop().time)
    assert len(times) == pytest.approx(10_000, rel=0.03)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.pstdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.05)  # exponential


@pytest.mark.parametrize(("distribution", "spread"), [("uniform", 0.5), ("lognormal", 0.8)])
def test_length_distributions_keep_the_mean(distribution: str, spread: float) -> None:
    rng = random.Random(7)
    draws = [sample_length(distribution, 1000, spread, rng) for _ in range(20_000)]
    assert statistics.mean(draws) == pytest.approx(1000, rel=0.03)
    assert min(draws) >= 1
    if distribution == "uniform":
        assert min(draws) == 500 and max(draws) == 1500


def test_closed_loop_keeps_concurrency_in_flight() -> None:
    generator = LoadGenerator(LoadSpec(concurrency=8), random.Random(0), closed_loop_ramp_s=10.0)
    first = [generator.pop() for _ in range(8)]
    assert all(a.closed_loop for a in first) and max(a.time for a in first) < 10.0
    assert generator.next_time == math.inf  # nothing more until one is done
    generator.request_done(42.0)
    assert generator.next_time == 42.0
    generator.set_load(LoadSpec(concurrency=10), 50.0)
    assert [generator.pop().time for _ in range(3)] == [42.0, 50.0, 50.0]


def test_schedule_switches_at_phase_boundaries() -> None:
    schedule = Schedule(
        [(0.0, LoadSpec(request_rate=0.0)), (30.0, LoadSpec(request_rate=5.0, prompt_tokens=99))]
    )
    generator = LoadGenerator(schedule, random.Random(3))
    arrival = generator.pop()
    assert arrival.time >= 30.0 and arrival.prompt_tokens == 99
    with pytest.raises(LoadError):
        Schedule([(5.0, LoadSpec())])


def test_stop_ends_arrivals() -> None:
    generator = LoadGenerator(LoadSpec(request_rate=100.0), random.Random(0))
    generator.pop()
    generator.stop()
    assert generator.next_time == math.inf
    with pytest.raises(IndexError):
        generator.pop()
