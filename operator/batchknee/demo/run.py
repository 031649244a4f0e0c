"""Driving the scenario through the world and recording what the operator did."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from batchknee.adapters.engine_runtime import HttpEngineRuntime
from batchknee.core.engine_args import int_flag
from batchknee.demo import compare
from batchknee.demo.client import DEFAULT_CONCURRENCY, ExternalClient, latencies
from batchknee.demo.scenario import Scenario
from batchknee.demo.timeline import Sample, plot, write_json
from batchknee.demo.world import NAMESPACE, DemoWorld
from batchknee.engines import sglang, vllm

REVISION = "deployment.kubernetes.io/revision"
FAILED = ("batchknee_emulator_dropped_requests_total", "batchknee_emulator_requests_rejected_total")


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
        holdReason=status.get("holdReason"),
    )


CONVERGING = ("rollout-in-progress", "settling", "unsteady", "cooldown")


def converged(current: Sample) -> bool:
    """Only an Auto LLMServing converges: it has once its loop holds for a reason other than being on
    its way (rolling, settling, waiting for a shift to hold or for the cooldown) — at the target, in the
    dead band, or held by a guard that waiting does not lift (single replica, quarantine, budget)."""
    return current.mode != "Auto" or (current.holdReason is not None and current.holdReason not in CONVERGING)


def actuation(world: DemoWorld, name: str) -> str:
    """How an Auto LLMServing applies a retune (Restart or Live); another mode by its name."""
    tuning = world.llmserving(name)["spec"].get("tuning", {})
    mode = str(tuning.get("mode", "Auto"))
    return str(tuning.get("actuation", "Restart")) if mode == "Auto" else mode


def knob(args: list[str]) -> int | None:
    """The batch limit the rendered args carry (vLLM's or SGLang's flag, in any spelling)."""
    for engine in (vllm, sglang):
        value = int_flag(args, engine.KNOB_FLAG, engine.COMMAND_LINE)
        if value is not None:
            return value
    return None


def enforced_cap(world: DemoWorld, name: str, live: bool, runtime: HttpEngineRuntime) -> int | None:
    """The cap every pod of the LLMServing enforces now, or None while they differ: for Restart the
    Deployment's flag once every pod runs it and is Ready (no old pod left); for Live the cap each
    Ready pod's runtime endpoint reports, once all of them answer the same."""
    deployment = world.deployment(name)
    if deployment is None:
        return None
    wanted = deployment["spec"].get("replicas", 1)
    if live:
        caps = set()
        ready = world.ready_endpoints(name)
        for _, url in ready:
            try:
                found = runtime.read_cap(url.removeprefix("http://"))
            except Exception:  # not answering this time: not enforced as far as anyone can see
                return None
            caps.add(found.cap if found is not None else None)
        return caps.pop() if len(ready) == wanted and len(caps) == 1 else None
    status = deployment.get("status") or {}
    rolled = (
        status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
        and status.get("replicas") == status.get("updatedReplicas") == status.get("readyReplicas") == wanted
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return knob(container.get("args") or []) if rolled else None


def probe(
    world: DemoWorld, name: str, phase: str, elapsed: float, live: bool, runtime: HttpEngineRuntime
) -> compare.Probe:
    pods = world.pods(name)
    restarts = sum(
        c.get("restartCount", 0) for p in pods for c in (p.get("status") or {}).get("containerStatuses") or []
    )
    return compare.Probe(
        time=round(elapsed, 1),
        phase=phase,
        llmserving=name,
        enforced=enforced_cap(world, name, live, runtime),
        pods=frozenset(p["metadata"]["uid"] for p in pods),
        container_restarts=restarts,
    )


def failed_so_far(world: DemoWorld, name: str) -> int | None:
    """Requests the LLMServing's emulators dropped or rejected, over every pod it ever had (None
    before Prometheus has them)."""
    total = 0.0
    for metric in FAILED:  # one query each: max_over_time drops the name, and two names would clash
        value = world.query(
            f'sum(max_over_time({metric}{{namespace="{NAMESPACE}",pod=~"{name}-[a-z0-9]+-[a-z0-9]+"}}[1h]))'
        )
        if value is None:
            return None
        total += value
    return round(total)


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


def client_file(world: DemoWorld, name: str) -> Path:
    """client.json for the first LLMServing (the one the e2e test reads), client-NAME.json else."""
    return world.out_dir / ("client.json" if name == world.names[0] else f"client-{name}.json")


def run_scenario(
    world: DemoWorld,
    scenario: Scenario,
    out: TextIO,
    *,
    on_phase_end: Callable[[str], None] | None = None,
) -> list[Sample]:
    """Play every phase, sampling each LLMServing, with an external client streaming through the
    Service (its Ready endpoints) of the first LLMServing and of every Live one; writes timeline.json,
    timeline.png, client.json (client-NAME.json for the others) and the Restart/Live comparison."""
    wait_ready(world)
    samples: list[Sample] = []
    probes: list[compare.Probe] = []
    rows: list[compare.Row] = []
    bounds: list[tuple[str, float, float]] = []
    modes = {name: actuation(world, name) for name in world.names}
    runtime = HttpEngineRuntime(timeout_s=2.0)
    clients: dict[str, ExternalClient] = {}
    for name in world.names:
        if name == world.names[0] or modes[name] == "Live":
            model = world.llmserving(name)["spec"]["model"]
            clients[name] = ExternalClient(
                functools.partial(world.client_endpoints, name),
                model=model.get("servedModelName") or model["name"],
                speedup=scenario.speedup,
                routing=world.routing,
            )
    print(
        f"external clients: {', '.join(clients)}, {DEFAULT_CONCURRENCY} streams each through the Service, "
        "round robin over "
        + (
            "its EndpointSlices' Ready endpoints"
            if world.routing == "EndpointSlice"
            else "its Ready pods (loopback pod addresses: the Service has no endpoints)"
        ),
        file=out,
        flush=True,
    )
    for client in clients.values():
        client.start()
    failed_before = {name: failed_so_far(world, name) or 0 for name in world.names}
    began = time.monotonic()
    try:
        for phase in scenario.phases:
            world.set_load(phase.load())
            for client in clients.values():
                client.set_phase(phase.name, phase.prompt_tokens)
            start = time.monotonic() - began
            print(
                f"\n== {phase.name}: prompt {phase.prompt_tokens}, output {phase.output_tokens} ±50 % tokens, "
                f"{phase.concurrency} requests in flight per pod, {phase.duration_s:.0f} s",
                file=out,
                flush=True,
            )
            end, latest = start + phase.duration_s, start + phase.duration_s + scenario.converge_grace_s
            while (elapsed := time.monotonic() - began) < latest:
                current_samples = []
                for name in world.names:
                    if name not in modes:  # added while the scenario runs (world.add)
                        modes[name] = actuation(world, name)
                    current = sample(world, name, phase.name, elapsed, scenario.speedup)
                    current_samples.append(current)
                    probes.append(probe(world, name, phase.name, elapsed, modes[name] == "Live", runtime))
                    print(current.line(), file=out, flush=True)
                samples.extend(current_samples)
                if elapsed >= end and all(map(converged, current_samples)):
                    break
                if elapsed >= end:
                    print(
                        f"   (phase extended: the loop is still converging, up to {latest:.0f} s)",
                        file=out,
                        flush=True,
                    )
                time.sleep(
                    max(0.0, min(scenario.sample_interval_s, (end if elapsed < end else latest) - elapsed))
                )
            bounds.append((phase.name, start, time.monotonic() - began))
            failed_now = {name: failed_so_far(world, name) for name in world.names}
            engine_failed = {
                name: None if now is None else now - failed_before.get(name, 0)
                for name, now in failed_now.items()
            }
            failed_before.update({name: now for name, now in failed_now.items() if now is not None})
            rows += compare.rows_for_phase(probes, phase.name, start, modes, engine_failed)
            snapshot = world.cluster.kubectl("get", "llms", "-n", NAMESPACE, "-o", "wide", check=False)
            print(f"\n$ kubectl get llms -o wide\n{snapshot.stdout.rstrip()}", file=out, flush=True)
            (world.out_dir / "llms.txt").write_text(snapshot.stdout)  # the last phase's, at the end
            if on_phase_end is not None:
                on_phase_end(phase.name)
    finally:
        for client in clients.values():
            client.stop()
        for name, client in clients.items():
            client.write_report(client_file(world, name))
    for name, client in clients.items():
        failed = sum(1 for r in client.records if r.error)
        drained = sum(1 for r in client.records if r.drained and not r.error)
        seen = latencies(client.records)
        print(
            f"\nexternal client ({name}, through {world.routing}): {len(client.records)} streamed requests, "
            f"{failed} errors, TTFT p50 {seen['ttftP50Ms']} ms, ITL p50 {seen['itlP50Ms']} ms (simulated; "
            f"{sum(1 for r in client.records if r.stalled)} read late by a stall of the client left out), "
            f"{drained} finished on a pod that left the endpoints meanwhile, "
            f"{len(client.endpoint_sets)} endpoint sets → {client_file(world, name)}",
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
    # the client's columns once its last requests are in (each counts in the phase it began in)
    rows = [
        dataclasses.replace(
            row,
            client_requests=sum(1 for r in clients[row.llmserving].records if r.phase == row.phase),
            client_errors=sum(1 for r in clients[row.llmserving].records if r.phase == row.phase and r.error),
        )
        if row.llmserving in clients
        else row
        for row in rows
    ]
    compare.write(rows, world.out_dir)
    print(
        "\nRestart and Live side by side (reaction: the phase start → the phase's cap enforced on every "
        f"pod, at the {scenario.sample_interval_s:g} s sample interval; failed (client): errors/requests "
        f"of the external client) → {world.out_dir / 'comparison.txt'}\n{compare.table(rows)}",
        file=out,
        flush=True,
    )
    write_json(samples, world.out_dir / "timeline.json")
    plot(samples, bounds, world.names[0], world.out_dir / "timeline.png")
    return samples


def default_examples() -> list[Path]:
    """The demo's LLMServings, shipped in the package (demo-timed: see the files' comments)."""
    manifests = Path(str(resources.files("batchknee.demo") / "manifests"))
    return [
        manifests / "llama-3-8b-a100.yaml",
        manifests / "llama-3-8b-a100-recommend.yaml",
        manifests / "llama-3-8b-a100-live.yaml",
    ]
