"""Reading the engines' metric contract from Prometheus (REFERENCE.md §2) into `Observation`s.

This is the only module that knows PromQL and its result shapes. Engine series are selected by a
fixed matcher — the `llmserving` label that the chart's PodMonitor (and the test kubelet's file_sd)
copies from every engine pod's `batchknee.io/llmserving` label — and grouped server-side by
(namespace, llmserving). So every LLMServing that shares an engine and a window is served by the
same dozen queries, whose size does not depend on how many there are or how long their names are
(Kubernetes truncates long pod names, so no name pattern is used). An LLMServing with
`spec.prometheus.selector` gets its own scope with those exact label matches.

Queries go as POST form bodies, concurrently, each with a total deadline (not a per-read timeout),
so a slow or trickling Prometheus costs one deadline per refresh and never more. Errors name the
URL without its credentials and carry the HTTP status and a short, single-line excerpt.
Metric renames across engine versions are handled with PromQL `or` chains (newest first), and both
spellings of vLLM's names (`vllm:x` and, through OpenMetrics negotiation, `vllm_x`) are matched.

Anything missing, NaN, infinite, negative, past any engine's bounds (an average context under one
token or over the largest KV pool, a latency of days, a fraction well above one), stale (no sample
inside the window) or thin (fewer samples than `min_samples`, or a sample count that is no count)
becomes `Reading.unavailable(reason)`, the reason naming the metric — never a zero.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import sys
import threading
import time
import urllib.parse
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field, fields
from datetime import datetime
from http.cookiejar import DefaultCookiePolicy
from typing import Any, cast

import requests
import urllib3
from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from batchknee.adapters import allocator
from batchknee.adapters.deadline_http import MAX_HEAD_BYTES, DeadlineAdapter, head_too_large, reads_before
from batchknee.adapters.observing import CREDENTIAL_HEADERS, read_bearer_token, redact_url
from batchknee.core.observation import (
    Engine,
    Observation,
    ObservationTarget,
    Reading,
    decode_context_under_reservation,
)
from batchknee.engines import sglang, trtllm, vllm
from batchknee.engines.contract import DCGM_DRAM_ACTIVE, EngineMetrics

Key = tuple[str, str]
Row = tuple[dict[str, str], float]  # one series: its labels and its value
LLMSERVING_LABEL = "llmserving"  # target label carrying the pod's batchknee.io/llmserving label
# What one answer may cost. A fleet's largest (one series per engine pod, ~230 bytes and ~11 JSON
# values each) fits 36,000 pods in both; json.loads of `[{},{},...]`, though, takes 25 bytes of
# memory per byte, so the values are counted (cheaply, in the raw bytes) before anything is parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024  # a query answer larger than this is refused, not buffered
MAX_ANSWER_VALUES = 400_000  # JSON values (',' '{' '[' counted) of one answer: about 100 MiB parsed
ANSWER_BYTES_IN_FLIGHT = 32 * 1024 * 1024  # answers held at once, of all the URLs specs chose
# The first bytes of every answer of a URL a spec chose, held outside the budget those URLs share:
# an honest answer (about 1 KiB per LLMServing) is never refused because other tenants' Prometheus
# servers hold the shared budget with their largest answers. What that adds is bounded by the
# threads reading: 64 KiB per query thread, 8 per refresh, of the refreshes running at once (a
# refresh returns once every query it started has ended: see `fetch`).
ANSWER_BYTES_RESERVED = 64 * 1024
# A URL a spec chose is asked nothing for this many times as long as its last refresh took (any
# scope of it; at least the cache's TTL, at most PACED_MAX_S): a silent URL, each refresh waiting
# out the deadline, then holds one of the threads those URLs share a tenth of the time, not all of
# it, however many objects or windows read it. A fast answer (milliseconds) is paced by the TTL
# alone; a slow honest one is read at least once a minute.
PACED_REUSE = 10
PACED_MAX_S = 60.0
# Prometheus answers an instant query for the very time it was asked; VictoriaMetrics, for a time
# near now, up to its -search.latencyOffset (30 s by default) earlier. Older is a cache's answer.
SAMPLE_TIME_TOLERANCE_S = 60.0
ERROR_BODY_BYTES = 8 * 1024  # of an error answer, only this much is read
EXCERPT_CHARS = 200
MAX_KV_USAGE = 1.05  # a fraction of the pool; averaged over a window it may round a little above one
MAX_POOL_TOKENS = 1e9  # tokens of one pod's KV pool: far beyond any GPU's memory at any model's size
# Finite but impossible figures are no readings either (and, multiplied into milliseconds or
# percent, would overflow to infinity on the way to status). Each bound is far past anything real.
MIN_CONTEXT_TOKENS = 1.0  # an average context under one token is no context: the knee would run away
# a TPOT or TTFT p99 of eleven days is no engine's latency (SGLang's TTFT buckets are the user's to
# set, so a p99 of hours may be real: it must read as over its target, not as no reading)
MAX_LATENCY_S = 1e6
MAX_FRACTION = MAX_KV_USAGE  # a fraction of something (KV usage, DRAM active), rounding a little above one
# SGLang's prefix hit ratio (cached / prompt tokens) counts a retracted request's cached tokens again
# when it is prefilled anew: above one under KV pressure (the policy reads it as at most one)
MAX_PREFIX_HIT_RATIO = 1e3
MAX_SEQUENCES = 1e9  # running or waiting requests of one LLMServing, all pods
MAX_EVENT_RATE = 1e12  # generated tokens or preemptions per second of one LLMServing, all pods
MAX_READ_BYTES_PER_S = 1e15  # bytes one GPU reads per second: 200 times an H200's HBM


# --- what may be shown ----------------------------------------------------------------------------


# `Authorization: Basic …`, `token=…`: a proxy or server that echoes a request may echo these
_CREDENTIAL = re.compile(
    r"(?i)\b(authorization|proxy-authorization|cookie|set-cookie|password|passwd|token|api[-_]?key)(\s*[:=]\s*)(basic |bearer )?\S+"
)


def _without_cut_secret(text: str, secret: str, shortest: int = 4) -> str:
    """`text` less a beginning of `secret` at its end: an answer cut at the bytes read may stop
    inside an echoed secret, whose head the whole-secret mask does not find."""
    for size in range(len(secret), shortest - 1, -1):  # the whole of it first: a tail may repeat its head
        if text.endswith(secret[:size]):
            return text[:-size] + "***"
    return text


def _echoed_forms(secret: str) -> set[str]:
    """`secret` as an answer may write it: as is, escaped as Python's and Go's HTML and JSON
    encoders write it (Go's JSON escapes <, > and &), and as a URL or a form writes it."""
    as_json = json.dumps(secret)[1:-1]
    return {
        secret,
        html.escape(secret),
        html.escape(secret, quote=False),
        html.escape(secret).replace("&#x27;", "&#39;").replace("&quot;", "&#34;"),
        as_json,
        as_json.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"),
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret, safe=""),
    }


def _masked(text: str, forms: Sequence[str]) -> str:
    for form in forms:
        text = text.replace(form, "***")
    return text


# Linear in the text, whatever it holds: `<[^>]*>` and a lazy `<script>…</script>` tried every `<`
# (or opener) to the end of a text with none closing it (8 KiB of `<` took 50 ms, per query). A
# quoted attribute value may hold `<` and `>` (`onclick="if(a<b)…"`).
_TAG = re.compile(r"""<(?:[^<>"']|"[^"]*"|'[^']*')*>""")
_SCRIPT_OPENER = re.compile(r"<(script|style)\b", re.IGNORECASE)
_SCRIPT_CLOSER = {name: re.compile(rf"</{name}\s*>", re.IGNORECASE) for name in ("script", "style")}


def _without_scripts(text: str) -> str:
    """The text less its scripts and styles, each up to its closing tag (none after an unclosed one)."""
    pieces, at = [], 0
    while (opener := _SCRIPT_OPENER.search(text, at)) is not None:
        closer = _SCRIPT_CLOSER[opener.group(1).lower()].search(text, opener.end())
        if closer is None:
            break
        pieces += [text[at : opener.start()], " "]
        at = closer.end()
    return "".join([*pieces, text[at:]])


