"""spec.targetRef: reconcile tunes a workload the user already runs by writing one env entry, and
nothing else; problems become a Wired=False condition and no write."""

from __future__ import annotations

import contextlib
import copy
from datetime import timedelta
from typing import Any

import pytest
from conftest import World
from fakes import observation

from batchknee.api.models import TARGET_ENV_VAR, Engine


def user_workload(
    name: str = "vllm", kind: str = "Deployment", args: list[str] | None = None, sidecar: bool = False
) -> dict[str, Any]:
    containers = [
        {
            "name": "vllm",
            "image": "vllm/vllm-openai:v0.11.0",
            "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"],
            "args": args
            if args is not None
            else ["--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)", "--port", "8000"],
            "env": [{"name": "HF_HOME", "value": "/models"}],
        }
    ]
    if sidecar:
        containers.append({"name": "proxy", "image": "envoyproxy/envoy:v1.31"})
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": containers}},
        },
    }


def adopting(
    name: str = "tuner", target: str = "vllm", kind: str = "Deployment", **ref: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "batchknee.io/v1alpha1",
        "kind": "LLMServing",
        "metadata": {"name": name},
        "spec": {
            "engine": "VLLM",
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "gpu": {"type": "a100-80gb", "count": 1},
            "targetRef": {"apiVersion": "apps/v1", "kind": kind, "name": target, **ref},
            "tuning": {"evaluationIntervalSeconds": 30, "windowSeconds": 120, "cooldownSeconds": 0},
        },
    }


def pod(name: str, app: str = "vllm") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "labels": {"app": app}}, "status": {}}


def env(world: World, name: str = "vllm", kind: str = "Deployment") -> dict[str, str]:
    container = world.kube.get(kind, "default", name)["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def finish(world: World, name: str = "vllm", kind: str = "Deployment") -> None:
    workload = world.kube.objects[(kind, "default", name)]
    workload["status"] = {
        "observedGeneration": workload["metadata"].get("generation", 1),
        "replicas": 2,
        "updatedReplicas": 2,
        "readyReplicas": 2,
        "availableReplicas": 2,
    }
    workload["metadata"]["resourceVersion"] = f"{workload['metadata'].get('resourceVersion')}-done"


def without_env(workload: dict[str, Any]) -> dict[str, Any]:
    copied = copy.deepcopy(workload)
    for container in copied["spec"]["template"]["spec"]["containers"]:
        container["env"] = [e for e in container.get("env", []) if e["name"] != TARGET_ENV_VAR]
    copied["metadata"] = {
        k: v for k, v in copied["metadata"].items() if k not in ("resourceVersion", "generation")
    }
    copied.pop("status", None)
    return copied


def test_a_wired_workload_gets_one_env_value_and_nothing_else(world: World) -> None:
    world.kube.apply(user_workload())
    before = world.kube.get("Deployment", "default", "vllm")
    world.kube.create(adopting())
    world.reconcile("tuner")

    after = world.kube.get("Deployment", "default", "vllm")
    assert env(world) == {"HF_HOME": "/models", TARGET_ENV_VAR: "64"}  # llama-3-8b at ctx 2048
    assert without_env(after) == without_env(before)  # type: ignore[arg-type]
    assert world.kube.get("Service", "default", "tuner") is None  # nothing created
    status = world.kube.status("default", "tuner")
    assert status["maxNumSeqs"] == 64 and [h["to"] for h in status["history"]] == [64]
    assert status["selector"] == "app=vllm" and status["replicas"] == 2
    wired = world.kube.condition("default", "tuner", "Wired")
    assert wired["status"] == "True" and wired["reason"] == "ArgsReferenceVariable"

    # traffic moves to 8k tokens: the env value follows, still nothing else
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-0")] = pod("vllm-0")
    leaving = pod("vllm-old")
    leaving["metadata"]["deletionTimestamp"] = "2026-03-01T12:00:00Z"
    world.kube.objects[("Pod", "default", "vllm-old")] = leaving
    world.reconcile("tuner")
    # read by its own pods (the default scope, by the llmserving label, matches none of them), not
    # the one terminating
    assert world.observer.asked[-1].pods == ("vllm-0",)
    world.clock.advance(121)
    for _ in range(6):  # a window for the average to take the change in, then it rolls
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
        world.reconcile("tuner")
        world.clock.advance(30)
    assert env(world)[TARGET_ENV_VAR] == "16"
    assert [h["to"] for h in world.kube.status("default", "tuner")["history"]] == [64, 16]
    assert without_env(world.kube.get("Deployment", "default", "vllm")) == without_env(before)  # type: ignore[arg-type]


def rolled_out_with_traffic(world: World, ctx: int) -> None:
    """The owner's rollout done, its pod up and settled, then six evaluations of traffic at `ctx`."""
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-0")] = pod("vllm-0")
    world.clock.advance(121)
    for _ in range(6):
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=ctx))
        world.reconcile("tuner")
        world.clock.advance(30)


