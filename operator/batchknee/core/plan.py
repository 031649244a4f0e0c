"""The seed's table as data: per context length, the knee, the recommendation and the batch rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from batchknee.core.recommend import Goal, Recommendation, recommend
from batchknee.core.roofline import DecodeRoofline, PrefillMix


@dataclass(frozen=True)
class BatchRow:
    batch: int
    tpot_s: float
    tokens_per_s: float
    tpot_p99_s: float | None = None  # with the prefill chunks interleaved (None: decode only)


@dataclass(frozen=True)
class ContextPlan:
    context_tokens: int
    model_bytes: float
    kv_bytes_per_token: float
    kv_bytes_per_seq: float
    recommendation: Recommendation
    rows: tuple[BatchRow, ...]
    cannot_run: str | None = None  # why no batch limit runs this context (None: one does)

    def to_json(self) -> dict[str, Any]:
        """The `batchknee plan --output json` contract (camelCase keys; other tools read them). A
        context no batch limit runs keeps every key, with `cannotRun` saying why, its recommendation
        null and no rows: a figure there (a limit of 1, a capacity of 0) would read as one to use."""
        rec = self.recommendation
        document: dict[str, Any] = {
            "contextLength": self.context_tokens,
            "modelBytes": self.model_bytes,
            "kvBytesPerToken": self.kv_bytes_per_token,
            "kvBytesPerSeq": self.kv_bytes_per_seq,
            "cannotRun": self.cannot_run,
            "bKnee": rec.b_knee,
            "recommendedMaxNumSeqs": rec.max_num_seqs,
            "recommendedMaxTokens": rec.max_tokens,
            "limitedBy": rec.limited_by,
            "sloBatch": rec.slo_batch,
            "kvCapacityBatch": rec.capacity_batch,
            "explanation": rec.explain(),
            "rows": [
                {
                    "batch": r.batch,
                    "tpotMs": r.tpot_s * 1e3,
                    "tpotP99Ms": None if r.tpot_p99_s is None else r.tpot_p99_s * 1e3,
                    "tokensPerSecond": r.tokens_per_s,
                }
                for r in self.rows
            ],
        }
        if self.cannot_run is None:
            return document
        unrunnable = {key: value if key in _CONTEXT_FACTS else None for key, value in document.items()}
        return {**unrunnable, "rows": []}


# What stays true of a context no batch limit runs: the model's and the context's own sizes.
_CONTEXT_FACTS = frozenset({"contextLength", "modelBytes", "kvBytesPerToken", "kvBytesPerSeq", "cannotRun"})


def prefix_share_of_context(share_of_prompt: float, context_tokens: float, output_tokens: float) -> float:
    """A prefix shared by `share_of_prompt` of every prompt (a system prompt: what the engines'
    prefix-cache hit rate shows) as a fraction of the average context a running sequence holds,
    the prompt plus half the output (it grows from one to the other while it decodes)."""
    if not 0.0 <= share_of_prompt < 1.0:
        raise ValueError("the shared share of the prompt must be in [0, 1)")
    prompt = max(0.0, context_tokens - output_tokens / 2.0)
    return min(share_of_prompt * prompt / context_tokens, 0.99) if context_tokens > 0 else 0.0


def build_plan(
    roofline: DecodeRoofline,
    contexts: Sequence[int],
    batches: Sequence[int],
    *,
    knee_factor: float = 1.0,
    tpot_target_s: float | None = None,
    gpu_memory_utilization: float = 0.9,
    prefix_sharing_of_prompt: float | None = None,
    output_tokens: float = 0.0,
    prompt_fraction: float = 0.0,
    max_num_batched_tokens: int = 2048,
    goal: Goal = "Knee",
) -> list[ContextPlan]:
    """One plan per context. With `prefix_sharing_of_prompt`, the roofline's prefix sharing (a
    fraction of the context) is set per context from it and the mean output length."""
    plans = []
    for ctx in contexts:
        planner = roofline
        if prefix_sharing_of_prompt is not None:
            planner = replace(
                roofline, prefix_sharing=prefix_share_of_context(prefix_sharing_of_prompt, ctx, output_tokens)
            )
        plans.extend(
            _plans(
                planner,
                [ctx],
                batches,
                knee_factor,
                tpot_target_s,
                gpu_memory_utilization,
                prompt_fraction,
                max_num_batched_tokens,
                goal,
            )
        )
    return plans


def _plans(
    roofline: DecodeRoofline,
    contexts: Sequence[int],
    batches: Sequence[int],
    knee_factor: float,
    tpot_target_s: float | None,
    gpu_memory_utilization: float,
    prompt_fraction: float,
    max_num_batched_tokens: int,
    goal: Goal,
) -> list[ContextPlan]:
    """One plan per context. A positive `prompt_fraction` (the share of the mean context that is
    prompt) models the prefill chunks interleaved with decoding: the rows gain a TPOT p99 and the
    SLO batch keeps that p99 under the target."""

    def mix(ctx: int) -> PrefillMix | None:
        if prompt_fraction <= 0:
            return None
        return PrefillMix.for_context(ctx, prompt_fraction, max_num_batched_tokens)

    def p99(batch: int, ctx: int) -> float | None:
        prefill = mix(ctx)
        return None if prefill is None else roofline.tpot_with_prefill_s(batch, ctx, prefill, 0.99)

    return [
        ContextPlan(
            context_tokens=ctx,
            model_bytes=roofline.model_bytes,
            kv_bytes_per_token=roofline.kv_bytes_per_token,
            kv_bytes_per_seq=roofline.kv_bytes_per_seq(ctx),
            recommendation=recommend(
                roofline,
                ctx,
                knee_factor=knee_factor,
                tpot_target_s=tpot_target_s,
                gpu_memory_utilization=gpu_memory_utilization,
                prefill=mix(ctx),
                goal=goal,
            ),
            rows=tuple(
                BatchRow(b, roofline.tpot_s(b, ctx), roofline.throughput_tokens_per_s(b, ctx), p99(b, ctx))
                for b in batches
            ),
        )
        for ctx in contexts
    ]
