"""Reading the engines' metric contract from Prometheus (REFERENCE.md §2) into `Observation`s.

This is the only module that knows PromQL and its result shapes. It queries in batches: every
LLMServing that shares an engine and a window is served by the same dozen queries per tick, each
grouped server-side by a `llmserving` label derived from the pod name (`<name>-<rs hash>-<pod hash>`).
Metric renames across engine versions are handled with PromQL `or` chains (newest first), and both
spellings of vLLM's names (`vllm:x` and, through OpenMetrics negotiation, `vllm_x`) are matched.

Anything missing, NaN, infinite, negative, stale (no sample inside the window) or thin (fewer samples
than `min_samples`) becomes `Reading.unavailable(reason)` — never a zero.
"""

from __future__ import annotations

import math
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from urllib3.util.retry import Retry

from batchknee.core.observation import (
    Engine,
    Observation,
    ObservationTarget,
    Reading,
    decode_context_under_reservation,
)
from batchknee.engines import sglang, trtllm, vllm
from batchknee.engines.contract import EngineMetrics

Key = tuple[str, str]
POD_SUFFIX = "-[a-z0-9]+-[a-z0-9]+"  # a Deployment's pods: <name>-<pod-template-hash>-<random>


VLLM_METRICS = vllm.METRICS
VLLM_CACHE_INFO = vllm.CACHE_INFO
TRTLLM_METRICS = trtllm.METRICS
SGLANG_METRICS = sglang.METRICS
ENGINE_METRICS: dict[Engine, EngineMetrics] = {
    "VLLM": VLLM_METRICS,
    "TensorRTLLM": TRTLLM_METRICS,
    "SGLang": SGLANG_METRICS,
}


@dataclass(frozen=True)
class _Scope:
    """Targets queried together: one PromQL matcher, and how a series maps back to its target."""

    engine: Engine
    window_s: int
    matcher: str
    targets: dict[Key, ObservationTarget]
    tag_regex: str | None  # default scope: the pod-name regex whose group 1 is the LLMServing name

    def tag(self, expr: str) -> str:
        """Label every series of `expr` with the LLMServing it belongs to (`llmserving`)."""
        if self.tag_regex is not None:
            return f'label_replace({expr}, "llmserving", "$1", "pod", "{_promql_string(self.tag_regex)}")'
        [target] = self.targets.values()
        return f'label_replace({expr}, "llmserving", "{_promql_string(target.name)}", "", "")'

    def owner(self, namespace: str, pod: str) -> Key | None:
        if self.tag_regex is None:
            [key] = self.targets
            return key
        match = re.fullmatch(self.tag_regex, pod)
        if match is None:
            return None
        key = (namespace, match.group(1))
        return key if key in self.targets else None

    def select(self, name_regex: str) -> str:
        return f'{{__name__=~"{name_regex}",{self.matcher}}}'

    def rate(self, name_regex: str) -> str:
        return f"rate({self.select(name_regex)}[{self.window}])"

    def grouped(self, expr: str) -> str:
        """Sum `expr` per LLMServing."""
        return f"sum by (namespace, llmserving) ({self.tag(expr)})"

    @property
    def window(self) -> str:
        return f"{self.window_s}s"

    @property
    def recent_window(self) -> str:
        """The last third of the window (trend detection)."""
        return f"{max(1, self.window_s // 3)}s"


