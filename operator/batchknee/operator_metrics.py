"""The operator's own /metrics (prometheus_client): what each object runs and why it held."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from batchknee.pacing import RolloutPacer
from batchknee.reconcile import Outcome


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["namespace", "name"]
        self.applied = Gauge(
            "batchknee_max_num_seqs", "Batch limit the engine Deployment runs", labels, registry=self.registry
        )
        self.recommended = Gauge(
            "batchknee_recommended_max_num_seqs",
            "Batch limit the knee math recommends",
            labels,
            registry=self.registry,
        )
        self.b_knee = Gauge(
            "batchknee_b_knee", "Knee batch at the observed context", labels, registry=self.registry
        )
        self.context = Gauge(
            "batchknee_observed_context_tokens",
            "Average context per running sequence the operator observed (tokens)",
            labels,
            registry=self.registry,
        )
        self.tpot_p99 = Gauge(
            "batchknee_observed_tpot_p99_seconds",
            "Time per output token p99 the operator observed over the window",
            labels,
            registry=self.registry,
        )
        self.tpot_target = Gauge(
            "batchknee_tpot_p99_target_seconds",
            "The LLMServing's TPOT p99 target (spec.tuning.tpotP99TargetMilliseconds), when set",
            labels,
            registry=self.registry,
        )
        self.capacity = Gauge(
            "batchknee_capacity_sequences",
            "Sequences the ready engine pods can run now: ready pods × applied max-num-seqs (a replica "
            "autoscaler's supply; it falls when the knee lowers each pod's batch limit)",
            labels,
            registry=self.registry,
        )
        self.demand = Gauge(
            "batchknee_demand_sequences",
            "Sequences the engines are asked to run: running + waiting, all pods (a replica autoscaler's "
            "demand)",
            labels,
            registry=self.registry,
        )
        self.retunes = Counter(
            "batchknee_retunes", "Rollouts of a new batch limit", labels, registry=self.registry
        )
        self.holds = Counter(
            "batchknee_holds", "Decisions that held, by reason", ["reason"], registry=self.registry
        )
        self.errors = Counter("batchknee_reconcile_errors", "Reconciles that failed", registry=self.registry)
        self.status_writes = Counter(
            "batchknee_status_writes",
            "LLMServing status writes (a steady hold refreshes its figures once a window)",
            registry=self.registry,
        )
        self.duration = Histogram(
            "batchknee_reconcile_duration_seconds",
            "Time of one reconcile (observe, decide, act, status)",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.full_collections = Histogram(
            "batchknee_python_full_collection_seconds",
            "Python's full (generation 2) garbage collections: how long each held the interpreter, "
            "every thread and the event loop waiting",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self._collection_started = 0.0

    def track_pacer(self, pacer: RolloutPacer) -> None:
        """How far a template change of the operator's own (an upgrade) has gone through the fleet."""
        Gauge(
            "batchknee_template_rollouts_under_way",
            "Engine rollouts for a pod template of the operator's own holding a place (a stalled one "
            "keeps it: at templateRolloutsAtOnce for long, look for Degraded RolloutStalled)",
            registry=self.registry,
        ).set_function(pacer.under_way)
        Gauge(
            "batchknee_template_rollouts_waiting",
            "LLMServings whose new pod template of the operator's own waits for a place",
            registry=self.registry,
        ).set_function(pacer.waiting)

    def time_full_collections(self) -> None:
        """Observe every full collection of this process from now on (once per process)."""
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Safe inside a collection: prometheus_client holds a value's lock only around float
        # arithmetic, which allocates no tracked object, so no collection starts while it is held.
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._collection_started = time.perf_counter()
        else:
            self.full_collections.observe(time.perf_counter() - self._collection_started)

    def record(self, outcome: Outcome, seconds: float) -> None:
        self.duration.observe(seconds)
        if outcome.status_written:
            self.status_writes.inc()
        key = (outcome.namespace, outcome.name)
        if not outcome.found:
            self.forget(*key)
            return
        status = outcome.status
        if status is not None:
            if status.max_num_seqs is not None:
                self.applied.labels(*key).set(status.max_num_seqs)
            if status.recommended_max_num_seqs is not None:
                self.recommended.labels(*key).set(status.recommended_max_num_seqs)
            if status.b_knee is not None:
                self.b_knee.labels(*key).set(status.b_knee)
            observed = status.observed
            if observed is not None and observed.avg_context_length is not None:
                self.context.labels(*key).set(observed.avg_context_length)
            if observed is not None and observed.tpot_p99_milliseconds is not None:
                self.tpot_p99.labels(*key).set(observed.tpot_p99_milliseconds / 1000)
            if status.hold_reason:
                self.holds.labels(status.hold_reason).inc()
            # An autoscaler's inputs go when they are no longer known (the workload gone, another
            # LLMServing tunes it): a last value kept would hold its replicas for good.
            if outcome.ready_replicas is not None and status.max_num_seqs is not None:
                self.capacity.labels(*key).set(outcome.ready_replicas * status.max_num_seqs)
            else:
                _remove(self.capacity, key)
            if (
                outcome.tunes  # a workload another LLMServing tunes is that one's demand
                and observed is not None
                and observed.running is not None
                and observed.waiting is not None
            ):
                self.demand.labels(*key).set(observed.running + observed.waiting)
            else:
                _remove(self.demand, key)
        if outcome.tpot_target_ms is not None:
            self.tpot_target.labels(*key).set(outcome.tpot_target_ms / 1000)
        else:
            _remove(self.tpot_target, key)
        if outcome.rolled:
            self.retunes.labels(*key).inc()

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone or no longer watched: none of its series stay behind."""
        for gauge in (
            self.retunes,
            self.applied,
            self.recommended,
            self.b_knee,
            self.context,
            self.tpot_p99,
            self.tpot_target,
            self.capacity,
            self.demand,
        ):
            _remove(gauge, (namespace, name))

    def serve(self, address: str, port: int) -> ThreadingHTTPServer:
        """/metrics on a thread of its own (and one per scrape, at most MAX_SCRAPES)."""
        handler = type("Scrape", (MetricsHandler.factory(self.registry),), {"timeout": SCRAPE_TIMEOUT_S})
        server = BoundedMetricsServer((address, port), handler)
        threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
        return server


def _remove(metric: Gauge | Counter, key: tuple[str, str]) -> None:
    with contextlib.suppress(KeyError):  # not set yet
        metric.remove(*key)


SCRAPE_TIMEOUT_S = 10.0  # each read and write of a scrape's connection
MAX_SCRAPES = 4  # connections served at once; one more is closed as it comes


class BoundedMetricsServer(ThreadingHTTPServer):
    """prometheus_client's own server starts a thread per connection and waits on it for ever: a
    client that sends half a request holds a thread until it leaves (200 such connections, 200
    threads, up to the pod's limits). Here each read and write has a deadline and at most
    MAX_SCRAPES connections are served at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[MetricsHandler]) -> None:
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0]  # IPv4 or 6
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
