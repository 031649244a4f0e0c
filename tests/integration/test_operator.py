"""The operator on the local control plane, with a real Prometheus scraping vLLM-format test
exporters that the test kubelet runs as the "vllm" runtime (tests/support/vllm_exporter.py,
whose values each test sets through a JSON state file named in the LLMServing's own args).

tests/integration/conftest.py maps the "vllm" runtime to the exporter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchknee.devcluster import DevCluster, LocalPrometheus
from batchknee.devcluster.cluster import free_port
from batchknee.render import TEMPLATE_CHANGED_ANNOTATION, deployment_state

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "batchknee.io_llmservings.yaml"
PEERING_CRD = ROOT / "crds" / "kopf.dev_peerings.yaml"
BLOCKS, BLOCK_SIZE, RUNNING = 30000, 16, 32


def state_for(ctx: int, tpot_s: float = 0.02) -> dict[str, Any]:
    """Exporter state whose KV-usage method gives `ctx` tokens per running sequence."""
    return {
        "running": RUNNING,
        "waiting": 0,
        "numGpuBlocks": BLOCKS,
        "blockSize": BLOCK_SIZE,
        "kvUsage": ctx * RUNNING / (BLOCKS * BLOCK_SIZE),
        "tpotSeconds": tpot_s,
        "requestsPerSecond": 20.0,
    }


def retuned_for_8192(status: dict[str, Any]) -> int | None:
    """The value a retune for 8,192 tokens settled on, once the status shows it, else None.

    The knee there is 15.0 → 16. A roll decided while the 30 s window still blends in the 2,048-token
    traffic goes to the knee of the window's last third; when that third itself still blends (its
    average about 7,450–7,700 tokens: knee 16.0–16.5, rounded up to 24) it stays at 24: the 10 % dead
    band is measured on the unrounded knee (16.3 against 15.0), by design. Either way the
    recommendation for the settled window is 16, and a 24 came from a roll that saw less than 8,192
    tokens."""
    value, history = status.get("maxNumSeqs"), status.get("history") or []
    if status.get("recommendedMaxNumSeqs") != 16 or not history or history[-1].get("to") != value:
        return None
    if value == 16:
        return 16
    seen = re.search(r"avg ctx (\d+)", history[-1].get("reason", ""))
    return 24 if value == 24 and seen is not None and int(seen.group(1)) < 8192 else None


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    detail: Callable[[], str] | None = None,
    interval_s: float = 0.5,
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f}s waiting for {what}\n{detail() if detail else ''}"
            )
        time.sleep(interval_s)


class Harness:
    def __init__(self, cluster: DevCluster, namespace: str, prometheus: LocalPrometheus, tmp: Path) -> None:
        self.cluster, self.ns, self.prometheus, self.tmp = cluster, namespace, prometheus, tmp
        self.operator: subprocess.Popen[bytes] | None = None
        self.state = tmp / "engine-state.json"
        self.set_state(state_for(2048))

    def set_state(self, state: dict[str, Any]) -> None:
        part = self.state.with_suffix(".tmp")
        part.write_text(json.dumps(state))
        part.replace(self.state)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, "-n", self.ns, check=check, input=input)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        done = self.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def start_operator(
        self, *extra: str, log_name: str = "operator.log", settings: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        env = self.cluster.env()
        env["BATCHKNEE_PROMETHEUS_URL"] = self.prometheus.url
        env.update(settings or {})
        log = (self.tmp / log_name).open("ab")
        flags = list(extra) or ["--peering", "standalone"]
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchknee",
                "operator",
                "--namespace",
                self.ns,
                "--metrics-port",
                "0",
                "--health-port",
                "0",
                *flags,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        if log_name == "operator.log":
            self.operator = process
        return process

    def kill_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.send_signal(signal.SIGKILL)
            self.operator.wait(timeout=30)
        self.operator = None

    def stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(timeout=30)
        self.operator = None

    def log(self) -> str:
        path = self.tmp / "operator.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def apply(self, name: str, **spec: Any) -> subprocess.CompletedProcess[str]:
        body: dict[str, Any] = {
            "engine": "VLLM",
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "gpu": {"type": "a100-80gb", "count": 1},
            "args": ["--state", str(self.state)],
            "rollout": {"allowServingGap": True},  # one replica, retuned (no spare GPU to surge onto)
            "tuning": {
                "evaluationIntervalSeconds": 5,
                "windowSeconds": 30,
                "cooldownSeconds": 0,
                "deadBandPercent": 10,
            },
        }
        for key, value in spec.items():
            body[key] = (
                {**body[key], **value}
                if isinstance(value, dict) and isinstance(body.get(key), dict)
                else value
            )
        manifest = {
            "apiVersion": "batchknee.io/v1alpha1",
            "kind": "LLMServing",
            "metadata": {"name": name},
            "spec": body,
        }
        return self.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)

    def max_num_seqs(self, name: str) -> int | None:
        dep = self.get("deployment", name)
        if dep is None:
            return None
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return int(args[args.index("--max-num-seqs") + 1])

    def status(self, name: str) -> dict[str, Any]:
        found = self.get("llmserving", name)
        return (found or {}).get("status") or {}

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), {})

    def events(self, reason: str) -> list[dict[str, Any]]:
        done = self.kubectl("get", "events", "--field-selector", f"reason={reason}", "-o", "json")
        items = json.loads(done.stdout)["items"]
        return sorted(
            items, key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["creationTimestamp"])
        )


@pytest.fixture(scope="module")
def crds(cluster: DevCluster) -> None:
    done = cluster.kubectl("apply", "--server-side", "-f", str(CRD), "-f", str(PEERING_CRD), check=False)
    assert done.returncode == 0, done.stderr
    cluster.kubectl("wait", "--for=condition=Established", "crd/llmservings.batchknee.io", "--timeout=180s")


@pytest.fixture
def world(
    crds: None, cluster: DevCluster, namespace: str, prometheus: LocalPrometheus, tmp_path: Path
) -> Iterator[Harness]:
    harness = Harness(cluster, namespace, prometheus, tmp_path)
    try:
        yield harness
    finally:
        harness.stop_operator()
        if os.environ.get("BATCHKNEE_KEEP_LOGS"):
            print(harness.log())


def test_the_crd_is_accepted_and_explains_itself(crds: None, cluster: DevCluster) -> None:
    def explain(path: str) -> str:  # the apiserver publishes a new CRD's OpenAPI a moment after Established
        done = wait_for(
            lambda: (r := cluster.kubectl("explain", path, check=False)).returncode == 0 and r,
            60,
            f"explain {path}",
        )
        return str(done.stdout)

    explained = explain("llms.spec.tuning")
    assert "kneeFactorPercent" in explained and "minMaxNumSeqs" in explained
    assert "B_knee" in explained  # the descriptions are there
    assert (
        "rollout budget" in cluster.kubectl("explain", "llms.spec.tuning.maxRolloutsPerHour").stdout.lower()
    )


def test_a_bad_spec_is_rejected_at_admission_naming_the_field(world: Harness) -> None:
    done = world.apply("bad", tuning={"minMaxNumSeqs": 64, "maxMaxNumSeqs": 16})
    assert done.returncode != 0
    assert "spec.tuning.minMaxNumSeqs" in done.stderr
    done = world.apply("unknown", model={"name": "acme/secret-13b"})
    assert done.returncode != 0 and "spec.model.name" in done.stderr and "architecture" in done.stderr
    done = world.apply("factor", tuning={"kneeFactorPercent": 300})
    assert done.returncode != 0 and "kneeFactorPercent" in done.stderr
    # a selector key is written into the operator's queries as it is: this one would read another namespace
    injected = {'a="b"}[1s]) or last_over_time({namespace="victim",zz': ""}
    done = world.apply("injected", prometheus={"selector": injected})
    assert done.returncode != 0 and "spec.prometheus.selector" in done.stderr
    assert "must be a Prometheus label name" in done.stderr
    assert world.apply("labelled", prometheus={"selector": {"model_name": "llama"}}).returncode == 0
    # a managed engine and an adopted workload would run side by side: no switching either way
    adopt = {
        "args": [],
        "rollout": None,
        "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
    }
    done = world.apply("labelled", prometheus={"selector": {"model_name": "llama"}}, **adopt)
    assert done.returncode != 0 and "spec.targetRef cannot be added to or removed from" in done.stderr, (
        done.stderr
    )
    assert world.apply("adopting", **adopt).returncode == 0
    done = world.apply("adopting")
    assert done.returncode != 0 and "spec.targetRef cannot be added to or removed from" in done.stderr, (
        done.stderr
    )
    assert (
        world.apply("adopting", **adopt, tuning={"deadBandPercent": 20}).returncode == 0
    )  # other changes stand


def test_retune_follows_the_context_and_explains_itself(world: Harness) -> None:
    world.start_operator()
    assert world.apply("chat").returncode == 0
    wait_for(lambda: world.max_num_seqs("chat") == 64, 60, "the Deployment at 64", world.log)
    dep = world.get("deployment", "chat")
    assert dep is not None
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--max-num-seqs") == 1 and "--state" in args
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "LLMServing"
    wait_for(lambda: world.condition("chat", "Ready").get("status") == "True", 90, "Ready", world.log)
    wait_for(lambda: world.status("chat").get("observed", {}).get("avgContextLength"), 90, "an observation")

    world.set_state(state_for(8192))
    final = wait_for(lambda: retuned_for_8192(world.status("chat")), 150, "the retune for 8,192", world.log)
    assert world.max_num_seqs("chat") == final
    status = world.status("chat")
    # the windowed average climbs from 2048 to 8192, so the way down may take a step on the way
    steps = [h["to"] for h in status["history"]]
    assert steps[0] == 64 and steps[-1] == final and steps == sorted(steps, reverse=True)
    last = status["history"][-1]["reason"]
    assert last.startswith(f"max-num-seqs {steps[-2]}→{final}: avg ctx") and "B_knee" in last
    retuned = world.events("Retuned")
    assert retuned and retuned[-1]["message"].startswith(f"max-num-seqs {steps[-2]}→{final}: avg ctx")
    assert "B_knee" in retuned[-1]["message"] and "TPOT p99" in retuned[-1]["message"]

    table = world.kubectl("get", "llms", "-o", "wide").stdout
    header = table.splitlines()[0].split()
    for column in (
        "ENGINE",
        "MODEL",
        "CTX",
        "B-KNEE",
        "MAX-SEQS",
        "RECOMMENDED",
        "TPOT-P99",
        "READY",
        "AGE",
        "REASON",
    ):
        assert column in header
    assert "avg ctx 8192 tok → B_knee 15.0 → 16" in table  # the Reason column: the decision in one line


def test_recommend_mode_never_changes_the_deployment(world: Harness) -> None:
    world.start_operator()
    assert world.apply("advice", tuning={"mode": "Recommend"}).returncode == 0
    wait_for(lambda: world.get("deployment", "advice"), 60, "the Deployment")
    wait_for(lambda: world.condition("advice", "Ready").get("status") == "True", 90, "Ready")
    generation = world.get("deployment", "advice")["metadata"]["generation"]  # type: ignore[index]
    world.set_state(state_for(8192))
    wait_for(lambda: world.status("advice").get("recommendedMaxNumSeqs") == 16, 120, "the recommendation")
    time.sleep(10)
    assert world.get("deployment", "advice")["metadata"]["generation"] == generation  # type: ignore[index]
    assert world.max_num_seqs("advice") == 64
    assert world.status("advice")["action"] == "recommend"


def test_prometheus_stopped_holds_and_says_so(world: Harness) -> None:
    world.start_operator()
    assert world.apply("steady").returncode == 0
    wait_for(
        lambda: world.status("steady").get("observed", {}).get("avgContextLength"), 120, "an observation"
    )
    world.prometheus.stop()
    try:
        world.set_state(state_for(8192))
        wait_for(
            lambda: world.condition("steady", "MetricsAvailable").get("status") == "False",
            60,
            "MetricsAvailable=False",
            world.log,
        )
        time.sleep(10)
        assert world.max_num_seqs("steady") == 64
        assert world.status("steady")["holdReason"] == "metrics-unavailable"
    finally:
        world.prometheus.start()


def test_deleting_the_llmserving_removes_its_children(world: Harness) -> None:
    world.start_operator()
    assert world.apply("gone").returncode == 0
    wait_for(lambda: world.get("deployment", "gone"), 60, "the Deployment")
    assert world.get("service", "gone") is not None
    world.kubectl("delete", "llms", "gone", "--wait=true")
    wait_for(lambda: world.get("deployment", "gone") is None, 60, "the garbage collector")
    wait_for(lambda: world.get("service", "gone") is None, 60, "the Service gone")


def test_with_budgets_turned_off_the_operator_deletes_its_own(world: Harness) -> None:
    """BATCHKNEE_DISRUPTION_BUDGETS=false, on the real apiserver: the budget the operator made goes
    (a precondition-checked delete), a same-named budget another owner made in its place stays,
    and the engine Deployment is not restarted."""
    world.start_operator()
    for name in ("budget", "elsewhere"):
        assert world.apply(name).returncode == 0
        wait_for(lambda name=name: world.get("pdb", name), 60, f"{name}'s budget")
    # another owner's budget of the name, where the operator's was
    world.stop_operator()
    world.kubectl("delete", "pdb", "elsewhere", "--wait=true")
    foreign = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "elsewhere"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"team": "ops"}}},
    }
    world.kubectl("apply", "-f", "-", input=json.dumps(foreign))
    generation = world.get("deployment", "budget")["metadata"]["generation"]  # type: ignore[index]

    world.start_operator(settings={"BATCHKNEE_DISRUPTION_BUDGETS": "false"})
    wait_for(lambda: world.get("pdb", "budget") is None, 60, "its own budget deleted")
    time.sleep(12)  # two more evaluations of each
    kept = world.get("pdb", "elsewhere")
    assert kept is not None and kept["spec"]["selector"] == {"matchLabels": {"team": "ops"}}
    assert world.get("deployment", "budget")["metadata"]["generation"] == generation  # type: ignore[index]
    assert world.get("pdb", "budget") is None  # and not made again


def test_a_new_default_image_rolls_the_engines_one_at_a_time(world: Harness) -> None:
    """The operator restarted with another default engine image (what an upgrade that renders a new
    pod template does) and BATCHKNEE_TEMPLATE_ROLLOUTS_AT_ONCE=1, on the real apiserver and
    controller-manager: at no moment do two engines roll to the new template; the one that waits says
    why; both run it in the end."""
    names = ("upgraded", "queued")
    world.start_operator()
    for name in names:
        assert world.apply(name).returncode == 0
    for name in names:
        wait_for(
            lambda name=name: world.condition(name, "Ready").get("status") == "True", 120, f"{name} Ready"
        )
    old_image = images(world)["upgraded"]
    new_image = "vllm/vllm-openai:v99.0.0"
    assert old_image != new_image
    world.stop_operator()
    # each new pod takes 4 s to turn Ready (an engine loading its model), so that a rollout lasts
    # past the polling below: unpaced, both Deployments are seen rolling to the new template at once
    world.set_state({**state_for(2048), "startupSeconds": 4})

    world.start_operator(
        settings={"BATCHKNEE_VLLM_IMAGE": new_image, "BATCHKNEE_TEMPLATE_ROLLOUTS_AT_ONCE": "1"}
    )
    waited: dict[str, str] = {}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        listed = json.loads(world.kubectl("get", "deployments", "-o", "json").stdout)["items"]
        rolling_to_new = [
            d["metadata"]["name"]
            for d in listed
            if image_of(d) == new_image and deployment_state(d).rolling  # type: ignore[union-attr]
        ]
        assert len(rolling_to_new) <= 1, f"rolling to the new template together: {rolling_to_new}"
        for name in names:
            progressing = world.condition(name, "Progressing")
            if progressing.get("reason") == "RolloutQueued":
                waited[name] = progressing["message"]
        done = [
            d
            for d in listed
            if image_of(d) == new_image and not deployment_state(d).rolling  # type: ignore[union-attr]
        ]
        if len(done) == len(names):
            break
        time.sleep(0.3)
    assert images(world) == dict.fromkeys(names, new_image), world.log()
    assert len(waited) == 1, waited  # one took the place, the other waited for it
    # and by the record, not only by sampling: the one that waited got the new template no sooner
    # than the controller saw the other's rollout complete
    [queued] = waited
    [holder] = [name for name in names if name != queued]
    progress = next(
        c
        for c in world.get("deployment", holder)["status"]["conditions"]  # type: ignore[index]
        if c["type"] == "Progressing"
    )
    assert progress["reason"] == "NewReplicaSetAvailable"
    changed = world.get("deployment", queued)["metadata"]["annotations"][TEMPLATE_CHANGED_ANNOTATION]  # type: ignore[index]
    assert changed >= progress["lastUpdateTime"], (changed, progress)
    assert "at most 1 engines at a time" in next(iter(waited.values()))
    assert [e["involvedObject"]["name"] for e in world.events("RolloutQueued")] == list(waited)


def images(world: Harness) -> dict[str, str]:
    listed = json.loads(world.kubectl("get", "deployments", "-o", "json").stdout)["items"]
    return {d["metadata"]["name"]: image_of(d) for d in listed}


def image_of(deployment: dict[str, Any]) -> str:
    return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])


KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"  # what an older build's per-object daemon needed


def test_one_scheduler_re_evaluates_adds_no_finalizer_and_frees_a_deleted_objects_state(
    world: Harness,
) -> None:
    """Every object is re-evaluated at its interval by one scheduler, not a kopf daemon per object: no
    finalizer is added; an object an older build left with kopf's finalizer loses it and deletes; a
    deleted object's state (its gauges here) is freed. Another kopf operator's finalizer (kopf's
    default name, which they all share) on a Service the operator watches is left alone: taken off,
    that operator's delete handler would never run."""
    assert world.apply("legacy").returncode == 0
    patch = json.dumps({"metadata": {"finalizers": [KOPF_FINALIZER]}})
    world.kubectl("patch", "llms", "legacy", "--type=merge", "-p", patch)
    world.kubectl("create", "service", "clusterip", "theirs", "--tcp=80:80")
    world.kubectl("patch", "service", "theirs", "--type=merge", "-p", patch)
    port = free_port()
    world.start_operator("--peering", "standalone", "--metrics-port", str(port))
    assert world.apply("ticking").returncode == 0

    def sampled() -> str | None:
        return world.status("ticking").get("observed", {}).get("sampledAt")

    first = wait_for(sampled, 150, "an observation of ticking", world.log)
    second = wait_for(
        lambda: (s := sampled()) != first and s, 60, "a second evaluation (interval 5 s)", world.log
    )
    wait_for(lambda: (s := sampled()) not in (first, second) and s, 60, "a third evaluation", world.log)

    def finalizers(name: str) -> list[str]:
        return list((world.get("llmserving", name) or {})["metadata"].get("finalizers") or [])

    assert KOPF_FINALIZER not in finalizers("ticking")  # evaluated three times, never blocked
    wait_for(lambda: KOPF_FINALIZER not in finalizers("legacy"), 60, "kopf's old finalizer gone", world.log)
    theirs = world.get("service", "theirs") or {}
    assert theirs["metadata"].get("finalizers") == [KOPF_FINALIZER]  # through three evaluations
    world.kubectl(
        "patch", "service", "theirs", "--type=merge", "-p", json.dumps({"metadata": {"finalizers": None}})
    )

    def gauges() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    assert 'batchknee_max_num_seqs{name="ticking"' in gauges()
    done = world.kubectl("delete", "llms", "ticking", "legacy", "--wait=true", "--timeout=60s", check=False)
    assert done.returncode == 0, done.stderr
    assert world.get("llmserving", "legacy") is None
    wait_for(lambda: 'batchknee_max_num_seqs{name="ticking"' not in gauges(), 30, "ticking's gauges freed")


