"""Transient apiserver answers (409, 429, 5xx) are retried with backoff; others are not. No answer
at all (a timeout, a connection refused or lost, a TLS error) is transient too, and costs a call
one timeout at most.

A loopback HTTP server stands in for an apiserver that is busy: it answers from a script; a loopback
TCP server for one that does not answer."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ConnectTimeoutError, LocationValueError, MaxRetryError, ReadTimeoutError

from batchknee.adapters import kubernetes as kube_adapter
from batchknee.adapters.kubernetes import KubernetesAdapter, pooled_client, with_retries
from batchknee.ports import ApplyConflict, ApplyError, ObjectGone, TransientApiError

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
    api = pooled_client(4, configuration)  # the operator's client (urllib3's own retries off)
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


# --- no answer -------------------------------------------------------------------------------------

TIMEOUT_S = 0.3


class Silent:
    """A loopback TCP server that reads each request and then does `then` with its connection:
    `hold` (an apiserver, or a webhook behind it, that never answers), `drop` (closes it without an
    answer) or `stall` (the start of an answer, then nothing)."""

    def __init__(self, then: Callable[[socket.socket], None]) -> None:
        self.then = then
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.connections += 1
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            self.then(conn)

    def adapter(self) -> KubernetesAdapter:
        configuration = client.Configuration()
        configuration.host = f"http://127.0.0.1:{self.port}"
        return KubernetesAdapter(pooled_client(4, configuration), timeout_s=TIMEOUT_S)


def hold(conn: socket.socket) -> None:
    conn.settimeout(10)
    with contextlib.suppress(OSError):
        while conn.recv(65536):  # until the client gives up and closes it
            pass


def drop(conn: socket.socket) -> None:
    pass  # closed without an answer, as a kept-alive connection the apiserver dropped


def stall(conn: socket.socket) -> None:
    """Headers and the start of a body, then nothing."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    hold(conn)


@pytest.fixture
def silent() -> Iterator[Callable[[Callable[[socket.socket], None]], Silent]]:
    servers: list[Silent] = []

    def start(then: Callable[[socket.socket], None]) -> Silent:
        servers.append(Silent(then))
        return servers[-1]

    yield start
    for server in servers:
        server.listener.close()


def timed(call: Callable[[], Any]) -> tuple[TransientApiError, float]:
    started = time.monotonic()
    with pytest.raises(TransientApiError) as raised:
        call()
    return raised.value, time.monotonic() - started


def test_an_apiserver_that_never_answers_costs_each_call_one_timeout_and_is_transient(
    silent: Callable[[Callable[[socket.socket], None]], Silent],
) -> None:
    """urllib3's own retries asked a GET four times (each its own timeout) and ended in a raw
    MaxRetryError; a write in a raw ReadTimeoutError. A timeout is not asked again: the deadline is
    spent, and the request may have been received."""
    server = silent(hold)
    adapter = server.adapter()
    calls: list[tuple[Callable[[], Any], str]] = [
        (lambda: adapter.get_deployment("ml", "chat"), "get Deployment ml/chat"),
        (lambda: adapter.list_pods("ml", {"app": "chat"}), "list pods ml app=chat"),
        (lambda: adapter.apply(UPDATE), "apply Deployment ml/chat"),
        (lambda: adapter.patch_status("ml", "chat", {}), "write the status of LLMServing ml/chat"),
    ]
    for call, what in calls:
        before = server.connections
        error, took = timed(call)
        assert server.connections - before == 1, what
        assert took < 3 * TIMEOUT_S, what  # four timeouts before
        assert error.summary == f"{what}: no answer in {TIMEOUT_S:g} s (after 1 try)"
        assert "timed out" in str(error)  # what urllib3 said: in the detail, for the log


def test_an_answer_whose_body_stops_coming_is_a_timeout_too(
    silent: Callable[[Callable[[socket.socket], None]], Silent],
) -> None:
    """The body of an answer asked for unread is read within the retried call, not after it."""
    adapter = silent(stall).adapter()
    error, took = timed(lambda: adapter.get_deployment("ml", "chat"))
    assert error.summary == f"get Deployment ml/chat: no answer in {TIMEOUT_S:g} s (after 1 try)"
    assert took < 3 * TIMEOUT_S


def test_a_closed_port_is_asked_again_within_the_bounded_retries_then_transient() -> None:
    """Nothing was sent: even a create may be asked again."""
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    adapter = KubernetesAdapter(pooled_client(4, configuration), timeout_s=TIMEOUT_S)
    for call, what in [
        (lambda: adapter.get_deployment("ml", "chat"), "get Deployment ml/chat"),
        (lambda: adapter.apply({**DEPLOYMENT, "spec": {}}), "apply Deployment ml/chat"),
    ]:
        error, _ = timed(call)
        assert error.summary == f"{what}: connection failed (after 4 tries)"
        assert "refused" in str(error)


def test_a_connection_lost_after_the_request_went_is_asked_again_only_where_a_5xx_would_be(
    silent: Callable[[Callable[[socket.socket], None]], Silent],
) -> None:
    """A create whose connection dropped may have been made (as after a 5xx): the next evaluation
    reads it instead. A read, or a write conditional on the version read, is asked again."""
    server = silent(drop)
    adapter = server.adapter()
    error, _ = timed(lambda: adapter.apply({**DEPLOYMENT, "spec": {}}))
    assert error.summary == "apply Deployment ml/chat: connection lost (after 1 try)"
    assert server.connections == 1
    error, _ = timed(lambda: adapter.apply(UPDATE))
    assert error.summary == "apply Deployment ml/chat: connection lost (after 4 tries)"
    assert server.connections == 5


