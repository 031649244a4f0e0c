"""reconcile's `Observer` port over the Prometheus adapter's url-aware, tick-cached observer.

An LLMServing may name its own Prometheus (spec.prometheus.url) when the admin allows that URL;
every other one is read from the operator's default URL. The cache behind
(`batchknee.adapters.prometheus.CachedObserver`) serves all objects of one URL and scope with one
batch of queries per tick, with one refresh in flight per URL.

`prepare` is the asynchronous half: the handlers await it (under the object's asyncio lock) before
reconcile goes to a thread, so objects waiting for a slow Prometheus wait as coroutines and never
hold the threads that objects of another Prometheus need. The refreshes themselves run on threads
of their own: one for the operator's own Prometheus, and a pool for the URLs specs chose (sharing
asyncio's default pool, six threads on two cores, six tenants' silent URLs made the operator's own
Prometheus wait out their deadlines).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import re
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Protocol

from batchknee.core.observation import Observation, ObservationTarget


class UrlObserver(Protocol):
    def observation(self, url: str, target: ObservationTarget, now: datetime) -> Observation: ...


URL_FORM = "http(s)://host[:port][/path]"


def normalise_url(url: str) -> str:
    return url.strip().rstrip("/")


ANY_URL = "*"


def has_host(url: str) -> bool:
    try:
        return bool(urllib.parse.urlsplit(url).hostname)
    except ValueError:  # such as an unclosed IPv6 bracket
        return False


MAX_TOKEN_BYTES = 16 * 1024  # far past any JWT a ServiceAccount or an OIDC issuer hands out


def read_bearer_token(path: str) -> str:
    """The bearer token in the file `path`, read now: a projected ServiceAccount token is rotated in
    place, so the operator reads it at every query. ValueError says what is wrong with the file,
    never what it holds."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_TOKEN_BYTES + 1)
    except OSError as error:
        raise ValueError(f"cannot be read ({type(error).__name__})") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"is over {MAX_TOKEN_BYTES // 1024} KiB: no token")
    token = raw.strip()
    if not token:
        raise ValueError("is empty")
    if any(not 0x21 <= byte <= 0x7E for byte in token):  # it goes into a header: visible ASCII only
        raise ValueError("holds whitespace, control or non-ASCII characters: no token")
    return token.decode("ascii")


# An HTTP header name (RFC 9110 `token`).
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
MAX_HEADER_VALUE_BYTES = 8 * 1024
# Headers that frame the request or the connection: the operator's HTTP client sets them.
FRAMING_HEADERS = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-connection",
    }
)
# Headers that carry credentials: like a bearer token, they go over HTTPS only.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


