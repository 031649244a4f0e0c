"""Rendering the engine's objects, and reading a Deployment back."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from batchknee.api.models import format_timestamp
from batchknee.api.resolve import (
    SpecError,
    kv_pool_bytes,
    parse_llmserving,
    resolve_roofline,
    trtllm_kv_cache,
)
from batchknee.core.engine_args import int_flag
from batchknee.core.policy import Rollout
from batchknee.render import (
    TEMPLATE_CHANGED_ANNOTATION,
    Desired,
    RenderDefaults,
    decode_rollouts,
    deployment,
    deployment_state,
    draining,
    encode_rollouts,
    overridden_args,
    read_rollouts,
    ready_since,
    render,
    stale_engine_configs,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def obj(**spec: Any) -> Any:
    body = {
        "engine": "VLLM",
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "gpu": {"type": "h100", "count": 2},
    }
    body.update(spec)
    return parse_llmserving({"metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}, "spec": body})


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_vllm_deployment() -> None:
    dep = deployment(
        obj(args=["--max-num-seqs", "256", "--enable-prefix-caching"]), Desired(64, 0), RenderDefaults()
    )
    assert dep["metadata"]["name"] == "chat" and dep["metadata"]["namespace"] == "ml"
    c = container(dep)
    assert c["command"] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert c["args"] == [
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "2",
        "--port", "8000", "--max-num-seqs", "64", "--shutdown-timeout", "100", "--enable-prefix-caching",
    ]  # fmt: skip
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
    spec = dep["spec"]
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["progressDeadlineSeconds"] == 750  # unset: 600 s + 10 s per GiB of its 15 GiB of weights
    assert "replicas" not in spec  # not in the spec: left to whoever scales the Deployment
    assert spec["selector"]["matchLabels"] == {"batchknee.io/llmserving": "chat"}
    pod = spec["template"]
    # No app.kubernetes.io/instance on the pods: with app.kubernetes.io/name it is a Helm-installed
    # engine's Service selector, and its value would be the tenant's choice of name.
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "batchknee",
        "batchknee.io/llmserving": "chat",
    }
    assert dep["metadata"]["labels"] == pod["metadata"]["labels"]  # nor on the objects: no Helm
    # release's or Argo CD application's selector takes them in
    # No prometheus.io/* annotations: they opt the pods into annotation-based scrape jobs, which
    # commonly honour the series' own labels (a tenant's code could write another's llmserving).
    assert pod["metadata"]["annotations"] == {"batchknee.io/max-num-seqs": "64"}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner == {
        "apiVersion": "batchknee.io/v1alpha1", "kind": "LLMServing", "name": "chat", "uid": "u-1",
        "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip


def test_template_overrides_are_merged_in() -> None:
    dep = deployment(
        obj(
            template={
                "resources": {"limits": {"nvidia.com/gpu": 8, "memory": "64Gi"}, "requests": {"cpu": "8"}},
                "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                "env": [{"name": "HF_HOME", "value": "/cache"}],
                "labels": {"team": "ml", "app.kubernetes.io/name": "spoofed"},
                "annotations": {"prometheus.io/port": "9999"},
                "drainSeconds": 30,
                "terminationGracePeriodSeconds": 10,
            },
            rollout={"maxSurge": 1, "maxUnavailable": 0},
        ),
        Desired(64, 0),
        RenderDefaults(),
    )
    c, pod = container(dep), dep["spec"]["template"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "2", "memory": "64Gi"}, "requests": {"cpu": "8"}}
    assert c["env"] == [{"name": "HOME", "value": "/home/engine"}, {"name": "HF_HOME", "value": "/cache"}]
    # their own /dev/shm, not a second one; a home of the operator's
    assert c["volumeMounts"] == [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "batchknee-home", "mountPath": "/home/engine"},
    ]
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["spec"]["volumes"][0]["name"] == "shm"
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "vllm"  # the operator's own win
    assert pod["metadata"]["labels"]["batchknee.io/llmserving"] == "chat"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9999"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30  # never shorter than the drain
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_engine_gets_a_writable_home_shared_memory_and_time_to_finish(tmp_path: Any) -> None:
    """What a real engine needs of the restricted pod: its user (1000) has no home in the images, so
    HOME was / and every cache (Hugging Face, vLLM's compile cache, Triton) failed to write; tensor
    parallelism's workers share memory through /dev/shm (64 MiB in a container); and vLLM aborts the
    requests in flight at SIGTERM unless --shutdown-timeout gives them the grace period left."""
    dep = deployment(obj(), Desired(64, 0), RenderDefaults())
    c, pod = container(dep), dep["spec"]["template"]["spec"]
    assert {"name": "HOME", "value": "/home/engine"} in c["env"]
    assert {"name": "batchknee-home", "mountPath": "/home/engine"} in c["volumeMounts"]
    assert {"name": "batchknee-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "batchknee-shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert c["args"][c["args"].index("--shutdown-timeout") + 1] == "100"  # 120 s grace − 15 s drain − 5
    # one GPU: no shared memory of its own; a HOME of the user's, or a user of theirs, is theirs
    own = deployment(
        obj(
            gpu={"type": "h100", "count": 1},
            template={
                "env": [{"name": "HOME", "value": "/models"}],
                "drainSeconds": 30,
                "terminationGracePeriodSeconds": 300,
            },
            args=["--shutdown-timeout", "600"],
        ),
        Desired(64, 0),
        RenderDefaults(),
    )
    c = container(own)
    assert c["env"] == [{"name": "HOME", "value": "/models"}] and "volumeMounts" not in c
    assert c["args"].count("--shutdown-timeout") == 1 and c["args"][-1] == "600"
    rooted = deployment(
        obj(template={"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}),
        Desired(64, 0),
        RenderDefaults(),
    )
    assert not any(e["name"] == "HOME" for e in container(rooted).get("env", []))
    # SGLang's /health generates a token behind whatever the scheduler runs: a longer probe timeout
    sglang = deployment(obj(engine="SGLang"), Desired(64, 0), RenderDefaults())
    assert container(sglang)["readinessProbe"]["timeoutSeconds"] == 10
    assert container(dep)["readinessProbe"]["timeoutSeconds"] == 2


def deadline(**spec: Any) -> Any:
    return deployment(obj(**spec), Desired(64, 0), RenderDefaults())["spec"]["progressDeadlineSeconds"]


def test_the_progress_deadline_unset_grows_with_the_weights_each_pod_downloads() -> None:
    """Engine pods have only a readiness probe: one merely loading a big checkpoint is not
    restarted, but a deadline of 600 s passed while a 70B model (141 GB) downloaded, so every
    retune of it was rolled back and its limit quarantined. Unset, the deadline is 600 s plus 10 s
    per GiB of the whole model's weights (one pod downloads them all, whatever its GPU count), at
    the spec's weight dtype, at most a day."""
    assert deadline() == 750  # Llama-3.1-8B: 8.03e9 × 2 bytes = 14.96 GiB → 600 + 150
    assert deadline(gpu={"type": "h100", "count": 1}) == 750  # the same weights on one GPU
    seventy = {"name": "meta-llama/Llama-3.1-70B-Instruct"}
    assert deadline(model=seventy, gpu={"type": "h100", "count": 4}) == 1916  # 131.50 GiB → 600 + 1316
    # quantized to fp8 as it loads: the 16-bit checkpoint is what each pod downloads
    assert deadline(model={**seventy, "weightDtype": "fp8"}, gpu={"type": "h100", "count": 4}) == 1916
    assert (
        deadline(model={"name": "meta-llama/Llama-3.1-405B-Instruct"}, gpu={"type": "h100", "count": 8})
        == 8161
    )
    # a model outside the catalog, by its architecture; and the cap (5e12 parameters: 9,313 GiB)
    architecture = {"layers": 32, "attentionHeads": 32, "kvHeads": 8, "headDim": 128, "params": 8030000000}
    assert deadline(model={"name": "acme/chat-8b", "architecture": architecture}) == 750
    assert deadline(model={"name": "meta-llama/Llama-3.1-8B-Instruct", "params": 5_000_000_000_000}) == 86400
    # an empty rollout, or one that sets other fields, leaves it unset
    assert deadline(rollout={}) == deadline(rollout={"maxSurge": 1, "maxUnavailable": 0}) == 750


@pytest.mark.parametrize("given", [10, 30, 600, 750, 86400])
def test_a_progress_deadline_set_is_rendered_as_given(given: int) -> None:
    """A value set wins over the derived one, for a small model and a big one alike, 600 included."""
    assert deadline(rollout={"progressDeadlineSeconds": given}) == given
    big = {"name": "meta-llama/Llama-3.1-70B-Instruct"}
    assert (
        deadline(model=big, gpu={"type": "h100", "count": 4}, rollout={"progressDeadlineSeconds": given})
        == given
    )


def test_tensorrt_llm_objects() -> None:
    llms = obj(
        engine="TensorRTLLM",
        extraLlmApiOptions={"kv_cache_config": {"enable_block_reuse": True}, "backend": "pytorch"},
    )
    config_map, service, budget, dep = render(llms, Desired(16, 131072))
    assert budget["kind"] == "PodDisruptionBudget" and budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"batchknee.io/llmserving": "chat"}},
        # an engine that never gets Ready must not block node drains
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    options = yaml.safe_load(config_map["data"]["engine.yaml"])
    # no max_tokens: max_batch_size carries the knee (a B × context token cap starves the
    # guaranteed-no-evict scheduler); the free-memory fraction is the one the math uses; without
    # the two switches trtllm-serve has no /prometheus/metrics and no running or KV gauges
    assert options == {
        "backend": "pytorch",
        "max_batch_size": 16,
        "tensor_parallel_size": 2,
        "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.9},
        "return_perf_metrics": True,
        "enable_iter_perf_stats": True,
    }
    assert config_map["immutable"] is True
    assert re.fullmatch(r"chat-engine-[0-9a-f]{8}", config_map["metadata"]["name"])
    assert service["spec"]["ports"][0]["port"] == 8000
    c = container(dep)
    assert c["command"] == ["trtllm-serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert {"name": "batchknee-engine-config", "mountPath": "/etc/batchknee", "readOnly": True} in c[
        "volumeMounts"
    ]
    volume = next(
        v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "batchknee-engine-config"
    )
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]  # the revision names its file
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert not any(key.startswith("prometheus.io/") for key in annotations)
    other_map, _, _, other = render(llms, Desired(24, 131072))
    assert other_map["metadata"]["name"] != config_map["metadata"]["name"]
    assert (
        other["spec"]["template"]["metadata"]["annotations"]["batchknee.io/engine-config-checksum"]
        != annotations["batchknee.io/engine-config-checksum"]
    )
    state = deployment_state(dep)
    assert state is not None and (state.max_num_seqs, state.max_tokens) == (16, None)


