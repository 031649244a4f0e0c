"""The bandwidth signal: achieved bandwidth as a fraction of the GPU's peak, the one-word diagnosis
(the seed's rules), and the calibration of the bandwidth efficiency from achieved bytes/s."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.core.bandwidth import (
    assess,
    bandwidth_fraction,
    diagnose,
    efficiency_from_bandwidth,
    prefill_share,
)
from batchknee.core.observation import Observation, Reading
from batchknee.core.policy import CalibrationPoint, calibrate, measured_efficiencies
from batchknee.core.roofline import PrefillMix

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
A100 = find_gpu("a100-80gb")


def naive() -> DecodeRoofline:
    return DecodeRoofline(find_model("llama-3-8b"), A100)


def observation(**readings: Reading) -> Observation:
    base = Observation.unavailable(NOW, "not in this test", pods=2)
    values = {name: getattr(base, name) for name in Observation.__dataclass_fields__}
    values.update(readings)
    return Observation(**values)


# --- the fraction ---------------------------------------------------------------------------------


def test_the_engine_counter_is_divided_by_the_gpus_peak() -> None:
    read = Reading.of(1.6e12)
    fraction, source, _ = bandwidth_fraction(read, Reading.of(0.3), A100.bandwidth_bytes_per_s)
    assert source == "engine"  # the engine's bytes win over DCGM's time share
    assert fraction == pytest.approx(1.6e12 / A100.bandwidth_bytes_per_s)
    assert 0.78 < fraction < 0.79  # 1.6 TB/s of the A100-80GB's 2.04 TB/s


def test_dcgm_dram_active_stands_in_when_the_engine_does_not_count() -> None:
    off = Reading.unavailable("no read-bytes series (start the engine with --enable-mfu-metrics)")
    fraction, source, _ = bandwidth_fraction(off, Reading.of(0.62), A100.bandwidth_bytes_per_s)
    assert (fraction, source) == (0.62, "dcgm")


def test_missing_signals_are_never_a_zero() -> None:
    off = Reading.unavailable("the read-bytes counter stays at zero while tokens are generated")
    no_dcgm = Reading.unavailable("no DRAM-active fraction (dcgm-exporter) series")
    fraction, source, reason = bandwidth_fraction(off, no_dcgm, A100.bandwidth_bytes_per_s)
    assert fraction is None and source is None
    assert "stays at zero" in reason and "dcgm-exporter" in reason
    found = assess(observation(read_bytes_per_s_per_gpu=off, dram_active=no_dcgm), naive())
    assert found.fraction is None and found.diagnosis is None
    assert found.reason.startswith("no bandwidth signal")


# --- the diagnosis --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "kwargs", "word"),
    [
        # the seed: stuck at ≥ 85 % → decode saturates the bus, a smaller batch recovers TPOT
        (0.91, {"waiting": 12.0, "share_of_prefill": 0.1}, "memory-bound"),
        (0.85, {"waiting": 0.0, "share_of_prefill": None}, "memory-bound"),
        # the seed: TTFT p99 breaks its SLO first (TPOT within its own) → prefill
        (
            0.6,
            {
                "waiting": 3.0,
                "share_of_prefill": 0.2,
                "ttft_p99_s": 2.5,
                "ttft_target_s": 1.0,
                "tpot_p99_s": 0.025,
                "tpot_target_s": 0.030,
            },
            "prefill-bound",
        ),
        (0.4, {"waiting": 0.0, "share_of_prefill": 0.62}, "prefill-bound"),
        # TTFT and TPOT both over: not the prefill pattern; requests wait with the bus at 60 %
        (
            0.6,
            {
                "waiting": 3.0,
                "share_of_prefill": 0.2,
                "ttft_p99_s": 2.5,
                "ttft_target_s": 1.0,
                "tpot_p99_s": 0.045,
                "tpot_target_s": 0.030,
            },
            "queueing",
        ),
        (0.3, {"waiting": 1.0, "share_of_prefill": 0.05}, "queueing"),
        (0.3, {"waiting": 0.4, "share_of_prefill": 0.05}, "underused"),
        (0.7, {"waiting": 0.0, "share_of_prefill": 0.05}, "balanced"),
    ],
)
def test_one_word_from_the_bandwidth_and_the_queues(fraction: float, kwargs: dict, word: str) -> None:
    found, why = diagnose(fraction, **kwargs)
    assert found == word
    assert f"{fraction:.0%}" in why


@pytest.mark.parametrize(("fraction", "word"), [(0.3, "underused"), (0.7, "balanced")])
def test_an_unknown_queue_is_not_an_empty_one(fraction: float, word: str) -> None:
    found, why = diagnose(fraction, waiting=None, share_of_prefill=0.05)
    assert found == word and "nothing waits" not in why and "how many requests wait is unknown" in why


def test_prefill_share_follows_the_request_mix() -> None:
    roofline = naive()
    # Long prompts, short answers: each output token brings 128 prompt tokens of prefill compute.
    heavy = prefill_share(roofline, 64, 2048, PrefillMix(2048, 16))
    # Chat-like answers much longer than their prompts: decode steps barely see prefill.
    light = prefill_share(roofline, 64, 2048, PrefillMix(100, 1000))
    assert heavy > 0.5 > 0.05 > light > 0


def test_assess_diagnoses_a_saturated_fleet_from_its_counters() -> None:
    roofline = naive()
    found = assess(
        observation(
            read_bytes_per_s_per_gpu=Reading.of(0.9 * A100.bandwidth_bytes_per_s),
            waiting=Reading.of(0.0),
            running=Reading.of(128.0),
            avg_context_tokens=Reading.of(2048.0),
        ),
        roofline,
    )
    assert found.source == "engine"
    assert found.fraction == pytest.approx(0.9)
    assert found.diagnosis == "memory-bound"
    assert "read-bytes counters" in found.reason


# --- calibration ----------------------------------------------------------------------------------


def test_efficiency_is_the_achieved_fraction_less_the_overheads_share() -> None:
    # 25 ms steps of which 2.5 ms are overhead: reading 72 % of peak over the whole window is
    # 80 % of peak while the step reads.
    assert efficiency_from_bandwidth(0.72, 0.025, 0.0025) == pytest.approx(0.8)
    assert efficiency_from_bandwidth(0.72, 0.025, 0.0) == pytest.approx(0.72)
    assert efficiency_from_bandwidth(0.5, 0.002, 0.003) is None  # no time left for reading
    assert efficiency_from_bandwidth(0.99, 0.010, 0.005) == 1.0  # capped


WINDOWS = [(8, 2048), (16, 2048), (32, 1024), (48, 2048), (64, 512), (96, 1024), (128, 512), (24, 4096)]


def windows(
    truth: DecodeRoofline, *, read_scale: float = 1.0, mix: PrefillMix | None = None
) -> list[CalibrationPoint]:
    """Decode windows of an engine that runs like `truth`: mean TPOT from its roofline, the bytes
    it reads per step (weights + KV) counted over the same steps."""
    points = []
    for i, (batch, context) in enumerate(WINDOWS):
        step = truth.tpot_s(batch, context)
        read_per_step = truth.weight_bytes_read_per_gpu(batch) + truth.kv_bytes_read(batch, context)
        points.append(
            CalibrationPoint(
                NOW + timedelta(minutes=i),
                batch,
                context,
                tpot_p99_s=step * 1.2,
                tpot_mean_s=step,
                prompt_tokens=mix.prompt_tokens if mix else None,
                output_tokens=mix.output_tokens if mix else None,
                read_bytes_per_s=read_scale * read_per_step / step,
            )
        )
    return points


def test_achieved_bytes_set_the_efficiency_and_the_overhead_is_refitted() -> None:
    truth = DecodeRoofline(naive().model, A100, bandwidth_efficiency=0.8, overhead_s=0.002)
    points = windows(truth)
    # achieved / peak alone is below the efficiency by the overhead's share of each step
    raw = [p.read_bytes_per_s / A100.bandwidth_bytes_per_s for p in points if p.read_bytes_per_s]
    assert max(raw) < 0.8
    measured = measured_efficiencies(naive(), points, overhead_s=0.002)
    assert measured == pytest.approx([0.8] * len(WINDOWS), rel=1e-6)
    fit, text = calibrate(naive(), points)
    assert fit is not None
    assert "bandwidth efficiency 80% measured in 8 decode-dominated windows" in text
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=0.01)
    assert fit.overhead_s == pytest.approx(0.002, abs=1e-4)


def test_windows_without_the_exact_mean_or_a_busy_batch_measure_nothing() -> None:
    truth = DecodeRoofline(naive().model, A100, bandwidth_efficiency=0.8, overhead_s=0.002)
    points = windows(truth)
    no_mean = [
        CalibrationPoint(p.time, p.batch, p.context_tokens, p.tpot_p99_s, read_bytes_per_s=p.read_bytes_per_s)
        for p in points
    ]
    idle = [
        CalibrationPoint(
            p.time, 0.5, p.context_tokens, p.tpot_p99_s, p.tpot_mean_s, read_bytes_per_s=p.read_bytes_per_s
        )
        for p in points
    ]
    assert measured_efficiencies(naive(), no_mean, overhead_s=0.002) == []
    assert measured_efficiencies(naive(), idle, overhead_s=0.002) == []


def test_counted_bytes_that_disagree_with_the_tpot_are_not_used() -> None:
    truth = DecodeRoofline(naive().model, A100, bandwidth_efficiency=0.8, overhead_s=0.002)
    # a counter reading half of what the steps need: efficiency ~0.4 cannot explain the TPOTs
    fit, text = calibrate(naive(), windows(truth, read_scale=0.5))
    assert fit is not None and "not used" in text
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=0.03)


def test_prefill_dominated_windows_do_not_measure_the_efficiency() -> None:
    truth = DecodeRoofline(naive().model, A100, bandwidth_efficiency=0.8, overhead_s=0.002)
    points = windows(truth, mix=PrefillMix(4096, 16))
    assert measured_efficiencies(naive(), points, overhead_s=0.002) == []


@pytest.mark.parametrize("read_scale", [1.15, 1.25])
def test_a_counter_reading_somewhat_high_does_not_set_the_efficiency(read_scale: float) -> None:
    # the engine's read counter is its own estimate: 15–25 % high, it put the efficiency at 0.92–1.0
    # and the SLO cap 11–18 % over what meets the target (its residual, 4–6 % of TPOT, passed a 20 % bar)
    truth = DecodeRoofline(naive().model, A100, bandwidth_efficiency=0.8, overhead_s=0.002)
    fit, text = calibrate(naive(), windows(truth, read_scale=read_scale))
    assert fit is not None and "not used" in text, text
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=0.01)
    assert fit.apply(naive()).max_batch_for_tpot(0.030, 2048) == truth.max_batch_for_tpot(0.030, 2048)


def test_compute_bound_windows_do_not_measure_the_efficiency() -> None:
    # short contexts at large batches: the step waits on compute, so bytes per second read low
    # (0.36–0.67 for a true 0.8), and their median pulled the whole fit to it
    truth = DecodeRoofline(naive().model, A100, bandwidth_efficiency=0.8, overhead_s=0.002)
    bound = [(b, 200) for b in (256, 384, 512, 768)]
    assert all(naive().decode_compute_bound(b, c) for b, c in bound)
    points = [
        CalibrationPoint(
            NOW + timedelta(minutes=i),
            b,
            c,
            tpot_p99_s=truth.tpot_s(b, c),
            tpot_mean_s=truth.tpot_s(b, c),
            read_bytes_per_s=(truth.weight_bytes_read_per_gpu(b) + truth.kv_bytes_read(b, c))
            / truth.tpot_s(b, c),
        )
        for i, (b, c) in enumerate(bound)
    ]
    assert measured_efficiencies(naive(), points, overhead_s=0.002) == []
    assert not naive().decode_compute_bound(64, 2048)