def check_headers(headers: Mapping[str, object]) -> dict[str, str]:
    """`headers` as sent with every query to the operator's Prometheus (Mimir's or Cortex's
    `X-Scope-OrgID`, a gateway's API key). ValueError names the header and what is wrong with it,
    never its value (it may be a secret)."""
    checked: dict[str, str] = {}
    for number, (name, value) in enumerate(headers.items(), 1):
        if not isinstance(name, str) or not HEADER_NAME.match(name):
            raise ValueError(
                f"header {number}'s name is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        if name.lower() in FRAMING_HEADERS:
            raise ValueError(f"header {name!r} frames the request: the operator's HTTP client sets it")
        if any(name.lower() == earlier.lower() for earlier in checked):
            raise ValueError(f"header {name!r} is given twice (header names ignore case)")
        if not isinstance(value, str):
            raise ValueError(f"header {name!r}: give its value as a JSON string")
        raw = value.encode("utf-8")
        if not raw or raw != raw.strip() or len(raw) > MAX_HEADER_VALUE_BYTES:
            raise ValueError(
                f"header {name!r}: its value is empty, starts or ends with whitespace, or is over "
                f"{MAX_HEADER_VALUE_BYTES // 1024} KiB"
            )
        if any(not (0x20 <= byte <= 0x7E) for byte in raw):  # no CR/LF: no header of its own
            raise ValueError(f"header {name!r}: its value holds control or non-ASCII characters")
        checked[name] = value
    return checked


def check_ca_file(path: str) -> None:
    """ValueError unless `path` holds PEM certificates a TLS client can verify a server with."""
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError:  # an OSError too: first
        raise ValueError("holds no PEM certificate") from None
    except OSError as error:
        raise ValueError(f"cannot be read ({type(error).__name__})") from None


def redact_url(url: str) -> str:
    """The URL as it may appear in status, Events and logs: no userinfo (credentials), no query."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


# refreshes of the URLs specs chose that run at once (one per URL): as many as asyncio's own pool
CHOSEN_REFRESH_THREADS = min(32, (os.cpu_count() or 1) + 4)


class RoutedObserver:
    """Implements `batchknee.ports.Observer`: which Prometheus to ask is remembered per object."""

    def __init__(self, inner: UrlObserver, default_url: str, allowed_urls: Iterable[str] = ()) -> None:
        self.inner = inner
        # URLs as one spelling (a trailing slash, blanks): one observer, one budget, per Prometheus
        self.default_url = normalise_url(default_url)
        # Only these and the default are ever fetched (`*`: any URL). A tenant's URL is the
        # operator's request, from its network, with its answer excerpted into the tenant's status.
        allowed = list(allowed_urls)
        self.any_url = ANY_URL in allowed
        self.allowed_urls = frozenset(normalise_url(u) for u in [*allowed, default_url] if u != ANY_URL)
        self.urls: dict[tuple[str, str], str] = {}
        self.lock = threading.Lock()
        self._preparing: dict[str, asyncio.Lock] = {}
        # one refresh per URL runs at a time (`prepare`): the default URL needs one thread
        self._own_refreshes = ThreadPoolExecutor(1, thread_name_prefix="refresh-own")
        self._chosen_refreshes = ThreadPoolExecutor(
            CHOSEN_REFRESH_THREADS, thread_name_prefix="refresh-chosen"
        )

    def allows(self, url: str | None) -> bool:
        """May an LLMServing name `url` as its Prometheus? (Never one without a host.)"""
        return not url or (has_host(url) and (self.any_url or normalise_url(url) in self.allowed_urls))

    def refusal(self, url: str) -> str | None:
        """Why an LLMServing may not name `url` (None: it may)."""
        if self.allows(url):
            return None
        if not has_host(url):
            return f"{redact_url(url)} is not a URL with a host; write it as {URL_FORM}"
        return (
            f"{redact_url(url)} is not among the Prometheus URLs the operator allows "
            "(its prometheusAllowedUrls setting, BATCHKNEE_PROMETHEUS_ALLOWED_URLS): name one of "
            "those, or leave spec.prometheus.url unset to use the operator's default"
        )

    def route(self, namespace: str, name: str, url: str | None) -> None:
        if url and not self.allows(url):
            url = None  # reconcile refuses the spec before observing; never fetch a refused URL
        url = normalise_url(url) if url else None
        with self.lock:
            previous = self.urls.get((namespace, name))
            if url:
                self.urls[(namespace, name)] = url
            else:
                self.urls.pop((namespace, name), None)
        if previous and previous != url:
            self._drop_if_unused(previous)

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone (or no longer watched): drop its route and what only it used."""
        with self.lock:
            previous = self.urls.pop((namespace, name), None)
        forget = getattr(self.inner, "forget", None)
        if forget is not None:
            forget((namespace, name))
        if previous:
            self._drop_if_unused(previous)

    def _drop_if_unused(self, url: str) -> None:
        with self.lock:
            used = url == self.default_url or url in self.urls.values()
            if not used:
                self._preparing.pop(url, None)
        drop = getattr(self.inner, "drop_url", None)
        if not used and drop is not None:
            drop(url)

    def reads_its_own(self, namespace: str, name: str) -> bool:
        """Whether the object reads a Prometheus other than the operator's default (its spec's)."""
        with self.lock:
            return (namespace, name) in self.urls

    def is_fresh(self, target: ObservationTarget) -> bool:
        """Whether the cache holds a fresh refresh of the target's scope (an observer without a
        cache: always)."""
        is_fresh = getattr(self.inner, "is_fresh", None)
        return is_fresh is None or bool(is_fresh(self.url(target), target))

    def url(self, target: ObservationTarget) -> str:
        with self.lock:
            return self.urls.get(target.key, self.default_url)

    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        url = self.url(target)
        try:
            return self.inner.observation(url, target, now)
        finally:
            self._drop_if_unused(url)

    def _refresh(
        self, refresh: Callable[..., object], url: str, target: ObservationTarget, now: datetime
    ) -> None:
        try:
            refresh(url, target, now)
        finally:
            # Its objects were forgotten while this waited for the gate or a thread: the refresh
            # made the URL's cache again (a session and query threads), which nothing would drop.
            self._drop_if_unused(url)

    async def prepare(self, target: ObservationTarget, now: datetime) -> None:
        """Make the cache fresh for `target` without holding a thread while waiting: one refresh
        per URL runs in a thread, and every other object of that URL awaits it as a coroutine."""
        refresh = getattr(self.inner, "refresh", None)
        if refresh is None or self.is_fresh(target):
            return  # not behind the refreshes of other scopes (other objects', other tenants')
        url = self.url(target)
        with self.lock:
            gate = self._preparing.setdefault(url, asyncio.Lock())
        async with gate:
            if not self.is_fresh(target):
                pool = self._own_refreshes if url == self.default_url else self._chosen_refreshes
                call = functools.partial(
                    contextvars.copy_context().run, self._refresh, refresh, url, target, now
                )
                await asyncio.get_running_loop().run_in_executor(pool, call)