_ERROR_TYPE = re.compile(r"[a-z_]{1,32}")


def _error_type(body: bytes) -> str:
    """Prometheus's own `errorType` of an error answer (`bad_data`, `execution`, `timeout`); empty
    where the answer has none of that form."""
    try:
        found = json.loads(body[:ERROR_BODY_BYTES]).get("errorType")
    except (ValueError, RecursionError, AttributeError):
        return ""
    return found if isinstance(found, str) and _ERROR_TYPE.fullmatch(found) else ""


def excerpt(body: bytes | str, limit: int = EXCERPT_CHARS, secrets: Iterable[str] = ()) -> str:
    """A short, single-line, printable excerpt of an upstream answer (never the whole body: only
    its head is read, so a huge one costs no more than a small one). Prometheus's own JSON errors
    give their `errorType: error`; HTML loses its tags; credentials, the caller's `secrets` and
    what looks like one, are masked."""
    head = body[:ERROR_BODY_BYTES]
    text = head.decode("utf-8", "replace") if isinstance(head, bytes) else head
    secrets = [secret for secret in secrets if secret]
    # as an answer may write a secret (escaped as HTML, JSON or a URL does), the longest first: a
    # secret inside a longer one must not leave the longer one's rest
    forms = sorted({form for secret in secrets for form in _echoed_forms(secret)}, key=len, reverse=True)
    # the forms that stripping tags or reading the JSON would change, before they do (the plain
    # ones after: masked first, a secret that is also a JSON key would spoil the reading)
    text = _masked(text, [form for form in forms if any(c in form for c in "<>&\\%+")])
    if len(body) >= ERROR_BODY_BYTES:
        for secret in secrets:
            text = _without_cut_secret(text, secret)
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        text = f"{parsed.get('errorType', 'error')}: {parsed['error']}"
    else:
        text = _TAG.sub(" ", _without_scripts(text))
    text = _masked(text, forms)  # and as the JSON's unescaping wrote it
    text = _CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


VLLM_METRICS = vllm.METRICS
VLLM_CACHE_INFO = vllm.CACHE_INFO
TRTLLM_METRICS = trtllm.METRICS
SGLANG_METRICS = sglang.METRICS
ENGINE_METRICS: dict[Engine, EngineMetrics] = {
    "VLLM": VLLM_METRICS,
    "TensorRTLLM": TRTLLM_METRICS,
    "SGLang": SGLANG_METRICS,
}
# what to say when none of an engine's running series is there
ABSENT_HINTS: dict[Engine, str] = {"TensorRTLLM": trtllm.ABSENT_HINT}


@dataclass(frozen=True)
class _Scope:
    """Targets queried together: one PromQL matcher, and how a series maps back to its target.

    The default scope (one per engine and window) matches every series with an `llmserving` label
    and maps a series to (namespace, llmserving). A selector scope serves exactly one target."""

    engine: Engine
    window_s: int
    matcher: str
    owner_key: Key | None = None  # a selector scope: the one target it serves

    def owner(self, labels: dict[str, str]) -> Key:
        if self.owner_key is not None:
            return self.owner_key
        return labels.get("namespace", ""), labels.get(LLMSERVING_LABEL, "")

    def tag(self, expr: str) -> str:
        """A selector scope labels its series with its target's name (so grouping is uniform)."""
        if self.owner_key is None:
            return expr
        name = _promql_string(self.owner_key[1])
        return f'label_replace({expr}, "{LLMSERVING_LABEL}", "{name}", "", "")'

    def select(self, name_regex: str, matchers: str = "") -> str:
        return f'{{__name__=~"{name_regex}",{self.matcher}{"," + matchers if matchers else ""}}}'

    def rate(self, name_regex: str) -> str:
        return f"rate({self.select(name_regex)}[{self.window}])"

    def grouped(self, expr: str) -> str:
        """Sum `expr` per LLMServing."""
        return f"sum by (namespace, {LLMSERVING_LABEL}) ({self.tag(expr)})"

    @property
    def window(self) -> str:
        return f"{self.window_s}s"

    @property
    def recent_window(self) -> str:
        """The last third of the window (trend detection)."""
        return f"{max(1, self.window_s // 3)}s"


def _promql_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def scope_for(target: ObservationTarget) -> _Scope:
    if target.selector or target.pods is not None:
        # its own scope: exact label matches, and/or an adopted workload's pods by name
        matchers = [f'namespace="{_promql_string(target.namespace)}"'] + [
            f'{label}="{_promql_string(value)}"' for label, value in sorted((target.selector or {}).items())
        ]
        if target.pods is not None:
            pods = "|".join(re.escape(pod) for pod in sorted(target.pods)) or "$^"
            matchers.append(f'pod=~"{_promql_string(pods)}"')
        return _Scope(target.engine, target.window_s, ",".join(matchers), target.key)
    return _Scope(target.engine, target.window_s, f'{LLMSERVING_LABEL}!=""')


def _scopes(targets: Iterable[ObservationTarget]) -> dict[_Scope, list[ObservationTarget]]:
    grouped: dict[_Scope, list[ObservationTarget]] = defaultdict(list)
    for target in targets:
        grouped[scope_for(target)].append(target)
    return dict(grouped)


def _once(expr: str, rank_labels: tuple[str, ...]) -> str:
    """`expr` with the series of ranks that write the same figure read once."""
    return f"max without ({', '.join(rank_labels)}) ({expr})" if rank_labels else expr


def _first_of(exprs: Iterable[str]) -> str:
    """PromQL fallback chain: each label set takes the first expression that has it."""
    return " or ".join(f"({expr})" for expr in exprs)


def spellings(name: str) -> tuple[str, ...]:
    """The names an engine may write `name` as: `vllm[:_]x` is `vllm:x` and `vllm_x`."""
    return tuple(dict.fromkeys((name.replace("[:_]", ":"), name.replace("[:_]", "_"))))


def each_spelling(name: str, expr: Callable[[str], str]) -> str:
    """`expr` of each spelling of `name` (see `spellings`), as one vector: a series of both keeps the
    first. One selector for both made every function that drops the name (rate, avg_over_time) fail
    the whole query — the whole fleet's — where one pod served both with the same labels ("vector
    cannot contain metrics with the same labelset"); read apart, a pod of either spelling counts."""
    return _first_of(expr(spelling) for spelling in spellings(name))


# The most rows one pod adds to an answer of per-engine rows: an engine's data-parallel ranks in
# one pod are a node's GPUs. A pod that writes more (15,000 `engine` label values) would otherwise
# make the fleet's answer pass what is parsed, and every LLMServing read with it hold.
MAX_ROWS_PER_POD = 32


def _per_pod_bounded(expr: str) -> str:
    return f"topk by (namespace, {LLMSERVING_LABEL}, pod) ({MAX_ROWS_PER_POD}, {expr})"


# Queries whose rows are per pod (labels kept) vs per LLMServing (one value per target).
POD_QUERIES = (
    "running",
    "waiting",
    "usage",
    "recent_running",
    "recent_usage",
    "samples",
    "scrapes",
    "capacity",
    "read_bytes",
)


# What an observation reads from a per-pod row (vLLM's pool size is in its cache-config labels).
ROW_LABELS = ("pod", "engine", "num_gpu_blocks", "block_size")


def _credentials(url: str) -> tuple[str, ...]:
    """The userinfo of `url` as an answer could echo it: the password, `user:password`, and its
    Basic-auth base64."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return ()
    user, password = urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password)
    pair = f"{user}:{password}"
    return tuple(s for s in (base64.b64encode(pair.encode()).decode(), pair, password) if len(s) >= 4)


def _header_secrets(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The header values an answer could echo (an API key, a tenant), a credential header's without
    its scheme too (`Basic …`), bar the shortest: no secret, and masking them would mask every digit
    of an error."""
    values = [*headers.values()]
    values += [v.split(None, 1)[-1] for k, v in headers.items() if k.lower() in CREDENTIAL_HEADERS]
    return tuple(dict.fromkeys(v for v in values if len(v) >= 4))


MAX_LABEL_CHARS = 253  # a pod's name at the longest Kubernetes allows