def test_killing_the_operator_during_a_rollout_does_not_roll_twice(world: Harness) -> None:
    world.start_operator()
    assert world.apply("restart", tuning={"cooldownSeconds": 3600}).returncode == 0
    wait_for(lambda: world.condition("restart", "Ready").get("status") == "True", 120, "Ready")
    wait_for(
        lambda: world.status("restart").get("observed", {}).get("avgContextLength"), 120, "an observation"
    )
    world.set_state(state_for(8192))
    retuned = wait_for(
        lambda: (n := world.max_num_seqs("restart")) is not None and n < 64 and n,
        150,
        "the retune",
        world.log,
    )
    world.kill_operator()  # mid-rollout: the status may not even say so yet
    generation = world.get("deployment", "restart")["metadata"]["generation"]  # type: ignore[index]

    world.start_operator()
    wait_for(lambda: world.status("restart").get("maxNumSeqs") == retuned, 60, "the new operator's status")
    wait_for(lambda: world.condition("restart", "Ready").get("status") == "True", 120, "the rollout done")
    time.sleep(15)  # three more evaluations
    assert world.get("deployment", "restart")["metadata"]["generation"] == generation  # type: ignore[index]
    assert [h["to"] for h in world.status("restart")["history"]] == [64, retuned]
    assert len(world.events("Retuned")) == 1


