"""Component tests: reconcile against in-memory adapters and a fixed clock."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import Clock, MemoryKube, MemoryObserver

from batchknee.reconcile import Outcome, Ports, reconcile


class World:
    """One LLMServing's world: the store, the observer, the clock, and reconcile."""

    def __init__(self) -> None:
        self.kube = MemoryKube()
        self.observer = MemoryObserver()
        self.clock = Clock()
        self.ports = Ports(self.kube, self.observer)

    def reconcile(self, name: str = "chat", namespace: str = "default") -> Outcome:
        return reconcile(namespace, name, self.ports, self.clock.now)

    def args(self, name: str = "chat", namespace: str = "default") -> list[str]:
        container = self.kube.deployment(namespace, name)["spec"]["template"]["spec"]["containers"][0]
        return list(container["args"])


def llmserving(name: str = "chat", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "engine": "VLLM",
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "gpu": {"type": "a100-80gb", "count": 1},
        "tuning": {"evaluationIntervalSeconds": 30, "windowSeconds": 120, "cooldownSeconds": 600},
        # one replica: the tests retune it, accepting the serving gap (test_rollout_safety holds it)
        "rollout": {"allowServingGap": True},
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return {
        "apiVersion": "batchknee.io/v1alpha1",
        "kind": "LLMServing",
        "metadata": {"name": name},
        "spec": body,
    }


@pytest.fixture
def world() -> World:
    return World()
