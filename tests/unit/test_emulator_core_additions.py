"""The two core helpers the engine simulation needs: Σ KV bytes from sums, and prefill attention pairs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchknee.core import MODELS, DecodeRoofline, find_gpu

contexts = st.lists(st.integers(min_value=1, max_value=20_000), min_size=1, max_size=40)


@given(st.sampled_from(MODELS), contexts)
def test_kv_bytes_of_contexts_is_the_sum_over_sequences(model: object, lengths: list[int]) -> None:
    roofline = DecodeRoofline(model, find_gpu("h100-sxm"))  # type: ignore[arg-type]
    total = sum(lengths)
    windowed = sum(roofline.windowed_tokens(n) for n in lengths)
    expected = sum(roofline.kv_bytes_per_seq(n) for n in lengths)
    assert roofline.kv_bytes_of_contexts(total, windowed) == pytest.approx(expected, rel=1e-12)


def test_windowed_tokens_cap_at_the_window() -> None:
    from batchknee.core import find_model

    mistral = DecodeRoofline(find_model("mistral-7b-v0.1"), find_gpu("a100-80gb"))
    llama = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
    assert mistral.windowed_tokens(10_000) == 4096 and mistral.windowed_tokens(100) == 100
    assert llama.windowed_tokens(10_000) == 10_000
    # Mistral v0.1 windows every layer: a 10k-token sequence holds 4096 tokens per layer.
    assert mistral.kv_bytes_per_seq(10_000) == mistral.kv_bytes_per_seq(4096)


@given(st.integers(min_value=0, max_value=5000), st.integers(min_value=0, max_value=5000))
def test_prefill_attended_pairs_counts_causal_pairs(computed: int, chunk: int) -> None:
    brute = sum(computed + j for j in range(1, chunk + 1))
    assert DecodeRoofline.prefill_attended_pairs(computed, chunk) == brute


def test_a_decode_step_is_a_chunk_of_one() -> None:
    assert DecodeRoofline.prefill_attended_pairs(2047, 1) == 2048
    with pytest.raises(ValueError, match="zero or positive"):
        DecodeRoofline.prefill_attended_pairs(-1, 4)
