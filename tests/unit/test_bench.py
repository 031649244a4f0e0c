"""`batchknee bench` on short traces: the comparison's structure and the figures that matter."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.core.policy import TuningRules
from batchknee.emulator.bench import (
    POLICIES,
    BenchSetup,
    arrivals,
    bench_trace,
    observe,
    phase_rate,
    refinement,
    request_lifetime_s,
    run_policy,
    search_statics,
    snapshot,
    standard_traces,
)

NAIVE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
REAL = DecodeRoofline(NAIVE.model, NAIVE.gpu, bandwidth_efficiency=0.8, overhead_s=0.002)
KNEE = TuningRules(tpot_p99_target_ms=30, max_max_num_seqs=1024, window_s=120, cooldown_s=120)
SLO = TuningRules(goal="SLO", tpot_p99_target_ms=30, max_max_num_seqs=1024, window_s=120, cooldown_s=120)
# a coarse pass dense where the short traces' best values are (the search refines around them)
SETUP = BenchSetup(REAL, NAIVE, KNEE, restart_s=60, candidates=(16, 24, 32, 64, 96, 192, 256))
NEAR_THE_FLAPPING_KNEE = (48, 56, 64, 72)  # ditto for tests of the flapping trace's other figures


@pytest.fixture(scope="module")
def shift() -> dict[str, object]:
    trace = standard_traces(900.0)["shift"]
    return {"trace": trace, "result": bench_trace(SETUP, trace, knee_rules=KNEE, slo_rules=SLO)}


def test_the_oracle_bounds_every_static_and_the_best_static_bounds_the_default(shift: dict) -> None:
    p = shift["result"].policies  # type: ignore[attr-defined]
    assert list(p) == list(POLICIES)
    assert p["oracle"].slo_goodput >= p["best-static"].slo_goodput >= p["vllm-default"].slo_goodput
    assert p["oracle"].ratio_to_oracle == 1.0
    assert p["best-static"].rollouts == p["oracle"].rollouts == p["vllm-default"].rollouts == 0


def test_the_p99_oracle_picks_per_phase_only_values_whose_tpot_p99_meets_the_target(shift: dict) -> None:
    result = shift["result"]  # type: ignore[attr-defined]
    p99_oracle, oracle = result.p99_oracle, result.policies["oracle"]
    assert p99_oracle is not None
    assert 0 < p99_oracle.slo_goodput <= oracle.slo_goodput
    # each phase's p99 meets the target, so the whole run's does (a mixture's tail is no heavier)
    assert p99_oracle.tpot_p99_ms <= result.trace.tpot_target_ms
    assert p99_oracle.ratio_to_p99_oracle == 1.0
    assert result.policies["slo"].ratio_to_p99_oracle >= result.policies["slo"].ratio_to_oracle


def test_the_margin_oracle_keeps_each_phase_within_goal_slos_own_bound(shift: dict) -> None:
    """Goal SLO aims under the target less its margin (30 ms less 10 %): the oracle held to that
    bound is what it could reach switching for free, and no more than the p99 oracle."""
    result = shift["result"]  # type: ignore[attr-defined]
    margin, p99 = result.margin_oracle, result.p99_oracle
    assert margin is not None and p99 is not None
    assert 0 < margin.slo_goodput <= p99.slo_goodput
    bound_ms = result.trace.tpot_target_ms * (1 - SLO.slo_margin_percent / 100)
    assert margin.tpot_p99_ms <= bound_ms
    # per phase a smaller value or the same; at 2,048 tokens the p99 oracle's pick (88) runs a p99
    # between 27 and 30 ms: within the target, over goal SLO's bound
    picks = [
        (int(a), int(b)) for a, b in zip(margin.values.split(" | "), p99.values.split(" | "), strict=True)
    ]
    assert all(m <= q for m, q in picks)
    assert picks[1][0] < picks[1][1]


def test_every_rollout_costs_its_downtime_in_gpu_seconds(shift: dict) -> None:
    p = shift["result"].policies  # type: ignore[attr-defined]
    assert p["knee"].rollouts >= 1  # the shift moves the knee from 240 to 64 to 16
    for name in ("knee", "slo"):
        assert p[name].restart_gpu_s == p[name].rollouts * SETUP.restart_s


def test_knee_beats_vllms_default_where_256_breaks_the_tpot_target() -> None:
    """At 2,048–2,300 tokens of context vLLM's 256 runs TPOT p99 past 60 ms: almost no request meets
    30 ms, while the knee (64) meets it."""
    trace = standard_traces(600.0)["flapping"]
    setup = replace(SETUP, candidates=NEAR_THE_FLAPPING_KNEE)
    result = bench_trace(setup, trace, knee_rules=KNEE, slo_rules=SLO)
    p = result.policies
    assert p["vllm-default"].tpot_p99_ms > 50
    assert p["knee"].slo_goodput > 10 * p["vllm-default"].slo_goodput
    assert p["oracle"].slo_goodput >= p["best-static"].slo_goodput >= p["knee"].slo_goodput * 0.9


def test_the_decision_loop_without_rollouts_is_the_static_run() -> None:
    """Scrapes and decisions do not disturb the engine: Pinned at 64 serves exactly what static 64 does."""
    trace = standard_traces(600.0)["flapping"]
    stream = arrivals(SETUP, trace)
    steady = run_policy(SETUP, trace, stream, "static", static=64)
    pinned = TuningRules(mode="Pinned", pinned_max_num_seqs=64, window_s=60)
    assert run_policy(SETUP, trace, stream, "pinned", rules=pinned).good(trace) == pytest.approx(
        steady.good(trace), rel=1e-9
    )
    assert steady.good(trace) > 0


def test_the_observation_reads_like_the_prometheus_adapters() -> None:
    """Windowed gauges and histogram quantiles from scrapes of a running engine."""
    from batchknee.emulator.engine import Engine
    from batchknee.emulator.workload import LoadSpec

    engine = Engine(
        SETUP.engine_config(64, False),
        load=LoadSpec(request_rate=20.0, prompt_tokens=1024, output_tokens=256),
    )
    scrapes = []
    for t in range(15, 601, 15):
        engine.run_until(float(t))
        scrapes.append(snapshot(engine))
    seen = observe(scrapes, SETUP.num_gpu_blocks * SETUP.block_size, 600.0, 300.0)
    assert seen.running.value == pytest.approx(64, abs=1)
    assert seen.avg_context_tokens.value == pytest.approx(1024 + 128, rel=0.1)
    assert seen.tpot_mean_s.value is not None and seen.tpot_p99_s.value is not None
    assert 0.01 < seen.tpot_mean_s.value <= seen.tpot_p99_s.value
    # the mean step time is the window's own steps (inter-token latency), as the adapter reads it
    base, last = [s for s in scrapes if s.time <= 300.0][-1], [s for s in scrapes if s.time <= 600.0][-1]
    steps = (last.itl[1] - base.itl[1]) / (last.itl[2] - base.itl[2])
    assert seen.tpot_mean_s.value == pytest.approx(steps, rel=1e-9)
    assert seen.prompt_tokens_mean.value == pytest.approx(1024)
    thin = observe(scrapes[:2], SETUP.num_gpu_blocks * SETUP.block_size, 30.0, 300.0)
    assert not thin.running.available and "samples" in thin.running.reason


def test_cli_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "bench",
        "--model", "llama-3-8b", "--gpu", "a100-80gb", "--overhead-ms", "2", "--bandwidth-efficiency", "0.8",
        "--trace", "flapping", "--duration", "300", "--candidates", "56,64,72", "--output", "json",
    )  # fmt: skip
    assert status == 0
    document = json.loads(out.strip().splitlines()[-1])
    policies = document["traces"]["flapping"]["policies"]
    assert set(policies) == set(POLICIES)
    for figures in policies.values():
        assert set(figures) == {
            "sloGoodputTokensPerSecond", "ratioToOracle", "tpotP99Ms", "ttftP99Ms", "rollouts", "restartGpuSeconds",
            "ratioToP99Oracle", "servedShare",
        }  # fmt: skip
        assert 0 < figures["servedShare"] <= 1
    assert policies["oracle"]["ratioToOracle"] == 1.0
    p99_oracle = document["traces"]["flapping"]["p99Oracle"]
    assert p99_oracle["ratioToP99Oracle"] == 1.0
    assert p99_oracle["sloGoodputTokensPerSecond"] <= policies["oracle"]["sloGoodputTokensPerSecond"]
    margin_oracle = document["traces"]["flapping"]["marginOracle"]
    assert margin_oracle["sloGoodputTokensPerSecond"] <= p99_oracle["sloGoodputTokensPerSecond"]
    assert document["wallSeconds"] > 0


def test_cli_rejects_an_unknown_trace(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bench", "--gpu", "a100-80gb", "--model", "llama-3-8b", "--trace", "nope")
    assert status == 2 and "unknown trace 'nope'" in err


def test_live_caps_change_the_limit_without_a_restart_below_the_ceiling() -> None:
    """Live actuation: a cap under the startup ceiling costs no downtime; one above it restarts."""
    trace = standard_traces(900.0)["shift"]
    stream = arrivals(SETUP, trace)
    live = replace(SETUP, live=True)
    ceiling = live.live_ceiling(KNEE, 64)
    run = run_policy(live, trace, stream, "knee", rules=KNEE)
    changes = [v for _, v in run.values]
    assert run.rollouts == len(changes) - 1 >= 2
    above = 0
    for value in changes[1:]:
        if value > ceiling:  # a restart raises the ceiling to the value
            above, ceiling = above + 1, live.live_ceiling(KNEE, value)
    assert run.restart_gpu_s == above * SETUP.restart_s
    restarted = run_policy(SETUP, trace, stream, "knee", rules=KNEE)
    assert run.restart_gpu_s < restarted.restart_gpu_s


CLI_ENGINE = ["--model", "llama-3-8b", "--gpu", "a100-80gb", "--overhead-ms", "2", "--bandwidth-efficiency", "0.8"]  # fmt: skip


def test_cli_refuses_a_duration_shorter_than_one_evaluation_window_before_simulating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(was: `--duration 1` printed a table of zeros and `-`: no request finished, no window was seen)"""

    def simulated(*_: object, **__: object) -> None:
        raise AssertionError("the traces ran before the duration was checked")

    monkeypatch.setattr("batchknee.commands.bench.bench_trace", simulated)
    status, out, err = run(capsys, "bench", *CLI_ENGINE, "--duration", "1")
    assert status == 2 and out == ""
    assert err.startswith("batchknee bench: error: --duration: 1 s is too short to compare the policies")
    assert "a full 300 s evaluation window (--window-seconds)" in err
    assert err.strip().endswith("give --duration 300 or more") and len(err.strip().splitlines()) == 1


