"""The check after a change (pure): what reverts, what is kept, what is inconclusive."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from batchknee.adapters.prometheus import Row, ScopeData, scope_for
from batchknee.core.observation import ObservationTarget
from batchknee.core.verify import Figures, verify

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
KEY = ("prod", "llama")


def labels(pod: str) -> dict[str, str]:
    return {"namespace": "prod", "llmserving": "llama", "pod": pod}


def figures(ctx: float = 8192, tokens: float = 1000, p99_ms: float = 49.7, mean_ms: float | None = 45.0,
            preemptions: float = 0.0, prompt: float | None = None) -> Figures:  # fmt: skip
    return Figures(ctx, tokens, p99_ms / 1e3, preemptions, None if mean_ms is None else mean_ms / 1e3, prompt)


def test_a_tpot_gain_inside_one_histogram_bucket_shows_in_the_mean() -> None:
    """64 → 16 at 8,192 tokens: throughput per pod falls, TPOT halves; the p99 read from vLLM's
    buckets stays near 50 ms, the exact mean shows the gain: kept."""
    check = verify(figures(tokens=1000, mean_ms=45), figures(tokens=700, mean_ms=24), dead_band_percent=10)
    assert check.verdict == "Kept"


def test_throughput_lost_with_no_tpot_gain_reverts() -> None:
    check = verify(figures(tokens=1000, mean_ms=45), figures(tokens=700, mean_ms=46), dead_band_percent=10)
    assert check.verdict == "Reverted" and "throughput fell without a TPOT gain" in check.reason
    no_mean = verify(figures(mean_ms=None), figures(tokens=700, mean_ms=None), dead_band_percent=10)
    assert no_mean.verdict == "Reverted"


def test_preemptions_and_a_broken_target_revert_and_moved_traffic_is_inconclusive() -> None:
    assert verify(figures(), figures(preemptions=1.0), 10).verdict == "Reverted"
    broke = verify(figures(p99_ms=38), figures(p99_ms=45), 10, tpot_target_s=0.040)
    assert broke.verdict == "Reverted" and "40 ms target" in broke.reason
    assert verify(figures(ctx=2048), figures(ctx=8192, tokens=10), 10).verdict == "Inconclusive"


def test_traffic_is_the_clients_prompt_not_the_running_context_a_restart_makes_young() -> None:
    """16 → 64 on one replica restarted into a step 8× slower: the queue is admitted at once, so the
    window after holds a young cohort, its running context 10 % under the window before's while
    the clients sent the same prompts. Judged on the prompt, the change is checked (and its lost
    throughput reverts it); judged on the context it would have been "inconclusive"."""
    before = figures(ctx=1555, tokens=20000, mean_ms=8.0, prompt=939)
    after = figures(ctx=1399, tokens=10555, mean_ms=8.1, prompt=939)
    check = verify(before, after, dead_band_percent=10)
    assert check.verdict == "Reverted" and "throughput fell" in check.reason
    no_prompt = verify(replace(before, prompt_tokens=None), after, dead_band_percent=10)
    assert no_prompt.verdict == "Inconclusive" and "avg ctx 1555 → 1399 tok" in no_prompt.reason
    shifted = verify(before, replace(after, prompt_tokens=6042), dead_band_percent=10)
    assert shifted.verdict == "Inconclusive" and "mean prompt 939 → 6042 tok" in shifted.reason


def test_a_window_before_that_still_held_a_shifts_shorter_contexts_is_no_baseline() -> None:
    """336 → 88 right after a 512 → 2,048 shift (seen in an e2e run): the clients' prompts had moved
    already, so both windows show the same mean prompt, but the window before still held the ramp's
    shorter running contexts — more tokens/s, faster steps. The window after, at the new traffic's
    context, reads 15 % fewer tokens/s and no TPOT gain: not the setting's doing. A restart only
    shortens the running context, so a rise past the dead band is traffic: inconclusive."""
    before = figures(ctx=1330, tokens=80593, p99_ms=36.0, mean_ms=20.0, prompt=742)
    after = figures(ctx=1531, tokens=68464, p99_ms=35.5, mean_ms=19.8, prompt=748)
    check = verify(before, after, dead_band_percent=10, raised=False)
    assert check.verdict == "Inconclusive" and "avg ctx 1330 → 1531 tok" in check.reason
    within_band = verify(replace(before, context_tokens=1420), after, dead_band_percent=10)
    assert within_band.verdict == "Reverted" and "throughput fell" in within_band.reason
    # after a raise, preemptions are judged first: the engine preempts the youngest, leaving the
    # running set older; after a cut (as here) they come with the longer contexts
    preempting = replace(after, preemptions_per_s=0.5)
    raised = verify(before, preempting, dead_band_percent=10, raised=True)
    assert raised.verdict == "Reverted" and "preemptions appeared" in raised.reason
    assert verify(before, preempting, dead_band_percent=10, raised=False).verdict == "Inconclusive"


def test_a_pod_drained_mid_window_counts_by_the_part_it_served() -> None:
    """Right after a rollout the window still holds the old pods' last samples: two new pods served
    the whole window (12 samples each), two drained old ones a quarter of it (3 each). The tokens of
    all four over the window are 2.5 pods' worth, not 4: per pod the throughput held."""
    scope = scope_for(ObservationTarget("prod", "llama", "VLLM", 60))
    found = ScopeData(scope, NOW, min_samples=3)
    samples = {"llama-new-1": 12.0, "llama-new-2": 12.0, "llama-old-1": 3.0, "llama-old-2": 3.0}
    rows: dict[str, list[Row]] = {
        "running": [(labels(pod), 16.0) for pod in samples],
        "samples": [(labels(pod), count) for pod, count in samples.items()],
    }
    found.pod_rows = {name: {KEY: value} for name, value in rows.items()}
    found.values = {"generation": {KEY: 2500.0}}
    seen = found.observation(KEY)
    assert seen.pods == 4 and seen.pods_served.value == 2.5
    tokens = seen.generation_tokens_per_s.value
    assert tokens is not None and tokens / seen.pods_served.value == 1000.0
    before, after = (
        figures(tokens=1000, mean_ms=45),
        figures(tokens=tokens / seen.pods_served.value, mean_ms=45),
    )
    assert verify(before, after, dead_band_percent=10).verdict == "Kept"
    assert (
        verify(before, figures(tokens=tokens / seen.pods, mean_ms=45), 10).verdict == "Reverted"
    )  # counted whole


def test_tensorrt_llm_has_no_prompt_histogram_its_counters_give_the_mean_prompt() -> None:
    """trtllm-serve exports no per-request length histograms: the window's prompt tokens per
    finished request (its counters, as for its reservation) are the traffic the check compares."""
    scope = scope_for(ObservationTarget("prod", "llama", "TensorRTLLM", 60))
    found = ScopeData(scope, NOW, min_samples=3)
    found.pod_rows = {
        "running": {KEY: [(labels("llama-1"), 16.0)]},
        "samples": {KEY: [(labels("llama-1"), 12.0)]},
    }
    found.values = {"reserved_prompt": {KEY: 4864.0}, "generation": {KEY: 500.0}}
    assert found.observation(KEY).prompt_tokens_mean.value == 4864.0
    found.values = {"reserved_prompt": {}, "generation": {KEY: 500.0}}
    quiet = found.observation(KEY).prompt_tokens_mean
    assert quiet.value is None and "mean prompt" in (quiet.reason or "")
