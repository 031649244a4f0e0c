"""Reconcile refuses what the operator's admission rules do not allow: Degraded reason Forbidden
naming the field, a Warning Event, and nothing rendered or applied."""

from __future__ import annotations

from conftest import World, llmserving

from batchknee.api.admission import AdmissionRules


def test_a_forbidden_spec_applies_nothing_and_says_why(world: World) -> None:
    world.kube.create(llmserving(template={"serviceAccountName": "admin"}))
    world.reconcile()
    assert world.kube.applies == 0 and world.kube.get("Deployment", "default", "chat") is None
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Forbidden"
    assert degraded["message"].startswith("spec.template.serviceAccountName:")
    assert "allowServiceAccount" in degraded["message"]
    assert world.kube.status("default", "chat")["holdReason"] == "forbidden"
    assert [e["reason"] for e in world.kube.events] == ["Forbidden"]


def test_a_running_llmserving_edited_to_a_forbidden_image_keeps_its_pods(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    before = world.kube.deployment("default", "chat")
    world.kube.edit_spec("default", "chat", {"image": "evil.example/miner:1"})
    world.reconcile()
    assert world.kube.deployment("default", "chat") == before
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "Forbidden" and degraded["message"].startswith("spec.image:")


def test_what_the_admin_allowed_is_rendered(world: World) -> None:
    world.ports.admission = AdmissionRules(allow_service_account=True)
    world.kube.create(llmserving(template={"serviceAccountName": "engine"}))
    world.reconcile()
    pod = world.kube.deployment("default", "chat")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "engine" and pod["automountServiceAccountToken"] is True


def test_a_priority_class_outside_the_admins_patterns_applies_nothing(world: World) -> None:
    world.kube.create(llmserving(template={"priorityClassName": "system-node-critical"}))
    world.reconcile()
    assert world.kube.applies == 0 and world.kube.get("Deployment", "default", "chat") is None
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "Forbidden"
    assert degraded["message"].startswith("spec.template.priorityClassName:")
    assert "allowedPriorityClasses" in degraded["message"]

    world.ports.admission = AdmissionRules(allowed_priority_classes=("inference-*",))
    world.kube.edit_spec("default", "chat", {"template": {"priorityClassName": "inference-high"}})
    world.reconcile()
    pod = world.kube.deployment("default", "chat")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "inference-high"
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"
