"""`batchknee simulate`: the knee for a workload, measured on the engine simulation.

Runs the continuous-batching simulation once per `--sweep` value of max-num-seqs and reports the
output throughput, TPOT p50/p99, TTFT p99, goodput and preemptions of each, next to the roofline's
prediction. By default the load is a closed loop as large as the batch limit, so the limit binds;
`--request-rate` makes it open-loop Poisson. `--benchmark` instead times the simulator itself.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchknee.argtypes import fraction, non_negative_float, positive_float, positive_int
from batchknee.commands import UsageError, check_output_path, require_extra
from batchknee.commands._options import (
    VLLM_MEMORY_UTILIZATION,
    VLLM_STEP_TOKENS,
    add_engine_option,
    add_roofline_options,
    batch_limits,
    describe,
    engine_block_size,
    engine_memory_utilization,
    engine_step_tokens,
    resolve_roofline,
    simulated_seconds,
    slo_margin_percent,
    step_tokens,
)
from batchknee.core.recommend import recommend
from batchknee.core.roofline import DecodeRoofline, PrefillMix
from batchknee.emulator.engine import (
    Engine,
    EngineConfig,
    EngineConfigError,
    no_kv_memory,
    vllm_num_gpu_blocks,
)
from batchknee.emulator.engine_args import DEFAULT_MAX_MODEL_LEN, load_from_args
from batchknee.emulator.sweep import SweepResult, default_duration_s, request_lifetime_s, sweep
from batchknee.emulator.workload import DISTRIBUTIONS, MAX_REQUEST_RATE, LoadError, LoadSpec
from batchknee.engines import sglang, trtllm, vllm

BENCHMARK_RATE = 100.0
BENCHMARK_DURATION_S = 3600.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="measure throughput and TPOT against --max-num-seqs on the engine simulation",
        description=(
            "Simulate continuous batching at each --sweep value of max-num-seqs and show where "
            "throughput stops paying for TPOT: the knee, for your workload, before any cluster."
        ),
    )
    add_roofline_options(parser)
    add_engine_option(parser)
    parser.add_argument("--prompt-tokens", type=positive_int, default=512, help="mean prompt length")
    parser.add_argument("--output-tokens", type=positive_int, default=512, help="mean output length")
    parser.add_argument("--prompt-distribution", choices=DISTRIBUTIONS, default="fixed")
    parser.add_argument("--output-distribution", choices=DISTRIBUTIONS, default="fixed")
    parser.add_argument(
        "--prompt-spread", type=non_negative_float, default=0.5, help="uniform ±fraction or lognormal sigma"
    )
    parser.add_argument("--output-spread", type=non_negative_float, default=0.5)
    parser.add_argument(
        "--sweep", type=batch_limits, default=[16, 32, 64, 128, 256], help="max-num-seqs values to simulate"
    )
    parser.add_argument(
        "--request-rate",
        type=positive_float,
        help="open-loop Poisson arrivals per second (default: a closed loop of max-num-seqs requests)",
    )
    parser.add_argument(
        "--concurrency", type=positive_int, help="closed loop with this many requests in flight"
    )
    parser.add_argument("--tpot-target-ms", type=positive_float, help="goodput counts requests meeting it")
    parser.add_argument(
        "--goal",
        choices=("knee", "slo"),
        help="also simulate the planner's pick for this goal (as `plan --goal`): knee, or slo — the largest "
        "batch whose modelled TPOT p99 meets --tpot-target-ms less --slo-margin-percent",
    )
    parser.add_argument(
        "--slo-margin-percent",
        type=slo_margin_percent,
        default=10.0,
        help="headroom under the target (goal slo)",
    )
    parser.add_argument(
        "--duration",
        type=simulated_seconds,
        help="simulated seconds per point, at most a day (default: 10 request lifetimes)",
    )
    parser.add_argument(
        "--warmup", type=non_negative_float, help="simulated seconds not measured (default: 30%% of duration)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=step_tokens,
        default=None,
        help=f"default {VLLM_STEP_TOKENS}, 8192 on a GPU of 70 GiB or more but an A100 (sglang: --chunked-prefill-size {sglang.DEFAULT_CHUNKED_PREFILL_SIZE}; "
        f"trtllm: max_num_tokens {trtllm.DEFAULT_MAX_NUM_TOKENS})",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=positive_float,
        default=None,
        help=f"default {VLLM_MEMORY_UTILIZATION} (sglang: --mem-fraction-static {sglang.DEFAULT_MEM_FRACTION_STATIC}; "
        f"trtllm: free_gpu_memory_fraction {trtllm.DEFAULT_FREE_GPU_MEMORY_FRACTION} of what the weights leave)",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help=f"default {vllm.DEFAULT_BLOCK_SIZE} (sglang: --page-size {sglang.DEFAULT_PAGE_SIZE}; trtllm: "
        f"tokens_per_block {trtllm.DEFAULT_TOKENS_PER_BLOCK})",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        help=f"default: {DEFAULT_MAX_MODEL_LEN}, or prompt + output if longer",
    )
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="do not cache the shared prefix (--prefix-sharing)"
    )
    parser.add_argument("--step-noise", type=fraction, default=0.0, help="lognormal sigma of step-time noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="write throughput and TPOT p99 against max-num-seqs"
    )
    parser.add_argument(
        "--benchmark",
        action="store_true",
        help=f"time the simulator: {BENCHMARK_DURATION_S:.0f} s of {BENCHMARK_RATE:.0f} requests/s "
        "(or --request-rate/--duration) at the largest --sweep value",
    )
    parser.set_defaults(handler=run)


def _engine_defaults(args: argparse.Namespace, roofline: DecodeRoofline) -> None:
    """Fill the engine's own defaults in where the command line left them out."""
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = engine_step_tokens(args.engine, roofline)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = engine_memory_utilization(args.engine, roofline)
    if args.block_size is None:
        args.block_size = engine_block_size(args.engine)


