"""Transient apiserver answers (409, 429, 5xx) are retried with backoff; others are not.

A loopback HTTP server stands in for an apiserver that is busy: it answers from a script."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client

from batchknee.adapters import kubernetes as kube_adapter
from batchknee.adapters.kubernetes import KubernetesAdapter
from batchknee.ports import ApplyConflict, ApplyError, TransientApiError

DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat", "namespace": "ml"}}
# a change to an object the operator read as its own: conditional on the resourceVersion read
UPDATE = {**DEPLOYMENT, "metadata": {**DEPLOYMENT["metadata"], "resourceVersion": "7"}, "spec": {}}
SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat", "namespace": "ml"}}


class Script:
    def __init__(self) -> None:
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.requests: list[str] = []
        self.bodies: list[Any] = []
        self.queries: list[str] = []


@pytest.fixture
def apiserver() -> Iterator[tuple[Script, KubernetesAdapter]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            sent = self.rfile.read(length)
            script.bodies.append(json.loads(sent) if sent else None)
            script.requests.append(f"{self.command} {self.path.split('?')[0]}")
            script.queries.append(self.path.partition("?")[2])
            status, body = script.answers.pop(0) if script.answers else (500, {"message": "no script"})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if status == 429:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_POST = answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    api = client.ApiClient(configuration)
    try:
        yield script, KubernetesAdapter(api, timeout_s=5)
    finally:
        api.close()
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_adapter.with_retries, "__defaults__", ((0.01, 0.01, 0.01),))


def status(code: int, reason: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "code": code, "reason": reason, "message": f"{reason} (scripted)"}


def test_busy_answers_are_retried_until_one_succeeds(apiserver: tuple[Script, KubernetesAdapter]) -> None:
    script, adapter = apiserver
    script.answers = [status(503, "ServiceUnavailable"), status(429, "TooManyRequests"), (200, DEPLOYMENT)]
    assert adapter.get_deployment("ml", "chat") == DEPLOYMENT
    assert len(script.requests) == 3


def test_an_apply_that_stays_busy_is_transient_not_an_apply_error(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    script, adapter = apiserver
    script.answers = [status(503, "ServiceUnavailable")] * 4
    with pytest.raises(TransientApiError, match="503"):
        adapter.apply(UPDATE)
    assert len(script.requests) == 4  # the first try and three retries, then the next tick


def test_a_create_answered_5xx_is_not_asked_again_but_read_at_the_next_evaluation(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A 5xx may come after the object was made: asked again, the create would meet it and could
    take it for someone else's. A 429 is a request not served: that one is asked again."""
    script, adapter = apiserver
    script.answers = [status(503, "ServiceUnavailable")]
    with pytest.raises(TransientApiError, match=r"503 Service Unavailable \(after 1 try\)"):
        adapter.apply({**DEPLOYMENT, "spec": {}})
    assert len(script.requests) == 1
    script.requests.clear()
    script.answers = [status(429, "TooManyRequests"), (201, DEPLOYMENT)]
    adapter.apply({**DEPLOYMENT, "spec": {}})
    assert len(script.requests) == 2


def managed(*managers: tuple[str, str]) -> dict[str, Any]:
    entries = [{"manager": m, "operation": "Apply" if m == "batchknee" else "Update"} for m, _ in managers]
    for entry, (_, subresource) in zip(entries, managers, strict=True):
        if subresource:
            entry["subresource"] = subresource
    return {**SERVICE, "metadata": {**SERVICE["metadata"], "uid": "u-1", "managedFields": entries}}


# an apply of no fields, on the object met only (gone or replaced: nothing to take back)
TAKE_BACK = {"apiVersion": "v1", "kind": "Service", "metadata": {**SERVICE["metadata"], "uid": "u-1"}}


