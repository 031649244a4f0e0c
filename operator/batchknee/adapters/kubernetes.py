"""The Kubernetes side of reconcile (`batchknee.ports.KubernetesPort`) with the official client.

Reads come back as plain dicts (the apiserver's JSON), so the pure code parses what the cluster
really stores. Writes are server-side apply with field manager "batchknee": forced only over an object
the operator read and found to be its own, conditional on the resourceVersion it read; a create is
never forced. The status goes through the status subresource, Events as core/v1 Events.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from http import HTTPStatus
from typing import Any, NoReturn, TypeVar, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    LocationValueError,
    MaxRetryError,
    NewConnectionError,
    SSLError,
)
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from batchknee.adopt import tuned_workload, tuner
from batchknee.api.models import GROUP, PLURAL, VERSION, bounded, format_timestamp
from batchknee.ports import ApplyConflict, ApplyError, EventType, ObjectGone, TransientApiError
from batchknee.render import FIELD_MANAGER

log = logging.getLogger(__name__)
APPLY = "application/apply-patch+yaml"
T = TypeVar("T")
MESSAGE_LIMIT = 512  # characters of an error answer's message kept for a log line or a condition
LISTING_GAP_S = 30.0  # a namespace's listed objects further apart than this are two listings
RETRY_DELAYS_S = (0.2, 0.5, 1.0)  # then give up until the next reconcile (bounded: < 2 s in all)


def transient(error: ApiException) -> bool:
    """A conflict, throttling or a server-side failure: worth trying again, not a user error."""
    status = error.status or 0
    return status in (409, 429) or 500 <= status <= 599


def _retry_after(error: ApiException) -> float | None:
    headers = error.headers or {}
    try:
        return float(headers.get("Retry-After", ""))
    except (TypeError, ValueError):
        return None


def _finish(response: Any) -> None:
    """Read an unread (`_preload_content=False`) answer to its end, so that its connection goes
    back to the pool: left unread, every write would open a new TLS connection."""
    response.drain_conn()
    response.release_conn()


def _foreign(obj: dict[str, Any]) -> bool:
    """Whether an object another manager created or writes (its managed fields name one beside the
    operator's, bar the controllers' status writes): an apply that found it already there met it."""
    return any(
        entry.get("manager") != FIELD_MANAGER and not entry.get("subresource")
        for entry in obj.get("metadata", {}).get("managedFields") or []
    )


# How a request that got no answer ended, and whether asking again may help (see `_unanswered`)
NEVER = "never"  # the deadline is spent (and the request may have been received)
ALWAYS = "always"  # nothing was sent: even a create may be asked again
LIKE_SERVER_ERRORS = "like a 5xx"  # sent, maybe served: asked again where a 5xx would be


def _unanswered(error: Exception, timeout_s: float | None) -> tuple[str, str] | None:
    """A request that got no HTTP answer: (a fixed phrase of ours for the summary, and when to ask
    again), or None for an answer (or an error of another kind). The kubernetes client turns a
    TLS error into ApiException(status=0); a client built with urllib3's own retries on wraps the
    last error in MaxRetryError (the operator's is not: `pooled_client`)."""
    if isinstance(error, MaxRetryError) and isinstance(error.reason, HTTPError):
        error = error.reason
    if isinstance(error, ApiException):
        # status 0 is the client's own: its TLS error ("SSLError\n..."), or an answer it could not
        # parse (served, so not a request that went unanswered)
        tls = not error.status and str(error.reason or "").split("\n", 1)[0] == "SSLError"
        return ("TLS error", LIKE_SERVER_ERRORS) if tls else None
    if not isinstance(error, HTTPError) or isinstance(error, LocationValueError):
        return None  # not a request's failure (a URL that does not parse is a bug: raised)
    within = f" in {timeout_s:g} s" if timeout_s is not None else " in time"
    if isinstance(error, NewConnectionError):  # refused, unreachable, a name that does not resolve
        return "connection failed", ALWAYS
    if isinstance(error, ConnectTimeoutError):  # nothing sent, but the deadline is spent
        return f"no connection{within}", NEVER
    if isinstance(error, Urllib3Timeout):  # sent (maybe received), and the deadline is spent
        return f"no answer{within}", NEVER
    if isinstance(error, SSLError):
        return "TLS error", LIKE_SERVER_ERRORS
    # a kept-alive connection dropped, or reset mid-answer: the request may have been served
    return "connection lost", LIKE_SERVER_ERRORS


def with_retries(
    call: Callable[[], T],
    what: str,
    delays: tuple[float, ...] = RETRY_DELAYS_S,
    *,
    retry_conflicts: bool = True,
    retry_server_errors: bool = True,
    timeout_s: float | None = None,
) -> T:
    """`call()`, retried with backoff (and jitter, honouring Retry-After up to the step's bound)
    while the apiserver answers 409 (unless `retry_conflicts` is off), 429 or 5xx (unless
    `retry_server_errors` is off: TransientApiError at once); then TransientApiError.

    No answer at all is transient too, and the one retry policy (urllib3's own is off in the
    operator's client, `pooled_client`): a timeout (`timeout_s`, the call's, for the summary) is
    TransientApiError at once — the deadline is spent, and one timeout is all a call may cost; a
    connection that never opened is retried as a 429 would be (nothing was sent); a connection lost
    after the request went (a kept-alive one dropped, a reset mid-answer, a TLS error) as a 5xx
    would be, since the request may have been served. The summary names the call and a phrase of
    ours; what the exception said goes in the detail, for the log."""
    for attempt in range(len(delays) + 1):
        try:
            return call()
        except (ApiException, HTTPError) as error:
            lost = _unanswered(error, timeout_s)
            if lost is not None:
                phrase, when = lost
                retry = when == ALWAYS or (when == LIKE_SERVER_ERRORS and retry_server_errors)
                hinted = None
                detail = _message(error) if isinstance(error, ApiException) else _printable(str(error))
            elif isinstance(error, ApiException) and transient(error):
                if error.status == 409 and not retry_conflicts:
                    raise
                phrase, detail, hinted = _status(error), _message(error), _retry_after(error)
                retry = (error.status or 0) < 500 or retry_server_errors
            else:
                raise
            if attempt == len(delays) or not retry:
                tries = f"{attempt + 1} tries" if attempt else "1 try"
                raise TransientApiError(f"{what}: {phrase} (after {tries})", detail) from None
            bound = delays[attempt]
            pause = min(hinted, 2 * bound) if hinted is not None else bound * random.uniform(0.5, 1.0)
            log.debug("%s: %s: %s; retrying in %.2f s", what, phrase, detail, pause)
            time.sleep(pause)
    raise AssertionError("unreachable")


def _read(response: T) -> T:
    """An answer asked for unread (`_preload_content=False`), read to its end within the call (and
    so its retries): a body that stops coming is a timeout as much as headers that never come.
    urllib3 keeps what it read; `_finish` then hands the connection back."""
    cast(Any, response).data  # noqa: B018 (the property reads the body)
    return response


def load_config() -> None:
    """In a pod: its service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]


def _status_body(error: ApiException) -> dict[str, Any]:
    """The answer's Status body, or {} when it is not a JSON object: whatever answered (the
    apiserver, a webhook through it, a proxy) wrote it."""
    try:
        body = json.loads(error.body or "{}")
    except (ValueError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}


def _message(error: ApiException) -> str:
    """The answer's message (a Status body's `message`, else the reason phrase), printable and
    bounded."""
    return _printable(str(_status_body(error).get("message") or error.reason or ""))


def _names(error: ApiException, kind: str, name: str) -> bool:
    """Whether a Status answer is about the object `name` of `kind` (its resource name), as a 404
    for a deleted object is; a 404 for a missing resource or subresource names none."""
    details = _status_body(error).get("details")
    return isinstance(details, dict) and details.get("name") == name and details.get("kind") == kind


def _printable(text: str) -> str:
    """`text` for a log line or a condition: printable, and bounded (MESSAGE_LIMIT)."""
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:MESSAGE_LIMIT] + ("…" if len(text) > MESSAGE_LIMIT else "")


def _status(error: ApiException) -> str:
    """The status code with its standard phrase (not the one the answer sent)."""
    try:
        return f"{error.status} {HTTPStatus(error.status or 0).phrase}"
    except ValueError:
        return f"{error.status} error"


def _explain(error: ApiException) -> str:
    return f"{_status(error)}: {_message(error)}"


def pooled_client(connections: int, configuration: client.Configuration | None = None) -> client.ApiClient:
    """An API client whose connection pool holds `connections` (one per thread that calls it): the
    default (5 × CPUs) is smaller than the reconcile workers on a small node, and every connection
    the pool cannot keep is a new TLS handshake for the next call.

    urllib3's own retries are off (the client passes `retries` to its PoolManager): by default they
    retry a read timeout of every GET three times, so a call to an apiserver (or webhook) that never
    answers held its worker for four timeouts, and ended in a MaxRetryError. `with_retries` is the
    one retry policy; urllib3 raises the error itself (ReadTimeoutError, NewConnectionError, ...).
    Off, they follow no redirect either: an apiserver sends none (a proxy's 3xx is an error)."""
    configuration = configuration or client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, connections)
    configuration.retries = False
    return client.ApiClient(configuration)