def test_two_replicas_never_both_act(world: Harness) -> None:
    """kopf peering: the replica with the higher priority acts, the other pauses."""

    def settled() -> bool:
        """The higher replica acts, the lower one is paused: it paused on seeing the higher, or
        it never resumed (kopf starts paused under mandatory peering). Not a fixed sleep: on a
        busy machine a replica takes seconds to start."""
        high_log, low_log = (world.tmp / "high.log").read_text(), (world.tmp / "low.log").read_text()
        low_paused = "Pausing operations in favour of" in low_log or "Resuming operations" not in low_log
        return "Resuming operations" in high_log and low_paused

    low = world.start_operator("--peering", "mandatory", "--priority", "10", log_name="low.log")
    high = world.start_operator("--peering", "mandatory", "--priority", "20", log_name="high.log")
    try:
        wait_for(
            settled,
            60,
            "the higher replica acting, the lower paused",
            lambda: (world.tmp / "low.log").read_text(),
        )
        assert world.apply("shared").returncode == 0
        wait_for(
            lambda: world.max_num_seqs("shared") == 64,
            60,
            "the Deployment",
            lambda: (world.tmp / "high.log").read_text(),
        )
        time.sleep(10)
        high_log, low_log = (world.tmp / "high.log").read_text(), (world.tmp / "low.log").read_text()
        assert "shared: max-num-seqs ∅→64" in high_log
        assert "shared" not in low_log, low_log
        assert len(world.events("Deployed")) == 1
        peering = world.get("kopfpeering", "batchknee")
        assert peering is not None
        assert sorted(p["priority"] for p in peering["status"].values()) == [10, 20]
    finally:
        for process in (low, high):
            process.terminate()
            process.wait(timeout=30)