def test_a_tls_error_is_transient(apiserver: tuple[Script, KubernetesAdapter]) -> None:
    """The kubernetes client turns a TLS error into ApiException(status=0): no answer, not a
    refusal. (An https client against the loopback HTTP server: its handshake fails.)"""
    _, plain = apiserver
    configuration = client.Configuration()
    configuration.host = plain.api_client.configuration.host.replace("http://", "https://")
    configuration.verify_ssl = False
    adapter = KubernetesAdapter(pooled_client(4, configuration), timeout_s=TIMEOUT_S)
    error, _ = timed(lambda: adapter.get_deployment("ml", "chat"))
    assert error.summary == "get Deployment ml/chat: TLS error (after 4 tries)"
    assert "SSL" in str(error) and "\n" not in str(error)
    error, _ = timed(lambda: adapter.apply({**DEPLOYMENT, "spec": {}}))
    assert error.summary == "apply Deployment ml/chat: TLS error (after 1 try)"


def test_the_peering_objects_are_made_with_a_timeout_and_a_warning_when_none_answers(
    silent: Callable[[Callable[[socket.socket], None]], Silent], caplog: pytest.LogCaptureFixture
) -> None:
    """At the operator's start: an apiserver that accepts and never answers held it for good."""
    server = silent(hold)
    adapter = server.adapter()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=kube_adapter.__name__):
        adapter.ensure_peering("batchknee", ["ml", "serving"])
    assert time.monotonic() - started < 2 * 3 * TIMEOUT_S
    assert server.connections == 2
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "could not create the KopfPeering 'batchknee'"
    ] * 2
    with pytest.raises(TransientApiError, match="no answer"):
        adapter.peering_statuses("batchknee", ["ml"])


def test_a_status_written_as_the_llmserving_is_deleted_finds_it_gone(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    script, adapter = apiserver
    gone = status(404, "NotFound")
    gone[1]["details"] = {"name": "chat", "group": "batchknee.io", "kind": "llmservings"}
    script.answers = [gone]
    with pytest.raises(ObjectGone):
        adapter.patch_status("ml", "chat", {"action": "hold"})
    assert len(script.requests) == 1
    # a 404 that names no object (no status subresource, an apiserver behind on the CRD) is no
    # deletion: taken for one, the object's state was forgotten while it lived on
    script.answers = [status(404, "NotFound")]
    with pytest.raises(ApiException) as raised:
        adapter.patch_status("ml", "chat", {"action": "hold"})
    assert not isinstance(raised.value, ObjectGone) and raised.value.status == 404


def test_a_status_0_the_client_made_of_an_answer_it_could_not_parse_is_no_tls_error(
    apiserver: tuple[Script, KubernetesAdapter],
) -> None:
    # served (so not asked again, where a delete or a create may have been made), and not named TLS
    error = ApiException(status=0, reason="Unsupported content type: application/octet-stream")
    calls: list[int] = []

    def unparsable() -> None:
        calls.append(1)
        raise error

    with pytest.raises(ApiException):
        with_retries(unparsable, "get LLMServing ml/chat", delays=(0.0, 0.0))
    assert calls == [1]


def test_an_unnamed_event_answered_5xx_is_not_sent_again(apiserver: tuple[Script, KubernetesAdapter]) -> None:
    # its POST may have been served: sent again, the Event would be there twice
    script, adapter = apiserver
    script.answers = [status(503, "ServiceUnavailable"), (201, {})]
    involved = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "ml"},
    }
    with pytest.raises(TransientApiError):
        adapter.emit_event(
            involved, "Normal", "Retuned", "max-num-seqs 64→16", datetime(2026, 3, 1, tzinfo=UTC)
        )
    assert len(script.requests) == 1


def test_a_connect_timeout_is_not_asked_again_and_a_wrapped_error_is_sorted_as_its_reason() -> None:
    """A connection that did not open within the timeout sent nothing, but spent the deadline; a
    client with urllib3's own retries on (not the operator's) wraps the last error in MaxRetryError.
    A URL that does not parse is no passing failure: raised as it is."""
    tries: list[str] = []

    def failing(error: Exception) -> Callable[[], None]:
        def call() -> None:
            tries.append(type(error).__name__)
            raise error

        return call

    with pytest.raises(TransientApiError) as raised:
        with_retries(failing(ConnectTimeoutError("connect timed out")), "get x", timeout_s=10)
    assert raised.value.summary == "get x: no connection in 10 s (after 1 try)" and len(tries) == 1
    wrapped = MaxRetryError(None, "/x", ReadTimeoutError(None, "/x", "Read timed out."))
    with pytest.raises(TransientApiError) as raised:
        with_retries(failing(wrapped), "get x", timeout_s=10)
    assert raised.value.summary == "get x: no answer in 10 s (after 1 try)" and len(tries) == 2
    with pytest.raises(LocationValueError):
        with_retries(failing(LocationValueError("no host")), "get x", timeout_s=10)
    assert len(tries) == 3