def test_cli_minimum_duration_under_a_short_window_is_one_request_of_the_first_phase(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under a 30 s window the flapping trace's first request binds: 1,024 output tokens at
    vLLM's default limit, about 71 s; a duration that holds it shows figures, not zeros."""
    lifetime = request_lifetime_s(SETUP, standard_traces()["flapping"].phases[0])
    needed = math.ceil(lifetime)
    assert 30 < needed < 300
    argv = [
        "bench", *CLI_ENGINE, "--trace", "flapping", "--window-seconds", "30", "--candidates", "56,64,72",
        "--output", "json",
    ]  # fmt: skip
    status, _, err = run(capsys, *argv, "--duration", str(needed - 1))
    assert status == 2
    assert f"trace flapping's first phase lives about {lifetime:.0f} s at vLLM's default limit" in err
    assert f"give --duration {needed} or more" in err
    status, out, err = run(capsys, *argv, "--duration", str(needed))
    assert status == 0, err
    policies = json.loads(out.strip().splitlines()[-1])["traces"]["flapping"]["policies"]
    for name, figures in policies.items():
        assert figures["sloGoodputTokensPerSecond"] > 0 and figures["tpotP99Ms"] is not None, name


def test_make_benchs_durations_hold_every_trace() -> None:
    """`make bench`: an hour per trace, production's 5-minute window."""
    from batchknee.commands.bench import check_duration

    check_duration(3600.0, 300, SETUP, standard_traces(3600.0))  # no UsageError


class _Captured(Exception):
    """Raised by a stand-in for bench_trace once it has seen what the command built."""


@pytest.mark.parametrize(("gpu", "limits"), [("a100-80gb", (256, 2048)), ("h100-sxm", (1024, 8192))])
def test_cli_takes_vllms_default_limits_for_the_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, gpu: str, limits: tuple[int, int]
) -> None:
    """(was: vllm-default ran 256 with 2,048 batched tokens whatever --gpu said; vLLM starts 1,024
    and 8,192 on a GPU of 70 GiB or more that is not an A100) — the emulator's own rule for both."""
    from batchknee.emulator.engine_args import parse_emulator_args

    seen: dict[str, object] = {}

    def captured(setup: BenchSetup, trace: object, *, knee_rules: TuningRules, **_: object) -> None:
        seen.update(setup=setup, rules=knee_rules)
        raise _Captured

    monkeypatch.setattr("batchknee.commands.bench.bench_trace", captured)
    with pytest.raises(_Captured):
        run(capsys, "bench", "--model", "llama-3-8b", "--gpu", gpu, "--trace", "flapping")
    setup, rules = seen["setup"], seen["rules"]
    assert isinstance(setup, BenchSetup) and isinstance(rules, TuningRules)
    assert rules.max_num_batched_tokens == limits[1]  # the operator's step budget is the engine's
    assert (setup.vllm_default, setup.batched_tokens) == limits
    engine = parse_emulator_args(["--gpu", gpu, "llama-3-8b"], environ={}).config
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == limits