def test_tensorrt_llm_memory_configuration_has_one_source() -> None:
    # the user's free-memory fraction and fp8 KV reach both the math (the KV pool) and the file
    llms = obj(
        engine="TensorRTLLM",
        model={"name": "meta-llama/Llama-3.1-8B-Instruct", "kvCacheDtype": "fp8"},
        extraLlmApiOptions={"kv_cache_config": {"free_gpu_memory_fraction": 0.5, "max_tokens": 100_000}},
    )
    options = yaml.safe_load(render(llms, Desired(16, 0))[0]["data"]["engine.yaml"])
    assert options["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.5,
        "max_tokens": 100_000,
        "dtype": "fp8",
    }
    roofline = resolve_roofline(llms.spec)
    assert kv_pool_bytes(llms.spec, roofline) == min(
        roofline.kv_pool_bytes_free_fraction(0.5), 100_000 * roofline.kv_bytes_per_token
    )
    assert roofline.kv_bytes_per_token == 131072 / 2 / 2  # fp8 halves it in the math too (per GPU of 2)
    flag = obj(engine="TensorRTLLM", args=["--kv_cache_free_gpu_memory_fraction", "0.6"])
    assert yaml.safe_load(render(flag, Desired(16, 0))[0]["data"]["engine.yaml"])["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.6
    }
    assert kv_pool_bytes(flag.spec, roofline) > 0