def _promql_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _scopes(targets: Iterable[ObservationTarget]) -> list[_Scope]:
    grouped: dict[tuple[Engine, int], dict[Key, ObservationTarget]] = defaultdict(dict)
    scopes: list[_Scope] = []
    for target in targets:
        if target.selector or target.pods is not None:
            matchers = [f'namespace="{_promql_string(target.namespace)}"'] + [
                f'{label}="{_promql_string(value)}"'
                for label, value in sorted((target.selector or {}).items())
            ]
            if target.pods is not None:
                pods = "|".join(re.escape(pod) for pod in sorted(target.pods)) or "$^"
                matchers.append(f'pod=~"{_promql_string(pods)}"')
            scopes.append(
                _Scope(target.engine, target.window_s, ",".join(matchers), {target.key: target}, None)
            )
        else:
            grouped[(target.engine, target.window_s)][target.key] = target
    for (engine, window_s), members in sorted(grouped.items()):
        namespaces = "|".join(sorted({re.escape(ns) for ns, _ in members}))
        names = "|".join(sorted({re.escape(name) for _, name in members}))
        pod_regex = f"({names}){POD_SUFFIX}"
        matcher = f'namespace=~"{_promql_string(namespaces)}",pod=~"{_promql_string(pod_regex)}"'
        scopes.append(_Scope(engine, window_s, matcher, members, pod_regex))
    return scopes


def _first_of(exprs: Iterable[str]) -> str:
    """PromQL fallback chain: each label set takes the first expression that has it."""
    return " or ".join(f"({expr})" for expr in exprs)


class PrometheusUnavailable(Exception):
    """Prometheus could not be reached or refused a query; every target is unavailable."""