def test_vllm_default_runs_and_loads_each_phase_at_the_gpus_default_limit() -> None:
    """On an H100 the default policy is 1,024 and each phase's load is that limit's capacity."""
    h100 = DecodeRoofline(NAIVE.model, find_gpu("h100-sxm"), bandwidth_efficiency=0.8, overhead_s=0.002)
    setup = replace(
        SETUP,
        roofline=h100,
        operator_roofline=replace(h100, bandwidth_efficiency=1.0, overhead_s=0.0),
        candidates=NEAR_THE_FLAPPING_KNEE,
    )
    phase = standard_traces()["flapping"].phases[0]
    assert phase_rate(setup, phase) * request_lifetime_s(setup, phase) == pytest.approx(1024)
    trace = standard_traces(300.0)["flapping"]
    result = bench_trace(setup, trace, knee_rules=KNEE, slo_rules=SLO)
    assert result.policies["vllm-default"].values == "1024"
    assert (setup.vllm_default, setup.batched_tokens) == (1024, 8192)


def test_cli_json_has_null_where_a_ratio_has_no_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """(was: a 1 ms TPOT target leaves the oracle 0 tok/s, and every ratio to it printed as NaN,
    which is not JSON) — null in the printed object and in --json-file, and `-` in the table."""

    def strict(text: str) -> dict[str, Any]:
        def refuse(constant: str) -> None:
            raise ValueError(f"{constant} is not JSON")

        return json.loads(text, parse_constant=refuse)

    argv = [
        "bench", *CLI_ENGINE, "--trace", "flapping", "--duration", "300", "--tpot-target-ms", "1",
        "--candidates", "56,64,72",
    ]  # fmt: skip
    status, out, err = run(capsys, *argv, "--output", "json", "--json-file", str(tmp_path / "bench.json"))
    assert status == 0, err
    for document in (strict(out.strip().splitlines()[-1]), strict((tmp_path / "bench.json").read_text())):
        trace = document["traces"]["flapping"]
        assert trace["policies"]["oracle"]["sloGoodputTokensPerSecond"] == 0
        for figures in (*trace["policies"].values(), trace["p99Oracle"], trace["marginOracle"]):
            assert figures["ratioToOracle"] is None and figures["ratioToP99Oracle"] is None
    status, out, _ = run(capsys, *argv)
    assert status == 0 and "nan" not in out.lower()