@pytest.mark.parametrize(
    ("max_tokens", "fraction"),
    [(2**31, None), (0, None), (True, None), (1.5, None), (None, 0), (None, 1.5), (None, "half")],
)
def test_tensorrt_llm_kv_options_out_of_range_name_the_field(max_tokens: object, fraction: object) -> None:
    kv: dict[str, object] = {}
    if max_tokens is not None:
        kv["max_tokens"] = max_tokens
    if fraction is not None:
        kv["free_gpu_memory_fraction"] = fraction
    llms = obj(engine="TensorRTLLM", extraLlmApiOptions={"kv_cache_config": kv})
    with pytest.raises(SpecError) as error:
        trtllm_kv_cache(llms.spec)
    field = "max_tokens" if max_tokens is not None else "free_gpu_memory_fraction"
    assert error.value.field == f"spec.extraLlmApiOptions.kv_cache_config.{field}"
    if max_tokens is not None:
        assert "2147483647" in str(error.value)
    assert (
        trtllm_kv_cache(
            obj(engine="TensorRTLLM", extraLlmApiOptions={"kv_cache_config": {"max_tokens": 2**31 - 1}}).spec
        ).max_tokens
        == 2**31 - 1
    )


def test_stale_engine_configs_keep_the_newest_three_of_ours() -> None:
    llms = obj(engine="TensorRTLLM")

    def item(name: str, second: int, uid: str | None = "u-1") -> dict[str, object]:
        refs = [{"controller": True, "uid": uid}] if uid else []  # obj() has uid u-1
        return {"metadata": {"name": name, "uid": f"cm-{name}", "ownerReferences": refs,
                             "creationTimestamp": f"2026-03-01T12:00:{second:02d}Z"}}  # fmt: skip

    found = [
        item("a", 1),
        item("b", 2),
        item("c", 3),
        item("d", 4),
        item("foreign", 0, "other"),
        item("e", 5),
    ]
    assert stale_engine_configs(llms, found, current="e") == [("b", "cm-b"), ("a", "cm-a")]
    assert stale_engine_configs(llms, found, current="a") == [("c", "cm-c"), ("b", "cm-b")]


