"""`batchknee bench`: batchknee's closed loop against static settings, in simulated time.

For each trace the same Poisson arrivals are replayed against vLLM's default limit, static values
(searched for the best in hindsight, and the best per phase: the oracle) and batchknee's goals Knee
and SLO, each driving the engine simulation through the real `decide()` with a restart per rollout.
`--output json` prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from batchknee.api.models import TuningSpec
from batchknee.argtypes import at_most, int_list, non_negative_float, positive_int
from batchknee.commands import UsageError, check_output_path, require_extra
from batchknee.commands._options import (
    MAX_SIMULATED_S,
    add_roofline_options,
    describe,
    resolve_roofline,
    simulated_seconds,
    step_tokens,
)
from batchknee.core.policy import TuningRules
from batchknee.emulator.bench import (
    POLICIES,
    BenchSetup,
    Trace,
    TraceResult,
    bench_trace,
    request_lifetime_s,
    standard_traces,
)
from batchknee.emulator.engine import no_kv_memory
from batchknee.engines import vllm

# What `make bench` checks (printed, not asserted: benchmarks print figures).
SLO_TO_ORACLE_TARGET = 0.95
ONE_HOUR_WALL_LIMIT_S = 60.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="batchknee's closed loop against vLLM's default, the best static value and the per-phase oracle",
        description=(
            "Replay Poisson traffic traces on the engine simulation under each policy — vLLM's default "
            "limits for the GPU (256 and 2,048 batched tokens; 1,024 and 8,192 on a GPU of 70 GiB or "
            "more that is not an A100), the best static value in hindsight, the best value per phase "
            "(oracle), and batchknee's goals Knee and SLO through the real decision loop with a restart per rollout — and compare "
            "their SLO goodput. --overhead-ms and --bandwidth-efficiency describe the simulated engine; "
            "the operator is given the catalog's roofline, as in a cluster."
        ),
    )
    add_roofline_options(parser)
    traces = tuple(standard_traces())
    parser.add_argument(
        "--trace", type=_trace_list, default=list(traces), help=f"traces to run, of {', '.join(traces)}"
    )
    parser.add_argument(
        "--duration",
        type=simulated_seconds,
        default=3600.0,
        help="simulated seconds per trace, at most a day",
    )
    parser.add_argument(
        "--tpot-target-ms", type=positive_int, default=30, help="TPOT p99 target (goodput, goal SLO)"
    )
    parser.add_argument("--ttft-target-ms", type=positive_int, default=10_000, help="TTFT target (goodput)")
    parser.add_argument(
        "--slo-margin-percent", type=int, default=10, help="goal SLO's headroom under the target"
    )
    parser.add_argument(
        "--restart-seconds",
        type=at_most(non_negative_float, MAX_SIMULATED_S, f"{MAX_SIMULATED_S:.0f} s (a day)"),
        default=120.0,
        help="a rollout's pod downtime",
    )
    parser.add_argument(
        "--actuation",
        choices=("restart", "live"),
        default="restart",
        help="how batchknee's changes reach the engine: a restart (--restart-seconds down, requests in "
        "flight lost), or live caps (spec.tuning.actuation: Live; a restart only above the startup ceiling)",
    )
    parser.add_argument("--knee-factor-percent", type=int, default=100)
    parser.add_argument("--dead-band-percent", type=int, default=10)
    parser.add_argument("--cooldown-seconds", type=int, default=600)
    parser.add_argument("--max-rollouts-per-hour", type=int, default=4)
    parser.add_argument("--window-seconds", type=int, default=300)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=step_tokens,
        help="the engine's step budget (default: vLLM's for the GPU)",
    )
    parser.add_argument(
        "--candidates",
        type=int_list,
        help="the coarse pass of static values for best-static and the oracles, vLLM's default always "
        "among them (default: every multiple of 8 to 96, then 112 … 512); the search then tries the "
        "values batchknee can set between each best and its neighbours",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument("--plot", metavar="FILE.png", help="write goodput per policy and trace")
    parser.add_argument("--json-file", type=Path, metavar="FILE", help="also write the JSON document here")
    parser.add_argument(
        "--targets", action="store_true", help="also print whether the figures meet the issue's targets"
    )
    parser.set_defaults(handler=run)


def _trace_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = standard_traces()
    if not names:
        raise argparse.ArgumentTypeError(f"give one or more traces, comma-separated, of {', '.join(known)}")
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown trace {name!r} (known: {', '.join(known)})")
    return names


# The fields TuningRules' errors name, as this command's options
_RULE_OPTIONS = {
    "kneeFactorPercent": "--knee-factor-percent",
    "tpotP99TargetMilliseconds": "--tpot-target-ms",
    "ttftP99TargetMilliseconds": "--ttft-target-ms",
    "sloMarginPercent": "--slo-margin-percent",
    "deadBandPercent": "--dead-band-percent",
    "cooldownSeconds": "--cooldown-seconds",
    "windowSeconds": "--window-seconds",
    "maxRolloutsPerHour": "--max-rollouts-per-hour",
}


def _check_against_the_api(args: argparse.Namespace, goal: str) -> None:
    """The tuning options within the bounds an LLMServing's spec.tuning takes (a window of 0 s or a
    cooldown of 10^25 s describes no operator a user could run)."""
    asked = {
        "goal": goal,
        "kneeFactorPercent": args.knee_factor_percent,
        "tpotP99TargetMilliseconds": args.tpot_target_ms,
        "ttftP99TargetMilliseconds": args.ttft_target_ms,
        "sloMarginPercent": args.slo_margin_percent,
        "deadBandPercent": args.dead_band_percent,
        "cooldownSeconds": args.cooldown_seconds,
        "maxRolloutsPerHour": args.max_rollouts_per_hour,
        "windowSeconds": args.window_seconds,
    }
    try:
        TuningSpec.model_validate(asked)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        bounds = {
            type(limit).__name__: getattr(limit, type(limit).__name__.lower())
            for info in TuningSpec.model_fields.values()
            if info.alias == field
            for limit in info.metadata
            if type(limit).__name__ in ("Ge", "Le")
        }
        said = (
            f"must be within {bounds['Ge']:,}–{bounds['Le']:,}" if len(bounds) == 2 else first["msg"].lower()
        )
        raise UsageError(f"{_RULE_OPTIONS.get(field, field)}: {said}, as spec.tuning.{field} takes") from None


def _rules(args: argparse.Namespace, goal: str, batched_tokens: int) -> TuningRules:
    _check_against_the_api(args, goal)
    try:
        return TuningRules(
            goal=goal,  # type: ignore[arg-type]
            knee_factor_percent=args.knee_factor_percent,
            tpot_p99_target_ms=args.tpot_target_ms,
            ttft_p99_target_ms=args.ttft_target_ms,
            slo_margin_percent=args.slo_margin_percent,
            min_max_num_seqs=8,
            max_max_num_seqs=1024,
            dead_band_percent=args.dead_band_percent,
            cooldown_s=args.cooldown_seconds,
            max_rollouts_per_hour=args.max_rollouts_per_hour,
            window_s=args.window_seconds,
            max_num_batched_tokens=batched_tokens,
        )
    except ValueError as error:
        message = str(error)
        for field, option in _RULE_OPTIONS.items():
            message = message.replace(field, option)
        raise UsageError(message) from None


def run(args: argparse.Namespace) -> int:
    if args.plot:
        require_extra("plot", "--plot")  # before an hour of simulation, not after
        check_output_path("--plot", Path(args.plot))
    if args.json_file:
        check_output_path("--json-file", args.json_file)
    engine_roofline = resolve_roofline(args)
    operator_roofline = replace(engine_roofline, bandwidth_efficiency=1.0, overhead_s=0.0)
    batched_tokens = args.max_num_batched_tokens or vllm.default_limits(engine_roofline.gpu)[1]
    knee_rules, slo_rules = _rules(args, "Knee", batched_tokens), _rules(args, "SLO", batched_tokens)
    setup = BenchSetup(
        engine_roofline,
        operator_roofline,
        knee_rules,
        restart_s=args.restart_seconds,
        max_num_batched_tokens=batched_tokens,
        seed=args.seed,
        live=args.actuation == "live",
    )
    if args.candidates:
        setup = replace(setup, candidates=tuple(sorted(set(args.candidates))))
    pool_tokens = setup.num_gpu_blocks * setup.block_size
    if pool_tokens < setup.max_model_len:
        what = (
            no_kv_memory(engine_roofline, setup.gpu_memory_utilization)
            if pool_tokens == 0
            else f"the KV pool holds {pool_tokens:,} tokens, less than one {setup.max_model_len:,}-token sequence"
        )
        raise UsageError(f"--tp/--gpu: {what}; raise --tp or pick a larger GPU")
    traces = standard_traces(args.duration)
    check_duration(args.duration, knee_rules.window_s, setup, {name: traces[name] for name in args.trace})
    started = time.perf_counter()
    results: list[TraceResult] = []
    for name in args.trace:
        trace = traces[name]
        trace = replace(trace, tpot_target_ms=args.tpot_target_ms, ttft_target_ms=args.ttft_target_ms)
        results.append(
            bench_trace(setup, trace, knee_rules=knee_rules, slo_rules=slo_rules, clock=time.perf_counter)
        )
    wall = time.perf_counter() - started
    if args.output == "table":
        print(render_table(describe(engine_roofline), args, results, wall))
    if args.targets or args.output == "table":
        print(render_targets(results, args.duration))
    if args.plot:
        from batchknee.emulator.plot import plot_bench

        plot_bench(results, Path(args.plot))
    document = {"traces": {r.trace.name: r.to_json() for r in results}, "wallSeconds": round(wall, 2)}
    if args.json_file:
        args.json_file.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    if args.output == "json":
        print(json.dumps(document, allow_nan=False))
    return 0


def check_duration(duration_s: float, window_s: int, setup: BenchSetup, traces: dict[str, Trace]) -> None:
    """Refuse traces too short to compare anything (a table of zeros and `-`): batchknee's goals
    decide on a full evaluation window, and that window's figures are those of finished requests,
    so each trace must hold one window and one request of its first phase's whole life."""
    lifetimes = {name: request_lifetime_s(setup, trace.phases[0]) for name, trace in traces.items()}
    slowest = max(lifetimes, key=lambda name: lifetimes[name])
    minimum_s = max(float(window_s), lifetimes[slowest])
    if duration_s < minimum_s:
        raise UsageError(
            f"--duration: {duration_s:g} s is too short to compare the policies: batchknee's goals decide on "
            f"a full {window_s} s evaluation window (--window-seconds), and a request of trace {slowest}'s "
            f"first phase lives about {lifetimes[slowest]:.0f} s at vLLM's default limit; give --duration "
            f"{math.ceil(minimum_s)} or more"
        )


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def render_table(title: str, args: argparse.Namespace, results: list[TraceResult], wall: float) -> str:
    lines = [
        f"engine: {title}, {args.overhead_ms:g} ms per step, {args.bandwidth_efficiency:g} of peak bandwidth",
        f"targets: TPOT ≤ {args.tpot_target_ms} ms and TTFT ≤ {args.ttft_target_ms:,} ms per request; "
        f"batchknee's actuation {args.actuation} (a restart is {args.restart_seconds:g} s down"
        + (", only above the startup ceiling" if args.actuation == "live" else "")
        + f"); {args.duration:g} simulated s per trace",
    ]
    for result in results:
        trace = result.trace
        lines += [
            "",
            f"trace {trace.name}: "
            + " → ".join(p.name for p in trace.phases[:6])
            + (" …" if len(trace.phases) > 6 else ""),
            f"  {'policy':<13} {'goodput tok/s':>13} {'÷oracle':>7} {'÷p99 or':>7} {'served':>6} "
            f"{'TPOT p99':>9} {'TTFT p99':>9} {'rollouts':>8} {'restart GPU·s':>13} {'wall s':>6}  max-num-seqs",
        ]
        rows = [(name, result.policies[name]) for name in POLICIES]
        oracles = [("oracle-p99", result.p99_oracle), ("oracle-margin", result.margin_oracle)]
        after = POLICIES.index("oracle") + 1
        rows[after:after] = [(name, f) for name, f in oracles if f is not None]
        for name, f in rows:
            lines.append(
                f"  {name:<13} {f.slo_goodput:>13,.0f} {_ratio(f.ratio_to_oracle):>7} "
                f"{_ratio(f.ratio_to_p99_oracle):>7} {_share(f.served_share):>6} {_ms(f.tpot_p99_ms):>9} "
                f"{_ms(f.ttft_p99_ms):>9} {f.rollouts:>8} {f.restart_gpu_s:>13,.0f} {f.wall_s:>6.1f}  {f.values}"
            )
    lines.append(
        "(latencies in ms, the p99s over the requests served; served: the share of arrivals that "
        "finished — the rest were shed by the gateway's queue, lost to a restart, turned away while "
        "down or still running at the end; oracle: best static value per phase, switched for free; "
        "oracle-p99: the same among values whose TPOT p99 in the phase meets the target, - where none does; "
        f"oracle-margin: the same under goal SLO's bound, the target less its {args.slo_margin_percent} % "
        f"margin; wall {wall:.0f} s)"
    )
    return "\n".join(lines)


