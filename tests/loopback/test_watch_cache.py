"""The watch cache: a steady-state reconcile reads what the watches delivered, never what was there
before the operator's own write, and an object that stops being the operator's is read afresh."""

from __future__ import annotations

from typing import Any

import pytest
from test_kubernetes_retries import Script, apiserver

from batchknee.adapters.kubernetes import KubernetesAdapter, WatchCache
from batchknee.handlers import remember
from batchknee.ports import ApplyConflict
from batchknee.render import LABEL

__all__ = ["apiserver"]


def deployment(version: str, replicas: int = 1, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "chat",
            "namespace": "ml",
            "resourceVersion": version,
            "labels": labels,
            "managedFields": [{"manager": "batchknee", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {"replicas": replicas},
    }


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_listed_object_reads_back_as_a_get_would_without_managed_fields() -> None:
    cache = WatchCache()
    remember(
        cache,
        "Deployment",
        "apps/v1",
        {"type": None, "object": deployment("7", **{LABEL: "chat"})},
        label=LABEL,
    )
    found = cache.get("Deployment", "ml", "chat")
    assert found is not None
    assert found["kind"] == "Deployment" and found["apiVersion"] == "apps/v1"  # a list's items lack both
    assert "managedFields" not in found["metadata"] and found["metadata"]["resourceVersion"] == "7"
    found["spec"]["replicas"] = 5  # each read is the caller's own copy
    assert cache.get("Deployment", "ml", "chat")["spec"]["replicas"] == 1  # type: ignore[index]


def test_deleted_or_relabelled_objects_are_read_from_the_apiserver() -> None:
    cache = WatchCache()
    ours = {"type": "MODIFIED", "object": deployment("7", **{LABEL: "chat"})}
    remember(cache, "Deployment", "apps/v1", ours, label=LABEL)
    remember(cache, "Deployment", "apps/v1", {"type": "MODIFIED", "object": deployment("8")}, label=LABEL)
    assert cache.get("Deployment", "ml", "chat") is None  # label taken off: no longer the operator's
    remember(cache, "Deployment", "apps/v1", ours, label=LABEL)
    remember(
        cache, "Deployment", "apps/v1", {"type": "DELETED", "object": deployment("9", **{LABEL: "chat"})}
    )
    assert cache.get("Deployment", "ml", "chat") is None and len(cache) == 0


def test_after_a_write_reads_wait_for_the_watch_to_bring_it() -> None:
    clock = Clock()
    cache = WatchCache(write_wait_s=10, clock=clock)
    cache.seen("Deployment", deployment("7"))
    cache.wrote("Deployment", "ml", "chat", "9")
    assert cache.get("Deployment", "ml", "chat") is None  # what it holds is from before the write
    cache.seen("Deployment", deployment("8"))  # an event from before the write, still in flight
    assert cache.get("Deployment", "ml", "chat") is None
    cache.seen("Deployment", deployment("9", replicas=3))  # the write itself
    assert cache.get("Deployment", "ml", "chat")["spec"]["replicas"] == 3  # type: ignore[index]

    # a write whose own event never shows (squashed by a later one): the wait ends
    cache.wrote("Deployment", "ml", "chat", "11")
    cache.seen("Deployment", deployment("12", replicas=4))
    assert cache.get("Deployment", "ml", "chat") is None
    clock.now += 10
    assert cache.get("Deployment", "ml", "chat")["spec"]["replicas"] == 4  # type: ignore[index]


def test_waits_no_read_or_event_ends_are_swept() -> None:
    """A write of an object no watch brings back and no read asks for again (an options ConfigMap
    named by its content, replaced at each retune) kept its wait for good: one entry per retune."""
    clock = Clock()
    cache = WatchCache(write_wait_s=10, clock=clock)
    for retune in range(100):
        cache.wrote("ConfigMap", "ml", f"chat-options-{retune}", str(retune))
        clock.now += 60
    assert len(cache._written) <= 1
    cache.wrote("Deployment", "ml", "chat", "9")
    cache.seen("Deployment", deployment("8"))
    assert cache.get("Deployment", "ml", "chat") is None  # a wait still on is kept


def test_a_cleared_cache_knows_nothing() -> None:
    cache = WatchCache()
    cache.seen("Service", deployment("7"))
    cache.clear()
    assert cache.get("Service", "ml", "chat") is None


def test_the_adapter_reads_the_cache_and_the_apiserver_only_around_it(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    script, plain = apiserver
    cache = WatchCache()
    kube = KubernetesAdapter(plain.api_client, timeout_s=5, cache=cache)
    cache.seen("Deployment", {"apiVersion": "apps/v1", "kind": "Deployment", **deployment("7")})
    assert kube.get_deployment("ml", "chat")["metadata"]["resourceVersion"] == "7"  # type: ignore[index]
    assert script.requests == []

    # an object the watch has not brought: asked for (an LLMServing by a list of its name, which the
    # watch's RBAC allows)
    script.answers.append((200, {"items": [{"metadata": {"name": "chat", "namespace": "ml"}}]}))
    assert kube.get_llmserving("ml", "chat") is not None
    assert script.requests == ["GET /apis/batchknee.io/v1alpha1/namespaces/ml/llmservings"]

    # a fresh read asks the apiserver though the cache has it (the watch may have missed a delete)
    script.requests.clear()
    cache.seen("LLMServing", {"metadata": {"name": "gone", "namespace": "ml", "resourceVersion": "3"}})
    assert kube.get_llmserving("ml", "gone") is not None and script.requests == []
    script.answers.append((200, {"items": []}))
    assert kube.get_llmserving("ml", "gone", fresh=True) is None
    assert script.requests == ["GET /apis/batchknee.io/v1alpha1/namespaces/ml/llmservings"]

    # after the operator's own write, the next read is the apiserver's until the watch brings it
    script.requests.clear()
    script.answers.append((200, {"metadata": {"name": "chat", "namespace": "ml", "resourceVersion": "8"}}))
    kube.apply({"apiVersion": "apps/v1", **deployment("7")} | {"kind": "Deployment"})
    script.answers.append((200, {"metadata": {"name": "chat", "namespace": "ml", "resourceVersion": "8"}}))
    assert kube.get_deployment("ml", "chat")["metadata"]["resourceVersion"] == "8"  # type: ignore[index]
    assert script.requests == [
        "PATCH /apis/apps/v1/namespaces/ml/deployments/chat",
        "GET /apis/apps/v1/namespaces/ml/deployments/chat",
    ]
    cache.seen("Deployment", deployment("8"))
    script.requests.clear()
    assert kube.get_deployment("ml", "chat")["metadata"]["resourceVersion"] == "8"  # type: ignore[index]
    assert script.requests == []


def test_an_apply_that_meets_a_newer_object_reads_the_apiserver_next(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A 409 on the resourceVersion read from the cache: the watch has not brought the newer object
    yet, so the decision made again (reconcile's second attempt) must read the apiserver, or it
    reads the same body and meets the same 409."""
    script, plain = apiserver
    cache = WatchCache()
    kube = KubernetesAdapter(plain.api_client, timeout_s=5, cache=cache)
    cache.seen("Deployment", {"apiVersion": "apps/v1", "kind": "Deployment", **deployment("7")})
    read = kube.get_deployment("ml", "chat")
    assert read is not None and script.requests == []
    script.answers.append((409, {"kind": "Status", "code": 409, "reason": "Conflict"}))
    with pytest.raises(ApplyConflict):
        kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", **read})
    script.answers.append((200, {"metadata": {"name": "chat", "namespace": "ml", "resourceVersion": "8"}}))
    assert kube.get_deployment("ml", "chat")["metadata"]["resourceVersion"] == "8"  # type: ignore[index]
    assert script.requests == [
        "PATCH /apis/apps/v1/namespaces/ml/deployments/chat",
        "GET /apis/apps/v1/namespaces/ml/deployments/chat",
    ]


def listed(cache: WatchCache, name: str, namespace: str = "ml", labelled: bool = True) -> None:
    body = deployment("7", **({LABEL: name} if labelled else {}))
    body["metadata"].update(name=name, namespace=namespace)
    remember(cache, "Deployment", "apps/v1", {"type": None, "object": body}, label=LABEL)


def test_an_object_a_later_listing_did_not_deliver_is_read_from_the_apiserver() -> None:
    """kopf lists again after a watch's 410 Gone, and an object deleted in the gap sends no DELETED:
    served from here, a deleted engine Deployment was never made again (its LLMServing Ready)."""
    clock = Clock()
    cache = WatchCache(clock=clock)
    for name in ("a", "b"):
        listed(cache, name)
    listed(cache, "x", namespace="other")
    clock.now += 600
    listed(cache, "a")  # the listing after a 410: b was deleted in the gap
    assert cache.get("Deployment", "ml", "a") is not None
    assert cache.get("Deployment", "ml", "b") is None
    assert cache.get("Deployment", "other", "x") is not None  # another namespace's watch listed nothing
    # one listing, however many pages: objects delivered a moment apart belong to it
    clock.now += 1
    listed(cache, "c")
    assert cache.get("Deployment", "ml", "a") is not None and cache.get("Deployment", "ml", "c") is not None
    # an object of the kind that is not the operator's still says a listing ran
    clock.now += 600
    listed(cache, "unlabelled", labelled=False)
    assert cache.get("Deployment", "ml", "a") is None
    # and an event after the listing counts as a delivery
    clock.now += 1
    remember(
        cache,
        "Deployment",
        "apps/v1",
        {"type": "MODIFIED", "object": deployment("8", **{LABEL: "chat"})},
        label=LABEL,
    )
    assert cache.get("Deployment", "ml", "chat") is not None