rollouts = st.lists(
    st.builds(
        Rollout,
        st.datetimes(
            min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1), timezones=st.just(UTC)
        ).map(lambda d: d.replace(microsecond=0)),
        st.none() | st.integers(1, 4096),
        st.integers(1, 4096),
        st.text(max_size=40),
        live=st.booleans(),
    ),
    max_size=10,
).map(lambda rs: sorted(rs, key=lambda r: r.time))


@given(rollouts, st.integers(1, 4096))
def test_the_cluster_reads_back_what_was_rendered(record: list[Rollout], n: int) -> None:
    dep = deployment(obj(args=["--max_num_seqs=7"]), Desired(n, 0, tuple(record)), RenderDefaults())
    state = deployment_state(dep)
    assert state is not None
    assert state.max_num_seqs == n == int_flag(container(dep)["args"], "--max-num-seqs")
    assert list(state.rollouts) == record
    assert decode_rollouts(encode_rollouts(record)) == tuple(record)


def test_a_damaged_record_reads_as_none() -> None:
    assert decode_rollouts("{not json") == ()
    assert decode_rollouts('{"time": "2026-03-01T12:00:00Z"}') == ()
    assert decode_rollouts("[" * 100_000 + "]" * 100_000) == ()  # json's RecursionError
    assert decode_rollouts('[{"time": "yesterday"}]') == ()
    # a time without its zone (an edited annotation) would make every comparison with now raise
    assert decode_rollouts('[{"time": "2026-03-01T12:00:00", "from": 64, "to": 16, "reason": "r"}]') == ()


GOOD = {"time": "2026-03-01T12:00:00Z", "from": 64, "to": 16, "reason": "r"}