def render_targets(results: list[TraceResult], duration_s: float) -> str:
    """The issue's targets, each MET or MISSED with its figure."""
    lines = ["", "targets:"]

    def line(ok: bool, text: str) -> None:
        lines.append(f"  {'MET   ' if ok else 'MISSED'} {text}")

    for r in results:
        p = r.policies
        name = r.trace.name
        # what goal SLO could reach at all: each phase's best value within its own bound, for free
        ceiling = f"; oracle-margin {_ratio(r.margin_oracle.ratio_to_oracle)}" if r.margin_oracle else ""
        line(
            p["slo"].ratio_to_oracle >= SLO_TO_ORACLE_TARGET,
            f"{name}: slo ≥ {SLO_TO_ORACLE_TARGET} × oracle ({_ratio(p['slo'].ratio_to_oracle)}{ceiling})",
        )
        line(
            p["knee"].slo_goodput >= p["vllm-default"].slo_goodput,
            f"{name}: knee ≥ vllm-default ({p['knee'].slo_goodput:,.0f} vs {p['vllm-default'].slo_goodput:,.0f} tok/s)",
        )
        if name == "flapping":
            rolls = p["knee"].rollouts + p["slo"].rollouts
            line(rolls == 0, f"{name}: zero rollouts (knee {p['knee'].rollouts}, slo {p['slo'].rollouts})")
        slowest = max(f.wall_s for f in p.values()) * 3600.0 / duration_s
        line(
            slowest < ONE_HOUR_WALL_LIMIT_S,
            f"{name}: each policy's hour under a minute (slowest {slowest:.1f} s per hour)",
        )
    return "\n".join(lines)
