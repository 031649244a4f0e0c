"""The SGLang closed loop end to end: the fast scenario with 60 % of every prompt shared; and, in
the same world, a vLLM LLMServing with goal SLO that must climb past the knee and hold its target.

The same world as the vLLM loop (real apiserver, controller-manager and Prometheus, the test kubelet
running the emulator), with one SGLang LLMServing: its pods run `python -m sglang.launch_server
--max-running-requests N …`, and the emulator holds the shared prefix once in the pool as SGLang's
radix cache does. The operator must read the unique context from the pool and roll
`--max-running-requests` to the planner's recommendation for it.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model, recommend
from batchknee.demo.run import run_scenario
from batchknee.demo.scenario import FAST_SHARED
from batchknee.demo.timeline import Sample
from batchknee.demo.world import DemoWorld

pytestmark = pytest.mark.e2e

NAME = "llama-3-8b-sglang"
ROOFLINE = DecodeRoofline(find_model("meta-llama/Llama-3.1-8B-Instruct"), find_gpu("a100-80gb"))
DEAD_BAND = 0.10  # the manifest's default deadBandPercent
MANIFESTS = resources.files("batchknee.demo") / "manifests"
MANIFEST = Path(str(MANIFESTS / "llama-3-8b-a100-sglang.yaml"))
SLO_NAME = "llama-3-8b-slo"
SLO_MANIFEST = Path(str(MANIFESTS / "llama-3-8b-a100-slo.yaml"))
TPOT_TARGET_MS = 50.0  # the SLO manifest's tpotP99TargetMilliseconds


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Sample]]:
    out = tmp_path_factory.mktemp("sglang-out")
    log = io.StringIO()
    with DemoWorld(
        out, gpu="a100-80gb", speedup=FAST_SHARED.speedup, examples=[MANIFEST, SLO_MANIFEST]
    ) as world:
        try:
            found = run_scenario(world, FAST_SHARED, log)
        finally:
            sys.stdout.write(log.getvalue())  # the live timeline, for a failing run's report
        deployment = world.deployment(NAME)
        assert deployment is not None
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["python", "-m", "sglang.launch_server"]
        yield found


def unique_context(target: int) -> float:
    """The phase's context per running sequence with the shared prompt prefix held once (spread
    over the batch, so nearly nothing per sequence)."""
    phase = next(p for p in FAST_SHARED.phases if p.target_context == target)
    return target - phase.prefix_sharing * phase.prompt_tokens


@pytest.mark.parametrize("phase", ["ctx-512", "ctx-2048", "ctx-8192"])
def test_each_phase_retunes_to_the_planner_for_the_unique_context(samples: list[Sample], phase: str) -> None:
    last = [s for s in samples if s.llmserving == NAME and s.phase == phase][-1]
    target = int(phase.removeprefix("ctx-"))
    assert last.avgContextLength is not None and last.appliedMaxNumSeqs is not None, last
    unique = unique_context(target)
    print(
        f"{phase}: observed {last.avgContextLength} tokens (unique {unique:.0f}), applied {last.appliedMaxNumSeqs}"
    )
    # the shared prefix counts once: the operator sees the unique context, not the attended one
    assert last.avgContextLength == pytest.approx(unique, rel=0.15)
    assert last.avgContextLength < 0.85 * target
    assert abs(last.appliedMaxNumSeqs - recommend(ROOFLINE, last.avgContextLength).max_num_seqs) <= (
        DEAD_BAND * last.appliedMaxNumSeqs
    )
    # more room than the same traffic without sharing: the knee rose
    assert last.appliedMaxNumSeqs > recommend(ROOFLINE, target).max_num_seqs


def slo_phase_end(samples: list[Sample], phase: str) -> Sample:
    last = [s for s in samples if s.llmserving == SLO_NAME and s.phase == phase][-1]
    assert last.avgContextLength is not None and last.appliedMaxNumSeqs is not None, last
    print(
        f"{phase}: goal SLO applied {last.appliedMaxNumSeqs} (knee "
        f"{recommend(ROOFLINE, last.avgContextLength).max_num_seqs}) at ctx {last.avgContextLength}, "
        f"TPOT p99 {last.tpotP99Ms} ms — {last.reason}"
    )
    return last


# At 2,048 and 8,192 tokens the knee (88, 24) is below what the traffic keeps in flight (96, 48 per
# pod); at 512 it is above (about 320 against 256), so the limit does not bind and nothing is gained
# past it.
@pytest.mark.parametrize("phase", ["ctx-2048", "ctx-8192"])
def test_goal_slo_climbs_past_the_knee_where_the_limit_binds(samples: list[Sample], phase: str) -> None:
    last = slo_phase_end(samples, phase)
    assert last.avgContextLength is not None and last.appliedMaxNumSeqs is not None
    assert last.appliedMaxNumSeqs > recommend(ROOFLINE, last.avgContextLength).max_num_seqs, last


@pytest.mark.parametrize("phase", ["ctx-512", "ctx-2048", "ctx-8192"])
def test_goal_slo_holds_the_tpot_target(samples: list[Sample], phase: str) -> None:
    last = slo_phase_end(samples, phase)
    # the bucketed p99 reads at or under 50 ms exactly when 99 % of the tokens did (a bucket bound)
    assert last.tpotP99Ms is not None and last.tpotP99Ms <= TPOT_TARGET_MS, last