@pytest.mark.parametrize(
    "damaged",
    [
        {**GOOD, "time": "2026-03-01T13:00:00"},  # no zone
        {**GOOD, "time": ["2026-03-01T13:00:00Z"]},
        {**GOOD, "to": 1e999},  # int(inf) raised OverflowError
        {**GOOD, "to": 0},
        {**GOOD, "to": True},
        {**GOOD, "to": 16.5},
        {**GOOD, "to": 2**60},
        {**GOOD, "from": "64"},
        {**GOOD, "reason": {"r": 1}},
        "an entry",
        None,
    ],
)
def test_a_damaged_entry_is_skipped_and_the_rest_kept(damaged: Any) -> None:
    """The rest of the record still holds the cooldown, the budget and the stall rollback."""
    later = {**GOOD, "time": "2026-03-01T12:30:00Z", "from": 16, "to": 32, "target": 1e999}
    text = json.dumps([GOOD, damaged, later])
    rollouts, note = read_rollouts(text)
    assert [(r.from_value, r.to_value, r.target) for r in rollouts] == [(64, 16, None), (16, 32, None)]
    assert note == "1 of its 3 entries unreadable: skipped"
    nested = text.replace('"to": 32', '"to": ' + "[" * 100_000 + "]" * 100_000)
    assert read_rollouts(nested) == ((), "not JSON: read as no record")


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    )
)
def test_no_record_raises(value: Any) -> None:
    kept = decode_rollouts(json.dumps([value, GOOD, {**GOOD, "to": value}, {**GOOD, "time": value}]))
    assert kept[0] == Rollout(datetime(2026, 3, 1, 12, tzinfo=UTC), 64, 16, "r")


def test_a_record_keeps_its_newest_entries_and_bounded_reasons() -> None:
    entries = [{**GOOD, "time": f"2026-03-01T12:{minute:02d}:00Z", "to": minute + 1} for minute in range(30)]
    entries[-1]["reason"] = "x" * 100_000
    rollouts = decode_rollouts(json.dumps(entries))
    assert [r.to_value for r in rollouts] == list(range(21, 31))  # as many as status.history holds
    assert len(rollouts[-1].reason) == 2048


def test_rollout_progress() -> None:
    dep = deployment(obj(), Desired(64, 0), RenderDefaults())
    dep["metadata"]["generation"] = 2
    assert deployment_state(None) is None
    state = deployment_state(dep)
    assert state is not None and state.rolling  # the controller has not seen generation 2
    dep["status"] = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1}
    state = deployment_state(dep)
    assert state is not None and state.rolling and "old pods" in state.message
    dep["status"] = {
        "observedGeneration": 2,
        "replicas": 1,
        "updatedReplicas": 1,
        "availableReplicas": 1,
        "readyReplicas": 1,
    }
    state = deployment_state(dep)
    assert state is not None and not state.rolling and state.available
    dep["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "lastUpdateTime": "2026-03-01T12:00:10Z",
        }
    ]
    state = deployment_state(dep)
    assert state is not None and state.stalled
    assert state.stalled_at == datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC)
    dep["metadata"]["generation"] = 3  # a new template the controller has not seen: not its stall
    state = deployment_state(dep)
    assert state is not None and not state.stalled and state.rolling


def test_template_progress_is_pods_being_replaced_not_pods_unavailable() -> None:
    dep = deployment(obj(), Desired(64, 0), RenderDefaults())
    dep["metadata"]["generation"] = 2
    dep["status"] = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1}
    state = deployment_state(dep)
    assert state is not None and state.rolling and state.template_progressing
    dep["status"] = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 0}
    state = deployment_state(dep)  # the new template's pod is there, not available (yet, or ever)
    assert state is not None and state.rolling and not state.template_progressing


def test_the_template_change_time_goes_with_the_deployment_and_a_damaged_one_reads_as_none() -> None:
    moment = datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC)
    dep = deployment(obj(), Desired(64, 0, template_changed_at=moment), RenderDefaults())
    state = deployment_state(dep)
    assert state is not None and state.template_changed_at == moment
    assert deployment_state(deployment(obj(), Desired(64, 0), RenderDefaults())).template_changed_at is None  # type: ignore[union-attr]
    for damaged in ("2026-03-01T12:00:10", "yesterday", ""):  # no zone: never compared with an aware time
        dep["metadata"]["annotations"][TEMPLATE_CHANGED_ANNOTATION] = damaged
        assert deployment_state(dep).template_changed_at is None  # type: ignore[union-attr]


