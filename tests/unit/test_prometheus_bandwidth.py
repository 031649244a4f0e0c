"""The adapter's bandwidth readings from query rows: the engines' read-bytes rate per GPU, and
dcgm-exporter's DRAM activity; a counter that is registered but not counting is no zero."""

from __future__ import annotations

from datetime import UTC, datetime

from batchknee.adapters.prometheus import Row, ScopeData, queries, scope_for
from batchknee.core.observation import ObservationTarget

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
KEY = ("prod", "llama")


def labels(pod: str) -> dict[str, str]:
    return {"namespace": "prod", "llmserving": "llama", "pod": pod}


def data(
    read: list[float] | None, generation: float, *, engine: str = "VLLM", samples: float = 10
) -> ScopeData:
    scope = scope_for(ObservationTarget(*KEY, engine, 60))  # type: ignore[arg-type]
    found = ScopeData(scope, NOW, min_samples=3)
    pods = ["llama-1", "llama-2"]
    rows: dict[str, list[Row]] = {
        "running": [(labels(p), 16.0) for p in pods],
        "samples": [(labels(p), samples) for p in pods],
    }
    if read is not None:
        rows["read_bytes"] = [(labels(p), v) for p, v in zip(pods, read, strict=True)]
    found.pod_rows = {name: {KEY: value} for name, value in rows.items()}
    found.values = {"generation": {KEY: generation}, "dram_active": {KEY: 0.64}}
    return found


def test_the_read_rate_is_the_mean_over_the_pods_gpus() -> None:
    seen = data([1.6e12, 1.2e12], generation=900).observation(KEY)
    assert seen.read_bytes_per_s_per_gpu.value == 1.4e12
    assert seen.dram_active.value == 0.64


def test_a_counter_flat_at_zero_while_tokens_flow_is_switched_off_not_idle() -> None:
    off = data([0.0, 0.0], generation=900).observation(KEY).read_bytes_per_s_per_gpu
    assert not off.available and "--enable-mfu-metrics" in off.reason
    idle = data([0.0, 0.0], generation=0).observation(KEY).read_bytes_per_s_per_gpu
    assert idle.value == 0.0  # nothing generated, nothing read: a real zero


def test_missing_thin_or_unsupported_is_a_reason() -> None:
    missing = data(None, generation=900).observation(KEY).read_bytes_per_s_per_gpu
    assert not missing.available and "--enable-mfu-metrics" in missing.reason
    thin = data([1e12, 1e12], generation=900, samples=1).observation(KEY).read_bytes_per_s_per_gpu
    assert not thin.available and "samples" in thin.reason
    trt = data(None, generation=900, engine="TensorRTLLM").observation(KEY).read_bytes_per_s_per_gpu
    assert not trt.available and "exports no read-bytes counter" in trt.reason


def test_dcgm_is_joined_to_the_engine_pods_by_namespace_and_pod() -> None:
    promql = queries(scope_for(ObservationTarget(*KEY, "VLLM", 60)))
    assert "rate(" in promql["read_bytes"] and "estimated_read_bytes_per_gpu_total" in promql["read_bytes"]
    dram = promql["dram_active"]
    assert "DCGM_FI_PROF_DRAM_ACTIVE" in dram
    assert "on (namespace, pod) group_left (llmserving)" in dram
    assert 'llmserving!=""' in dram  # the engine pods of the fleet, never a list of names