def test_an_adopted_workloads_settle_time_does_not_wait_for_its_replaced_pods(world: World) -> None:
    """An adopted workload is read by its own pods' names, the terminating ones left out: a
    replaced pod still draining cannot lower its window's figures, so nothing waits for it."""
    world.kube.apply(user_workload())
    world.kube.create(adopting())
    world.reconcile("tuner")
    rolled_out_with_traffic(world, 8192)
    assert env(world)[TARGET_ENV_VAR] == "16"
    # the owner's Deployment reports the new pods rolled out; one it replaced is still terminating
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-1")] = pod("vllm-1")
    leaving = pod("vllm-0")
    leaving["metadata"]["deletionTimestamp"] = (world.clock.now + timedelta(seconds=30)).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    world.kube.objects[("Pod", "default", "vllm-0")] = leaving
    world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
    world.reconcile("tuner")
    status = world.kube.status("default", "tuner")
    assert status["rolloutCompleteTime"] == world.clock.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert status["holdReason"] == "settling"
    assert world.observer.asked[-1].pods == ("vllm-1",)  # read by its own pods, not the one leaving


def adopted_unwritten(world: World, args: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Adopt a workload with these args: it is left as it was; (the workload, the Wired condition)."""
    world.kube.apply(user_workload(args=args))
    before = world.kube.get("Deployment", "default", "vllm")
    world.kube.create(adopting())
    world.reconcile("tuner")
    assert before is not None and world.kube.get("Deployment", "default", "vllm") == before
    wired = world.kube.condition("default", "tuner", "Wired")
    assert wired["status"] == "False"
    return before, wired


def test_args_without_the_variable_get_the_exact_argument_and_no_write(world: World) -> None:
    before, wired = adopted_unwritten(world, ["--max-num-seqs", "256"])
    assert wired["reason"] == "ArgsDoNotReferenceVariable"
    assert "--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)" in wired["message"]
    status = world.kube.status("default", "tuner")
    assert status["maxNumSeqs"] == 256 and status["action"] == "recommend"  # what the args run
    assert "ArgsDoNotReferenceVariable" in [e["reason"] for e in world.kube.events]

    # traffic at 8k tokens: the recommendation is read against the value the workload runs
    rolled_out_with_traffic(world, 8192)
    status = world.kube.status("default", "tuner")
    assert (status["maxNumSeqs"], status["recommendedMaxNumSeqs"]) == (256, 16)
    assert status["reason"].startswith("recommend 16: avg ctx 8192 tok") and "keeps 256" in status["reason"]
    assert world.kube.get("Deployment", "default", "vllm")["spec"] == before["spec"]  # type: ignore[index]


def test_a_second_running_batch_limit_in_the_args_is_named_and_nothing_is_written(world: World) -> None:
    """vLLM 0.34 refuses to start with --max-num-active-seqs above --max-num-seqs; under it, the
    value written would not be the one running. Either way the operator writes nothing."""
    args = ["--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)", "--max-num-active-seq", "128", "--port", "8000"]
    _, wired = adopted_unwritten(world, args)
    assert wired["reason"] == "SecondBatchLimit"
    assert "also sets --max-num-active-seq 128" in wired["message"] and "remove it" in wired["message"]
    status = world.kube.status("default", "tuner")
    assert status["recommendedMaxNumSeqs"] == 64 and status["action"] == "recommend"


def test_a_shell_wrapped_engine_is_read_word_by_word(world: World) -> None:
    """`sh -c "vllm serve …"`: Kubernetes expands $(VAR) in the script, so it is wired; a second
    batch limit inside the script is found the same way."""
    wrapped = user_workload(args=[])
    engine = wrapped["spec"]["template"]["spec"]["containers"][0]
    engine["command"] = [
        "/bin/sh",
        "-c",
        "exec vllm serve M --max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS) --port 8000  # was --max-num-seqs 256",
    ]
    world.kube.apply(wrapped)
    world.kube.create(adopting())
    world.reconcile("tuner")
    assert world.kube.condition("default", "tuner", "Wired")["reason"] == "ArgsReferenceVariable"
    assert env(world)[TARGET_ENV_VAR] == "64"
    finish(world)
    world.reconcile("tuner")
    assert world.kube.status("default", "tuner")["maxNumSeqs"] == 64  # the env value, not the comment's

    engine["command"][2] = (
        "exec vllm serve M --max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS) --max-num-active-seqs 8"
    )
    world.kube.apply(
        wrapped | {"metadata": {**wrapped["metadata"], "name": "other", "labels": {"app": "other"}}}
    )
    world.kube.create(adopting(name="other-tuner", target="other"))
    world.reconcile("other-tuner")
    wired = world.kube.condition("default", "other-tuner", "Wired")
    assert wired["reason"] == "SecondBatchLimit" and "--max-num-active-seqs 8" in wired["message"]
    assert TARGET_ENV_VAR not in env(world, "other")


def refused_wiring(world: World, workload: dict[str, Any]) -> dict[str, Any]:
    """The Wired condition of an LLMServing adopting `workload`, which it must leave as it was."""
    world.kube.apply(workload)
    before = world.kube.get("Deployment", "default", "vllm")
    world.kube.create(adopting())
    world.reconcile("tuner")
    assert world.kube.get("Deployment", "default", "vllm") == before
    return world.kube.condition("default", "tuner", "Wired")


def test_a_shell_script_the_shell_cannot_read_is_named_and_nothing_is_written(world: World) -> None:
    """Chosen by its first words (`vllm serve`), a script with an unclosed quote further on is not
    the engine's command line: named, never written (a sidecar beside it makes the choice matter)."""
    workload = user_workload(args=[], sidecar=True)
    engine = workload["spec"]["template"]["spec"]["containers"][0]
    engine["command"] = ["sh", "-c", "vllm serve M --max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS) --x 'oops"]
    wired = refused_wiring(world, workload)
    assert (wired["status"], wired["reason"]) == ("False", "ScriptUnreadable"), wired
    assert wired["message"].startswith(
        "container vllm of Deployment default/vllm runs a shell script the shell cannot read"
    )


def test_a_shell_script_too_long_to_read_is_named_and_nothing_is_written(world: World) -> None:
    """A 1.4 MB script was split word by word at every evaluation (3.7 s each, holding the worker);
    past 64 Ki characters it is not read, and the condition says so."""
    from batchknee.adopt import MAX_SCRIPT_CHARS, engine_words

    script = "exec vllm serve M --max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS) " + "'a' " * (MAX_SCRIPT_CHARS // 4)
    workload = user_workload(args=[])
    engine = workload["spec"]["template"]["spec"]["containers"][0]
    engine["command"] = ["/bin/sh", "-c", script]
    assert engine_words(engine) == ["/bin/sh", "-c", script]  # whole: not split
    wired = refused_wiring(world, workload)
    assert (wired["status"], wired["reason"]) == ("False", "ScriptTooLong")
    assert wired["message"].startswith(
        f"container vllm of Deployment default/vllm runs a shell script of {len(script):,} characters; "
        f"the operator reads scripts of at most {MAX_SCRIPT_CHARS:,}"
    )

    engine["command"][2] = script[: MAX_SCRIPT_CHARS - 1]  # within the bound it is read, and wired
    assert engine_words(engine)[:5] == ["/bin/sh", "-c", "exec", "vllm", "serve"]


def test_each_container_is_asked_for_its_first_words_only() -> None:
    """Which container starts the engine is asked of every container at every evaluation: a script
    is read no further than its first words (20 containers of 64-KiB scripts took 2 s per
    evaluation on the shared worker, now 2 ms), and a readable script's first words are those the
    full reading gives (shells, paths, arguments after the script)."""
    from batchknee.adopt import MAX_SCRIPT_CHARS, engine_container, engine_words

    filler = "x " * (MAX_SCRIPT_CHARS // 2 - 40)
    containers: list[dict[str, Any]] = [
        {"name": f"app{i}", "command": ["sh", "-c", f"python app.py {filler}"]} for i in range(20)
    ]
    containers.append({"name": "engine", "command": ["/bin/sh", "-c", f"exec vllm serve M {filler}"]})
    containers.append({"name": "plain", "command": ["vllm"], "args": ["serve", "M", "--port", "8000"]})
    after = {"name": "after", "command": ["bash", "-c", 'exec vllm serve "$0" --port 8000', "M"]}
    for container in [*containers[-3:], after]:
        full = engine_words(container)
        for n in (1, 2, 3, 4, 6):
            assert engine_words(container, at_most=n) == full[:n]
    found, problem = engine_container(containers[:-1], Engine.VLLM, None)
    assert problem is None and found is not None and found["name"] == "engine"
    assert engine_container(containers[:20], Engine.VLLM, None)[1][0] == "ContainerAmbiguous"  # type: ignore[index]


@pytest.mark.parametrize(
    ("command", "args", "env_value", "running"),
    [
        (["vllm", "serve", "M"], ["--max-num-seqs", "256"], None, 256),
        (["vllm", "serve", "M"], ["--port", "8000"], "64", None),  # an env value the args never read
        (["sh", "-c", "vllm serve M --max-num-seqs 64 && exec sidecar --max-num-seqs 999"], [], None, 64),
        (["sh", "-c", "vllm serve M --max-num-seqs 'unbalanced"], [], None, None),
        (
            ["trtllm-serve", "M"],
            ["--max_batch_size", "256", "--extra_llm_api_options", "/etc/o.yaml"],
            None,
            None,
        ),
        (["trtllm-serve", "M"], ["--max_batch_size", "256"], None, 256),
    ],
)
def test_the_value_an_unwired_workload_runs_is_read_from_the_engines_own_words(
    command: list[str], args: list[str], env_value: str | None, running: int | None
) -> None:
    from batchknee.adopt import engine_words, running_value
    from batchknee.api.models import Engine

    container: dict[str, Any] = {"command": command, "args": args}
    if env_value is not None:
        container["env"] = [{"name": TARGET_ENV_VAR, "value": env_value}]
    engine = Engine.TensorRTLLM if command[0] == "trtllm-serve" else Engine.VLLM
    assert running_value(container, engine_words(container), engine) == running


@pytest.mark.parametrize(
    ("workload", "ref", "reason", "words"),
    [
        (None, {}, "TargetNotFound", "Deployment default/vllm (spec.targetRef) does not exist"),
        (user_workload(sidecar=True), {"container": "engine"}, "ContainerNotFound", "vllm, proxy"),
        (
            user_workload(sidecar=True, args=["--port", "8000"])
            | {
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"app": "vllm"}},
                    "template": {"spec": {"containers": [{"name": "a"}, {"name": "b"}]}},
                }
            },
            {},
            "ContainerAmbiguous",
            "spec.targetRef.container",
        ),
    ],
)
def test_a_target_that_cannot_be_tuned_is_named_and_never_written(
    world: World, workload: dict[str, Any] | None, ref: dict[str, Any], reason: str, words: str
) -> None:
    if workload is not None:
        world.kube.apply(workload)
    before = copy.deepcopy(world.kube.objects)
    world.kube.create(adopting(**ref))
    world.reconcile("tuner")
    wired = world.kube.condition("default", "tuner", "Wired")
    assert wired["status"] == "False" and wired["reason"] == reason and words in wired["message"]
    after = {k: v for k, v in world.kube.objects.items() if k[0] != "LLMServing"}
    assert after == {k: v for k, v in before.items() if k[0] != "LLMServing"}