def test_overridden_args_name_the_users_spelling_and_the_value_run() -> None:
    vllm = obj(args=["-tp", "4", "--max-num-seqs=999", "--port", "8000", "--seed", "3"])
    assert overridden_args(vllm, Desired(64, 0)) == ["--max-num-seqs=999 → 64", "-tp 4 → 2"]
    # the tensor-parallel size under its other name too, and in the options file (which overrides
    # the flag: the pod held 2 GPUs and ran on 8, or on 1)
    trt = obj(
        engine="TensorRTLLM",
        args=["--tp_size", "1", "--max_batch_size", "512", "--tensor_parallel_size", "8"],
        extraLlmApiOptions={
            "max_batch_size": 300,
            "tensor_parallel_size": 1,
            "return_perf_metrics": False,
            "enable_iter_perf_stats": True,
        },
    )
    assert overridden_args(trt, Desired(16, 0)) == [
        "--max_batch_size 512 → 16",
        "--tp_size 1 → 2",
        "--tensor_parallel_size 8 → 2",
        "extraLlmApiOptions.max_batch_size 300 → 16",
        "extraLlmApiOptions.tensor_parallel_size 1 → 2",
        "extraLlmApiOptions.return_perf_metrics false → true",
    ]
    config_map, *_, dep = render(trt, Desired(16, 0))
    assert yaml.safe_load(config_map["data"]["engine.yaml"])["tensor_parallel_size"] == 2
    assert "--tensor_parallel_size" not in container(dep)["args"]
    assert overridden_args(obj(args=["--seed", "3"]), Desired(64, 0)) == []


@pytest.mark.parametrize(
    ("given", "iteration_switch"),
    [
        ({}, True),
        ({"extraLlmApiOptions": {"backend": "pytorch"}}, True),
        ({"extraLlmApiOptions": {"backend": "tensorrt"}}, False),
        ({"args": ["--backend", "tensorrt"]}, False),
        ({"args": ["--backend", "tensorrt"], "extraLlmApiOptions": {"backend": "_autodeploy"}}, True),
    ],
)
def test_the_iteration_stats_switch_is_set_only_for_a_backend_that_takes_it(
    given: dict[str, Any], iteration_switch: bool
) -> None:
    """The tensorrt backend always collects iteration stats, and its options refuse unknown keys."""
    config_map = render(obj(engine="TensorRTLLM", **given), Desired(16, 0))[0]
    options = yaml.safe_load(config_map["data"]["engine.yaml"])
    assert options["return_perf_metrics"] is True
    assert ("enable_iter_perf_stats" in options) is iteration_switch


def test_a_second_running_batch_limit_is_removed_and_named() -> None:
    """vLLM 0.34's --max-num-active-seqs caps the running batch under --max-num-seqs: above the
    operator's value vLLM refuses to start, under it the operator's value would not be what runs."""
    user = ["--max-num-active-seq", "128", "--max_num_active_seqs=8", "--seed", "3"]
    dep = deployment(obj(args=user), Desired(64, 0), RenderDefaults())
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert int_flag(args, "--max-num-seqs") == 64
    assert not any("active" in a for a in args) and args[-2:] == ["--seed", "3"]
    assert overridden_args(obj(args=user), Desired(64, 0)) == [
        "--max-num-active-seq 128 → removed",
        "--max_num_active_seqs=8 → removed",
    ]