def test_served_share_shows_the_load_a_limit_sheds_behind_its_better_p99s() -> None:
    """(was: the p99s counted only finished requests, so a limit that sheds load read as a latency
    win) — 16 on the flapping trace runs lower TPOT and TTFT p99s than vLLM's 256 because its
    gateway turns most arrivals away: it serves under half the share 256 does."""
    trace = standard_traces(600.0)["flapping"]
    stream = arrivals(SETUP, trace)
    small, default = (run_policy(SETUP, trace, stream, "static", static=v).figures() for v in (16, 256))
    assert small["tpotP99Ms"] < default["tpotP99Ms"] and small["ttftP99Ms"] < default["ttftP99Ms"]
    assert 0 < small["servedShare"] < default["servedShare"] / 2 and default["servedShare"] <= 1


def test_each_policy_reports_its_served_share_beside_its_p99s(shift: dict) -> None:
    """A restart loses the requests in flight and turns arrivals away while down: knee (three
    restarts) serves fewer than vLLM's default; the table prints the share and says the p99s are
    over the requests served."""
    from batchknee.cli import build_parser
    from batchknee.commands.bench import render_table

    result = shift["result"]  # type: ignore[attr-defined]
    p = result.policies
    assert all(0 < f.served_share <= 1 for f in p.values())
    assert p["knee"].rollouts >= 1 and p["knee"].served_share < p["vllm-default"].served_share
    args = build_parser().parse_args(["bench", *CLI_ENGINE])
    table = render_table("engine", args, [result], 1.0)
    header = next(line for line in table.splitlines() if "policy" in line).split()
    assert header[header.index("served") + 1 : header.index("served") + 3] == ["TPOT", "p99"]
    knee_row = next(line for line in table.splitlines() if line.strip().startswith("knee"))
    assert f"{p['knee'].served_share:.0%}" in knee_row.split()
    assert "the p99s over the requests served" in table


