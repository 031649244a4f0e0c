"""Properties of the roofline and the recommendation that must hold for every input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchknee.core import GPUS, MODELS, DecodeRoofline, find_gpu, find_model, recommend

models = st.sampled_from(MODELS)
gpus = st.sampled_from(GPUS)
contexts = st.integers(min_value=16, max_value=131_072)
efficiencies = st.floats(min_value=0.3, max_value=1.0)
overheads = st.floats(min_value=0.0, max_value=0.005)


@st.composite
def rooflines(draw: st.DrawFn) -> DecodeRoofline:
    model = draw(models)
    return DecodeRoofline(
        model,
        draw(gpus),
        tensor_parallel=draw(st.sampled_from([1, 2, 4, 8])),
        kv_dtype=draw(st.sampled_from(["auto", "fp8"])),
        bandwidth_efficiency=draw(efficiencies),
        overhead_s=draw(overheads),
        prefix_sharing=draw(st.sampled_from([0.0, 0.3, 0.6])),
    )


@given(rooflines(), contexts, st.integers(min_value=1, max_value=2048))
def test_tpot_is_non_decreasing_in_batch(roofline: DecodeRoofline, context: int, batch: int) -> None:
    assert roofline.tpot_s(batch + 1, context) >= roofline.tpot_s(batch, context)


@given(rooflines(), contexts, st.integers(min_value=1, max_value=2048))
def test_throughput_increases_in_batch(roofline: DecodeRoofline, context: int, batch: int) -> None:
    here, after = (roofline.throughput_tokens_per_s(b, context) for b in (batch, batch + 1))
    assert after >= here * (1 - 1e-12)
    # Strictly while memory-bound; on the compute roof TPOT grows in proportion to B and it is flat.
    memory_s = (
        roofline.weight_bytes_read_per_gpu(batch + 1) + roofline.kv_bytes_read(batch + 1, context)
    ) / roofline.bandwidth
    tpot_memory_bound = memory_s / roofline.bandwidth_efficiency + roofline.overhead_s
    if roofline.tpot_s(batch + 1, context) == pytest.approx(tpot_memory_bound, rel=1e-12):
        assert after > here


@given(rooflines(), contexts, st.integers(min_value=2, max_value=2048))
def test_throughput_is_concave_in_batch(roofline: DecodeRoofline, context: int, batch: int) -> None:
    # Only in the memory-bound regime: at the compute roof throughput is flat, which is concave too,
    # but a MoE model's expert reads make small batches locally convex; dense models are checked.
    if roofline.model.is_moe:
        return
    before, here, after = (
        roofline.throughput_tokens_per_s(b, context) for b in (batch - 1, batch, batch + 1)
    )
    assert here - before >= after - here - 1e-9 * here


@given(models, contexts, st.floats(min_value=1e11, max_value=1e13), st.floats(min_value=1e11, max_value=1e13))
def test_b_knee_does_not_depend_on_bandwidth(model: object, context: int, bw_a: float, bw_b: float) -> None:
    gpu = find_gpu("a100-80gb")
    a = DecodeRoofline(model, gpu, bandwidth_bytes_per_s=bw_a)  # type: ignore[arg-type]
    b = DecodeRoofline(model, gpu, bandwidth_bytes_per_s=bw_b)  # type: ignore[arg-type]
    assert a.b_knee(context) == pytest.approx(b.b_knee(context), rel=1e-9)


@given(rooflines(), contexts)
def test_at_the_knee_kv_reads_equal_weight_reads(roofline: DecodeRoofline, context: int) -> None:
    knee = roofline.b_knee(context)
    if knee >= 1:  # below one sequence (a huge shared prefix on a sharded MoE) there is no balance point
        assert roofline.kv_bytes_read(knee, context) == pytest.approx(
            roofline.weight_bytes_read_per_gpu(knee), rel=1e-6
        )


@settings(max_examples=200)
@given(
    rooflines(),
    contexts,
    st.floats(min_value=1.0, max_value=2.0),
    st.integers(min_value=1, max_value=64).map(lambda n: n * 8),
    st.integers(min_value=0, max_value=64).map(lambda n: n * 8),
    st.one_of(st.none(), st.floats(min_value=0.005, max_value=0.2)),
)
def test_recommendation_is_within_bounds_and_a_multiple_of_8(
    roofline: DecodeRoofline,
    context: int,
    factor: float,
    minimum: int,
    span: int,
    tpot_target_s: float | None,
) -> None:
    maximum = minimum + span
    rec = recommend(
        roofline, context, knee_factor=factor, tpot_target_s=tpot_target_s, minimum=minimum, maximum=maximum
    )
    value = rec.max_num_seqs
    assert minimum <= value <= maximum
    if rec.limited_by == "knee":
        assert factor * rec.b_knee <= value < factor * rec.b_knee + 8 or value == 8
    if rec.limited_by != "minimum":  # only the user's lower bound may override a cap
        for cap in (rec.slo_batch, rec.capacity_batch):
            assert cap is None or value <= cap
    binding_cap = {"tpot-target": rec.slo_batch, "kv-capacity": rec.capacity_batch}.get(rec.limited_by)
    if binding_cap is None or binding_cap >= 8:
        assert value % 8 == 0


@given(rooflines(), contexts, st.floats(min_value=0.005, max_value=0.5))
def test_slo_batch_is_the_largest_meeting_the_target(
    roofline: DecodeRoofline, context: int, target: float
) -> None:
    batch = roofline.max_batch_for_tpot(target, context)
    if batch == 0:
        assert roofline.tpot_s(1, context) > target
    else:
        assert roofline.tpot_s(batch, context) <= target
        assert batch >= (1 << 20) or roofline.tpot_s(batch + 1, context) > target


# --- tensor parallelism, MLA, MoE, sliding windows, dtypes, prefix sharing --------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_up_to_kv_heads_divides_weights_and_kv_alike(tp: int) -> None:
    one = DecodeRoofline(find_model("llama-3-70b"), find_gpu("h100-sxm"))
    split = DecodeRoofline(find_model("llama-3-70b"), find_gpu("h100-sxm"), tensor_parallel=tp)
    assert split.weight_bytes_per_gpu == pytest.approx(one.weight_bytes_per_gpu / tp)
    assert split.kv_bytes_per_token == pytest.approx(one.kv_bytes_per_token / tp)
    assert split.b_knee(2048) == pytest.approx(one.b_knee(2048))


def test_tp_beyond_kv_heads_replicates_them_and_lowers_the_knee() -> None:
    qwen = find_model("qwen2.5-7b")  # 4 KV heads
    tp4 = DecodeRoofline(qwen, find_gpu("h100-sxm"), tensor_parallel=4)
    tp8 = DecodeRoofline(qwen, find_gpu("h100-sxm"), tensor_parallel=8)
    assert tp8.kv_heads_per_gpu == tp4.kv_heads_per_gpu == 1
    assert tp8.kv_bytes_per_token == tp4.kv_bytes_per_token
    assert tp8.b_knee(2048) == pytest.approx(tp4.b_knee(2048) / 2)


def test_mla_latent_is_replicated_on_every_rank() -> None:
    deepseek = find_model("deepseek-v3")
    one = DecodeRoofline(deepseek, find_gpu("h200"), weight_dtype="fp8", tensor_parallel=1)
    eight = DecodeRoofline(deepseek, find_gpu("h200"), weight_dtype="fp8", tensor_parallel=8)
    assert one.kv_bytes_per_token == 70_272  # 61 · (512 + 64) · 2
    assert eight.kv_bytes_per_token == 70_272
    assert eight.weight_bytes_per_gpu == pytest.approx(one.weight_bytes_per_gpu / 8)


def test_kv_bytes_per_token_of_the_catalog() -> None:
    expected = {
        "llama-3.1-405b": 516_096,
        "mistral-7b": 131_072,
        "mixtral-8x7b": 131_072,
        "qwen2.5-7b": 57_344,
        "qwen2.5-72b": 327_680,
        "qwen3-8b": 147_456,
        "qwen3-32b": 262_144,
        "qwen3-30b-a3b": 98_304,
        "gemma-2-9b": 344_064,
    }
    for name, per_token in expected.items():
        assert DecodeRoofline(find_model(name), find_gpu("h100")).kv_bytes_per_token == per_token, name


def test_fp8_kv_halves_kv_bytes_and_doubles_the_knee() -> None:
    bf16 = DecodeRoofline(find_model("llama-3-8b"), find_gpu("h100"))
    fp8 = DecodeRoofline(find_model("llama-3-8b"), find_gpu("h100"), kv_dtype="fp8")
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    assert fp8.b_knee(4096) == pytest.approx(2 * bf16.b_knee(4096))


def test_weight_dtypes() -> None:
    sizes = {
        dtype: DecodeRoofline(
            find_model("llama-3-8b"), find_gpu("h100"), params=8e9, weight_dtype=dtype
        ).model_bytes
        for dtype in ("bf16", "fp16", "fp8", "int8", "int4")
    }
    assert sizes == {"bf16": 16e9, "fp16": 16e9, "fp8": 8e9, "int8": 8e9, "int4": 4e9}
    # int4 weights with auto KV keep 16-bit KV: the knee falls fourfold.
    int4 = DecodeRoofline(find_model("llama-3-8b"), find_gpu("h100"), params=8e9, weight_dtype="int4")
    assert int4.kv_bytes_per_token == 131_072


def test_sliding_window_caps_windowed_layers() -> None:
    v01 = DecodeRoofline(find_model("mistral-7b-v0.1"), find_gpu("a100"))
    v03 = DecodeRoofline(find_model("mistral-7b"), find_gpu("a100"))
    assert v01.kv_bytes_per_seq(4096) == v03.kv_bytes_per_seq(4096)
    assert v01.kv_bytes_per_seq(16384) == v03.kv_bytes_per_seq(4096)
    gemma = DecodeRoofline(find_model("gemma-2-9b"), find_gpu("a100"))
    # Half the layers keep 4096 tokens: at 8192 the KV is 3/4 of the all-full figure.
    assert gemma.kv_bytes_per_seq(8192) == pytest.approx(0.75 * 344_064 * 8192)


def test_moe_reads_more_experts_as_the_batch_grows() -> None:
    mixtral = DecodeRoofline(find_model("mixtral-8x7b"), find_gpu("h100"))
    assert mixtral.weight_bytes_read_per_gpu(1) == pytest.approx(12.9e9 * 2)
    assert mixtral.weight_bytes_read_per_gpu(256) == pytest.approx(46.7e9 * 2, rel=1e-6)
    reads = [mixtral.weight_bytes_read_per_gpu(b) for b in (1, 2, 4, 8, 16)]
    assert reads == sorted(reads)
    # Two tokens touch 8·(1 − (6/8)²) = 3.5 experts per layer on average.
    assert mixtral.expected_experts_touched(2) == pytest.approx(3.5)


def test_moe_knee_balances_kv_against_the_experts_touched() -> None:
    qwen_moe = DecodeRoofline(find_model("qwen3-30b-a3b"), find_gpu("h100"))
    knee = qwen_moe.b_knee(2048)
    assert qwen_moe.kv_bytes_read(knee, 2048) == pytest.approx(
        qwen_moe.weight_bytes_read_per_gpu(knee), rel=1e-6
    )
    # It lies between the active-only and all-experts knees.
    kv = qwen_moe.kv_bytes_per_seq(2048)
    assert 3.3e9 * 2 / kv < knee < 30.5e9 * 2 / kv


def test_prefix_sharing_raises_the_knee() -> None:
    plain = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100"), params=8e9)
    shared = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100"), params=8e9, prefix_sharing=0.6)
    reread = DecodeRoofline(
        find_model("llama-3-8b"),
        find_gpu("a100"),
        params=8e9,
        prefix_sharing=0.6,
        shared_prefix_read_once=False,
    )
    # 60 % shared: (59.6 − 0.6) / 0.4 ≈ 147.5, about 2.5× — the seed's "nearly 2× room" and more.
    assert shared.b_knee(2048) == pytest.approx((59.6046 - 0.6) / 0.4, rel=1e-4)
    assert shared.b_knee(2048) / plain.b_knee(2048) > 1.9
    assert reread.b_knee(2048) == plain.b_knee(2048)
    pool = plain.kv_pool_bytes()
    assert reread.kv_capacity_batch(2048, pool) > plain.kv_capacity_batch(2048, pool) * 2


def test_compute_roof_binds_at_short_context_and_large_batch() -> None:
    a100 = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
    memory_s = (a100.weight_bytes_read_per_gpu(1024) + a100.kv_bytes_read(1024, 128)) / a100.bandwidth
    assert a100.tpot_s(1024, 128) > memory_s  # at B 1024, ctx 128 the FLOPs take longer
    assert a100.tpot_s(1, 2048) == pytest.approx(
        (a100.weight_bytes_per_gpu + a100.kv_bytes_per_seq(2048)) / a100.bandwidth
    )


def test_efficiency_and_overhead_scale_step_time() -> None:
    naive = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100"))
    real = DecodeRoofline(
        find_model("llama-3-8b"), find_gpu("a100"), bandwidth_efficiency=0.8, overhead_s=0.002
    )
    assert real.tpot_s(64, 2048) == pytest.approx(naive.tpot_s(64, 2048) / 0.8 + 0.002)
    assert real.b_knee(2048) == naive.b_knee(2048)


def test_kv_capacity_of_llama_3_8b_on_a100_80gb() -> None:
    roofline = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
    pool = roofline.kv_pool_bytes(0.9, reserve_bytes=0)
    assert pool == pytest.approx(81920 * 2**20 * 0.9 - 16.06e9)
    assert roofline.kv_capacity_batch(8192, pool) == math.floor(pool / (131_072 * 8192))


def test_capacity_cap_rounds_down_and_is_never_exceeded() -> None:
    roofline = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a10g"))  # 22.5 GiB: little KV room
    rec = recommend(roofline, 2048, knee_factor=1.5)
    assert rec.limited_by == "kv-capacity"
    assert rec.max_num_seqs <= rec.capacity_batch
    assert rec.max_num_seqs == rec.capacity_batch // 8 * 8


def test_model_that_does_not_fit_leaves_no_capacity() -> None:
    roofline = DecodeRoofline(find_model("llama-3-70b"), find_gpu("l4"))
    assert roofline.kv_pool_bytes() < 0
    assert roofline.kv_capacity_batch(2048, roofline.kv_pool_bytes()) == 0
    assert recommend(roofline, 2048, minimum=1).limited_by == "minimum"


def test_naive_slo_cap_overestimates_the_calibrated_one() -> None:
    naive = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
    measured = DecodeRoofline(
        find_model("llama-3-8b"), find_gpu("a100-80gb"), bandwidth_efficiency=0.75, overhead_s=0.002
    )
    target = 0.030
    ratio = naive.max_batch_for_tpot(target, 2048) / measured.max_batch_for_tpot(target, 2048)
    assert 1.6 <= ratio <= 2.3  # DESIGN.md §1
    rec = recommend(measured, 2048, knee_factor=1.5, tpot_target_s=0.020)
    assert rec.limited_by == "tpot-target"
    assert measured.tpot_s(rec.max_num_seqs, 2048) <= 0.020


def test_invalid_parameters_are_refused() -> None:
    model, gpu = find_model("llama-3-8b"), find_gpu("a100")
    for kwargs in (
        {"tensor_parallel": 0},
        {"bandwidth_efficiency": 0.0},
        {"bandwidth_efficiency": 1.2},
        {"overhead_s": -1.0},
        {"prefix_sharing": 1.0},
        {"params": 0.0},
        {"weight_dtype": "fp4x"},
        {"kv_dtype": "int4"},
    ):
        with pytest.raises(ValueError):  # noqa: PT011 — each names its own field
            DecodeRoofline(model, gpu, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_tokens"):
        DecodeRoofline(model, gpu).b_knee(0)
    with pytest.raises(ValueError, match="bounds"):
        recommend(DecodeRoofline(model, gpu), 2048, minimum=64, maximum=32)