def test_a_create_that_met_someone_elses_object_takes_back_what_it_added(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """The apiserver merges an unforced apply into an object made since it was found missing
    wherever no field conflicts (tests/integration/test_ownership.py): an apply of no fields takes
    back what only the operator owns, and reconcile decides again (it then reads a stranger's)."""
    script, adapter = apiserver
    ours = {**SERVICE, "spec": {"selector": {"batchknee.io/llmserving": "chat"}}}
    script.answers = [(200, managed(("kubectl-create", ""), ("batchknee", ""))), (200, SERVICE)]
    with pytest.raises(ApplyConflict, match="created by someone else"):
        adapter.apply(ours)
    assert script.requests == ["PATCH /api/v1/namespaces/ml/services/chat"] * 2
    assert script.bodies[1] == TAKE_BACK

    # its own object, answered 200 (a create the watch had not shown yet): nothing taken back,
    # whatever the controllers wrote of its status
    script.requests.clear()
    script.answers = [(200, managed(("batchknee", ""), ("kube-controller-manager", "status")))]
    adapter.apply(ours)
    assert len(script.requests) == 1


def test_a_taking_back_that_fails_is_tried_again_and_nothing_is_applied_over_it(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    script, adapter = apiserver
    ours = {**SERVICE, "spec": {"selector": {"batchknee.io/llmserving": "chat"}}}
    script.answers = [(200, managed(("kubectl-create", ""), ("batchknee", "")))]
    script.answers += [status(503, "ServiceUnavailable")] * 4
    with pytest.raises(ApplyError, match="taking back what the operator added failed"):
        adapter.apply(ours)
    # the next evaluation reads it as its own (it carries the controller reference the apply
    # merged in) and applies over it: the taking back goes first, and then nothing else
    script.bodies.clear()
    script.answers = [(200, SERVICE)]
    with pytest.raises(ApplyConflict, match="taken back"):
        adapter.apply({**ours, "metadata": {**ours["metadata"], "resourceVersion": "7"}})
    assert script.bodies == [TAKE_BACK]
    assert not adapter.taking_back("Service", "ml", "chat")


def test_a_taking_back_of_an_object_gone_since_creates_nothing(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """The stranger's object was deleted (or replaced) before the taking back succeeded: an apply
    of no fields would create an empty one; with the uid met, the apiserver refuses it (409)."""
    script, adapter = apiserver
    ours = {**SERVICE, "spec": {"selector": {"batchknee.io/llmserving": "chat"}}}
    script.answers = [(200, managed(("kubectl-create", ""), ("batchknee", "")))]
    script.answers += [status(503, "ServiceUnavailable")] * 4
    with pytest.raises(ApplyError):
        adapter.apply(ours)
    # refused for its uid, and read: another object holds the name now (or none does)
    script.answers = [
        status(422, "Invalid"),
        (200, {**SERVICE, "metadata": {**SERVICE["metadata"], "uid": "u-2"}}),
    ]
    with pytest.raises(ApplyConflict, match="taken back"):
        adapter.apply(ours)
    assert not adapter.taking_back("Service", "ml", "chat")
    script.bodies.clear()
    script.answers = [(201, SERVICE)]
    adapter.apply(ours)  # decided again: created as any missing object is
    assert script.bodies == [ours]


def test_what_a_failing_answer_wrote_is_never_the_summary_and_is_bounded_in_the_detail(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A proxy in front of the apiserver answers 502 with a message of its own (an escape sequence,
    a page of text): the summary that status and Events carry names the call and the status code
    with its standard phrase only; the detail for the log is printable and bounded."""
    script, adapter = apiserver
    message = "\x1b[31mupstream says: " + "x" * 5000
    script.answers = [(502, {"kind": "Status", "code": 502, "message": message})] * 4
    with pytest.raises(TransientApiError) as raised:
        adapter.apply(UPDATE)
    error = raised.value
    assert error.summary == "apply Deployment ml/chat: 502 Bad Gateway (after 4 tries)"
    detail = str(error)
    assert detail.startswith(error.summary) and "upstream says" in detail
    assert "\x1b" not in detail and len(detail) < len(error.summary) + 600


def test_an_apply_conflict_is_not_retried_but_decided_again(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A 409 on an apply is its resourceVersion precondition (the object moved since it was read):
    retrying the same body cannot succeed; reconcile reads again and decides again."""
    script, adapter = apiserver
    script.answers = [status(409, "Conflict")]
    with pytest.raises(ApplyConflict, match="409"):
        adapter.apply({**DEPLOYMENT, "spec": {}})
    assert len(script.requests) == 1


def test_a_refusal_is_not_retried(apiserver: tuple[Script, KubernetesAdapter]) -> None:
    script, adapter = apiserver
    script.answers = [status(422, "Invalid")]
    with pytest.raises(ApplyError, match="422"):
        adapter.apply({**DEPLOYMENT, "spec": {}})
    assert len(script.requests) == 1


def test_the_reads_of_children_and_pods_are_retried_too(apiserver: tuple[Script, KubernetesAdapter]) -> None:
    script, adapter = apiserver
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat", "namespace": "ml"}}
    script.answers = [status(503, "ServiceUnavailable"), (200, service)]
    assert adapter.get_object("Service", "ml", "chat") == service
    script.answers = [status(500, "InternalError"), (200, {"kind": "PodList", "items": [{"metadata": {}}]})]
    assert adapter.list_pods("ml", {"app": "chat"}) == [{"metadata": {}}]
    assert (
        script.requests
        == ["GET /api/v1/namespaces/ml/services/chat"] * 2 + ["GET /api/v1/namespaces/ml/pods"] * 2
    )
    script.answers = [status(503, "ServiceUnavailable")] * 4
    with pytest.raises(TransientApiError, match="list pods ml app=chat: 503 Service Unavailable"):
        adapter.list_pods("ml", {"app": "chat"})
    script.answers = [status(404, "NotFound")]
    assert adapter.get_object("Service", "ml", "gone") is None


def test_pods_are_listed_from_the_watch_cache_unless_asked_fresh(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A fresh list (before Live caps are set) is a consistent read: no resourceVersion, so not an
    apiserver's watch cache that may not have seen a pod's delete yet."""
    script, adapter = apiserver
    script.answers = [(200, {"kind": "PodList", "items": []})] * 2
    adapter.list_pods("ml", {"app": "chat"})
    adapter.list_pods("ml", {"app": "chat"}, fresh=True)
    cached, fresh = script.queries
    assert "resourceVersion=0" in cached and "resourceVersion" not in fresh


def test_a_taking_back_refused_while_the_object_met_is_still_there_is_still_to_do(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A 409 that is not the uid's (a webhook's, say) leaves the stranger's object as the create
    left it: the taking back stays to do, and such a ConfigMap is never pruned meanwhile."""
    script, adapter = apiserver
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "chat-1", "namespace": "ml"}}
    met = {**config, "metadata": {**config["metadata"], "uid": "u-1"}}
    met["metadata"]["managedFields"] = [{"manager": "kubectl-create", "operation": "Update"}]
    script.answers = [(200, met), status(409, "Conflict"), (200, met)]
    with pytest.raises(ApplyError, match="taking back what the operator added failed"):
        adapter.apply({**config, "data": {"a": "b"}})
    assert adapter.taking_back("ConfigMap", "ml", "chat-1")
    script.requests.clear()
    adapter.delete("ConfigMap", "ml", "chat-1", "u-1")
    assert script.requests == []


def test_a_named_event_answered_5xx_then_already_there_is_recorded(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    """A rollout's Event carries its own name: a retry that meets the first try's Event (made, its
    answer lost) is done, and an unnamed Event's 409 is retried like any other."""
    script, adapter = apiserver
    involved = {
        "apiVersion": "batchknee.io/v1alpha1",
        "kind": "LLMServing",
        "metadata": {"name": "chat", "namespace": "ml"},
    }
    now = datetime(2026, 12, 4, tzinfo=UTC)
    script.answers = [status(503, "ServiceUnavailable"), status(409, "AlreadyExists")]
    adapter.emit_event(involved, "Normal", "Retuned", "max-num-seqs 64→16", now, name="chat.5e1f2a")
    assert script.requests == ["POST /api/v1/namespaces/ml/events"] * 2
    assert [b["metadata"] for b in script.bodies] == [{"namespace": "ml", "name": "chat.5e1f2a"}] * 2

    script.requests.clear()
    script.bodies.clear()
    script.answers = [status(409, "AlreadyExists"), (201, {})]
    adapter.emit_event(involved, "Normal", "Recommended", "recommend 16", now)
    assert len(script.requests) == 2 and script.bodies[0]["metadata"] == {
        "namespace": "ml",
        "generateName": "chat.",
    }