def test_the_hindsight_search_refines_between_coarse_candidates_to_the_policies_grid() -> None:
    """(was: best-static and the oracle took the best of a coarse grid — 96, 112, 128, 160, … —
    where goodput falls off a cliff between neighbours: on the prefix chat 152 beats 128 by 5 %
    and 168 collapses) — every value the policies can set between the coarse neighbours of each
    phase's best: multiples of 8, of 4 under 64 and of 2 under 32, as goal SLO rounds."""
    # two phases whose goodput rises with the limit up to a cliff just past 52 and 104
    cliffs = (52, 104)
    runs: list[int] = []

    def run(value: int) -> list[float]:
        runs.append(value)
        return [float(value) if value <= cliff else 0.0 for cliff in cliffs]

    def bests(found: dict[int, list[float]]) -> set[int]:
        return {max(found, key=lambda v, p=p: found[v][p]) for p in range(len(cliffs))}  # type: ignore[misc]

    coarse = (16, 32, 64, 128, 256)
    found = search_statics(coarse, 8, run, bests)
    assert bests(found) == {52, 104}
    assert sorted(runs) == sorted(found) and len(runs) == len(set(runs))  # each value run once
    # the coarse bests 32 and 64 refine 16–64 and 32–128 on the policies' grid, nothing else
    assert sorted(set(found) - set(coarse)) == [
        *range(18, 32, 2), *range(36, 64, 4), *range(72, 128, 8)
    ]  # fmt: skip
    # a wider gap is halved until the best's neighbours are at most 8 values away, then filled
    assert refinement(coarse, 256, 8) == [192]  # and nothing above the top candidate
    assert refinement((192, 256), 256, 8) == list(range(200, 256, 8))


def test_the_baselines_do_not_depend_on_the_values_the_goals_chose() -> None:
    """(was: the values knee and slo set joined the static candidates, so a goal that found a value
    between coarse candidates lifted the oracle it was measured against) — goals pinned at 60, the
    best of the flapping trace's 2,300-token phases, or at 200 leave every baseline as it is."""
    trace = standard_traces(300.0)["flapping"]
    setup = replace(SETUP, candidates=(48, 64, 96, 256))

    def baselines(pinned: int) -> dict[str, tuple[dict[str, Any], str]]:
        goals = TuningRules(mode="Pinned", pinned_max_num_seqs=pinned, window_s=60)
        slo = replace(goals, goal="SLO", tpot_p99_target_ms=30)
        result = bench_trace(setup, trace, knee_rules=goals, slo_rules=slo)
        assert result.policies["knee"].values == str(pinned)
        named = {**result.policies, "oracle-p99": result.p99_oracle, "oracle-margin": result.margin_oracle}
        return {
            name: (figures.to_json(), figures.values)
            for name, figures in named.items()
            if figures is not None and name not in ("knee", "slo")
        }

    at_the_best = baselines(60)
    assert "60" in at_the_best["oracle"][1].split(" | ")  # found by the search, not taken from the goals
    assert at_the_best == baselines(200)