class WatchCache:
    """The latest body of each object kopf's watch-streams deliver (LLMServings, and the engine
    Deployments, Services and PodDisruptionBudgets), so that a steady-state reconcile reads none of
    them from the apiserver.

    - An object the cache does not know is read from the apiserver (None from `get`): not yet
      listed, deleted, or not ours.
    - After the operator writes an object, reads go to the apiserver until the watch brings that
      write back (its resourceVersion), or `write_wait_s` passes (a write squashed by a later event
      never shows): a reconcile right after a write never decides on what was there before it.
    - Bodies are kept as compact JSON without managedFields (most of a stored object), parsed per
      read: a fresh dict for each caller, and a tenth of the memory of the parsed object.
    - kopf lists a resource again when its watch's resourceVersion expired (410 Gone), and an object
      deleted in that gap sends no DELETED event: one that a namespace's latest listing did not
      deliver is read from the apiserver (a deleted engine Deployment was served from here for good,
      never made again, its LLMServing Ready).
    """

    def __init__(self, write_wait_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.write_wait_s = write_wait_s
        self.clock = clock
        self._bodies: dict[tuple[str, str, str], tuple[str, bytes]] = {}  # key → (resourceVersion, JSON)
        self._written: dict[tuple[str, str, str], tuple[str, float]] = {}  # key → (resourceVersion, until)
        self._pruned_until = 0.0  # the next sweep of waits ended that no read or event removed
        self._seen_at: dict[tuple[str, str, str], float] = {}  # key → when a watch last delivered it
        # (kind, namespace) → (when its latest listing started, when it last listed an object)
        self._listings: dict[tuple[str, str], tuple[float, float]] = {}
        self._lock = threading.Lock()  # fed from the event loop, read from the reconcile threads

    def seen(self, kind: str, body: Mapping[str, Any]) -> None:
        """An object as a watch event (or the listing) delivered it."""
        meta = body.get("metadata") or {}
        key = (kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        version = str(meta.get("resourceVersion") or "")
        slim = {**body, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
        data = json.dumps(slim, separators=(",", ":")).encode()
        with self._lock:
            self._bodies[key] = (version, data)
            self._seen_at[key] = self.clock()
            written = self._written.get(key)
            if written is not None and written[0] == version:
                del self._written[key]

    def listed(self, kind: str, namespace: str) -> None:
        """A listing (at the start of a watch, or again after a 410) delivered an object of `kind` in
        `namespace` (the operator's or not: told before it is kept): the first more than
        LISTING_GAP_S after the namespace's last one starts a new listing."""
        now = self.clock()
        with self._lock:
            started, last = self._listings.get((kind, namespace), (now, -math.inf))
            self._listings[(kind, namespace)] = (now if now - last > LISTING_GAP_S else started, now)

    def gone(self, kind: str, namespace: str, name: str) -> None:
        """Deleted, or no longer one of the operator's (a label taken off)."""
        with self._lock:
            self._bodies.pop((kind, namespace, name), None)
            self._written.pop((kind, namespace, name), None)
            self._seen_at.pop((kind, namespace, name), None)

    def wrote(self, kind: str, namespace: str, name: str, resource_version: str | None) -> None:
        """The operator wrote the object (it is now at `resource_version`)."""
        now = self.clock()
        with self._lock:
            self._written[(kind, namespace, name)] = (resource_version or "", now + self.write_wait_s)
            # Writes of objects no watch brings back and nothing reads again (a TensorRT-LLM options
            # ConfigMap is named by its content, an LLMServing deleted meanwhile): an ended wait is
            # no wait, so sweep them, at most once a wait.
            if now >= self._pruned_until:
                for ended in [key for key, (_, until) in self._written.items() if until <= now]:
                    del self._written[ended]
                self._pruned_until = now + self.write_wait_s

    def stale(self, kind: str, namespace: str, name: str) -> None:
        """A write conditional on the body read met a newer object (409): reads go to the apiserver
        until the watch brings the operator's next write, or `write_wait_s` passes (the version
        stored is not known, so no event of it ends the wait sooner)."""
        self.wrote(kind, namespace, name, None)

    def clear(self) -> None:
        """Forget everything (the watches were paused: what they delivered may be old)."""
        with self._lock:
            self._bodies.clear()
            self._written.clear()
            self._seen_at.clear()
            self._listings.clear()

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as last delivered, or None: ask the apiserver."""
        key = (kind, namespace, name)
        with self._lock:
            written = self._written.get(key)
            if written is not None:
                if self.clock() < written[1]:
                    return None
                del self._written[key]
            found = self._bodies.get(key)
            listing = self._listings.get((kind, namespace))
            if found is not None and listing is not None and self._seen_at.get(key, -math.inf) < listing[0]:
                # not delivered by the namespace's latest listing (not yet, or deleted before it)
                found = None
        if found is None:
            return None
        body: dict[str, Any] = json.loads(found[1])
        return body

    def has(self, kind: str, namespace: str, name: str) -> bool:
        """Whether a watch has delivered this object (and no delete since), however old."""
        with self._lock:
            return (kind, namespace, name) in self._bodies

    def __len__(self) -> int:
        return len(self._bodies)


class KubernetesAdapter:
    def __init__(
        self,
        api_client: client.ApiClient | None = None,
        *,
        timeout_s: float = 10.0,
        cache: WatchCache | None = None,
    ) -> None:
        self.api_client = api_client or client.ApiClient()
        self.cache = cache  # what the watches delivered (None: every read asks the apiserver)
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.policy = client.PolicyV1Api(self.api_client)
        self.timeout_s = timeout_s
        self.instance = socket.gethostname()
        # who adopts which workload, from the watch (the operator's kopf index): (namespace, kind,
        # name) → [(creationTimestamp, LLMServing)]; None: list the namespace
        self.tuners_index: Callable[[str, str, str], list[tuple[str, str]]] | None = None
        # objects a create met (someone else made them meanwhile) whose taking back has not
        # succeeded yet, with the uid met: never applied over, the taking back tried again instead
        self._not_taken_back: dict[tuple[str, str, str], str] = {}

    def _retried(
        self,
        call: Callable[[], T],
        what: str,
        *,
        retry_conflicts: bool = True,
        retry_server_errors: bool = True,
    ) -> T:
        """`with_retries` for a call made with this adapter's timeout (which its summary names)."""
        return with_retries(
            call,
            what,
            retry_conflicts=retry_conflicts,
            retry_server_errors=retry_server_errors,
            timeout_s=self.timeout_s,
        )

    # --- reads ---
    def cached(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.cache.get(kind, namespace, name) if self.cache is not None else None

    def get_llmserving(self, namespace: str, name: str, *, fresh: bool = False) -> dict[str, Any] | None:
        cached = None if fresh else self.cached("LLMServing", namespace, name)
        if cached is not None:
            return cached
        if self.cache is not None:
            # a list by name, not a get: the watch's list and watch are all the RBAC it takes
            listed = self._retried(
                lambda: self.custom.list_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    field_selector=f"metadata.name={name}",
                    _request_timeout=self.timeout_s,
                ),
                f"read LLMServing {namespace}/{name}",
            )
            items = cast(dict[str, Any], listed).get("items") or []
            return cast(dict[str, Any], items[0]) if items else None
        try:
            found = self._retried(
                lambda: self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _request_timeout=self.timeout_s
                ),
                f"get LLMServing {namespace}/{name}",
            )
            return cast(dict[str, Any], found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def tuners(self, namespace: str, kind: str, name: str) -> list[tuple[str, str]]:
        if self.tuners_index is not None:
            return self.tuners_index(namespace, kind, name)
        # No index (outside the operator's runtime): the namespace's LLMServings, from the apiserver.
        found = self._retried(
            lambda: self.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, _request_timeout=self.timeout_s
            ),
            f"list LLMServings in {namespace}",
        )
        items = cast(dict[str, Any], found).get("items") or []
        return [tuner(item) for item in items if tuned_workload(item) == (kind, name)]

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        cached = self.cached("Deployment", namespace, name)
        if cached is not None:
            return cached
        try:
            response: Any = self._retried(
                lambda: _read(
                    self.apps.read_namespaced_deployment(
                        name, namespace, _preload_content=False, _request_timeout=self.timeout_s
                    )
                ),
                f"get Deployment {namespace}/{name}",
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        found: dict[str, Any] = json.loads(response.data)
        return found

    def watched(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if self.cache is None:
            return self.get_object(kind, namespace, name)
        return self.cached(kind, namespace, name)

    def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        cached = self.cached(kind, namespace, name)
        if cached is not None:
            return cached
        read = {
            "Deployment": self.apps.read_namespaced_deployment,
            "StatefulSet": self.apps.read_namespaced_stateful_set,
            "Service": self.core.read_namespaced_service,
            "ConfigMap": self.core.read_namespaced_config_map,
            "PodDisruptionBudget": self.policy.read_namespaced_pod_disruption_budget,
        }[kind]
        try:
            response: Any = self._retried(
                lambda: _read(read(name, namespace, _preload_content=False, _request_timeout=self.timeout_s)),
                f"read {kind} {namespace}/{name}",
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        found: dict[str, Any] = json.loads(response.data)
        return found

    def list_pods(
        self, namespace: str, labels: dict[str, str], *, fresh: bool = False
    ) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        # resourceVersion "0": served from the apiserver's watch cache as it stands, without the wait
        # for etcd's latest revision that a consistent list makes (most of a reconcile's time when
        # every Deployment of a thousand reports unready pods); a pod's crash loop is no less seen.
        # `fresh` (no resourceVersion): the latest, where a cache that lags would not do.
        response: Any = self._retried(
            lambda: _read(
                self.core.list_namespaced_pod(
                    namespace,
                    label_selector=selector,
                    resource_version=None if fresh else "0",  # None: not sent
                    _preload_content=False,
                    _request_timeout=self.timeout_s,
                )
            ),
            f"list pods {namespace} {selector}",
        )
        items: list[dict[str, Any]] = json.loads(response.data).get("items") or []
        return items

    # --- writes ---
    def apply_method(self, kind: str) -> Callable[..., Any]:
        return {
            "Deployment": self.apps.patch_namespaced_deployment,
            "StatefulSet": self.apps.patch_namespaced_stateful_set,
            "Service": self.core.patch_namespaced_service,
            "ConfigMap": self.core.patch_namespaced_config_map,
            "PodDisruptionBudget": self.policy.patch_namespaced_pod_disruption_budget,
        }[kind]

    def apply(self, obj: dict[str, Any]) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        if self.taking_back(kind, namespace, name):
            self._take_back(obj)
        method = self.apply_method(kind)
        ours = bool(meta.get("resourceVersion"))
        try:
            response = self._retried(
                lambda: _read(
                    method(
                        name,
                        namespace,
                        cast(Any, obj),
                        field_manager=FIELD_MANAGER,
                        force=ours,
                        _content_type=APPLY,
                        _preload_content=False,
                        _request_timeout=self.timeout_s,
                    )
                ),
                f"apply {kind} {namespace}/{name}",
                retry_conflicts=False,  # a failed resourceVersion precondition stays failed: decide again
                # a create answered 5xx may have been made: asked again, it would meet itself and
                # could take itself for someone else's (below); the next evaluation reads it instead
                retry_server_errors=ours,
            )
        except ApiException as error:
            # 409: the resourceVersion precondition failed, or (unforced) another manager owns a field
            # of an object that appeared since it was found missing.
            if error.status != 409:
                raise ApplyError(f"{kind} {namespace}/{name}: {_explain(error)}") from None
            if self.cache is not None:
                # what was read (the watch's body, likely) is older than what is stored: the
                # decision made again (reconcile) reads the apiserver, not the same body again
                self.cache.stale(kind, namespace, name)
            raise ApplyConflict(f"{kind} {namespace}/{name}: {_explain(error)}") from None
        # A create that found the object there (200, not 201) met one someone else made since it was
        # found missing: the apiserver merged the apply into it wherever no field conflicted.
        met = json.loads(response.data) if not ours and response.status != HTTPStatus.CREATED else None
        self._written(kind, namespace, name, response)
        if met is not None and _foreign(met):
            self._not_taken_back[kind, namespace, name] = str(met["metadata"].get("uid") or "")
            self._take_back(obj)

    def taking_back(self, kind: str, namespace: str, name: str) -> bool:
        return (kind, namespace, name) in self._not_taken_back

    def _take_back(self, obj: dict[str, Any]) -> NoReturn:
        """Take back what a create added to an object someone else made: an apply of no fields drops
        every field only this manager owns (what the other owner set stays), on that object only
        (its uid: gone or replaced, there is nothing to take back, and an apply would create one).
        ApplyConflict when done (the next evaluation reads the object as someone else's), ApplyError
        while not."""
        kind, meta = obj["kind"], obj["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        key = (kind, namespace, name)
        uid = self._not_taken_back[key]
        empty = {
            "apiVersion": obj["apiVersion"],
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
        }
        try:
            response = self._retried(
                lambda: _read(
                    self.apply_method(kind)(
                        name,
                        namespace,
                        cast(Any, empty),
                        field_manager=FIELD_MANAGER,
                        _content_type=APPLY,
                        _preload_content=False,
                        _request_timeout=self.timeout_s,
                    )
                ),
                f"take back the apply to {kind} {namespace}/{name}",
                retry_conflicts=False,
            )
        except ApiException as error:
            # refused for the uid (409 when none is there, 422 when another object holds the name):
            # the object met is gone, and what was added with it; anything else is still to do
            if error.status not in (409, 422) or self._still_there(key, uid):
                raise self._not_taken(key, _explain(error)) from None
        except TransientApiError as error:
            raise self._not_taken(key, error.summary) from None
        else:
            self._written(kind, namespace, name, response)
        del self._not_taken_back[key]
        raise ApplyConflict(
            f"{kind} {namespace}/{name} was created by someone else as the operator created it; what "
            "the operator's apply added to it is taken back (or gone with it)"
        )

    def _still_there(self, key: tuple[str, str, str], uid: str) -> bool:
        kind, namespace, name = key
        try:
            found = self.get_object(kind, namespace, name)
        except (ApiException, TransientApiError):
            return True  # not known to be gone: still to do
        return found is not None and found.get("metadata", {}).get("uid") == uid

    @staticmethod
    def _not_taken(key: tuple[str, str, str], detail: str) -> ApplyError:
        kind, namespace, name = key
        return ApplyError(
            f"{kind} {namespace}/{name} was created by someone else as the operator created it, and taking "
            f"back what the operator added failed ({detail}); tried again at every evaluation, nothing "
            "else is applied to it meanwhile"
        )

    def list_config_maps(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        response: Any = self._retried(
            lambda: _read(
                self.core.list_namespaced_config_map(
                    namespace,
                    label_selector=selector,
                    _preload_content=False,
                    _request_timeout=self.timeout_s,
                )
            ),
            f"list ConfigMaps {namespace} {selector}",
        )
        items: list[dict[str, Any]] = json.loads(response.data).get("items") or []
        return items

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        if self.taking_back(kind, namespace, name):
            return  # someone else's, with what a create merged into it still on it: never pruned
        delete = {
            "ConfigMap": self.core.delete_namespaced_config_map,
            "PodDisruptionBudget": self.policy.delete_namespaced_pod_disruption_budget,
        }[kind]
        try:
            self._retried(
                lambda: delete(
                    name,
                    namespace,
                    body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
                    _request_timeout=self.timeout_s,
                ),
                f"delete {kind} {namespace}/{name}",
                retry_conflicts=False,  # the uid precondition: another object of the name now
            )
        except ApiException as error:
            if error.status not in (404, 409):  # gone, or replaced by another object of that name
                raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "LLMServing",
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        try:
            response = self._retried(
                lambda: _read(
                    self.custom.patch_namespaced_custom_object_status(
                        GROUP,
                        VERSION,
                        namespace,
                        PLURAL,
                        name,
                        body,
                        field_manager=FIELD_MANAGER,
                        force=True,
                        _content_type=APPLY,
                        _preload_content=False,  # parsed only for its resourceVersion, with a cache
                        _request_timeout=self.timeout_s,
                    )
                ),
                f"write the status of LLMServing {namespace}/{name}",
            )
        except ApiException as error:
            if error.status == 404 and _names(error, PLURAL, name):  # deleted while the reconcile ran
                raise ObjectGone(f"LLMServing {namespace}/{name}") from None
            raise  # another 404 (no status subresource, an apiserver behind on the CRD) is no deletion
        self._written("LLMServing", namespace, name, response)

    def _written(self, kind: str, namespace: str, name: str, response: Any) -> None:
        """Tell the cache of a write (with the resourceVersion it made), or finish the unread answer."""
        if self.cache is not None:
            try:
                version = json.loads(response.data).get("metadata", {}).get("resourceVersion")
            except (ValueError, AttributeError):
                version = None
            self.cache.wrote(kind, namespace, name, version)
        _finish(response)

    def emit_event(
        self,
        involved: dict[str, Any],
        event_type: EventType,
        reason: str,
        message: str,
        now: datetime,
        name: str | None = None,
    ) -> None:
        meta = involved["metadata"]
        stamp = format_timestamp(now)
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"namespace": meta["namespace"]}
            | ({"name": name} if name else {"generateName": f"{meta['name']}."}),
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": event_type,
            "reason": reason,
            "message": bounded(1024)(message),
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": self.instance,
        }
        try:
            response = self._retried(
                lambda: _read(
                    self.core.create_namespaced_event(
                        meta["namespace"],
                        cast(Any, body),
                        _preload_content=False,
                        _request_timeout=self.timeout_s,
                    )
                ),
                f"record an Event on {meta['namespace']}/{meta['name']}",
                retry_conflicts=not name,
                # a POST that may have been served is sent again only under a fixed name (then 409)
                retry_server_errors=bool(name),
            )
        except ApiException as error:
            if name and error.status == 409:  # recorded already (or by a try answered 5xx that was made)
                return
            raise
        _finish(response)

    # --- peering ---
    def peering_statuses(self, name: str, namespaces: list[str]) -> list[dict[str, Any]] | None:
        """The status of each of kopf's peering objects (peer id → priority, lastseen, lifetime);
        None when one is missing. (A list by name: kopf's RBAC has list and watch, not get.)"""
        found = []
        targets: list[str | None] = list(namespaces) or [None]
        for namespace in targets:
            selector = f"metadata.name={name}"
            try:
                if namespace:
                    listed = self._retried(
                        functools.partial(
                            self.custom.list_namespaced_custom_object,
                            "kopf.dev",
                            "v1",
                            namespace,
                            "kopfpeerings",
                            field_selector=selector,
                            _request_timeout=self.timeout_s,
                        ),
                        f"list KopfPeerings {name} in {namespace}",
                    )
                else:
                    listed = self._retried(
                        functools.partial(
                            self.custom.list_cluster_custom_object,
                            "kopf.dev",
                            "v1",
                            "clusterkopfpeerings",
                            field_selector=selector,
                            _request_timeout=self.timeout_s,
                        ),
                        f"list ClusterKopfPeerings {name}",
                    )
            except ApiException as error:
                if error.status == 404:  # the peering CRD is not installed
                    return None
                raise
            items = cast(dict[str, Any], listed).get("items") or []
            if not items:
                return None
            found.append(items[0].get("status") or {})
        return found

    def ensure_peering(self, name: str, namespaces: list[str]) -> None:
        """kopf's peering object must exist for replicas to see each other: create it if missing
        (each create bounded by the adapter's timeout and retried as any call is: an apiserver that
        never answers is a warning, not a start that hangs)."""
        targets: list[str | None] = list(namespaces) or [None]
        for namespace in targets:
            kind, plural = (
                ("KopfPeering", "kopfpeerings")
                if namespace
                else ("ClusterKopfPeering", "clusterkopfpeerings")
            )
            body = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": name}}
            create = (
                functools.partial(self.custom.create_namespaced_custom_object, "kopf.dev", "v1", namespace)
                if namespace
                else functools.partial(self.custom.create_cluster_custom_object, "kopf.dev", "v1")
            )
            try:
                self._retried(
                    functools.partial(create, plural, body, _request_timeout=self.timeout_s),
                    f"create the {kind} {name}" + (f" in {namespace}" if namespace else ""),
                    # 409 is "already there" (a try answered 5xx that was made, included)
                    retry_conflicts=False,
                )
            except ApiException as error:
                if error.status != 409:  # already there is fine
                    log.warning("could not create the %s %r: %s", kind, name, _explain(error))
            except TransientApiError as error:
                log.warning("could not create the %s %r: %s", kind, name, error)
