"""`batchknee plan`: the seed's table — TPOT and throughput by batch, the knee, the recommendation."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchknee.argtypes import at_most, fraction, int_list, non_negative_float, positive_float
from batchknee.commands import UsageError, check_output_path, require_extra
from batchknee.commands._options import (
    VLLM_STEP_TOKENS,
    add_engine_option,
    add_roofline_options,
    batch_limits,
    describe,
    engine_memory_utilization,
    engine_step_tokens,
    knob_flag,
    resolve_roofline,
    slo_margin_percent,
    step_tokens,
)
from batchknee.core.plan import ContextPlan, build_plan
from batchknee.core.roofline import DecodeRoofline, PrefillMix
from batchknee.emulator.engine import no_kv_memory
from batchknee.engines import sglang, trtllm


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="the knee and the recommended --max-num-seqs for a model, GPU and context lengths",
        description="Roofline TPOT and throughput by batch size, B_knee and the recommended batch limit.",
    )
    add_roofline_options(parser)
    add_engine_option(parser)
    parser.add_argument(
        "--context", type=int_list, default=[512, 2048, 8192], help="context lengths (tokens)"
    )
    parser.add_argument(
        "--batch", type=batch_limits, default=[1, 8, 32, 64, 128, 256], help="batch sizes for the rows"
    )
    parser.add_argument(
        "--knee-factor", type=knee_factor, default=1.0, help="max-num-seqs = factor × B_knee (1 to 2)"
    )
    parser.add_argument(
        "--tpot-target-ms", type=positive_float, help="cap the batch so TPOT stays under this"
    )
    parser.add_argument(
        "--output-tokens",
        type=non_negative_float,
        default=0.0,
        help="mean output tokens per request: with --prefix-sharing, the prompt is the context less half "
        "of it (default 0: the context is all prompt)",
    )
    parser.add_argument(
        "--goal",
        choices=("knee", "slo"),
        default="knee",
        help="knee: the knee, capped by the TPOT target; slo: the largest batch whose TPOT p99 meets "
        "the target less --slo-margin-percent (needs --tpot-target-ms)",
    )
    parser.add_argument(
        "--slo-margin-percent",
        type=slo_margin_percent,
        default=10.0,
        help="headroom under the target (goal slo)",
    )
    parser.add_argument(
        "--prompt-fraction",
        type=fraction,
        default=0.5,
        help="share of the mean context that is prompt (the rest is half the output): the prefill "
        "chunks it brings set the TPOT p99; 0 models decode steps only",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=step_tokens,
        default=None,
        help=f"the engine's token budget per step (default {VLLM_STEP_TOKENS}, 8192 on a GPU of 70 GiB or "
        f"more but an A100; sglang: "
        f"{sglang.DEFAULT_CHUNKED_PREFILL_SIZE}; trtllm: {trtllm.DEFAULT_MAX_NUM_TOKENS})",
    )
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--plot", metavar="FILE.png", help="write TPOT and throughput against batch")
    parser.set_defaults(handler=run)


MAX_KNEE_FACTOR = 2.0  # spec.tuning.kneeFactorPercent's bounds, 100–200 %
_at_most_two = at_most(positive_float, MAX_KNEE_FACTOR, f"{MAX_KNEE_FACTOR:g} (kneeFactorPercent 200)")


def knee_factor(text: str) -> float:
    value = _at_most_two(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be at least 1 (kneeFactorPercent 100): under the knee the weights' read is "
            "not yet shared by enough sequences"
        )
    return value


def run(args: argparse.Namespace) -> int:
    if args.plot:
        require_extra("plot", "--plot")
        check_output_path("--plot", Path(args.plot))
    roofline = resolve_roofline(args)
    gpu_memory_utilization = engine_memory_utilization(args.engine, roofline)
    pool = roofline.kv_pool_bytes(gpu_memory_utilization)
    if pool <= 0:
        raise UsageError(
            f"--tp/--gpu: {no_kv_memory(roofline, gpu_memory_utilization)}; raise --tp or pick a larger GPU"
        )
    tpot_target_s = args.tpot_target_ms / 1e3 if args.tpot_target_ms else None
    if args.goal == "slo":
        if tpot_target_s is None:
            raise UsageError("--goal slo: needs --tpot-target-ms")
        tpot_target_s *= 1.0 - args.slo_margin_percent / 100.0
    if args.output_tokens and not args.prefix_sharing:
        raise UsageError(
            "--output-tokens: used only with --prefix-sharing (to find the prompt it shares); add it or drop this"
        )
    if args.prefix_sharing and args.output_tokens >= 2 * max(args.context):
        raise UsageError(
            f"--output-tokens: {args.output_tokens:g} leaves no prompt at any context (the prompt is the "
            f"context less half the output), so nothing to share; give less than {2 * max(args.context):,}"
        )
    step_budget = args.max_num_batched_tokens or engine_step_tokens(args.engine, roofline)
    plans = build_plan(
        roofline,
        args.context,
        args.batch,
        knee_factor=args.knee_factor,
        tpot_target_s=tpot_target_s,
        prefix_sharing_of_prompt=args.prefix_sharing or None,
        output_tokens=args.output_tokens,
        prompt_fraction=args.prompt_fraction,
        max_num_batched_tokens=step_budget,
        gpu_memory_utilization=gpu_memory_utilization,
        goal="SLO" if args.goal == "slo" else "Knee",
    )
    verdicts = [
        why_unrunnable(roofline, plan, pool, tpot_target_s, args.prompt_fraction, step_budget, args.goal)
        for plan in plans
    ]
    refusals = [verdict for verdict in verdicts if verdict is not None]
    if len(refusals) == len(plans):  # nothing to show: the first context's fix, as one line
        raise UsageError(refusals[0].error)
    plans = [
        plan if verdict is None else replace(plan, cannot_run=verdict.reason)
        for plan, verdict in zip(plans, verdicts, strict=True)
    ]
    runnable = [plan for plan in plans if plan.cannot_run is None]
    if refusals:  # exit 0 with rows that fit; a script reading only the status still hears of the rest
        unrunnable = ", ".join(f"{plan.context_tokens:,}" for plan in plans if plan.cannot_run is not None)
        print(
            f"batchknee plan: no batch limit runs context {unrunnable} (marked cannot run)", file=sys.stderr
        )
    if args.output == "json":
        print(json.dumps([plan.to_json() for plan in plans], indent=2))
    else:
        print(render_table(roofline, plans, knob_flag(args)))
        if args.engine == "sglang":
            pool_tokens = int(
                roofline.kv_pool_bytes(sglang.DEFAULT_MEM_FRACTION_STATIC) / roofline.kv_bytes_per_token
            )
            # SGLang sized for a context it cannot run would not start: its pick for the longest it can
            longest = max(plan.context_tokens for plan in runnable)
            unset = sglang.default_max_running_requests(pool_tokens, longest)
            print(
                f"\nSGLang's own pick without --max-running-requests: {unset} (KV pool {pool_tokens:,} tokens at "
                f"--mem-fraction-static {sglang.DEFAULT_MEM_FRACTION_STATIC}, context length {longest:,})"
            )
    if args.plot:
        from batchknee.plots import plot_plan

        plot_plan(runnable, describe(roofline), Path(args.plot))
    return 0


@dataclass(frozen=True)
class Unrunnable:
    """Why no batch limit runs one context: `reason` marks it in the table and the JSON; `error`
    is the one line that refuses the plan when no context runs, naming the option to change."""

    reason: str
    error: str


def why_unrunnable(
    roofline: DecodeRoofline,
    plan: ContextPlan,
    pool: float,
    tpot_target_s: float | None,
    prompt_fraction: float,
    step_budget: int,
    goal: str,
) -> Unrunnable | None:
    """One sequence's KV over the pool, or a TPOT target that one sequence alone misses (the
    recommendation would be the minimum bound, 1, a wrong figure); None when a batch limit runs it."""
    ctx = plan.context_tokens
    if plan.recommendation.capacity_batch < 1:
        need = f"{plan.kv_bytes_per_seq / 1e9:,.1f} GB of KV cache, more than the {pool / 1e9:.1f} GB KV pool per GPU"
        return Unrunnable(
            reason=f"one sequence needs {need}",
            error=f"--context: one sequence of {ctx:,} tokens needs {need}; lower --context, or raise --tp",
        )
    if tpot_target_s is not None and plan.recommendation.slo_batch == 0:
        if prompt_fraction > 0:  # the SLO batch keeps the p99 with the prefill chunks under the target
            mix = PrefillMix.for_context(ctx, prompt_fraction, step_budget)
            alone, what = roofline.tpot_with_prefill_s(1, ctx, mix, 0.99), "TPOT p99"
        else:
            alone, what = roofline.tpot_s(1, ctx), "TPOT"
        target = "the target" if goal == "knee" else "the target less --slo-margin-percent"
        target_ms = f"{tpot_target_s * 1e3:g} ms"
        return Unrunnable(
            reason=f"one sequence alone has a {what} of {alone * 1e3:.1f} ms, over {target} ({target_ms})",
            error=f"--tpot-target-ms: {target} ({target_ms}) cannot be met at any batch: one sequence alone "
            f"has a {what} of {alone * 1e3:.1f} ms at context {ctx:,}; raise the target",
        )
    return None


ABOVE_KV_POOL = "> KV pool"


def _change(current: float, previous: float | None) -> str:
    return "" if previous is None else f"{(current / previous - 1) * 100:+.0f}%"


def render_table(roofline: DecodeRoofline, plans: list[ContextPlan], knob: str = "--max-num-seqs") -> str:
    lines = [
        describe(roofline),
        f"model bytes {roofline.model_bytes / 1e9:.2f} GB, KV bytes per token {roofline.kv_bytes_per_token:,.0f}",
    ]
    for plan in plans:
        rec = plan.recommendation
        context = (
            f"context {plan.context_tokens:,} tokens: KV per sequence {plan.kv_bytes_per_seq / 1e6:,.1f} MB"
        )
        if plan.cannot_run is not None:
            lines += ["", context, f"  cannot run: {plan.cannot_run}"]
            continue
        lines += [
            "",
            f"{context}, B_knee {rec.b_knee:.1f}",
            f"  recommended {knob} {rec.max_num_seqs}   KV at that batch {rec.max_tokens:,} tokens"
            f"   ({rec.explain()})",
            f"  {'batch':>6} {'TPOT ms':>9} {'ΔTPOT':>7} {'tok/s':>9} {'Δtok/s':>7} {'p99 ms':>7}",
        ]
        over_pool = any(row.batch > rec.capacity_batch for row in plan.rows)
        for previous, row in zip((None, *plan.rows), plan.rows, strict=False):
            tpot_change = _change(row.tpot_s, previous.tpot_s if previous else None)
            tokens_change = _change(row.tokens_per_s, previous.tokens_per_s if previous else None)
            lines.append(
                f"  {row.batch:>6} {row.tpot_s * 1e3:>9.1f} {tpot_change:>7} {row.tokens_per_s:>9,.0f} {tokens_change:>7}"
                + ("" if row.tpot_p99_s is None else f" {row.tpot_p99_s * 1e3:>7.1f}")
                + (f"  {ABOVE_KV_POOL}" if row.batch > rec.capacity_batch else "")
            )
        lines.append("  (TPOT: decode steps only; p99: with the prefill chunks interleaved, per request)")
        if over_pool:
            # the figures of those rows assume the sequences fit; the engine would preempt instead
            lines.append(
                f"  ({ABOVE_KV_POOL}: the KV pool holds {rec.capacity_batch:,} sequences; the engine preempts)"
            )
    return "\n".join(lines)
