"""The average context from the KV pool (Σ usage × pool tokens / Σ running): values that are finite
but impossible — a usage above the whole pool, a pool of 10¹² tokens, negative sequences — are no
reading, never a context the policy would retune to."""

from __future__ import annotations

import pytest

from batchknee.adapters.prometheus import Row, _kv_context

POD = {"pod": "llama-1", "engine": "0"}


def context(usage: float, running: float = 16, blocks: str = "1000") -> tuple[float | None, str]:
    capacity: list[Row] = [({**POD, "num_gpu_blocks": blocks, "block_size": "16"}, 1.0)]
    reading = _kv_context([(POD, running)], [(POD, usage)], capacity)
    return reading.value, reading.reason


def test_a_fraction_of_the_pool_gives_the_context() -> None:
    assert context(0.5) == (500.0, "")  # half of 16,000 tokens over 16 sequences


@pytest.mark.parametrize(
    ("usage", "running", "blocks", "words"),
    [
        (40.0, 16, "1000", "KV usage 40, not a fraction of its pool"),
        (-0.1, 16, "1000", "KV usage -0.1, not a fraction"),
        (0.5, 16, "1e12", "a KV pool of 1.6e+13 tokens"),
        (0.5, 16, "0", "a KV pool of 0 tokens"),
        (0.5, -16, "1000", "-16 running sequences"),
    ],
)
def test_an_impossible_value_is_no_reading(usage: float, running: float, blocks: str, words: str) -> None:
    value, reason = context(usage, running, blocks)
    assert value is None and words in reason