def _engine_config(args: argparse.Namespace, roofline: DecodeRoofline, max_num_seqs: int) -> EngineConfig:
    _engine_defaults(args, roofline)
    if args.gpu_memory_utilization > 1.0:
        raise UsageError("--gpu-memory-utilization: must be in (0, 1]")
    max_model_len = args.max_model_len or max(DEFAULT_MAX_MODEL_LEN, args.prompt_tokens + args.output_tokens)
    if args.max_model_len is not None and args.max_model_len <= args.prompt_tokens:
        raise UsageError(
            f"--max-model-len: {args.max_model_len:,} is not longer than --prompt-tokens {args.prompt_tokens:,}: "
            "the engine would refuse every request; give a longer one"
        )
    pool = roofline.kv_pool_bytes(args.gpu_memory_utilization)
    if pool <= 0:
        if roofline.kv_pool_bytes(1.0) > 0:
            option, fix = "--gpu-memory-utilization", "raise it"
        else:
            option, fix = "--tp/--gpu", "raise --tp or pick a larger GPU"
        raise UsageError(f"{option}: {no_kv_memory(roofline, args.gpu_memory_utilization)}; {fix}")
    blocks = vllm_num_gpu_blocks(roofline, args.gpu_memory_utilization, args.block_size)
    if blocks <= 0:
        block_bytes = args.block_size * roofline.kv_bytes_per_token
        raise UsageError(
            f"--block-size: one block of {args.block_size:,} tokens ({block_bytes / 1e9:,.1f} GB) is larger than "
            f"the {pool / 1e9:.1f} GB KV pool"
        )
    try:
        return EngineConfig(
            roofline=roofline,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, max_num_seqs),
            num_gpu_blocks=blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=args.prefix_sharing > 0 and not args.no_prefix_caching,
            reserve_full_sequence=args.engine == "trtllm",  # GUARANTEED_NO_EVICT, its default
            step_noise=args.step_noise,
        )
    except EngineConfigError as error:
        # max_model_len is the user's, or the default, or the prompt and output they gave when longer
        derived = args.max_model_len is None and max_model_len > DEFAULT_MAX_MODEL_LEN
        option = "--prompt-tokens/--output-tokens" if derived else "--max-model-len"
        raise UsageError(f"{option}: {error}") from None


def _load(args: argparse.Namespace, rate: float | None) -> LoadSpec:
    if rate is not None and rate > MAX_REQUEST_RATE:
        raise UsageError(f"--request-rate: must be at most {MAX_REQUEST_RATE:g}")
    try:
        return load_from_args(args, rate)
    except LoadError as error:  # it names the field, e.g. `promptSpread: …`: name the option instead
        raise UsageError(error.for_command_line()) from None


