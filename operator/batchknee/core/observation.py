"""What the operator saw of an engine fleet: plain values, each either a number or a reason.

Adapters build these; policy reads them. A missing, NaN, infinite, stale or too-thin series is
never a zero: it is `Reading.unavailable("why")`, and the policy holds and says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Literal

Engine = Literal["VLLM", "TensorRTLLM", "SGLang"]


@dataclass(frozen=True)
class Reading:
    """One observed quantity: `value` when known, else `reason` says why not."""

    value: float | None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.value is None and not self.reason:
            raise ValueError("an unavailable reading needs a reason")
        if self.value is not None and not math.isfinite(self.value):
            raise ValueError(f"a reading must be finite, got {self.value}; make it unavailable instead")

    @classmethod
    def of(cls, value: float) -> Reading:
        return cls(value)

    @classmethod
    def unavailable(cls, reason: str) -> Reading:
        return cls(None, reason)

    @property
    def available(self) -> bool:
        return self.value is not None

    def __str__(self) -> str:
        return f"{self.value:g}" if self.value is not None else f"unavailable ({self.reason})"


def decode_context_under_reservation(reserved: Reading, mean_prompt: Reading) -> Reading:
    """The average context per running sequence where the engine reserves each request's prompt +
    whole output from admission (TensorRT-LLM's GUARANTEED_NO_EVICT), so the KV pool shows the
    reservation, not the context.

    Weighted by time, a running request holds p + o²/(2·o̅) tokens on average but reserves
    p + o²/o̅ (o its output: longer answers run longer), so the decode-time average is the mean of
    the reservation and the mean prompt, `(reserved + prompt) / 2` — about 1/1.56 of the
    reservation on the demo's traffic. The mean prompt comes from the engine's token counters."""
    if reserved.value is None:
        return reserved
    if mean_prompt.value is None:
        return Reading.unavailable(
            f"the KV pool shows each request's reservation; the mean prompt is needed ({mean_prompt.reason})"
        )
    if mean_prompt.value >= reserved.value:  # nothing reserved beyond the prompts: no decode share seen
        return reserved
    return Reading.of((reserved.value + mean_prompt.value) / 2)


@dataclass(frozen=True)
class Observation:
    """One LLMServing's engines over the evaluation window, aggregated across its pods."""

    sampled_at: datetime
    pods: int
    avg_context_tokens: Reading
    tpot_p99_s: Reading
    # mean time per output token over the window (for calibration and the check after a change):
    # per output step (inter-token latency) where the engine exports it, else per finished request
    tpot_mean_s: Reading
    ttft_p99_s: Reading
    running: Reading
    waiting: Reading
    kv_cache_usage: Reading  # fraction of the KV pool in use, 0–1
    prefix_hit_ratio: Reading  # 0–1
    preemptions_per_s: Reading
    generation_tokens_per_s: Reading
    # The average context over the last third of the window: when it disagrees with the whole
    # window's, traffic is mid-shift and the window's average is a blend of before and after.
    recent_avg_context_tokens: Reading = field(default_factory=lambda: Reading.unavailable("not measured"))
    # Mean prompt and output lengths of the requests finished in the window: how much prefill
    # shares the decode steps (the TPOT tail), for calibration and the SLO bound.
    prompt_tokens_mean: Reading = field(default_factory=lambda: Reading.unavailable("not measured"))
    output_tokens_mean: Reading = field(default_factory=lambda: Reading.unavailable("not measured"))
    # Achieved memory bandwidth: the bytes the engine says it read per GPU per second, averaged over
    # the pods' GPUs (vLLM/SGLang with --enable-mfu-metrics), and dcgm-exporter's fraction (0–1) of
    # time the DRAM interface was active, averaged over the GPUs of the pods.
    read_bytes_per_s_per_gpu: Reading = field(default_factory=lambda: Reading.unavailable("not measured"))
    dram_active: Reading = field(default_factory=lambda: Reading.unavailable("not measured"))
    # The pods weighted by the share of the window each was scraped in: a pod a rollout drained (or
    # started) mid-window served part of it, and counting it whole would read the per-pod throughput
    # low (what the check after a change compares).
    pods_served: Reading = field(default_factory=lambda: Reading.unavailable("not measured"))

    @classmethod
    def unavailable(cls, sampled_at: datetime, reason: str, pods: int = 0) -> Observation:
        """Nothing could be read (Prometheus down, no series): every field carries the reason."""
        missing = Reading.unavailable(reason)
        return cls(sampled_at, pods, *([missing] * (len(fields(cls)) - 2)))


@dataclass(frozen=True)
class ObservationTarget:
    """Which engine pods belong to one LLMServing, and over what window to read them.

    By default the pods' series are found by their `namespace` and `llmserving` labels (the scrape
    copies `llmserving` from the pod label batchknee.io/llmserving). `selector` (exact label
    matches) overrides that for unusual labelling, and `pods` (exact pod names, with `namespace`)
    for an adopted workload.
    """

    namespace: str
    name: str
    engine: Engine
    window_s: int
    selector: Mapping[str, str] | None = field(default=None, hash=False)
    # An adopted workload's pods, found by the workload's own label selector (StatefulSet pods are
    # `<name>-0`, and long names are truncated, so name patterns cannot find them).
    pods: tuple[str, ...] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)