def _label_value(value: Any) -> str:
    """A label value as the reasons may quote it: a Prometheus (a tenant may choose theirs) can
    answer any JSON for one — 200 KB of escapes went whole into the reasons."""
    if type(value) is str and len(value) <= MAX_LABEL_CHARS and value.isprintable():
        return value
    return excerpt(str(value)[:ERROR_BODY_BYTES], limit=63)


def _owner(scope: _Scope, labels: dict[str, str]) -> Key:
    """The target a series belongs to, its strings shared across the queries of a refresh."""
    namespace, name = scope.owner(labels)
    return sys.intern(namespace), sys.intern(name)


def queries(scope: _Scope) -> dict[str, str]:
    """Every PromQL query of one refresh of `scope`, by name. Their text depends on the engine,
    the window and the matcher only — never on how many LLMServings the scope serves."""
    metrics = ENGINE_METRICS[scope.engine]
    window = scope.window
    by_pod = f"namespace, {LLMSERVING_LABEL}, pod, engine"

    def gauge(name: str) -> str:
        return scope.select(name, metrics.gauge_matchers)

    def gauge_by_pod(names: tuple[str, ...], over: str = window, by: str = "sum") -> str:
        return _first_of(
            f"{by} by ({by_pod}) "
            f"({_once(each_spelling(n, lambda s: f'avg_over_time({gauge(s)}[{over}])'), metrics.rank_labels)})"
            for n in names
        )

    def quantile(names: tuple[str, ...], q: float) -> str:
        return _first_of(
            f"histogram_quantile({q}, sum by (namespace, {LLMSERVING_LABEL}, le) "
            f"({scope.tag(each_spelling(name + '_bucket', scope.rate))}))"
            for name in names
        )

    def mean(names: tuple[str, ...]) -> str:
        """Mean of a histogram over the window: rate(sum) / rate(count), per target."""
        return _first_of(
            f"{scope.grouped(each_spelling(name + '_sum', scope.rate))} / "
            f"{scope.grouped(each_spelling(name + '_count', scope.rate))}"
            for name in names
        )

    def rate(names: tuple[str, ...]) -> str:
        return _first_of(
            scope.grouped(_once(each_spelling(name, scope.rate), metrics.rank_labels)) for name in names
        )

    found = {
        "running": gauge_by_pod(metrics.running),
        "waiting": gauge_by_pod(metrics.waiting),
        # a fraction of the pool: each engine's own, averaged over the groups that share one engine's
        # pool equally (SGLang's data-parallel attention groups, each its own `dp_rank`)
        "usage": gauge_by_pod(metrics.kv_usage, by="avg"),
        "recent_running": gauge_by_pod(metrics.running, scope.recent_window),
        "recent_usage": gauge_by_pod(metrics.kv_usage, scope.recent_window, by="avg"),
        "samples": _first_of(
            f"min by ({by_pod}) ({each_spelling(n, lambda s: f'count_over_time({gauge(s)}[{window}])')})"
            for n in metrics.running
        ),
        # the scrape targets (job, instance) each engine was read through in the window: two scrape
        # configs selecting one pod, or a pod of the same name recreated with a new address, would
        # make every sum here count it twice
        "scrapes": _first_of(
            f"count by ({by_pod}) (count by ({by_pod}, job, instance) "
            f"({each_spelling(n, lambda s: f'last_over_time({scope.select(s)}[{window}])')}))"
            for n in metrics.running
        ),
        "capacity": _kv_capacity_query(scope, by_pod),
        "tpot_p99": quantile(metrics.tpot, 0.99),
        # the mean step time: per output step where the engine exports it (the window's own steps)
        "tpot_mean": mean(tuple(dict.fromkeys((*metrics.step_time, *metrics.tpot)))),
        "ttft_p99": quantile(metrics.ttft, 0.99),
        "generation": rate(metrics.generation_tokens),
    }
    if metrics.preemptions:
        found["preemptions"] = rate(metrics.preemptions)
    if metrics.prefix_hits:
        found["prefix"] = f"({rate(metrics.prefix_hits)}) / ({rate(metrics.prefix_queries)})"
    if metrics.prompt_length:
        found["length_fallback"] = (
            f"({mean(metrics.prompt_length)}) + ({mean(metrics.generation_length)}) / 2"
        )
        found["prompt_length_mean"] = mean(metrics.prompt_length)
        found["output_length_mean"] = mean(metrics.generation_length)
    if metrics.prompt_tokens and metrics.finished_requests:
        # An engine that reserves prompt + full output per request (TensorRT-LLM's default
        # scheduler): the mean prompt, to take the decode-time context out of the reservation.
        def mean_prompt(over: str) -> str:
            def over_rate(s: str) -> str:
                return f"rate({scope.select(s)}[{over}])"

            tokens = _first_of(scope.grouped(each_spelling(n, over_rate)) for n in metrics.prompt_tokens)
            done = _first_of(scope.grouped(each_spelling(n, over_rate)) for n in metrics.finished_requests)
            return f"({tokens}) / ({done})"

        found["reserved_prompt"] = mean_prompt(window)
        found["recent_reserved_prompt"] = mean_prompt(scope.recent_window)
    if metrics.read_bytes:
        # Bytes read per GPU per second, per pod: the average over the pod's engines (data-parallel
        # ranks) and reporting ranks, each of which counts for its own GPU.
        found["read_bytes"] = _first_of(
            f"avg by (namespace, {LLMSERVING_LABEL}, pod) ({each_spelling(n, scope.rate)})"
            for n in metrics.read_bytes
        )
    found["dram_active"] = _dram_active_query(scope, metrics)
    for name in POD_QUERIES:
        if name in found:
            found[name] = _per_pod_bounded(found[name])
    return found


def _dram_active_query(scope: _Scope, metrics: EngineMetrics) -> str:
    """dcgm-exporter's DRAM-active fraction, averaged over the GPUs of each LLMServing's pods.

    Its series carry the GPU's pod (Kubernetes mapping), not the engine's `llmserving` label: they
    are joined on (namespace, pod) to the engine's running gauge, which has both — one query for
    the whole fleet, whatever its size."""
    # one LLMServing per pod (where a relabelled pod has two in the window, the one whose last
    # running count is the larger): a right side with two for one pod failed the whole query
    last = each_spelling(metrics.running[0], lambda s: f"last_over_time({scope.select(s)}[{scope.window}])")
    pods = f"topk by (namespace, pod) (1, max by (namespace, pod, {LLMSERVING_LABEL}) ({last}))"
    # one series per GPU (an engine pod may serve this name too, under labels of its own: two for
    # one GPU, made alike by the join, failed the whole query)
    gpus = (
        f"avg by (namespace, pod, UUID, gpu) "
        f'(avg_over_time({{__name__="{DCGM_DRAM_ACTIVE}",pod!=""}}[{scope.window}]))'
    )
    joined = f"{gpus} * on (namespace, pod) group_left ({LLMSERVING_LABEL}) ({pods} * 0 + 1)"
    return f"avg by (namespace, {LLMSERVING_LABEL}) ({scope.tag(joined)})"


def _kv_capacity_query(scope: _Scope, by_pod: str) -> str:
    """KV pool size in tokens per pod (and engine): blocks × block size."""
    window = scope.window
    if scope.engine == "VLLM":
        # cache_config_info carries the numbers as labels; the value is always 1.
        last = each_spelling(VLLM_CACHE_INFO, lambda s: f"last_over_time({scope.select(s)}[{window}])")
        return f"max by ({by_pod}, num_gpu_blocks, block_size) ({last})"
    by = f"namespace, {LLMSERVING_LABEL}, pod"
    if scope.engine == "SGLang":
        # the pool in tokens; radix-shared prefixes are held once in it (and in its usage). Each
        # data-parallel attention group has its own (summed); every TP rank and pipeline stage of one
        # writes the same (whatever the switches: the scheduler's constants).
        metrics = ENGINE_METRICS[scope.engine]
        pools = each_spelling(
            sglang.MAX_TOTAL_TOKENS,
            lambda s: f"last_over_time({scope.select(s, metrics.gauge_matchers)}[{window}])",
        )
        return f"sum by ({by}) ({_once(pools, (*metrics.rank_labels, 'pp_rank'))})"
    blocks = f"max by ({by}) (last_over_time({scope.select(trtllm.KV_MAX_BLOCKS)}[{window}]))"
    per_block = f"max by ({by}) (last_over_time({scope.select(trtllm.KV_TOKENS_PER_BLOCK)}[{window}]))"
    return f"{blocks} * on ({by}) {per_block}"


