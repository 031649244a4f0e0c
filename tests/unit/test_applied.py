"""A rendered object is skipped only when the cluster holds it exactly as rendered: the stamp matches
and every rendered field reads back with its value (defaults the apiserver adds around them are fine)."""

from __future__ import annotations

import copy
from typing import Any

from batchknee.applied import APPLIED_ANNOTATION, TEMPLATE_ANNOTATION, in_place, new_pod_template, stamp


def rendered() -> dict[str, Any]:
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "chat", "namespace": "default", "labels": {"app": "chat"}},
            "spec": {
                "replicas": 1,
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "engine", "args": ["--max-num-seqs", "64"], "env": []},
                        ]
                    }
                },
            },
        }
    )


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    """As the apiserver returns it: defaults, status and bookkeeping added."""
    found = copy.deepcopy(obj)
    found["metadata"].update(resourceVersion="7", generation=2, uid="u-1")
    found["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicy="IfNotPresent")
    del found["spec"]["template"]["spec"]["containers"][0]["env"]  # an empty list is not stored
    found["spec"]["revisionHistoryLimit"] = 10
    found["status"] = {"replicas": 1}
    return found


def test_what_the_cluster_holds_as_rendered_is_in_place() -> None:
    assert in_place(rendered(), stored(rendered()))


def test_an_edited_managed_field_is_not_in_place() -> None:
    edited = stored(rendered())
    edited["spec"]["template"]["spec"]["containers"][0]["args"][1] = "999"  # a kubectl edit
    assert not in_place(rendered(), edited)
    longer = stored(rendered())
    longer["spec"]["template"]["spec"]["containers"][0]["args"].append("--enforce-eager")
    assert not in_place(rendered(), longer)
    typed = stored(rendered())
    typed["spec"]["replicas"] = True  # a value of another type is another value
    assert not in_place(rendered(), typed)


def test_a_different_rendering_or_no_stamp_is_not_in_place() -> None:
    before = stored(rendered())
    now = rendered()
    del now["metadata"]["labels"]  # rendered without a field it had: only an apply removes it
    now = stamp(now)
    assert (
        now["metadata"]["annotations"][APPLIED_ANNOTATION]
        != before["metadata"]["annotations"][APPLIED_ANNOTATION]
    )
    assert not in_place(now, before)
    unstamped = stored(rendered())
    del unstamped["metadata"]["annotations"][APPLIED_ANNOTATION]  # applied by an older operator
    assert not in_place(rendered(), unstamped)
    assert not in_place(rendered(), None)


def test_the_stamp_ignores_the_resource_version_and_itself() -> None:
    first = rendered()
    again = copy.deepcopy(first)
    again["metadata"]["resourceVersion"] = "42"
    assert stamp(again)["metadata"]["annotations"] == first["metadata"]["annotations"]


def test_a_new_pod_template_is_a_rendering_of_another_template() -> None:
    before = stored(rendered())
    assert not new_pod_template(rendered(), before)  # as it runs (the apiserver's defaults around it)
    assert not new_pod_template(rendered(), None)  # a creation rolls nothing

    relabelled = rendered()
    relabelled["metadata"]["labels"]["team"] = "a"  # the Deployment's own metadata
    relabelled["spec"]["replicas"] = 2  # and its scale: neither is the pod template
    assert not new_pod_template(stamp(relabelled), before)

    new_image = rendered()
    new_image["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v9"
    assert new_pod_template(new_image, before)

    # an edit since the apply is not a new rendering (putting it back restores the one recorded)
    edited = stored(rendered())
    edited["spec"]["template"]["spec"]["containers"][0]["args"][1] = "999"
    edited["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "8"}}
    assert not new_pod_template(rendered(), edited)


def test_a_template_field_no_longer_rendered_is_a_new_template() -> None:
    with_env = rendered()
    with_env["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}]
    before = stored(stamp(with_env))
    # the read-back holds every field rendered now; only the recorded template hash tells that the
    # apply removes one
    assert new_pod_template(rendered(), before)
    older = copy.deepcopy(before)
    del older["metadata"]["annotations"][TEMPLATE_ANNOTATION]  # applied by an operator before the hash
    assert not new_pod_template(rendered(), older)  # the fields are all it has to go by
    older["spec"]["template"]["spec"]["containers"][0]["args"][1] = "999"
    assert new_pod_template(rendered(), older)