def test_the_engine_container_is_found_among_sidecars(world: World) -> None:
    world.kube.apply(user_workload(sidecar=True))
    world.kube.create(adopting())
    world.reconcile("tuner")
    containers = world.kube.get("Deployment", "default", "vllm")["spec"]["template"]["spec"]["containers"]  # type: ignore[index]
    assert {e["name"] for e in containers[0]["env"]} == {"HF_HOME", TARGET_ENV_VAR}
    assert "env" not in containers[1]


def test_a_second_llmserving_on_the_same_workload_writes_nothing(world: World) -> None:
    world.kube.apply(user_workload())
    first = world.kube.create(adopting("first"))
    first["metadata"]["creationTimestamp"] = "2026-03-01T11:00:00Z"
    world.kube.create(adopting("second"))
    world.reconcile("first")
    value_before = env(world)[TARGET_ENV_VAR]
    world.reconcile("second")
    wired = world.kube.condition("default", "second", "Wired")
    assert wired["reason"] == "AlreadyTargeted" and "LLMServing first" in wired["message"]
    assert env(world)[TARGET_ENV_VAR] == value_before
    assert world.kube.condition("default", "first", "Wired")["status"] == "True"


def test_a_rival_the_watch_still_lists_but_the_apiserver_no_longer_has_holds_nothing_off(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch's index of adopted workloads keeps an LLMServing deleted while the watch was down
    (kopf's next listing does not say what went), and this one's own earlier self under an old uid:
    neither holds the adoption off for good — a rival counts only as stored now."""
    world.kube.apply(user_workload())
    world.kube.create(adopting("second"))
    lingering = [("2026-03-01T11:00:00Z", "first"), ("2026-03-01T10:00:00Z", "second")]
    listed = world.kube.tuners
    monkeypatch.setattr(world.kube, "tuners", lambda *ref: lingering + listed(*ref))
    world.reconcile("second")
    assert world.kube.condition("default", "second", "Wired")["status"] == "True"
    assert env(world)[TARGET_ENV_VAR] == "64"
    assert world.kube.fresh_reads == ["first"]  # past the watch's cache, which may keep it too
    # one that is there, older, on the same workload: it still holds this one off
    first = world.kube.create(adopting("first"))
    first["metadata"]["creationTimestamp"] = "2026-03-01T11:00:00Z"
    world.reconcile("second")
    wired = world.kube.condition("default", "second", "Wired")
    assert wired["reason"] == "AlreadyTargeted" and "LLMServing first" in wired["message"]


def test_a_statefulset_is_adopted_the_same_way(world: World) -> None:
    world.kube.apply(user_workload("sglang-like", kind="StatefulSet"))
    world.kube.create(adopting(target="sglang-like", kind="StatefulSet"))
    world.reconcile("tuner")
    assert env(world, "sglang-like", "StatefulSet")[TARGET_ENV_VAR] == "64"
    assert world.kube.status("default", "tuner")["selector"] == "app=sglang-like"


def test_a_workload_tuned_by_another_llmserving_is_still_watched_and_recommended_for(world: World) -> None:
    """The second LLMServing writes nothing, yet its status shows the pods that run and what it
    would recommend — not an empty fleet ("no engine pods") beside a running one."""
    world.kube.apply(user_workload())
    first = world.kube.create(adopting("first"))
    first["metadata"]["creationTimestamp"] = "2026-03-01T11:00:00Z"
    world.kube.create(adopting("second"))
    world.reconcile("first")
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-0")] = pod("vllm-0")
    world.observer.set("default", "second", observation(world.clock.now, ctx=8192))
    value_before = env(world)[TARGET_ENV_VAR]
    world.reconcile("second")

    assert env(world)[TARGET_ENV_VAR] == value_before  # still written by the first only
    status = world.kube.status("default", "second")
    assert status["replicas"] == 2 and status["selector"] == "app=vllm"
    assert status["recommendedMaxNumSeqs"] == 16 and status["action"] == "recommend"
    assert "maxNumSeqs" not in status  # it runs no value of its own (nor counts the first's in metrics)
    assert world.kube.condition("default", "second", "Ready")["status"] == "True"
    metrics = world.kube.condition("default", "second", "MetricsAvailable")
    assert metrics["status"] == "True" and metrics["reason"] == "Observed"
    assert world.kube.condition("default", "second", "Wired")["reason"] == "AlreadyTargeted"

    # the first's rollout stalls on a crash-looping pod: the first's to report, not the second's
    workload = world.kube.objects[("Deployment", "default", "vllm")]
    workload["status"] |= {
        "replicas": 3,
        "updatedReplicas": 1,
        "conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"},
        ],
    }
    crashing = pod("vllm-2") | {
        "status": {
            "containerStatuses": [
                {
                    "name": "vllm",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1}},
                }
            ]
        }
    }
    world.kube.objects[("Pod", "default", "vllm-2")] = crashing
    outcome = world.reconcile("second")
    assert world.kube.condition("default", "second", "Degraded")["status"] == "False"
    assert world.kube.condition("default", "second", "Ready")["reason"] == "RolloutInProgress"
    assert not outcome.tunes and not outcome.rolled and outcome.ready_replicas is None
    assert not world.kube.status("default", "second").get("quarantine")
    assert world.reconcile("first").ready_replicas is not None  # the tuner's capacity, counted once
    assert world.kube.condition("default", "first", "Degraded")["reason"] == "EngineCrashLooping"


def test_a_workload_whose_pods_cannot_be_told_apart_says_so_in_every_condition(world: World) -> None:
    workload = user_workload()
    workload["spec"]["selector"]["matchExpressions"] = [{"key": "tier", "operator": "In", "values": ["gpu"]}]
    world.kube.apply(workload)
    world.kube.create(adopting())
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-0")] = pod("vllm-0")
    world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
    world.reconcile("tuner")

    status = world.kube.status("default", "tuner")
    assert status["replicas"] == 2
    assert world.kube.condition("default", "tuner", "Ready")["status"] == "True"
    metrics = world.kube.condition("default", "tuner", "MetricsAvailable")
    assert metrics["status"] == "Unknown" and metrics["reason"] == "SelectorUnsupported"
    assert "matchExpressions" in metrics["message"]
    # no knee read from pods it cannot tell apart (the 8,192-token pods would say 16)
    assert status["recommendedMaxNumSeqs"] == 64 and "initial" in status["reason"]
    assert not [e for e in world.kube.events if e["reason"] == "MetricsUnavailable"]


def test_a_missing_target_is_not_reported_as_a_deployment_being_created(world: World) -> None:
    world.kube.create(adopting())
    world.reconcile("tuner")
    ready = world.kube.condition("default", "tuner", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "TargetNotFound"
    assert "does not exist" in ready["message"]
    metrics = world.kube.condition("default", "tuner", "MetricsAvailable")
    assert metrics["reason"] == "TargetNotFound"


def test_a_command_line_too_long_to_read_is_named_and_nothing_is_written(world: World) -> None:
    """190,000 words of `--ma` (each a prefix of flags the operator reads, so each matched against
    all of them) took 3.8 s at every evaluation on the shared worker: past 4,096 words the engine's
    flags are not read, and the condition says so."""
    from batchknee.render import MAX_ENGINE_WORDS

    workload = user_workload(args=["--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)", *["--ma"] * MAX_ENGINE_WORDS])
    wired = refused_wiring(world, workload)
    assert (wired["status"], wired["reason"]) == ("False", "ArgsTooLong")
    assert wired["message"].startswith("container vllm of Deployment default/vllm has 4,10")
    assert "the operator reads at most 4,096: start the engine with fewer" in wired["message"]


def test_a_value_past_any_count_in_a_workloads_env_is_not_read_as_its_limit(world: World) -> None:
    """A wired workload's env value of 4,000 digits was held as the running limit ("holding
    9999…", 4,000 digits in every reason), past what any float the policy computes with can hold:
    it reads as no value, and the knee is written."""
    workload = user_workload()
    [engine] = workload["spec"]["template"]["spec"]["containers"]
    engine["env"] = [{"name": TARGET_ENV_VAR, "value": "9" * 4000}]
    world.kube.apply(workload)
    world.kube.create(adopting())
    world.observer.set("default", "tuner", observation(world.clock.now, ctx=2048))
    outcome = world.reconcile("tuner")
    assert outcome.error is None and outcome.decision is not None
    assert outcome.decision.reason.startswith("max-num-seqs ∅→64: avg ctx 2048 tok → B_knee 59.8")
    assert env(world) == {TARGET_ENV_VAR: "64"}


def stalled(world: World, name: str = "vllm") -> None:
    """The controller gave up on the workload's newest template (its progress deadline passed)."""
    from batchknee.render import format_timestamp

    workload = world.kube.objects[("Deployment", "default", name)]
    workload["status"] = {
        "observedGeneration": workload["metadata"]["generation"],
        "replicas": 3,
        "updatedReplicas": 1,
        "readyReplicas": 2,
        "availableReplicas": 2,
        "conditions": [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "lastUpdateTime": format_timestamp(world.clock.now),
            }
        ],
    }
    workload["metadata"]["resourceVersion"] = f"{workload['metadata'].get('resourceVersion')}-stalled"


def retune_at_8k(world: World) -> None:
    """An adopted workload, rolled out, then traffic at 8k tokens: the limit is retuned."""
    world.kube.apply(user_workload())
    world.kube.create(adopting())
    world.reconcile("tuner")
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-0")] = pod("vllm-0")
    world.reconcile("tuner")
    world.clock.advance(121)
    for _ in range(6):
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
        world.reconcile("tuner")
        world.clock.advance(30)


def broken_upgrade(world: World) -> None:
    """The workload's owner sets an image whose pods never get Ready."""
    workload = world.kube.objects[("Deployment", "default", "vllm")]
    workload["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:broken"
    workload["metadata"]["generation"] += 1


def test_the_owners_upgrade_that_stalls_is_not_blamed_on_the_batch_limit(world: World) -> None:
    """The limit was retuned and rolled out whole; an hour later the workload's owner upgrades it
    to an image whose pods never get Ready. That stall is the image's: the env value stays, no value
    is quarantined — before, it was rolled back, and back again, at every progress deadline."""
    retune_at_8k(world)
    retuned = env(world)[TARGET_ENV_VAR]
    assert [h["to"] for h in world.kube.status("default", "tuner")["history"]] == [64, int(retuned)]
    finish(world)
    world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
    world.reconcile("tuner")  # the retune's rollout, seen complete

    world.clock.advance(3600)
    broken_upgrade(world)
    for _ in range(3):
        world.clock.advance(600)
        stalled(world)
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
        world.reconcile("tuner")
        status = world.kube.status("default", "tuner")
        assert env(world)[TARGET_ENV_VAR] == retuned
        assert len(status["history"]) == 2 and not status.get("quarantine")


def test_a_rollback_that_stalls_too_is_not_rolled_back_again(world: World) -> None:
    """The owner's upgrade stalls before the operator saw the retune complete: the retune is rolled
    back once (it may be the limit's); when the rollback stalls too, the stall is not the limit's,
    and the value that ran before stays."""
    retune_at_8k(world)
    broken_upgrade(world)
    seen = []
    for _ in range(3):
        world.clock.advance(600)
        stalled(world)
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
        world.reconcile("tuner")
        seen.append(env(world)[TARGET_ENV_VAR])
    history = world.kube.status("default", "tuner")["history"]
    assert seen == ["64", "64", "64"] and [h["to"] for h in history][-1] == 64
    assert sum(h["reason"].startswith("rollback") for h in history) == 1


def test_a_retune_whose_status_write_failed_still_holds_the_cooldown(world: World) -> None:
    """An adopted workload keeps its rollout history in status only: the env write went through, the
    status write after it failed, and the next evaluations knew of no rollout — traffic moving back
    restarted the pods again inside the cooldown. The value the workload runs now counts."""
    world.kube.apply(user_workload())
    spec = adopting()
    spec["spec"]["tuning"]["cooldownSeconds"] = 1800
    world.kube.create(spec)
    world.reconcile("tuner")
    finish(world)
    world.kube.objects[("Pod", "default", "vllm-0")] = pod("vllm-0")
    world.clock.advance(3600)
    apply = world.kube.apply

    def apply_then_fail_the_status(obj: dict[str, Any]) -> None:
        apply(obj)
        world.kube.fail_status = True  # the status write right after the env write fails

    world.kube.apply = apply_then_fail_the_status  # type: ignore[method-assign]
    for _ in range(8):
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
        with contextlib.suppress(RuntimeError):
            world.reconcile("tuner")
        if world.kube.fail_status:
            break
        world.clock.advance(30)
    world.kube.apply, world.kube.fail_status = apply, False  # type: ignore[method-assign]
    assert env(world)[TARGET_ENV_VAR] == "16"
    assert [h["to"] for h in world.kube.status("default", "tuner").get("history", [])] == [64]
    finish(world)
    world.clock.advance(330)
    for _ in range(8):  # traffic back at 2k tokens, well inside the 30-minute cooldown
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=2048))
        world.reconcile("tuner")
        world.clock.advance(30)
    status = world.kube.status("default", "tuner")
    assert env(world)[TARGET_ENV_VAR] == "16" and status["holdReason"] == "cooldown"
    assert [(h.get("from"), h["to"]) for h in status["history"]] == [(None, 64), (64, 16)]


def test_a_workload_missing_for_a_while_keeps_its_quarantine(world: World) -> None:
    """Its image unknown while it is gone (a reinstall, `kubectl replace --force`), the workload read
    as another setup: the quarantined 16 was dropped, then rolled straight back into its deadline."""
    retune_at_8k(world)
    stalled(world)
    world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
    world.reconcile("tuner")
    assert [q["maxNumSeqs"] for q in world.kube.status("default", "tuner")["quarantine"]] == [16]
    saved = world.kube.objects.pop(("Deployment", "default", "vllm"))
    world.clock.advance(30)
    world.reconcile("tuner")
    world.kube.objects[("Deployment", "default", "vllm")] = saved
    finish(world)
    for _ in range(10):
        world.clock.advance(30)
        world.observer.set("default", "tuner", observation(world.clock.now, ctx=8192))
        world.reconcile("tuner")
    status = world.kube.status("default", "tuner")
    assert [q["maxNumSeqs"] for q in status["quarantine"]] == [16]
    assert env(world)[TARGET_ENV_VAR] == "64" and status["holdReason"] == "quarantined", status["reason"]