class AnswerBudget:
    """The bytes of answers being read or parsed at once by the observers that share it, and the
    turn they take to parse one answer at a time (json.loads holds the GIL anyway; a parsed answer,
    several times its size, is dropped before the next is made). A query that would take more is
    refused at once (the next evaluation asks again): one that waited while holding part of its
    answer could wait on others doing the same. A budget with a `parent` takes from both, and
    parses in its own turn and then the parent's: its answers queue on its own turn, so at most one
    of them waits at the parent's, beside one of each sibling's.

    The operator's own Prometheus gets a budget its query threads cannot pass, and its own turn;
    each URL an LLMServing chose gets one answer's worth, under one budget they all share, except
    the first `reserved` bytes of each answer, taken from its own budget alone. So a tenant's
    Prometheus answering its largest to every query holds one answer of the shared budget and one
    place in the queue to parse, and never the operator's memory (and with it every tenant's loop)
    or its own reads; a few such tenants fill the shared budget, and every other URL's small
    answers still go through."""

    def __init__(
        self, limit: int = ANSWER_BYTES_IN_FLIGHT, parent: AnswerBudget | None = None, reserved: int = 0
    ) -> None:
        self.limit = limit
        self.parent = parent
        self.reserved = reserved
        self.held = 0
        self.turn = threading.Lock()  # held while one of this budget's answers is parsed
        self._lock = threading.Lock()

    def take_turn(self, deadline: float) -> bool:
        """Wait until `deadline` (monotonic) for this budget's turn to parse, then its parent's;
        False (holding neither) when the deadline passes first."""
        if not self.turn.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        if self.parent is None or self.parent.take_turn(deadline):
            return True
        self.turn.release()
        return False

    def end_turn(self) -> None:
        if self.parent is not None:
            self.parent.end_turn()
        self.turn.release()

    def take(self, size: int, alone: bool = False) -> AnswerBudget | None:
        """Take `size` bytes from this budget and (unless `alone`) its parent; None if taken, else
        the budget that refused (and nothing is held)."""
        with self._lock:
            if self.held + size > self.limit:
                return self
            self.held += size
        refused = self.parent.take(size) if self.parent is not None and not alone else None
        if refused is not None:
            self.give(size, alone=True)
        return refused

    def give(self, size: int, alone: bool = False) -> None:
        with self._lock:
            self.held -= size
        if self.parent is not None and not alone:
            self.parent.give(size)


WORDS_NOT_SHOWN = "its words are not shown: they can quote other LLMServings' series"


class PrometheusUnavailable(Exception):
    """Prometheus could not be reached or refused a query; every target is unavailable.

    `said` is what the answer itself said (an excerpt), kept apart from what the operator says of
    it: Prometheus's errors quote label sets, so in a scope that serves many LLMServings the words
    could name other tenants' namespaces, pods and LLMServings; only a scope of one target shows
    them (`shown`)."""

    def __init__(self, message: str, said: str = "", kind: str = "") -> None:
        super().__init__(f"{message}: {said}" if said else message)
        self.message = message
        self.said = said
        self.kind = kind  # Prometheus's errorType, where the answer gave one

    def shown(self, scope: _Scope) -> str:
        if scope.owner_key is not None or not self.said:
            return str(self)
        kind = f" ({self.kind})" if self.kind else ""
        return f"{self.message}{kind}; {WORDS_NOT_SHOWN}"


@dataclass
class ScopeData:
    """One refresh of a scope: per-pod rows and per-LLMServing values, by target key, or the
    reason nothing could be read. Observations of any target of the scope are built from it."""

    scope: _Scope
    sampled_at: datetime
    min_samples: int
    pod_rows: dict[str, dict[Key, list[Row]]] = field(default_factory=dict)
    values: dict[str, dict[Key, float]] = field(default_factory=dict)
    error: str | None = None

    def _prompt_mean(self, value: Callable[..., Reading]) -> Reading:
        """The mean prompt of the requests finished in the window: from the engine's histogram, or
        (TensorRT-LLM, which has none) prompt tokens per finished request from its counters."""
        histogram = _prompt(
            value(
                "prompt_length_mean", "mean prompt length", "no requests finished", MAX_POOL_TOKENS, " tokens"
            )
        )
        if histogram.available or "reserved_prompt" not in self.values:
            return histogram
        return self._reserved_prompt(value, "")

    def observation(self, key: Key) -> Observation:
        now = self.sampled_at
        if self.error is not None:
            return Observation.unavailable(now, self.error)
        scope = self.scope

        def rows(name: str) -> list[Row]:
            return self.pod_rows.get(name, {}).get(key, [])

        def value(name: str, what: str, empty: str = "", limit: float = math.inf, unit: str = "") -> Reading:
            return _value(self.values.get(name, {}), key, what, window_text, empty, limit, unit)

        window_text = f"in the last {scope.window_s}s"
        running_rows = rows("running")
        pods = {labels.get("pod") for labels, _ in running_rows}
        if not pods:
            hint = ABSENT_HINTS.get(scope.engine, "")
            return Observation.unavailable(
                now, f"no {scope.engine} engine metrics {window_text}" + (f"; {hint}" if hint else "")
            )
        doubled = sorted((labels.get("pod", ""), n) for labels, n in rows("scrapes") if n > 1)
        if doubled:
            pod, n = doubled[0]
            return Observation.unavailable(
                now,
                f"pod {pod}'s engine metrics came through {n:g} scrape targets (job, instance) "
                f"{window_text}: two scrape configs select it, or it was replaced or relabelled within "
                f"the window; every sum would count it {n:g} times, so the observation waits for one",
            )
        samples = [v for _, v in rows("samples")]
        # a count that is NaN, infinite or negative counts nothing: too few samples, like none
        uncounted = next((v for v in samples if not (math.isfinite(v) and v >= 0)), None)
        thin = uncounted is not None or min(samples, default=0) < self.min_samples
        # a pod scraped for part of the window (drained or started by a rollout) counts by that part
        # (each pod's share of the largest count: a sum of huge counts cannot overflow)
        top = max(samples) if samples and uncounted is None else 0.0
        pods_served = (
            Reading.of(sum(v / top for v in samples))
            if top > 0
            else Reading.unavailable(f"no sample counts {window_text}")
        )
        thin_reason = (
            f"only {min(samples, default=0):.0f} samples per pod {window_text} (need {self.min_samples})"
            if uncounted is None
            else f"no usable sample count per pod {window_text}: the count of samples is {uncounted:g} "
            f"(need {self.min_samples})"
        )

        def gauge(name: str, what: str, limit: float, combine: str = "sum") -> Reading:
            if thin:
                return Reading.unavailable(thin_reason)
            values = [v for _, v in rows(name)]
            if not values:
                return Reading.unavailable(f"no {what} series {window_text}")
            # each pod's own (a negative one would hide in the sum)
            broken = next(
                (r for v in values if not (r := _checked(v, f"one pod's {what}", limit)).available), None
            )
            if broken is not None:
                return broken
            total = sum(values) if combine == "sum" else sum(values) / len(values)
            return _checked(total, what, limit)

        if thin:
            context = Reading.unavailable(thin_reason)
            recent_context = context
        else:
            context = _kv_context(running_rows, rows("usage"), rows("capacity"))
            if not context.available:
                fallback = _context(
                    value("length_fallback", "prompt and generation length histograms"),
                    "average context from the prompt and generation length histograms",
                )
                if fallback.available:
                    context = fallback
                else:
                    context = Reading.unavailable(f"{context.reason}; histogram fallback: {fallback.reason}")
            recent_context = _kv_context(rows("recent_running"), rows("recent_usage"), rows("capacity"))
            metrics = ENGINE_METRICS[scope.engine]
            if metrics.prompt_tokens and metrics.finished_requests:
                context = decode_context_under_reservation(context, self._reserved_prompt(value, ""))
                recent_context = decode_context_under_reservation(
                    recent_context, self._reserved_prompt(value, "recent_")
                )
            # whatever path gave it, an average context is between one token and the largest pool
            context = _context(context, "average context")
            recent_context = _context(recent_context, "recent average context")
        tokens, seconds = MAX_POOL_TOKENS, MAX_LATENCY_S
        return Observation(
            sampled_at=now,
            pods=len(pods),
            pods_served=pods_served,
            avg_context_tokens=context,
            tpot_p99_s=value("tpot_p99", "TPOT p99", "no requests finished", seconds, " s"),
            tpot_mean_s=value("tpot_mean", "TPOT mean", "no requests finished", seconds, " s"),
            ttft_p99_s=value("ttft_p99", "TTFT p99", "no requests started", seconds, " s"),
            running=gauge("running", "running-requests", MAX_SEQUENCES),
            waiting=gauge("waiting", "waiting-requests", MAX_SEQUENCES),
            kv_cache_usage=gauge("usage", "KV-cache usage", MAX_FRACTION, combine="mean"),
            prefix_hit_ratio=value(
                "prefix", "prefix-cache hit ratio", "no prefix-cache queries", MAX_PREFIX_HIT_RATIO
            ),
            preemptions_per_s=value("preemptions", "preemption rate", limit=MAX_EVENT_RATE, unit="/s"),
            generation_tokens_per_s=value(
                "generation", "generation token rate", limit=MAX_EVENT_RATE, unit="/s"
            ),
            recent_avg_context_tokens=recent_context,
            prompt_tokens_mean=self._prompt_mean(value),
            output_tokens_mean=value(
                "output_length_mean", "mean output length", "no requests finished", tokens, " tokens"
            ),
            read_bytes_per_s_per_gpu=self._read_bandwidth(
                rows("read_bytes"),
                value("generation", "generation token rate", limit=MAX_EVENT_RATE, unit="/s"),
                thin,
                thin_reason,
            ),
            dram_active=value("dram_active", "DRAM-active fraction (dcgm-exporter)", limit=MAX_FRACTION),
        )

    @staticmethod
    def _reserved_prompt(value: Callable[..., Reading], recent: str) -> Reading:
        """The mean prompt per finished request, from the token counters (`recent`: of the last third)."""
        return _prompt(
            value(
                f"{recent}reserved_prompt", "mean prompt", "no requests finished", MAX_POOL_TOKENS, " tokens"
            )
        )

    def _read_bandwidth(
        self, read_rows: list[Row], generation: Reading, thin: bool, thin_reason: str
    ) -> Reading:
        """Bytes read per GPU per second, the mean over the pods. vLLM registers its counter with
        or without `--enable-mfu-metrics` and only counts with it: a flat zero while tokens are
        generated is a switched-off counter, not an idle GPU."""
        engine = self.scope.engine
        switch = "--enable-mfu-metrics"
        if not ENGINE_METRICS[engine].read_bytes:
            return Reading.unavailable(f"{engine} exports no read-bytes counter")
        if thin:
            return Reading.unavailable(thin_reason)
        values = [v for _, v in read_rows]
        if not values:
            return Reading.unavailable(
                f"no read-bytes series in the last {self.scope.window_s}s (start the engine with {switch})"
            )
        per_gpu = sum(values) / len(values)
        if per_gpu == 0 and generation.value != 0:
            return Reading.unavailable(
                f"the read-bytes counter stays at zero while tokens are generated: the engine counts "
                f"only with {switch}"
                if generation.value is not None
                else f"the read-bytes counter stays at zero and the generation rate is unknown "
                f"({generation.reason}): a counter the engine only runs with {switch} is not an idle GPU"
            )
        return _checked(per_gpu, "read bandwidth", MAX_READ_BYTES_PER_S, " B/s")


