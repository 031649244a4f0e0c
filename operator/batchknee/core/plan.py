"""The seed's table as data: per context length, the knee, the recommendation and the batch rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchknee.core.recommend import Recommendation, recommend
from batchknee.core.roofline import DecodeRoofline


@dataclass(frozen=True)
class BatchRow:
    batch: int
    tpot_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class ContextPlan:
    context_tokens: int
    model_bytes: float
    kv_bytes_per_token: float
    kv_bytes_per_seq: float
    recommendation: Recommendation
    rows: tuple[BatchRow, ...]

    def to_json(self) -> dict[str, Any]:
        """The `batchknee plan --output json` contract (camelCase keys; other tools read them)."""
        rec = self.recommendation
        return {
            "contextLength": self.context_tokens,
            "modelBytes": self.model_bytes,
            "kvBytesPerToken": self.kv_bytes_per_token,
            "kvBytesPerSeq": self.kv_bytes_per_seq,
            "bKnee": rec.b_knee,
            "recommendedMaxNumSeqs": rec.max_num_seqs,
            "recommendedMaxTokens": rec.max_tokens,
            "limitedBy": rec.limited_by,
            "sloBatch": rec.slo_batch,
            "kvCapacityBatch": rec.capacity_batch,
            "explanation": rec.explain(),
            "rows": [
                {"batch": r.batch, "tpotMs": r.tpot_s * 1e3, "tokensPerSecond": r.tokens_per_s}
                for r in self.rows
            ],
        }


def build_plan(
    roofline: DecodeRoofline,
    contexts: Sequence[int],
    batches: Sequence[int],
    *,
    knee_factor: float = 1.0,
    tpot_target_s: float | None = None,
    gpu_memory_utilization: float = 0.9,
) -> list[ContextPlan]:
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
            ),
            rows=tuple(
                BatchRow(b, roofline.tpot_s(b, ctx), roofline.throughput_tokens_per_s(b, ctx))
                for b in batches
            ),
        )
        for ctx in contexts
    ]
