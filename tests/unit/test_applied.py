"""A rendered object is skipped only when the cluster holds it exactly as rendered: the stamp matches
and every rendered field reads back with its value (defaults the apiserver adds around them are fine)."""

from __future__ import annotations

import copy
from typing import Any

from batchknee.applied import APPLIED_ANNOTATION, in_place, stamp


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
