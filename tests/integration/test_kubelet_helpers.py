"""The test kubelet's pure helpers: $(VAR) expansion, mountPath rewriting, label sanitizing, scrape
targets."""

from __future__ import annotations

from typing import Any

from batchknee.api.resolve import parse_llmserving
from batchknee.devcluster.kubelet import expand, rewrite_paths, sanitize_label, scrape_targets
from batchknee.render import Desired, RenderDefaults, deployment


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("--x=$(A)-$(B)", env) == "--x=1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"


def test_rewrite_paths_maps_mounts_and_flag_values() -> None:
    mounts = [("/etc/batchknee/sub", "/h/sub"), ("/etc/batchknee", "/h/cfg")]
    assert rewrite_paths("/etc/batchknee/engine.yaml", mounts) == "/h/cfg/engine.yaml"
    assert rewrite_paths("/etc/batchknee/sub/x", mounts) == "/h/sub/x"
    assert rewrite_paths("--extra=/etc/batchknee/e.yaml", mounts) == "--extra=/h/cfg/e.yaml"
    assert rewrite_paths("/etc/batchknee", mounts) == "/h/cfg"
    assert rewrite_paths("/etc/batchkneeX/y", mounts) == "/etc/batchkneeX/y"
    assert rewrite_paths("--max-num-seqs=64", mounts) == "--max-num-seqs=64"


def test_sanitize_label() -> None:
    assert sanitize_label("app.kubernetes.io/name") == "app_kubernetes_io_name"
    assert sanitize_label("9lives") == "_9lives"


def engine_pod(engine: str) -> dict[str, Any]:
    """A pod of the operator's rendered template, as the Deployment controller makes one."""
    llms = parse_llmserving(
        {
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
            "spec": {
                "engine": engine,
                "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                "gpu": {"type": "h100"},
            },
        }
    )
    template = deployment(llms, Desired(16, 131072), RenderDefaults())["spec"]["template"]
    return {**template, "metadata": {**template["metadata"], "namespace": "team-a", "name": "chat-0"}}


def test_engine_pods_are_scraped_on_their_engines_path_as_the_podmonitors_do() -> None:
    """The rendered pods carry no prometheus.io/* annotations: the test world finds their path by
    engine, as the chart's PodMonitors do (TensorRT-LLM serves Prometheus text on its own path)."""
    for engine, path in [
        ("VLLM", "/metrics"),
        ("TensorRTLLM", "/prometheus/metrics"),
        ("SGLang", "/metrics"),
    ]:
        (target,) = scrape_targets(engine_pod(engine), "127.0.0.9")
        assert target["targets"] == ["127.0.0.9:8000"]
        assert target["labels"]["__metrics_path__"] == path, engine
        assert (target["labels"]["namespace"], target["labels"]["pod"]) == ("team-a", "chat-0")
        assert target["labels"]["llmserving"] == "chat"
    # an engine pod's other ports are not scraped (the PodMonitors name the `http` port)
    sidecar = engine_pod("VLLM")
    sidecar["spec"]["containers"].append(
        {"name": "proxy", "ports": [{"name": "admin", "containerPort": 9901}]}
    )
    assert [t["targets"] for t in scrape_targets(sidecar, "127.0.0.9")] == [["127.0.0.9:8000"]]
    annotated = engine_pod("TensorRTLLM")
    annotated["metadata"]["annotations"] = {"prometheus.io/path": "/other"}
    assert scrape_targets(annotated, "127.0.0.9")[0]["labels"]["__metrics_path__"] == "/other"
    annotated["metadata"]["annotations"] = {"prometheus.io/scrape": "false"}
    assert scrape_targets(annotated, "127.0.0.9") == []