def test_sglang_deployment_runs_launch_server_with_the_managed_flags_first() -> None:
    user = [
        "--model",
        "other/model",
        "--tp",
        "8",
        "--max-running-requests=999",
        "--mem-fraction-static",
        "0.8",
    ]
    dep = deployment(obj(engine="SGLang", args=user), Desired(48, 0), RenderDefaults())
    c = container(dep)
    assert c["command"] == ["python", "-m", "sglang.launch_server"]
    assert c["args"] == [
        "--model-path", "meta-llama/Llama-3.1-8B-Instruct", "--max-running-requests", "48", "--tp-size", "2",
        "--host", "0.0.0.0", "--port", "8000", "--enable-metrics", "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "sglang"
    assert c["image"] == "lmsysorg/sglang:v0.5.23"
    assert [o["kind"] for o in render(obj(engine="SGLang"), Desired(48, 0))] == [
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    without_budgets = RenderDefaults(disruption_budgets=False)  # settings.disruption_budgets off
    assert [o["kind"] for o in render(obj(engine="SGLang"), Desired(48, 0), without_budgets)] == [
        "Service",
        "Deployment",
    ]
    state = deployment_state(dep)
    assert state is not None and state.max_num_seqs == 48


def test_sglang_overridden_args_list_every_managed_flag_and_alias() -> None:
    sglang = obj(
        engine="SGLang",
        args=["--tensor-parallel-size", "4", "--max-running-requests", "512", "--model=x", "--port", "30000"],
    )
    assert overridden_args(sglang, Desired(32, 0)) == [
        "--max-running-requests 512 → 32",
        "--tensor-parallel-size 4 → 2",
        "--port 30000 → 8000",
        "--model=x → meta-llama/Llama-3.1-8B-Instruct",
    ]
    assert overridden_args(obj(engine="SGLang", args=["--enable-metrics"]), Desired(32, 0)) == []


def test_the_options_files_kept_stay_within_their_bound_newest_first() -> None:
    """A TensorRT-LLM options file is rendered once per content and kept, the least recently used
    dropped first, within a bound on the characters kept (64 Ki emoji are 700 KB of YAML)."""
    from batchknee.render import _YamlCache

    cache = _YamlCache(max_chars=120)  # two of these files of 54 characters
    first = cache.yaml(json.dumps({"a": "x" * 50}))
    assert first == yaml.safe_dump({"a": "x" * 50}) and cache.chars == len(first)
    cache.yaml(json.dumps({"b": "y" * 50}))
    assert cache.yaml(json.dumps({"a": "x" * 50})) is first  # kept, and now the most recent
    cache.yaml(json.dumps({"c": "z" * 50}))  # past 120 characters: "b" goes, the least recent
    assert len(cache.texts) == 2 and cache.chars <= 120
    assert cache.yaml(json.dumps({"a": "x" * 50})) is first
    huge = cache.yaml(json.dumps({"d": "\U0001f600" * 1000}))  # alone past the bound: not kept
    assert huge == yaml.safe_dump({"d": "\U0001f600" * 1000}) and cache.chars <= 120
    assert cache.yaml(json.dumps({"a": "x" * 50})) is first  # nor did it push out the others


def test_a_pod_draining_counts_within_its_grace_period_and_a_margin_and_no_further() -> None:
    now = datetime(2026, 3, 1, 12, tzinfo=UTC)

    def pod(name: str, deleted_in_s: float | None, ready_s_ago: float = 0) -> dict[str, object]:
        meta: dict[str, object] = {"name": name}
        if deleted_in_s is not None:
            meta["deletionTimestamp"] = format_timestamp(now + timedelta(seconds=deleted_in_s))
        ready = {
            "type": "Ready",
            "status": "True",
            "lastTransitionTime": format_timestamp(now - timedelta(seconds=ready_s_ago)),
        }
        return {"metadata": meta, "status": {"phase": "Running", "conditions": [ready]}}

    pods = [
        pod("draining", 90),
        pod("stuck", -61),  # a minute past its deletionTimestamp
        pod("a-day-and-more", 86401),  # no drain takes that long: as good as stuck
        pod("serving", None, ready_s_ago=30),
        pod("serving-long", None, ready_s_ago=3000),
    ]
    assert draining(pods, now) == ["draining"]
    assert ready_since(pods) == now - timedelta(seconds=30)  # terminating pods' conditions not read
    assert ready_since([pod("draining", 90)]) is None