def _planner_roofline(roofline: DecodeRoofline, load: LoadSpec) -> DecodeRoofline:
    """The planner's view of the same workload: its prefix sharing is a fraction of the mean
    context (the simulation's is a fraction of each prompt, a system prompt)."""
    shared = load.prefix_sharing * load.prompt_tokens
    return replace(roofline, prefix_sharing=min(0.99, shared / load.mean_context_tokens))


def run(args: argparse.Namespace) -> int:
    if args.plot:
        require_extra("plot", "--plot")
        check_output_path("--plot", Path(args.plot))
    roofline = resolve_roofline(args)
    if args.request_rate is not None and args.concurrency is not None:
        raise UsageError("--concurrency: give either --request-rate or --concurrency, not both")
    if args.benchmark:
        return benchmark(args, roofline)
    load = _load(args, args.request_rate)  # first: its own errors name the load's options
    config = _engine_config(args, roofline, max(args.sweep))
    duration = args.duration if args.duration is not None else default_duration_s(config, load, args.sweep)
    warmup = args.warmup if args.warmup is not None else 0.3 * duration
    if warmup >= duration:
        raise UsageError(f"--warmup: {warmup:g} s leaves nothing of --duration {duration:g} s to measure")
    tpot_target_s = args.tpot_target_ms / 1e3 if args.tpot_target_ms else None
    config = replace(config, roofline=_planner_roofline(roofline, load))
    batches = list(args.sweep)
    goal_pick: int | None = None
    if args.goal is not None:
        goal_pick = goal_max_num_seqs(args, config, load, tpot_target_s)
        batches = sorted({*batches, goal_pick})
    lifetime = request_lifetime_s(config, load, max(batches))
    if duration - warmup < lifetime:
        # nothing would finish in the measured window: the rows would show 0 tok/s and no latencies
        needed = math.ceil(warmup + lifetime if args.warmup is not None else lifetime / 0.7)
        raise UsageError(
            f"{'--duration' if args.duration is not None else '--warmup'}: {duration - warmup:.3g} s measured "
            f"after the warm-up is shorter than one request's decode ({lifetime:.1f} s at max-num-seqs "
            f"{max(batches)}); give --duration {needed} or more"
        )
    result = sweep(
        config,
        load,
        batches,
        duration_s=duration,
        warmup_s=warmup,
        seed=args.seed,
        tpot_target_s=tpot_target_s,
    )
    if args.output == "json":
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render_table(roofline, load, result, duration, warmup, tpot_target_s))
        if goal_pick is not None:
            print(f"goal {args.goal}: the planner picks max-num-seqs {goal_pick}")
    if args.plot:
        from batchknee.emulator.plot import plot_sweep

        plot_sweep(result, describe(roofline), Path(args.plot))
    return 0


def goal_max_num_seqs(
    args: argparse.Namespace, config: EngineConfig, load: LoadSpec, tpot_target_s: float | None
) -> int:
    """What `plan --goal` recommends for this workload: its prefill mix is the load's own."""
    if args.goal == "slo":
        if tpot_target_s is None:
            raise UsageError("--goal slo: needs --tpot-target-ms")
        tpot_target_s *= 1.0 - args.slo_margin_percent / 100.0
    mix = PrefillMix(
        load.prompt_tokens,
        load.output_tokens,
        config.max_num_batched_tokens,
        load.prefix_sharing if config.enable_prefix_caching else 0.0,
    )
    pool = config.num_gpu_blocks * config.block_size * config.roofline.kv_bytes_per_token
    return recommend(
        config.roofline,
        load.mean_context_tokens,
        tpot_target_s=tpot_target_s,
        kv_pool_bytes=pool,
        maximum=4096,
        prefill=mix,
        goal="SLO" if args.goal == "slo" else "Knee",
    ).max_num_seqs


def _fmt_ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1e3:.1f}"


