"""Every figure of the source document (REFERENCE.md §1), reproduced with the seed's rounding."""

from __future__ import annotations

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model, recommend

TB_S = 1e12


def seed_8b(bandwidth: float = 2.0 * TB_S) -> DecodeRoofline:
    return DecodeRoofline(
        find_model("llama-3-8b"), find_gpu("a100-80gb"), params=8.0e9, bandwidth_bytes_per_s=bandwidth
    )


def test_kv_bytes_per_token_of_llama_3_8b_and_70b() -> None:
    assert seed_8b().kv_bytes_per_token == 131_072
    assert DecodeRoofline(find_model("llama-3-70b"), find_gpu("a100-80gb")).kv_bytes_per_token == 327_680
    assert seed_8b().model_bytes == 16e9


@pytest.mark.parametrize(("context", "knee"), [(512, 238), (2048, 60), (8192, 15)])
def test_b_knee_of_llama_3_8b(context: int, knee: int) -> None:
    # The seed prints 238.4 as 238, 59.6 as 60 and 14.9 as 15.
    assert round(seed_8b().b_knee(context)) == knee


def test_b_knee_of_llama_3_70b_at_2048() -> None:
    roofline = DecodeRoofline(find_model("llama-3-70b"), find_gpu("a100-80gb"), params=70e9)
    assert roofline.b_knee(2048) == pytest.approx(208.6, abs=0.05)  # the seed truncates to 208
    assert int(roofline.b_knee(2048)) == 208


def test_b_knee_is_the_same_on_a100_and_h100() -> None:
    a100 = seed_8b(2.0 * TB_S)
    h100 = DecodeRoofline(find_model("llama-3-8b"), find_gpu("h100-sxm"), params=8.0e9)
    assert h100.b_knee(2048) == a100.b_knee(2048)


def test_h100_tpot_is_about_40_percent_lower() -> None:
    a100 = seed_8b(2.0 * TB_S)
    h100 = DecodeRoofline(find_model("llama-3-8b"), find_gpu("h100-sxm"), params=8.0e9)
    assert 1 - h100.tpot_s(64, 2048) / a100.tpot_s(64, 2048) == pytest.approx(0.40, abs=0.005)


def test_ctx_2048_from_32_to_64() -> None:
    roofline = seed_8b()
    assert roofline.tpot_s(32, 2048) * 1e3 == pytest.approx(12.3, abs=0.05)
    assert roofline.tpot_s(64, 2048) * 1e3 == pytest.approx(16.6, abs=0.05)
    assert round(roofline.throughput_tokens_per_s(32, 2048)) == 2603  # seed: 2,602 (truncated)
    assert int(roofline.throughput_tokens_per_s(32, 2048)) == 2602
    assert int(roofline.throughput_tokens_per_s(64, 2048)) == 3857
    assert roofline.tpot_s(64, 2048) / roofline.tpot_s(32, 2048) - 1 == pytest.approx(0.35, abs=0.005)
    tokens_gain = roofline.throughput_tokens_per_s(64, 2048) / roofline.throughput_tokens_per_s(32, 2048) - 1
    assert tokens_gain == pytest.approx(0.48, abs=0.005)


def test_ctx_2048_from_64_to_128_marginal_efficiency_reverses() -> None:
    roofline = seed_8b()
    tpot_gain = roofline.tpot_s(128, 2048) / roofline.tpot_s(64, 2048) - 1
    tokens_gain = roofline.throughput_tokens_per_s(128, 2048) / roofline.throughput_tokens_per_s(64, 2048) - 1
    assert tpot_gain == pytest.approx(0.51, abs=0.01)
    assert tokens_gain == pytest.approx(0.32, abs=0.005)
    assert tpot_gain > tokens_gain


def test_ctx_8192_is_past_the_knee_early() -> None:
    roofline = seed_8b()
    # The seed prints 1.45 and 2.95; the roofline gives 1.440 and 2.950.
    assert roofline.tpot_s(8, 8192) / roofline.tpot_s(1, 8192) == pytest.approx(1.45, abs=0.011)
    assert roofline.tpot_s(32, 8192) / roofline.tpot_s(1, 8192) == pytest.approx(2.95, abs=0.005)
    assert roofline.throughput_tokens_per_s(32, 8192) == pytest.approx(1270, abs=1)
    assert roofline.throughput_tokens_per_s(256, 8192) == pytest.approx(1759, abs=1.5)
    gain = roofline.throughput_tokens_per_s(256, 8192) / roofline.throughput_tokens_per_s(32, 8192) - 1
    assert int(gain * 100) == 38  # "1,270 → 1,759로 38%"


def test_ctx_512_keeps_growing_through_256() -> None:
    roofline = seed_8b()
    throughputs = [roofline.throughput_tokens_per_s(b, 512) for b in (32, 64, 128, 256)]
    assert throughputs == sorted(throughputs)
    assert throughputs[-1] / throughputs[-2] > 1.4


@pytest.mark.parametrize(("context", "max_num_seqs"), [(512, 240), (2048, 64), (8192, 16)])
def test_recommended_max_num_seqs(context: int, max_num_seqs: int) -> None:
    rec = recommend(seed_8b(), context)
    assert rec.max_num_seqs == max_num_seqs
    assert rec.limited_by == "knee"
    assert rec.max_tokens == max_num_seqs * context


def test_recommendation_is_within_1_to_1_5_knee() -> None:
    for context in (2048, 8192):
        rec = recommend(seed_8b(), context, knee_factor=1.0)
        assert rec.b_knee <= rec.max_num_seqs <= 1.5 * rec.b_knee


@pytest.mark.parametrize(
    ("context", "knee", "tpot_32_ms"),
    [(512, 238.4, 9.1), (2048, 59.6, 12.3), (8192, 14.9, 25.2)],
)
def test_catalog_parameters_stay_within_2_percent_of_the_seed(
    context: int, knee: float, tpot_32_ms: float
) -> None:
    catalog = DecodeRoofline(
        find_model("llama-3-8b"), find_gpu("a100-80gb"), bandwidth_bytes_per_s=2.0 * TB_S
    )
    assert catalog.b_knee(context) == pytest.approx(knee, rel=0.02)
    assert catalog.tpot_s(32, context) * 1e3 == pytest.approx(tpot_32_ms, rel=0.02)
    seventy = DecodeRoofline(find_model("llama-3-70b"), find_gpu("a100-80gb"))
    assert seventy.b_knee(2048) == pytest.approx(208.6, rel=0.02)


def test_trtllm_knee_max_tokens_is_independent_of_context() -> None:
    roofline = seed_8b()
    per_context = [roofline.b_knee(ctx) * ctx for ctx in (512, 2048, 8192)]
    assert per_context == pytest.approx([roofline.knee_max_tokens()] * 3)
    assert roofline.knee_max_tokens() == pytest.approx(16e9 / 131_072)