class PrometheusObserver:
    """Batched observation of many LLMServings through one Prometheus URL."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        min_samples: int = 3,
        max_concurrent_queries: int = 8,
        budget: AnswerBudget | None = None,
        bearer_token_file: str = "",
        ca_file: str = "",
        headers: Mapping[str, str] | None = None,
        paced: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.paced = paced  # a refresh serves for PACED_REUSE times as long as it took
        # the operator's own Prometheus only: a URL an LLMServing chose never gets its token or headers
        self.bearer_token_file = bearer_token_file
        self.headers = dict(headers or {})
        self.verify: str | bool = ca_file or True
        # alone, its threads bound what it holds: a budget they cannot pass
        self.budget = budget or AnswerBudget(max_concurrent_queries * MAX_BODY_BYTES)
        self.shown_url = redact_url(self.url)
        # masked in whatever an answer echoes
        self._credentials = (*_credentials(self.url), *_header_secrets(self.headers))
        self._tokens: deque[str] = deque(maxlen=4)  # the bearer tokens last sent (rotated ones too)
        self.timeout_s = timeout_s
        self.min_samples = min_samples
        # Our own session, handed to the client (its documented `session=`): the client mounts
        # one quick retry on it (a down Prometheus must cost the tick seconds, not minutes), and
        # queries go through it as POST form bodies (custom_query, even with method="POST", puts
        # the query in the URL, whose size Prometheus limits).
        self._session = requests.Session()
        # A refused connection is tried once more; an answer never is: retrying one would read
        # its whole body unbounded and sleep as long as its Retry-After says (hours), holding a
        # query thread past every deadline. The next evaluation asks again.
        retry = Retry(
            total=1,
            connect=1,
            read=False,  # a read that timed out is raised as it is: the deadline passed
            status=0,
            backoff_factor=0.1,
            respect_retry_after_header=False,
            allowed_methods=["GET", "POST"],  # a query changes nothing: safe to repeat
            raise_on_status=False,
        )
        self._client = PrometheusConnect(url=self.url, session=self._session, timeout=timeout_s, retry=retry)
        # in place of the client's adapter: answers read within each query's deadline, head too. On
        # the schemes, not the URL: requests picks an adapter by the prepared URL, which another
        # spelling of it (a port's leading zero, an escaped path) does not start with.
        deadline = DeadlineAdapter(max_retries=retry)
        self._session.adapters.clear()
        for scheme in ("https://", "http://"):
            self._session.mount(scheme, deadline)
        # no cookies: an answer's Set-Cookie would be kept and sent back with every query, without
        # bound (a jar of 4 MB made each query's head 4 MB, past every deadline)
        self._session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        self._pool = ThreadPoolExecutor(max_concurrent_queries, thread_name_prefix="prometheus-query")
        self._counter_lock = threading.Lock()
        self.queries_sent = 0
        self.largest_query_bytes = 0

    @property
    def _secrets(self) -> tuple[str, ...]:
        return (*self._credentials, *self._tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # --- one query ----------------------------------------------------------------------------------

    def _timed_out(self) -> PrometheusUnavailable:
        return PrometheusUnavailable(
            f"Prometheus at {self.shown_url} did not answer within {self.timeout_s:g}s"
        )

    def _query(self, promql: str, now: datetime, deadline: float, take: Callable[[int], None]) -> bytes:
        """One instant query, POSTed, its whole answer read before `deadline` (time.monotonic),
        each piece taken from the budget (`take` raises _OverBudget)."""
        # partial_response=false: a Thanos querier answers without a store that timed out, as a
        # success (half the pods' tokens, all their samples: a revert of a good change); this way it
        # fails. Prometheus and Mimir ignore the parameter.
        form = {"query": promql, "time": f"{now.timestamp():.3f}", "partial_response": "false"}
        body = urllib.parse.urlencode(form)
        with self._counter_lock:
            self.queries_sent += 1
            self.largest_query_bytes = max(self.largest_query_bytes, len(body))
        headers = {**self.headers, "Content-Type": "application/x-www-form-urlencoded"}
        if self.bearer_token_file:
            try:
                token = read_bearer_token(self.bearer_token_file)
            except ValueError as error:
                raise PrometheusUnavailable(
                    f"Prometheus at {self.shown_url}: its bearer token file {error}"
                ) from None
            headers["Authorization"] = f"Bearer {token}"
            if token not in self._tokens:
                self._tokens.append(token)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out()
        try:
            with reads_before(deadline):
                response = self._session.post(
                    f"{self.url}/api/v1/query",
                    data=body,
                    headers=headers,
                    timeout=(remaining, remaining),
                    stream=True,
                    allow_redirects=False,  # a tenant's URL must not choose where the operator reads
                    verify=self.verify,
                )
                limit = MAX_BODY_BYTES if response.status_code == 200 else ERROR_BODY_BYTES
                content = _read_within(response, deadline, limit, take)
        except (_Deadline, requests.Timeout):
            raise self._timed_out() from None
        except _TooLarge:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} answered more than {MAX_BODY_BYTES // 2**20} MiB"
            ) from None
        except _OverBudget as over:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url}: the answers being read at once passed "
                f"{over.limit / 2**20:g} MiB; asking again at the next evaluation"
            ) from None
        except requests.exceptions.SSLError:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} unreachable: SSLError (no verified HTTPS connection; "
                "is its certificate signed by a CA the operator trusts?)"
            ) from None
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as error:
            if head_too_large(error):
                raise PrometheusUnavailable(
                    f"Prometheus at {self.shown_url}: its answer's status line and headers passed "
                    f"{MAX_HEAD_BYTES // 1024} KiB"
                ) from None
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} unreachable: {type(error).__name__}"
            ) from None
        if response.is_redirect:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} answered HTTP {response.status_code}, a redirect, not "
                "followed: give the URL it redirects to"
            )
        if response.status_code != 200:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} answered HTTP {response.status_code}",
                excerpt(content, secrets=self._secrets),
                _error_type(content),
            )
        return content

    def _result(self, content: bytes) -> list[dict[str, Any]]:
        """The series of an answer, counted before it is parsed (see MAX_ANSWER_VALUES)."""
        values = content.count(b",") + content.count(b"{") + content.count(b"[")
        if values > MAX_ANSWER_VALUES:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} answered {values:,} JSON values (at most "
                f"{MAX_ANSWER_VALUES:,}, about {MAX_ANSWER_VALUES // 11:,} series, are parsed)"
            )
        try:
            answer = json.loads(content)
            result: list[dict[str, Any]] = answer["data"]["result"]
            if answer.get("status") != "success" or not isinstance(result, list):
                raise ValueError
            if not all(
                isinstance(series, dict) and isinstance(series.get("metric"), dict) for series in result
            ):
                raise ValueError
        except (ValueError, KeyError, TypeError, RecursionError):
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} answered something that is not a query result",
                excerpt(content, secrets=self._secrets),
            ) from None
        return result

    def _shaped(
        self, scope: _Scope, name: str, promql: str, now: datetime, deadline: float
    ) -> dict[Key, list[Row]] | dict[Key, float]:
        """One query's answer by target, shaped in the worker: its bytes are held in the budget
        until it is parsed (its first `reserved` bytes from this URL's budget alone), one answer is
        parsed at a time and dropped before the next, and the rows keep only the labels the
        observation reads."""
        held = held_alone = 0

        def take(size: int) -> None:
            nonlocal held, held_alone
            alone = held_alone + size <= self.budget.reserved
            refused = self.budget.take(size, alone=alone)
            if refused is not None:
                raise _OverBudget(refused.limit)
            if alone:
                held_alone += size
            else:
                held += size

        try:
            content = self._query(promql, now, deadline, take)
            if not self.budget.take_turn(deadline):
                raise self._timed_out()
            try:
                return self._shape(scope, name, self._result(content), now)
            finally:
                self.budget.end_turn()
        finally:
            self.budget.give(held_alone, alone=True)
            self.budget.give(held)

    def _shape(
        self, scope: _Scope, name: str, result: list[dict[str, Any]], now: datetime
    ) -> dict[Key, list[Row]] | dict[Key, float]:
        asked_at = round(now.timestamp(), 3)
        if name not in POD_QUERIES:
            return {_owner(scope, series["metric"]): self._sample(series, asked_at) for series in result}
        by_key: dict[Key, list[Row]] = defaultdict(list)
        for series in result:
            labels = series["metric"]
            kept = {k: sys.intern(_label_value(labels[k])) for k in ROW_LABELS if k in labels}
            by_key[_owner(scope, labels)].append((kept, self._sample(series, asked_at)))
        return dict(by_key)

    def _sample(self, series: dict[str, Any], asked_at: float) -> float:
        """A sample as Prometheus writes one, [evaluation time, "value"], for the time asked. A
        number where the string belongs (float() reads JSON's true as 1.0) or another time (a cache
        between the operator and Prometheus answering an older query) is no reading."""
        at, text = series["value"]
        if not isinstance(text, str) or isinstance(at, bool) or not isinstance(at, int | float):
            raise PrometheusUnavailable(
                f'Prometheus at {self.shown_url} answered a sample that is not [time, "value"]'
            )
        offset = float(at) - asked_at
        if not abs(offset) <= SAMPLE_TIME_TOLERANCE_S:
            raise PrometheusUnavailable(
                f"Prometheus at {self.shown_url} answered for {offset:+g}s from the time asked: a cache "
                "between the operator and Prometheus? Give the URL of Prometheus itself"
            )
        return float(text)

    # --- one scope ----------------------------------------------------------------------------------

    def fetch(self, scope: _Scope, now: datetime) -> ScopeData:
        """Run every query of `scope` concurrently; never raises for Prometheus trouble (the data
        then carries the reason). Costs at most one deadline, however slowly Prometheus answers."""
        data = ScopeData(scope, now, self.min_samples)
        deadline = time.monotonic() + self.timeout_s
        cutoff = deadline + 0.25  # the workers stop reading at the deadline; a hung header read is cut here
        try:
            futures = {
                name: self._pool.submit(self._shaped, scope, name, promql, now, deadline)
                for name, promql in queries(scope).items()
            }
        except RuntimeError:  # closed while a refresh was starting
            data.error = f"Prometheus at {self.shown_url} is no longer used"
            return data
        try:
            for name, future in futures.items():
                shaped = future.result(timeout=max(0.0, cutoff - time.monotonic()))
                if name in POD_QUERIES:
                    data.pod_rows[name] = cast(dict[Key, list[Row]], shaped)
                else:
                    data.values[name] = cast(dict[Key, float], shaped)
        except PrometheusUnavailable as error:
            data.error = error.shown(scope)
        except FutureTimeout:
            data.error = str(self._timed_out())
        except (KeyError, IndexError, TypeError, ValueError, OverflowError):
            data.error = f"Prometheus at {self.shown_url} answered series of an unexpected shape"
        finally:
            for future in futures.values():
                future.cancel()
            # The queries already reading end by the deadline: waiting for them keeps a refresh
            # (one per caller's thread) the bound on how many answers are read at once, also when
            # its first query failed at once and the others trickle.
            wait_for(futures.values(), timeout=max(0.0, cutoff - time.monotonic()))
        return data

    def observe(self, targets: Sequence[ObservationTarget], now: datetime) -> dict[Key, Observation]:
        """One Observation per target, evaluated at `now`. Never raises for Prometheus trouble:
        the observations then carry the reason."""
        observations: dict[Key, Observation] = {}
        for scope, members in _scopes(targets).items():
            data = self.fetch(scope, now)
            observations.update({target.key: data.observation(target.key) for target in members})
        return observations


class _Deadline(Exception):
    pass


class _TooLarge(Exception):
    pass


class _OverBudget(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


def _read_within(
    response: requests.Response, deadline: float, limit: int, take: Callable[[int], None]
) -> bytes:
    """The body of a streamed response, read before `deadline` (time.monotonic()), up to `limit`
    bytes, each piece taken from a budget (`take` raises _OverBudget past it). Each socket read is
    given only the time left by the connection's own reader (the session's DeadlineAdapter, under
    `reads_before`), so a trickle cannot stretch the total."""
    raw = response.raw
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            if deadline - time.monotonic() <= 0:
                raise _Deadline
            try:
                chunk = raw.read1(65536, decode_content=True)
            except (TimeoutError, urllib3.exceptions.ReadTimeoutError):
                raise _Deadline from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit and limit >= MAX_BODY_BYTES:
                raise _TooLarge  # (before taking: a query refused for its size holds nothing more)
            take(len(chunk))
            chunks.append(chunk)
            if size > limit:  # an error page: its head is all we show
                return b"".join(chunks)[:limit]
    finally:
        response.close()


def _checked(value: float, what: str, limit: float = math.inf, unit: str = "") -> Reading:
    """`value` as a reading, unless it is NaN, infinite, negative or over `limit` (in `unit`):
    then unavailable, the reason naming `what`."""
    if math.isnan(value):
        return Reading.unavailable(f"{what} is NaN")
    if math.isinf(value):
        return Reading.unavailable(f"{what} is infinite")
    if value < 0:
        return Reading.unavailable(f"{what} is negative ({value:g})")
    if value > limit:
        return Reading.unavailable(f"{what} is {value:g}{unit}, over the {limit:g}{unit} any engine reports")
    return Reading.of(value)


def _value(
    values: dict[Key, float],
    key: Key,
    what: str,
    window_text: str,
    empty: str = "",
    limit: float = math.inf,
    unit: str = "",
) -> Reading:
    if key not in values:
        return Reading.unavailable(f"no {what} series {window_text}")
    value = values[key]
    if math.isnan(value) and empty:  # a ratio or quantile over zero events
        return Reading.unavailable(f"{empty} {window_text}")
    return _checked(value, what, limit, unit)


def _prompt(reading: Reading) -> Reading:
    """A mean prompt of at least one token, else unavailable: every prompt has one. Under one, the
    window counted prompt tokens and finished requests at different moments (TensorRT-LLM's
    counters: the prompt as a request starts, the request as it ends)."""
    tokens = reading.value
    if tokens is not None and tokens < MIN_CONTEXT_TOKENS:
        return Reading.unavailable(
            f"mean prompt is {tokens:g} tokens, under one: the window's prompt tokens and finished "
            "requests do not match"
        )
    return reading


def _context(reading: Reading, what: str) -> Reading:
    """An average context of at least one token and at most the largest pool accepted, else
    unavailable, the reason naming `what` (a tiny one sends the knee to infinity, a huge one to zero)."""
    tokens = reading.value
    if tokens is None:
        return reading
    if tokens < MIN_CONTEXT_TOKENS:
        return Reading.unavailable(f"{what} is {tokens:g} tokens, under {MIN_CONTEXT_TOKENS:g}")
    if tokens > MAX_POOL_TOKENS:
        return Reading.unavailable(
            f"{what} is {tokens:g} tokens, over the largest KV pool accepted ({MAX_POOL_TOKENS:g})"
        )
    return reading


def _kv_context(running_rows: list[Row], usage_rows: list[Row], capacity_rows: list[Row]) -> Reading:
    """Average context per running sequence from the KV pool: Σ usage × pool tokens / Σ running.
    Shared prefix blocks count once — exactly the effective KV per sequence the knee needs."""

    def pod_engine(labels: dict[str, str]) -> tuple[str, str]:
        return labels.get("pod", ""), labels.get("engine", "")

    capacity: dict[tuple[str, str], float] = {}
    for labels, value in capacity_rows:
        if "num_gpu_blocks" in labels:  # vLLM: numbers in labels
            try:
                value = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
            except (KeyError, ValueError):
                return Reading.unavailable("cache_config_info lacks numeric num_gpu_blocks/block_size labels")
        capacity[pod_engine(labels)] = value
    usage = {pod_engine(labels): value for labels, value in usage_rows}
    running = {pod_engine(labels): value for labels, value in running_rows}
    if not capacity:
        return Reading.unavailable("no KV pool size (cache config) series")
    tokens = 0.0
    sequences = 0.0
    for pod, pool_tokens in capacity.items():
        if pod not in usage or pod not in running:
            return Reading.unavailable(f"pod {pod[0]} reports a KV pool but no usage or running series")
        if not (math.isfinite(usage[pod]) and math.isfinite(running[pod]) and math.isfinite(pool_tokens)):
            return Reading.unavailable(f"pod {pod[0]} reports a non-finite KV usage, pool or running value")
        # finite but impossible (a fraction above one, a pool of 10¹² tokens) is no reading either
        if not 0 <= usage[pod] <= MAX_KV_USAGE:
            return Reading.unavailable(
                f"pod {pod[0]} reports KV usage {usage[pod]:g}, not a fraction of its pool"
            )
        if not 0 < pool_tokens <= MAX_POOL_TOKENS:
            return Reading.unavailable(f"pod {pod[0]} reports a KV pool of {pool_tokens:g} tokens")
        if running[pod] < 0:
            return Reading.unavailable(f"pod {pod[0]} reports {running[pod]:g} running sequences")
        tokens += usage[pod] * pool_tokens
        sequences += running[pod]
    if sequences < 0.5:
        return Reading.unavailable("no running sequences to average over")
    return _context(
        _checked(tokens / sequences, "average context"), "average context from KV usage × pool / running"
    )


# --- the operator's cache: one refresh in flight per URL ----------------------------------------------


@dataclass
class _Entry:
    data: ScopeData
    fetched: float  # time.monotonic() when the refresh finished


class _UrlCache:
    """The refreshed scopes of one Prometheus URL. `refreshing` is held across the HTTP calls of
    one refresh (one in flight per URL); `guard` only ever around dict reads and writes.

    A paced URL (one a spec chose) is asked nothing until `paced_until`: its last refresh serves
    every scope it read, however old, and a scope asked for meanwhile is read with the next one,
    which reads every scope due (so no scope waits behind another's turn)."""

    def __init__(self, observer: PrometheusObserver) -> None:
        self.observer = observer
        self.refreshing = threading.Lock()
        self.guard = threading.Lock()
        self.entries: dict[_Scope, _Entry] = {}
        self.asked: dict[_Scope, float] = {}  # when each scope was last asked for (time.monotonic())
        self.paced_until = 0.0  # time.monotonic()

    def paced(self) -> bool:
        return time.monotonic() < self.paced_until

    def fresh(self, scope: _Scope, ttl_s: float) -> _Entry | None:
        with self.guard:
            entry = self.entries.get(scope)
        if entry is not None and (time.monotonic() - entry.fetched < ttl_s or self.paced()):
            return entry
        return None

    def ask(self, scope: _Scope) -> _Entry | None:
        """Note that `scope` is wanted; its entry of any age."""
        with self.guard:
            self.asked[scope] = time.monotonic()
            return self.entries.get(scope)

    def kept_s(self, ttl_s: float) -> float:
        return 10 * ttl_s + (PACED_MAX_S if self.observer.paced else 0.0)

    def due(self, ttl_s: float) -> list[_Scope]:
        """The scopes asked for lately whose entry is missing or older than `ttl_s`, oldest first."""
        now = time.monotonic()
        with self.guard:
            wanted = [s for s, at in self.asked.items() if now - at <= self.kept_s(ttl_s)]
            fetched = {s: e.fetched for s, e in self.entries.items()}
        return sorted(
            (s for s in wanted if now - fetched.get(s, -math.inf) >= ttl_s),
            key=lambda s: fetched.get(s, -math.inf),
        )

    def store(self, scope: _Scope, data: ScopeData, ttl_s: float) -> _Entry:
        entry = _Entry(data, time.monotonic())
        with self.guard:
            # Scopes nobody asked for in a while (a window changed, a selector dropped) go.
            kept_s = self.kept_s(ttl_s)
            for old in [s for s, e in self.entries.items() if entry.fetched - e.fetched > kept_s]:
                del self.entries[old]
            for old in [s for s, at in self.asked.items() if entry.fetched - at > kept_s]:
                del self.asked[old]
            self.entries[scope] = entry
        return entry

    def pace(self, started: float, share: float = 1.0) -> None:
        """Ask the URL nothing for PACED_REUSE times as long as its refresh took (at most
        PACED_MAX_S), × the `share` of its due scopes that refresh read."""
        took_s = time.monotonic() - started
        self.paced_until = time.monotonic() + min(PACED_REUSE * took_s, PACED_MAX_S) * share

    def not_yet(self, scope: _Scope, now: datetime) -> ScopeData:
        return ScopeData(
            scope,
            now,
            self.observer.min_samples,
            error=f"Prometheus at {self.observer.shown_url} has not been read for this window and "
            "selector yet: a URL a spec chose is read at most a tenth of the time (its answers are "
            "slow), and this one is read with its next refresh",
        )


class CachedObserver:
    """Reconciles share refreshes: one refresh of a scope (engine, window, matcher) serves every
    LLMServing of that scope until it is `ttl_s` old. Each Prometheus URL has its own cache and its
    own refresh lock, so a slow URL delays only the objects that use it; a new LLMServing reads
    the current refresh of its scope and triggers nothing when that is fresh."""

    def __init__(self, observer_for_url: Callable[[str], PrometheusObserver], ttl_s: float = 5.0) -> None:
        self._observer_for_url = observer_for_url
        self.ttl_s = ttl_s
        self._guard = threading.Lock()
        self._urls: dict[str, _UrlCache] = {}
        # A dropped URL's pace, until it ends: deleting and recreating the objects that chose a
        # slow URL must not buy its next refresh early (time.monotonic(), by URL).
        self._paced_until: dict[str, float] = {}

    def _cache(self, url: str) -> _UrlCache:
        with self._guard:
            cache = self._urls.get(url)
            if cache is None:
                cache = self._urls[url] = _UrlCache(self._observer_for_url(url))
                cache.paced_until = self._paced_until.pop(url, 0.0)
            return cache

    def is_fresh(self, url: str, target: ObservationTarget) -> bool:
        with self._guard:
            cache = self._urls.get(url)  # (asking creates nothing: no session for a URL yet unused)
        return cache is not None and cache.fresh(scope_for(target), self.ttl_s) is not None

    def refresh(self, url: str, target: ObservationTarget, now: datetime) -> ScopeData:
        """The scope of `target`, refreshed unless another caller just did (then theirs)."""
        cache, scope = self._cache(url), scope_for(target)
        with cache.refreshing:
            cache.ask(scope)
            entry = cache.fresh(scope, self.ttl_s)
            fetched = entry is None
            if entry is None and cache.paced():  # a scope not read yet, of a paced URL
                return cache.not_yet(scope, now)
            if entry is None and cache.observer.paced:
                entry = self._refresh_paced(cache, scope, now)
                if entry is None:  # the URL let an older scope's deadline run out first
                    return cache.not_yet(scope, now)
            elif entry is None:
                entry = cache.store(scope, cache.observer.fetch(scope, now), self.ttl_s)
        if fetched:
            allocator.trim()  # the parsed answers are garbage now: give their pages back
        return entry.data

    def _refresh_paced(self, cache: _UrlCache, scope: _Scope, now: datetime) -> _Entry | None:
        """Every scope of the URL that is due, `scope` among them, oldest read first, each within
        its own deadline, none after one the URL let run out (it would cost every one of them a
        deadline); then the URL is paced by the time that took. A URL that answers, slowly, is read
        one deadline at a time (twenty scopes answered just in time held the calling thread for
        twenty deadlines), paced by the share it read: the rest, the oldest, go first next time, at
        the pace a whole refresh had. Oldest first, a scope the URL never answers goes to the back:
        it cannot keep the URL's other scopes (another object's selector, maybe another team's)
        unread. `scope`'s entry, unless its turn did not come."""
        started = time.monotonic()
        due = cache.due(self.ttl_s)
        for read, next_scope in enumerate(due, 1):
            began = time.monotonic()
            cache.store(next_scope, cache.observer.fetch(next_scope, now), self.ttl_s)
            if time.monotonic() - began >= cache.observer.timeout_s:
                break  # silent: paced in full
            if read < len(due) and time.monotonic() - started >= cache.observer.timeout_s:
                cache.pace(started, share=read / len(due))
                return cache.fresh(scope, self.ttl_s)
        cache.pace(started)
        return cache.fresh(scope, self.ttl_s)

    def observation(self, url: str, target: ObservationTarget, now: datetime) -> Observation:
        cache, scope = self._cache(url), scope_for(target)
        # The handlers refresh before a reconcile goes to a thread (`RoutedObserver.prepare`);
        # one that waited for a thread a little longer still uses that refresh.
        entry = cache.fresh(scope, 3 * self.ttl_s)
        if entry is None and (cache.refreshing.locked() or cache.paced()):
            # Someone is refreshing this URL (maybe waiting out a slow Prometheus), or it is paced:
            # the last refresh serves rather than this thread waiting or asking too.
            entry = cache.ask(scope)
            if entry is None and cache.paced():
                return cache.not_yet(scope, now).observation(target.key)
        data = entry.data if entry is not None else self.refresh(url, target, now)
        return data.observation(target.key)

    def forget(self, key: Key) -> None:
        """Drop what only this object used (its selector scopes)."""
        with self._guard:
            caches = list(self._urls.values())
        for cache in caches:
            with cache.guard:
                for scope in [s for s in cache.entries if s.owner_key == key]:
                    del cache.entries[scope]
                for scope in [s for s in cache.asked if s.owner_key == key]:
                    del cache.asked[scope]

    def drop_url(self, url: str) -> None:
        """No object uses `url` any more: its cache and HTTP session go."""
        with self._guard:
            cache = self._urls.pop(url, None)
            now = time.monotonic()
            for ended in [u for u, until in self._paced_until.items() if until <= now]:
                del self._paced_until[ended]
            if cache is not None and cache.paced():
                self._paced_until[url] = cache.paced_until
        if cache is not None:
            cache.observer.close()

    def urls(self) -> list[str]:
        with self._guard:
            return list(self._urls)


# --- the queried names, for the contract tests (tests/contract) ----------------------------------


@dataclass(frozen=True)
class QueriedMetric:
    """One metric the queries above read: its fallback chain (newest first, as name regexes), the
    type the query assumes, and the labels it reads from the series."""

    chain: tuple[str, ...]
    type: str  # gauge (avg_over_time, last_over_time) | counter (rate) | histogram (_bucket/_sum/_count)
    labels: tuple[str, ...] = ()


def queried_metric_names(engine: Engine) -> list[QueriedMetric]:
    """Every metric name this adapter queries for `engine`, with the type each query assumes.
    Counters carry their `_total` sample suffix; histograms are base names."""
    metrics = ENGINE_METRICS[engine]
    kinds = {
        "running": "gauge",
        "waiting": "gauge",
        "kv_usage": "gauge",
        "tpot": "histogram",
        "ttft": "histogram",
        "generation_tokens": "counter",
        "preemptions": "counter",
        "prefix_hits": "counter",
        "prefix_queries": "counter",
        "prompt_length": "histogram",
        "generation_length": "histogram",
        "prompt_tokens": "counter",
        "finished_requests": "histogram",  # its `_count` series, read with rate()
        "read_bytes": "counter",
        "step_time": "histogram",
    }
    how_read = {"gauge_matchers", "rank_labels"}  # not names: how the gauges above are read
    unknown = {f.name for f in fields(EngineMetrics)} - set(kinds) - how_read
    if unknown:
        raise ValueError(f"EngineMetrics fields without a query type here: {', '.join(sorted(unknown))}")
    queried = [
        QueriedMetric(tuple(name.removesuffix("_count") for name in getattr(metrics, f)), kind)
        if f == "finished_requests"
        else QueriedMetric(getattr(metrics, f), kind)
        for f, kind in kinds.items()
        if getattr(metrics, f)
    ]
    if engine == "VLLM":
        queried.append(QueriedMetric((VLLM_CACHE_INFO,), "gauge", vllm.CACHE_INFO_LABELS))
    elif engine == "SGLang":
        queried.append(QueriedMetric((sglang.MAX_TOTAL_TOKENS,), "gauge"))
    else:  # the KV pool size read by _kv_capacity_query
        queried += [
            QueriedMetric((trtllm.KV_MAX_BLOCKS,), "gauge"),
            QueriedMetric((trtllm.KV_TOKENS_PER_BLOCK,), "gauge"),
        ]
    return queried
