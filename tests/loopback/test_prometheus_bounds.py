"""Finite but impossible figures through the real adapter and a loopback Prometheus: an average
context under one token or past the largest KV pool, a latency of 1e306 s, a sample count of +Inf
or NaN, a rate of 1e300. Each is an unavailable reading whose reason names the metric (never a
figure, never an exception), the policy holds the last good setting and says why, and nothing
non-finite reaches status."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from fake_prometheus import FakePrometheus

from batchknee.adapters.prometheus import PrometheusObserver, queries, scope_for
from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.core.observation import Observation, ObservationTarget, Reading
from batchknee.core.policy import Applied, TuningRules, decide
from batchknee.core.verify import Figures
from batchknee.reconcile import observed_metrics, window_figures

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
TARGET = ObservationTarget("prod", "chat", "VLLM", 120)
ROOFLINE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
POOL = ROOFLINE.kv_pool_bytes(0.9)

# A healthy window (as text, the way Prometheus writes values); capacity: 1,000 blocks of 16.
HEALTHY = {
    "running": "48", "recent_running": "40", "waiting": "3", "usage": "0.5", "recent_usage": "0.625",
    "samples": "10", "scrapes": "1", "capacity": "1", "tpot_p99": "0.03", "tpot_mean": "0.02",
    "ttft_p99": "0.4", "generation": "2400", "preemptions": "0", "prefix": "0.25",
    "prompt_length_mean": "200", "output_length_mean": "300", "length_fallback": "350",
    "read_bytes": "1.5e12",
}  # fmt: skip
ABSENT = None  # an override that leaves the query's answer empty


def answers(of: ObservationTarget, figures: dict[str, str | list[str] | None]) -> Callable[[str], bytes]:
    """Each query answered with its figure (a list: one per pod, pods `<name>-0`, `<name>-1`…)."""
    names = {promql: name for name, promql in queries(scope_for(of)).items()}

    def answer(promql: str) -> bytes:
        name = names[promql]
        figure = figures.get(name)
        values = [] if figure is None else [figure] if isinstance(figure, str) else figure
        result = []
        for pod, value in enumerate(values):
            labels = {
                "namespace": of.namespace,
                "llmserving": of.name,
                "pod": f"{of.name}-{pod}",
                "engine": "0",
            }
            if name == "capacity":
                labels |= {"num_gpu_blocks": "1000", "block_size": "16"}
            result.append({"metric": labels, "value": [NOW.timestamp(), value]})
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()

    return answer


def observe(target: ObservationTarget = TARGET, **changes: str | list[str] | None) -> Observation:
    with FakePrometheus("answer", answer=answers(target, {**HEALTHY, **changes})) as prom:
        observer = PrometheusObserver(prom.url, timeout_s=2.0, min_samples=3)
        try:
            return observer.observe([target], NOW)[target.key]
        finally:
            observer.close()


def settled_decision(observation: Observation) -> tuple[bool, int, str | None, str]:
    """What the policy does at 64, long settled, with this observation: (rolls, value, hold, reason)."""
    applied = Applied(64, settled_since=NOW - timedelta(days=1))
    d = decide(TuningRules(), ROOFLINE, POOL, observation, applied, (), NOW)
    return d.rolls, d.value, d.hold, d.reason


def status_json(observation: Observation) -> str:
    """The observed block as it goes to status, in strict JSON (no NaN or Infinity)."""
    return json.dumps(observed_metrics(observation).dump(), allow_nan=False)


def test_a_healthy_window_is_read_and_decided() -> None:
    seen = observe()
    assert seen.avg_context_tokens.value == pytest.approx(0.5 * 16_000 / 48)
    assert seen.tpot_p99_s.value == 0.03 and seen.pods_served.value == 1
    assert settled_decision(seen)[2] != "metrics-unavailable"
    status_json(seen)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        # KV usage 1e-320 of a 16,000-token pool over 48 sequences: 3e-318 tokens (was: OverflowError
        # in the policy on every evaluation)
        ({"usage": "1e-320", "length_fallback": ABSENT}, ["KV usage × pool / running", "under 1"]),
        # no pool series: the histogram fallback of 1e-300 tokens (was: 64→512) or 1e12 (was: 64→8)
        (
            {"capacity": ABSENT, "length_fallback": "1e-300"},
            ["prompt and generation length histograms", "under 1"],
        ),
        (
            {"capacity": ABSENT, "length_fallback": "1e12"},
            ["prompt and generation length histograms", "over the largest KV pool"],
        ),
        # a context of 0.4 tokens (0.001 × 16,000 / 40): under one token, on the recent path too
        (
            {"usage": "0.001", "recent_usage": "0.001", "length_fallback": ABSENT},
            ["KV usage × pool / running", "under 1"],
        ),
    ],
)
def test_an_average_context_under_one_token_or_past_the_largest_pool_is_unavailable(
    changes: dict[str, str | None], names: list[str]
) -> None:
    seen = observe(**changes)
    context = seen.avg_context_tokens
    assert context.value is None, context
    for name in names:
        assert name in context.reason, context.reason
    rolls, value, hold, reason = settled_decision(seen)
    assert (rolls, value, hold) == (False, 64, "metrics-unavailable")
    assert names[0] in reason and "holding 64" in reason
    status_json(seen)


def test_a_tiny_kv_context_falls_back_to_the_histograms() -> None:
    seen = observe(usage="1e-320")
    assert seen.avg_context_tokens.value == 350  # the length histograms' figure, not 3e-318
    settled_decision(seen)  # (was: OverflowError)


@pytest.mark.parametrize(
    ("query", "attribute", "name", "field"),
    [
        ("tpot_p99", "tpot_p99_s", "TPOT p99", "tpotP99Milliseconds"),
        ("tpot_mean", "tpot_mean_s", "TPOT mean", None),
        ("ttft_p99", "ttft_p99_s", "TTFT p99", "ttftP99Milliseconds"),
    ],
)
def test_a_latency_of_1e306_seconds_is_unavailable_and_status_stays_json(
    query: str, attribute: str, name: str, field: str | None
) -> None:
    """(Was: 1e306 s × 1e3 = inf in status.observed, the calibration samples and the history,
    written to the API server as the literal `Infinity`.)"""
    seen = observe(**{query: "1e306"})
    reading: Reading = getattr(seen, attribute)
    assert reading.value is None and name in reading.reason and "1e+306" in reading.reason, reading
    observed = json.loads(status_json(seen))
    if field is not None:
        assert field not in observed
    figures = Figures.of(seen)
    if figures is not None:  # the check after a change keeps only finite figures
        before = window_figures(figures)
        assert before is not None
        json.dumps(before.dump(), allow_nan=False)
    else:
        assert query == "tpot_p99"
    settled_decision(seen)


@pytest.mark.parametrize("count", ["+Inf", "NaN", "-Inf"])
def test_a_sample_count_that_is_no_count_is_too_few_samples(count: str) -> None:
    """(+Inf was: `observation failed: a reading must be finite, got nan`, naming no metric; NaN
    skipped the too-few-samples check and the figures were used.)"""
    seen = observe(samples=count)
    for reading in (seen.avg_context_tokens, seen.running, seen.waiting, seen.kv_cache_usage):
        assert reading.value is None and "sample count" in reading.reason, reading
    assert seen.pods_served.value is None
    rolls, value, hold, reason = settled_decision(seen)
    assert (rolls, value, hold) == (False, 64, "metrics-unavailable") and "sample count" in reason
    status_json(seen)


def test_huge_finite_sample_counts_do_not_overflow_the_pods_served() -> None:
    """(Was: their sum, inf, over the largest: `a reading must be finite, got inf`.)"""
    seen = observe(samples=["1.5e308", "1.5e308"])
    assert seen.pods_served.value == 2


@pytest.mark.parametrize(
    ("query", "value", "attribute", "name"),
    [
        ("generation", "1e300", "generation_tokens_per_s", "generation token rate"),
        ("preemptions", "1e300", "preemptions_per_s", "preemption rate"),
        ("read_bytes", "1e300", "read_bytes_per_s_per_gpu", "read bandwidth"),
        ("prefix", "1e300", "prefix_hit_ratio", "prefix-cache hit ratio"),
        ("running", "1e300", "running", "running-requests"),
        ("waiting", "1e300", "waiting", "waiting-requests"),
        ("usage", "1e300", "kv_cache_usage", "KV-cache usage"),
        ("prompt_length_mean", "1e300", "prompt_tokens_mean", "mean prompt length"),
        ("output_length_mean", "1e300", "output_tokens_mean", "mean output length"),
    ],
)
def test_a_rate_count_or_fraction_past_any_engine_is_unavailable(
    query: str, value: str, attribute: str, name: str
) -> None:
    seen = observe(**{query: value})
    reading: Reading = getattr(seen, attribute)
    assert reading.value is None and name in reading.reason and "1e+300" in reading.reason, reading
    status_json(seen)
    settled_decision(seen)


@pytest.mark.parametrize(
    ("query", "value", "attribute"),
    [
        # SGLang counts a retracted request's cached tokens again when it prefills it anew (hit
        # ratios of 2 under KV pressure); the policy reads the ratio as at most one
        ("prefix", "2.05", "prefix_hit_ratio"),
        # a TTFT p99 of hours, from SGLang's TTFT buckets set by the user: over its target, a reading
        ("ttft_p99", "20000", "ttft_p99_s"),
        # a prompt of a million-token model, a fleet's token rate, a B200 read at TP 8 summed
        ("prompt_length_mean", "1e6", "prompt_tokens_mean"),
        ("generation", "5e8", "generation_tokens_per_s"),
        ("read_bytes", "6.4e13", "read_bytes_per_s_per_gpu"),
    ],
)
def test_large_figures_real_engines_report_are_readings(query: str, value: str, attribute: str) -> None:
    reading: Reading = getattr(observe(**{query: value}), attribute)
    assert reading.value == pytest.approx(float(value)), reading


@pytest.mark.parametrize(
    ("query", "attribute", "name"),
    [("running", "running", "running-requests"), ("usage", "kv_cache_usage", "KV-cache usage")],
)
def test_one_pods_impossible_figure_does_not_hide_in_the_fleets(
    query: str, attribute: str, name: str
) -> None:
    """(Was: running −20 and 60 summed to 40, KV usage −0.6 and 1.6 averaged to 0.5: readings.)"""
    figures = {"running": ["-20", "60"], "usage": ["-0.6", "1.6"]}
    seen = observe(**{query: figures[query], "samples": ["10", "10"], "scrapes": ["1", "1"]})
    reading: Reading = getattr(seen, attribute)
    assert reading.value is None and f"one pod's {name} is negative" in reading.reason, reading
    status_json(seen)


TRTLLM = ObservationTarget("prod", "chat", "TensorRTLLM", 120)


def test_a_mean_prompt_under_one_token_is_unavailable_not_a_halved_context() -> None:
    """TensorRT-LLM counts a prompt's tokens as its request starts and the request as it ends: a
    window where arrivals stopped and long requests finished has no prompt tokens per request. (Was:
    a mean prompt of 0, and the decode context read as half the reservation: 250 for 500.)"""
    reserved = {
        "capacity": "16000",
        "usage": "0.5",
        "recent_usage": "0.5",
        "running": "16",
        "recent_running": "16",
    }
    healthy = observe(TRTLLM, **reserved, reserved_prompt="100", recent_reserved_prompt="100")
    assert healthy.avg_context_tokens.value == pytest.approx((500 + 100) / 2)
    seen = observe(TRTLLM, **reserved, reserved_prompt="0", recent_reserved_prompt="0")
    for reading in (seen.prompt_tokens_mean, seen.avg_context_tokens, seen.recent_avg_context_tokens):
        assert reading.value is None and "mean prompt is 0 tokens, under one" in reading.reason, reading
    rolls, value, hold, _ = settled_decision(seen)
    assert (rolls, value, hold) == (False, 64, "metrics-unavailable")
    assert observe(prompt_length_mean="0.5").prompt_tokens_mean.value is None  # vLLM's histogram


def test_a_read_bytes_counter_at_zero_is_idle_only_when_nothing_is_generated() -> None:
    """(Was: with the generation rate unknown, a switched-off counter read as 0 % of peak.)"""
    assert observe(read_bytes="0", generation="0").read_bytes_per_s_per_gpu.value == 0
    for generation in ("2400", ABSENT):
        reading = observe(read_bytes="0", generation=generation).read_bytes_per_s_per_gpu
        assert reading.value is None and "--enable-mfu-metrics" in reading.reason, reading