class PrometheusObserver:
    """Batched observation of many LLMServings through one Prometheus."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, min_samples: int = 3) -> None:
        self.url = url.rstrip("/")
        self.min_samples = min_samples
        # One quick retry: a down Prometheus must cost the tick seconds, not minutes.
        self._client = PrometheusConnect(
            url=self.url,
            timeout=timeout_s,
            retry=Retry(total=1, backoff_factor=0.1, status_forcelist=[502, 503, 504]),
        )
        self.queries_sent = 0

    def close(self) -> None:
        self._client.close()

    def _query(self, promql: str, now: datetime) -> list[dict[str, Any]]:
        self.queries_sent += 1
        try:
            result: list[dict[str, Any]] = self._client.custom_query(
                promql, params={"time": f"{now.timestamp():.3f}"}
            )
        except requests.RequestException as error:
            raise PrometheusUnavailable(
                f"Prometheus at {self.url} unreachable: {type(error).__name__}"
            ) from None
        except PrometheusApiClientException as error:
            raise PrometheusUnavailable(f"Prometheus at {self.url} refused a query: {error}") from None
        return result

    def observe(self, targets: Sequence[ObservationTarget], now: datetime) -> dict[Key, Observation]:
        """One Observation per target, evaluated at `now`. Never raises for Prometheus trouble:
        the observations then carry the reason."""
        observations: dict[Key, Observation] = {}
        for scope in _scopes(targets):
            try:
                observations.update(self._observe_scope(scope, now))
            except PrometheusUnavailable as error:
                observations.update({key: Observation.unavailable(now, str(error)) for key in scope.targets})
        return observations

    # --- one scope ------------------------------------------------------------------------------

    def _per_target(self, scope: _Scope, promql: str, now: datetime) -> dict[Key, float]:
        """A query grouped by (namespace, llmserving): value per target (may be NaN or ±Inf)."""
        values: dict[Key, float] = {}
        for series in self._query(promql, now):
            labels = series["metric"]
            key = (labels.get("namespace", ""), labels.get("llmserving", ""))
            if key in scope.targets:
                values[key] = float(series["value"][1])
        return values

    def _per_pod(self, scope: _Scope, promql: str, now: datetime) -> list[tuple[Key, dict[str, str], float]]:
        """A query grouped by pod (and more): (target, labels, value) for each series of our pods."""
        rows = []
        for series in self._query(promql, now):
            labels = series["metric"]
            key = scope.owner(labels.get("namespace", ""), labels.get("pod", ""))
            if key is not None:
                rows.append((key, labels, float(series["value"][1])))
        return rows

    def _quantile(self, scope: _Scope, names: tuple[str, ...], quantile: float) -> str:
        return _first_of(
            f"histogram_quantile({quantile}, sum by (namespace, llmserving, le) ({scope.tag(scope.rate(name + '_bucket'))}))"
            for name in names
        )

    def _mean(self, scope: _Scope, names: tuple[str, ...]) -> str:
        """Mean of a histogram over the window: rate(sum) / rate(count), per target."""
        return _first_of(
            f"{scope.grouped(scope.rate(name + '_sum'))} / {scope.grouped(scope.rate(name + '_count'))}"
            for name in names
        )

    def _rate(self, scope: _Scope, names: tuple[str, ...]) -> str:
        return _first_of(scope.grouped(scope.rate(name)) for name in names)

    def _observe_scope(self, scope: _Scope, now: datetime) -> dict[Key, Observation]:
        metrics = ENGINE_METRICS[scope.engine]
        window = scope.window
        by_pod = "namespace, pod, engine"

        def gauge_by_pod(names: tuple[str, ...], over: str = window) -> str:
            return _first_of(f"sum by ({by_pod}) (avg_over_time({scope.select(n)}[{over}]))" for n in names)

        running_rows = self._per_pod(scope, gauge_by_pod(metrics.running), now)
        waiting_rows = self._per_pod(scope, gauge_by_pod(metrics.waiting), now)
        usage_rows = self._per_pod(scope, gauge_by_pod(metrics.kv_usage), now)
        recent_running_rows = self._per_pod(scope, gauge_by_pod(metrics.running, scope.recent_window), now)
        recent_usage_rows = self._per_pod(scope, gauge_by_pod(metrics.kv_usage, scope.recent_window), now)
        sample_rows = self._per_pod(
            scope,
            _first_of(
                f"min by ({by_pod}) (count_over_time({scope.select(n)}[{window}]))" for n in metrics.running
            ),
            now,
        )
        capacity_rows = self._per_pod(scope, self._kv_capacity_query(scope), now)
        tpot_p99 = self._per_target(scope, self._quantile(scope, metrics.tpot, 0.99), now)
        tpot_mean = self._per_target(scope, self._mean(scope, metrics.tpot), now)
        ttft_p99 = self._per_target(scope, self._quantile(scope, metrics.ttft, 0.99), now)
        generation = self._per_target(scope, self._rate(scope, metrics.generation_tokens), now)
        preemptions = (
            self._per_target(scope, self._rate(scope, metrics.preemptions), now)
            if metrics.preemptions
            else {}
        )
        prefix = (
            self._per_target(
                scope,
                f"({self._rate(scope, metrics.prefix_hits)}) / ({self._rate(scope, metrics.prefix_queries)})",
                now,
            )
            if metrics.prefix_hits
            else {}
        )
        prompt_mean = (
            self._per_target(scope, self._mean(scope, metrics.prompt_length), now)
            if metrics.prompt_length
            else {}
        )
        output_mean = (
            self._per_target(scope, self._mean(scope, metrics.generation_length), now)
            if metrics.generation_length
            else {}
        )
        # Each request's KV grows from its prompt to prompt + output while it decodes.
        length_fallback = {
            key: prompt_mean[key] + output_mean[key] / 2 for key in prompt_mean.keys() & output_mean.keys()
        }

        def mean_prompt(over: str) -> dict[Key, float]:
            ratio = (
                f"({_first_of(scope.grouped(f'rate({scope.select(n)}[{over}])') for n in metrics.prompt_tokens)})"
                f" / ({_first_of(scope.grouped(f'rate({scope.select(n)}[{over}])') for n in metrics.finished_requests)})"
            )
            return self._per_target(scope, ratio, now)

        reserving = bool(metrics.prompt_tokens and metrics.finished_requests)
        prompt_mean = mean_prompt(window) if reserving else {}
        recent_prompt_mean = mean_prompt(scope.recent_window) if reserving else {}

        window_text = f"in the last {scope.window_s}s"
        observations = {}
        for key in scope.targets:
            pods = {labels.get("pod") for k, labels, _ in running_rows if k == key}
            samples = [value for k, _, value in sample_rows if k == key]
            if not pods:
                observations[key] = Observation.unavailable(
                    now, f"no {scope.engine} engine metrics {window_text}"
                )
                continue
            thin = min(samples, default=0) < self.min_samples
            thin_reason = (
                f"only {min(samples, default=0):.0f} samples per pod {window_text} (need {self.min_samples})"
            )

            def gauge(
                rows: list[tuple[Key, dict[str, str], float]], what: str, combine: str = "sum"
            ) -> Reading:
                values = [value for k, _, value in rows if k == key]  # noqa: B023 — used at once
                if thin:  # noqa: B023
                    return Reading.unavailable(thin_reason)  # noqa: B023
                if not values:
                    return Reading.unavailable(f"no {what} series {window_text}")
                total = sum(values) if combine == "sum" else sum(values) / len(values)
                return _checked(total, what)

            running = gauge(running_rows, "running-requests")
            context = _kv_context(key, running_rows, usage_rows, capacity_rows)
            if reserving:
                context = decode_context_under_reservation(
                    context,
                    _value(prompt_mean, key, "mean prompt", window_text, empty="no requests finished"),
                )
            if thin:
                context = Reading.unavailable(thin_reason)
            elif not context.available:
                fallback = _value(
                    length_fallback, key, "prompt and generation length histograms", window_text
                )
                if fallback.available:
                    context = fallback
                else:
                    context = Reading.unavailable(f"{context.reason}; histogram fallback: {fallback.reason}")

            recent_context = (
                Reading.unavailable(thin_reason)
                if thin
                else _kv_context(key, recent_running_rows, recent_usage_rows, capacity_rows)
            )
            if reserving:
                recent_context = decode_context_under_reservation(
                    recent_context,
                    _value(recent_prompt_mean, key, "mean prompt", window_text, empty="no requests finished"),
                )
            observations[key] = Observation(
                sampled_at=now,
                pods=len(pods),
                avg_context_tokens=context,
                tpot_p99_s=_value(tpot_p99, key, "TPOT p99", window_text, empty="no requests finished"),
                tpot_mean_s=_value(tpot_mean, key, "TPOT mean", window_text, empty="no requests finished"),
                ttft_p99_s=_value(ttft_p99, key, "TTFT p99", window_text, empty="no requests started"),
                running=running,
                waiting=gauge(waiting_rows, "waiting-requests"),
                kv_cache_usage=gauge(usage_rows, "KV-cache usage", combine="mean"),
                prefix_hit_ratio=_value(
                    prefix, key, "prefix-cache hit ratio", window_text, empty="no prefix-cache queries"
                ),
                preemptions_per_s=_value(preemptions, key, "preemption rate", window_text),
                generation_tokens_per_s=_value(generation, key, "generation token rate", window_text),
                recent_avg_context_tokens=recent_context,
                prompt_tokens_mean=_value(
                    prompt_mean, key, "mean prompt length", window_text, empty="no requests finished"
                ),
                output_tokens_mean=_value(
                    output_mean, key, "mean output length", window_text, empty="no requests finished"
                ),
            )
        return observations

    def _kv_capacity_query(self, scope: _Scope) -> str:
        """KV pool size in tokens per pod (and engine): blocks × block size."""
        window = scope.window
        if scope.engine == "VLLM":
            # cache_config_info carries the numbers as labels; the value is always 1.
            return (
                f"max by (namespace, pod, engine, num_gpu_blocks, block_size) "
                f"(last_over_time({scope.select(VLLM_CACHE_INFO)}[{window}]))"
            )
        if scope.engine == "SGLang":
            # the pool in tokens; radix-shared prefixes are held once in it (and in its usage)
            return (
                f"max by (namespace, pod) (last_over_time({scope.select(sglang.MAX_TOTAL_TOKENS)}[{window}]))"
            )
        blocks = f"max by (namespace, pod) (last_over_time({scope.select(trtllm.KV_MAX_BLOCKS)}[{window}]))"
        per_block = (
            f"max by (namespace, pod) (last_over_time({scope.select(trtllm.KV_TOKENS_PER_BLOCK)}[{window}]))"
        )
        return f"{blocks} * on (namespace, pod) {per_block}"


def _checked(value: float, what: str) -> Reading:
    if math.isnan(value):
        return Reading.unavailable(f"{what} is NaN")
    if math.isinf(value):
        return Reading.unavailable(f"{what} is infinite")
    if value < 0:
        return Reading.unavailable(f"{what} is negative ({value:g})")
    return Reading.of(value)


def _value(values: dict[Key, float], key: Key, what: str, window_text: str, empty: str = "") -> Reading:
    if key not in values:
        return Reading.unavailable(f"no {what} series {window_text}")
    value = values[key]
    if math.isnan(value) and empty:  # a ratio or quantile over zero events
        return Reading.unavailable(f"{empty} {window_text}")
    return _checked(value, what)


def _kv_context(
    key: Key,
    running_rows: list[tuple[Key, dict[str, str], float]],
    usage_rows: list[tuple[Key, dict[str, str], float]],
    capacity_rows: list[tuple[Key, dict[str, str], float]],
) -> Reading:
    """Average context per running sequence from the KV pool: Σ usage × pool tokens / Σ running.
    Shared prefix blocks count once — exactly the effective KV per sequence the knee needs."""

    def pod_engine(labels: dict[str, str]) -> tuple[str, str]:
        return labels.get("pod", ""), labels.get("engine", "")

    capacity: dict[tuple[str, str], float] = {}
    for k, labels, value in capacity_rows:
        if k != key:
            continue
        if "num_gpu_blocks" in labels:  # vLLM: numbers in labels
            try:
                value = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
            except (KeyError, ValueError):
                return Reading.unavailable("cache_config_info lacks numeric num_gpu_blocks/block_size labels")
        capacity[pod_engine(labels)] = value
    usage = {pod_engine(labels): value for k, labels, value in usage_rows if k == key}
    running = {pod_engine(labels): value for k, labels, value in running_rows if k == key}
    if not capacity:
        return Reading.unavailable("no KV pool size (cache config) series")
    tokens = 0.0
    sequences = 0.0
    for pod, pool_tokens in capacity.items():
        if pod not in usage or pod not in running:
            return Reading.unavailable(f"pod {pod[0]} reports a KV pool but no usage or running series")
        if not (math.isfinite(usage[pod]) and math.isfinite(running[pod]) and math.isfinite(pool_tokens)):
            return Reading.unavailable(f"pod {pod[0]} reports a non-finite KV usage, pool or running value")
        tokens += usage[pod] * pool_tokens
        sequences += running[pod]
    if sequences < 0.5:
        return Reading.unavailable("no running sequences to average over")
    return _checked(tokens / sequences, "average context")


class CachedObserver:
    """Per-object reconciles in one tick share one batch of queries.

    Every LLMServing the operator knows is registered; the first `observation()` after the cache
    ages past `ttl_s` refreshes all of them at once.
    """

    def __init__(self, observer_for_url: Callable[[str], PrometheusObserver], ttl_s: float = 5.0) -> None:
        self._observer_for_url = observer_for_url
        self._ttl = timedelta(seconds=ttl_s)
        self._lock = threading.Lock()
        self._targets: dict[Key, tuple[str, ObservationTarget]] = {}
        self._cache: dict[Key, Observation] = {}

    def register(self, url: str, target: ObservationTarget) -> None:
        with self._lock:
            if self._targets.get(target.key) != (url, target):
                self._cache.pop(target.key, None)
            self._targets[target.key] = (url, target)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._targets.pop(key, None)
            self._cache.pop(key, None)

    def observation(self, url: str, target: ObservationTarget, now: datetime) -> Observation:
        self.register(url, target)
        with self._lock:
            cached = self._cache.get(target.key)
            if cached is not None and timedelta(0) <= now - cached.sampled_at < self._ttl:
                return cached
            same_url = [t for u, t in self._targets.values() if u == url]
            self._cache.update(self._observer_for_url(url).observe(same_url, now))
            return self._cache[target.key]


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
    }
    unknown = {f.name for f in fields(EngineMetrics)} - set(kinds)
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