def render_table(
    roofline: DecodeRoofline,
    load: LoadSpec,
    result: SweepResult,
    duration: float,
    warmup: float,
    tpot_target_s: float | None,
) -> str:
    arrivals = (
        f"Poisson {load.request_rate:g} requests/s"
        if load.request_rate
        else f"closed loop of {load.concurrency} requests"
        if load.concurrency
        else "closed loop of max-num-seqs requests"
    )
    lines = [
        describe(roofline),
        f"workload: prompt {load.prompt_tokens} ({load.prompt_distribution}), output {load.output_tokens} "
        f"({load.output_distribution}) tokens, mean context {result.context_tokens:.0f}; {arrivals}",
        f"simulated {duration:.0f} s per point, measured after {warmup:.0f} s of warm-up"
        + (f"; goodput at TPOT ≤ {tpot_target_s * 1e3:g} ms" if tpot_target_s else ""),
        f"B_knee {result.b_knee:.1f} at context {result.context_tokens:.0f}",
        "",
        f"{'max-num-seqs':>12} {'tok/s':>8} {'Δtok/s':>7} {'TPOT p50':>9} {'TPOT p99':>9} {'ΔTPOT':>6} "
        f"{'TTFT p99':>9} {'goodput':>8} {'preempt':>7} {'running':>7} {'roofline':>9}",
    ]
    previous = None
    for point in result.points:
        gain = (
            f"{(point.throughput_tokens_per_s / previous.throughput_tokens_per_s - 1) * 100:+.0f}%"
            if previous and previous.throughput_tokens_per_s
            else ""
        )
        tpot_change = (
            f"{(point.tpot_p99_s / previous.tpot_p99_s - 1) * 100:+.0f}%"
            if previous and previous.tpot_p99_s and not math.isnan(point.tpot_p99_s)
            else ""
        )
        lines.append(
            f"{point.max_num_seqs:>12} {point.throughput_tokens_per_s:>8,.0f} {gain:>7} "
            f"{_fmt_ms(point.tpot_p50_s):>9} {_fmt_ms(point.tpot_p99_s):>9} {tpot_change:>6} "
            f"{_fmt_ms(point.ttft_p99_s):>9} {point.goodput_tokens_per_s:>8,.0f} {point.preemptions:>7} "
            f"{point.mean_running:>7.1f} {point.roofline_throughput_tokens_per_s:>9,.0f}"
        )
        previous = point
    lines.append("(latencies in ms; roofline = B / TPOT(B) at the mean context, no prefill)")
    return "\n".join(lines)


def benchmark(args: argparse.Namespace, roofline: DecodeRoofline) -> int:
    """Simulated seconds per wall second: an hour of 100 requests/s by default."""
    ignored = [
        option
        for option, value in (
            ("--concurrency", args.concurrency),
            ("--warmup", args.warmup),
            ("--goal", args.goal),
            ("--plot", args.plot),
        )
        if value is not None
    ]
    if ignored:  # it would run, and report, something else than asked
        raise UsageError(
            f"{ignored[0]}: --benchmark times an open loop of --request-rate over --duration and takes no "
            f"{', '.join(ignored)}; drop {'it' if len(ignored) == 1 else 'them'}"
        )
    rate = args.request_rate or BENCHMARK_RATE
    duration = args.duration or BENCHMARK_DURATION_S
    config = _engine_config(args, roofline, max(args.sweep))
    load = _load(args, rate)
    engine = Engine(config, load=load, seed=args.seed)
    started = time.perf_counter()
    engine.run_until(duration)
    wall = time.perf_counter() - started
    stats = engine.stats
    figures = {
        "simulatedSeconds": duration,
        "wallSeconds": wall,
        "simulatedSecondsPerWallSecond": duration / wall,
        "requestRate": rate,
        "requests": stats.received,
        "finished": stats.finished,
        "rejected": stats.rejected,
        "steps": stats.steps,
        "generatedTokens": stats.generation_tokens,
        "maxNumSeqs": config.max_num_seqs,
        "meanRunning": stats.running_seconds / max(stats.busy_time_s, 1e-12),
    }
    if args.output == "json":
        print(json.dumps(figures, indent=2))
    else:
        print(
            f"{describe(roofline)}; max-num-seqs {config.max_num_seqs}\n"
            f"simulated {duration:.0f} s of {rate:g} requests/s (prompt {load.prompt_tokens}, output "
            f"{load.output_tokens}): {stats.received:,} requests, {stats.finished:,} finished, "
            f"{stats.rejected:,} rejected, {stats.steps:,} engine steps, {stats.generation_tokens:,} tokens\n"
            f"wall time {wall:.2f} s: {duration / wall:,.0f} simulated seconds per wall second"
        )
    return 0
