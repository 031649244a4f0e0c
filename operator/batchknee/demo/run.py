"""Driving the scenario through the world and recording what the operator did."""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from batchknee.demo.client import ExternalClient, latencies
from batchknee.demo.scenario import Scenario
from batchknee.demo.timeline import Sample, plot, write_json
from batchknee.demo.world import NAMESPACE, DemoWorld

REVISION = "deployment.kubernetes.io/revision"


def rollouts(world: DemoWorld, name: str) -> int:
    """Pod-template changes since creation: the Deployment controller's revision minus one."""
    deployment = world.deployment(name)
    if deployment is None:
        return 0
    revision = deployment["metadata"].get("annotations", {}).get(REVISION, "1")
    return max(0, int(revision) - 1)


def tokens_per_second(world: DemoWorld, name: str, speedup: float) -> float | None:
    """Output tokens per simulated second of all the LLMServing's pods, over the last 15 s."""
    value = world.query(
        f'sum(rate({{__name__=~"(vllm|sglang)[:_]generation_tokens_total",namespace="{NAMESPACE}",'
        f'pod=~"{name}-[a-z0-9]+-[a-z0-9]+"}}[15s]))'
    )
    return None if value is None else value / speedup


def sample(world: DemoWorld, name: str, phase: str, elapsed: float, speedup: float) -> Sample:
    obj = world.llmserving(name)
    status: dict[str, Any] = obj.get("status") or {}
    observed: dict[str, Any] = status.get("observed") or {}
    return Sample(
        time=round(elapsed, 1),
        phase=phase,
        llmserving=name,
        mode=obj["spec"].get("tuning", {}).get("mode", "Auto"),
        avgContextLength=observed.get("avgContextLength"),
        bKnee=status.get("bKnee"),
        appliedMaxNumSeqs=status.get("maxNumSeqs"),
        recommendedMaxNumSeqs=status.get("recommendedMaxNumSeqs"),
        tpotP99Ms=observed.get("tpotP99Milliseconds"),
        tokensPerSecond=tokens_per_second(world, name, speedup),
        running=observed.get("running"),
        rollouts=rollouts(world, name),
        reason=status.get("reason", ""),
    )


def wait_ready(world: DemoWorld, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    for name in world.names:
        while True:
            deployment = world.deployment(name)
            wanted = deployment["spec"].get("replicas", 1) if deployment else 0
            if deployment and deployment.get("status", {}).get("readyReplicas", 0) >= wanted > 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine Deployment {name} did not become ready in {timeout_s:.0f} s")
            time.sleep(1)


def run_scenario(
    world: DemoWorld,
    scenario: Scenario,
    out: TextIO,
    *,
    on_phase_end: Callable[[str], None] | None = None,
) -> list[Sample]:
    """Play every phase, sampling each LLMServing, with the external client streaming through the
    first LLMServing's Service (its Ready endpoints); writes timeline.json, timeline.png and client.json."""
    wait_ready(world)
    samples: list[Sample] = []
    bounds: list[tuple[str, float, float]] = []
    target = world.names[0]
    model = world.llmserving(target)["spec"]["model"]
    client = ExternalClient(
        lambda: world.client_endpoints(target),
        model=model.get("servedModelName") or model["name"],
        speedup=scenario.speedup,
        routing=world.routing,
    )
    print(
        f"external client: {client.concurrency} streams to {target}'s Service, round robin over "
        + (
            "its EndpointSlices' Ready endpoints"
            if world.routing == "EndpointSlice"
            else "its Ready pods (loopback pod addresses: the Service has no endpoints)"
        ),
        file=out,
        flush=True,
    )
    client.start()
    began = time.monotonic()
    try:
        for phase in scenario.phases:
            world.set_load(phase.load())
            client.set_phase(phase.name, phase.prompt_tokens)
            start = time.monotonic() - began
            print(
                f"\n== {phase.name}: prompt {phase.prompt_tokens}, output {phase.output_tokens} ±50 % tokens, "
                f"{phase.concurrency} requests in flight per pod, {phase.duration_s:.0f} s",
                file=out,
                flush=True,
            )
            while (elapsed := time.monotonic() - began) < start + phase.duration_s:
                for name in world.names:
                    current = sample(world, name, phase.name, elapsed, scenario.speedup)
                    samples.append(current)
                    print(current.line(), file=out, flush=True)
                time.sleep(max(0.0, min(scenario.sample_interval_s, start + phase.duration_s - elapsed)))
            bounds.append((phase.name, start, time.monotonic() - began))
            snapshot = world.cluster.kubectl("get", "llms", "-n", NAMESPACE, "-o", "wide", check=False)
            print(f"\n$ kubectl get llms -o wide\n{snapshot.stdout.rstrip()}", file=out, flush=True)
            if on_phase_end is not None:
                on_phase_end(phase.name)
    finally:
        client.stop()
        client.write_report(world.out_dir / "client.json")
    failed = sum(1 for r in client.records if r.error)
    drained = sum(1 for r in client.records if r.drained and not r.error)
    seen = latencies(client.records)
    print(
        f"\nexternal client ({target}, through {world.routing}): {len(client.records)} streamed requests, "
        f"{failed} errors, TTFT p50 {seen['ttftP50Ms']} ms, ITL p50 {seen['itlP50Ms']} ms (simulated), "
        f"{drained} finished on a pod that left the endpoints meanwhile, "
        f"{len(client.endpoint_sets)} endpoint sets → {world.out_dir / 'client.json'}",
        file=out,
        flush=True,
    )
    events = world.cluster.kubectl(
        "get", "events", "-n", NAMESPACE, "--field-selector", "reason=Retuned", "--sort-by", ".lastTimestamp",
        "-o", "custom-columns=OBJECT:.involvedObject.name,MESSAGE:.message", check=False,
    )  # fmt: skip
    print(
        f"\n$ kubectl get events --field-selector reason=Retuned\n{events.stdout.rstrip()}",
        file=out,
        flush=True,
    )
    write_json(samples, world.out_dir / "timeline.json")
    plot(samples, bounds, world.names[0], world.out_dir / "timeline.png")
    return samples


def default_examples() -> list[Path]:
    """The demo's LLMServings, shipped in the package (demo-timed: see the files' comments)."""
    manifests = Path(str(resources.files("batchknee.demo") / "manifests"))
    return [manifests / "llama-3-8b-a100.yaml", manifests / "llama-3-8b-a100-recommend.yaml"]
