"""Rendering the engine's objects, and reading a Deployment back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from batchknee.api.resolve import parse_llmserving
from batchknee.core.engine_args import int_flag
from batchknee.core.policy import Rollout
from batchknee.render import (
    Desired,
    RenderDefaults,
    decode_rollouts,
    deployment,
    deployment_state,
    encode_rollouts,
    render,
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
        "--port", "8000", "--max-num-seqs", "64", "--enable-prefix-caching",
    ]  # fmt: skip
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
    spec = dep["spec"]
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["progressDeadlineSeconds"] == 600
    assert "replicas" not in spec  # not in the spec: left to whoever scales the Deployment
    assert spec["selector"]["matchLabels"] == {"batchknee.io/llmserving": "chat"}
    pod = spec["template"]
    assert pod["metadata"]["labels"]["batchknee.io/llmserving"] == "chat"
    assert pod["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "batchknee"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
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
                "labels": {"team": "ml", "batchknee.io/llmserving": "spoofed"},
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
    assert c["env"] == [{"name": "HF_HOME", "value": "/cache"}]
    assert c["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["spec"]["volumes"][0]["name"] == "shm"
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"]["batchknee.io/llmserving"] == "chat"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9999"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30  # never shorter than the drain
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_tensorrt_llm_objects() -> None:
    llms = obj(
        engine="TensorRTLLM",
        extraLlmApiOptions={"kv_cache_config": {"enable_block_reuse": True}, "backend": "pytorch"},
    )
    config_map, service, budget, dep = render(llms, Desired(16, 131072))
    assert budget["kind"] == "PodDisruptionBudget" and budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"batchknee.io/llmserving": "chat"}},
    }
    options = yaml.safe_load(config_map["data"]["engine.yaml"])
    assert options == {
        "backend": "pytorch",
        "max_batch_size": 16,
        "kv_cache_config": {
            "enable_block_reuse": True,
            "free_gpu_memory_fraction": 0.9,
            "max_tokens": 131072,
        },
    }
    assert service["spec"]["ports"][0]["port"] == 8000
    c = container(dep)
    assert c["command"] == ["trtllm-serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert {"name": "batchknee-engine-config", "mountPath": "/etc/batchknee", "readOnly": True} in c[
        "volumeMounts"
    ]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/prometheus/metrics"
    other = deployment(llms, Desired(24, 131072), RenderDefaults())
    assert (
        other["spec"]["template"]["metadata"]["annotations"]["batchknee.io/engine-config-checksum"]
        != annotations["batchknee.io/engine-config-checksum"]
    )
    state = deployment_state(dep)
    assert state is not None and (state.max_num_seqs, state.max_tokens) == (16, 131072)


rollouts = st.lists(
    st.builds(
        Rollout,
        st.datetimes(
            min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1), timezones=st.just(UTC)
        ).map(lambda d: d.replace(microsecond=0)),
        st.none() | st.integers(1, 4096),
        st.integers(1, 4096),
        st.text(max_size=40),
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
    assert decode_rollouts('[{"time": "yesterday"}]') == ()


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
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    ]
    state = deployment_state(dep)
    assert state is not None and state.stalled
