"""The Prometheus adapter against a real Prometheus scraping vLLM-format exporters.

No cluster is needed: the exporters run on loopback addresses and a file_sd file labels them the
way the chart's PodMonitor labels engine pods (namespace, pod, and llmserving from the pod's
batchknee.io/llmserving label).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchknee.adapters.prometheus import PrometheusObserver
from batchknee.core.observation import Observation, ObservationTarget
from batchknee.devcluster import LocalPrometheus, tools
from batchknee.devcluster.cluster import free_port

pytestmark = pytest.mark.integration

EXPORTER = Path(__file__).parents[1] / "support" / "vllm_exporter.py"
WINDOW_S = 10
# avg context = usage × blocks × block size / running = 0.1398 × 30000 × 16 / 32 = 2097 tokens
BUSY = {
    "running": 32,
    "kvUsage": 0.1398,
    "tpotSeconds": 0.03,
    "itlSeconds": 0.024,
    "requestsPerSecond": 20,
    "promptTokens": 2000,
    "generationTokens": 100,
    "prefixHitRatio": 0.25,
}


class Fleet:
    """Exporters posing as engine pods, and the file_sd that names them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.file_sd = workdir / "targets.json"
        self.file_sd.write_text("[]")
        self.pods: dict[str, tuple[subprocess.Popen[bytes], dict[str, Any], str]] = {}

    def start(self, namespace: str, pod: str, state: dict[str, Any], llmserving: str | None = None) -> None:
        """An engine pod of LLMServing `llmserving` (default: the pod name less its two hashes)."""
        host = f"127.1.1.{len(self.pods) + 1}"
        port = free_port(host)
        state_file = self.workdir / f"{pod}.json"
        state_file.write_text(json.dumps(state))
        process = subprocess.Popen(
            [sys.executable, str(EXPORTER), "--state", str(state_file), "--host", host, "--port", str(port)]
        )
        owner = llmserving or pod.rsplit("-", 2)[0]
        labels = {"namespace": namespace, "pod": pod, "llmserving": owner}
        self.pods[pod] = (process, labels, f"{host}:{port}")
        self._write_targets()

    def relabel(self, pod: str, llmserving: str) -> None:
        """The pod's `llmserving` label changed (kubectl label --overwrite, a template's new label)."""
        process, labels, address = self.pods[pod]
        self.pods[pod] = (process, {**labels, "llmserving": llmserving}, address)
        self._write_targets()

    def stop(self, pod: str) -> None:
        process, _, _ = self.pods.pop(pod)
        process.terminate()
        process.wait(10)
        self._write_targets()

    def _write_targets(self) -> None:
        targets = [{"targets": [address], "labels": labels} for _, labels, address in self.pods.values()]
        self.file_sd.with_suffix(".tmp").write_text(json.dumps(targets))
        self.file_sd.with_suffix(".tmp").replace(self.file_sd)

    def close(self) -> None:
        for pod in list(self.pods):
            self.stop(pod)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    fleet.start("prod", "llama-7c9f8b6d5-abcde", BUSY)
    fleet.start("prod", "llama-7c9f8b6d5-fghij", {**BUSY, "running": 16, "kvUsage": 0.0699})
    # An older vLLM, scraped in the plain text format: legacy names, colons kept.
    fleet.start(
        "prod",
        "llama-2-6f7d8c9b4-klmno",
        {**BUSY, "running": 8, "legacyNames": True, "forceTextFormat": True},
    )
    fleet.start("prod", "idle-5d6f7c8b9-pqrst", {"running": 0, "requestsPerSecond": 0})
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def prometheus(fleet: Fleet) -> Iterator[LocalPrometheus]:
    with LocalPrometheus(fleet.file_sd, scrape_interval_s=1) as prom:
        observer = PrometheusObserver(prom.url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a full window of scrapes for every pod
            seen = observer.observe([target("llama"), target("llama-2"), target("idle")], datetime.now(UTC))
            if all(o.running.available for o in seen.values()):
                break
            time.sleep(1)
        time.sleep(WINDOW_S)  # rates over a window that began before the first scrape read low
        yield prom


def target(name: str, window_s: int = WINDOW_S) -> ObservationTarget:
    return ObservationTarget("prod", name, "VLLM", window_s)


def observe(prometheus: LocalPrometheus, *names: str) -> dict[str, Observation]:
    observer = PrometheusObserver(prometheus.url)
    result = observer.observe([target(name) for name in names], datetime.now(UTC))
    return {name: result[("prod", name)] for name in names}


def test_aggregates_the_pods_of_each_llmserving(prometheus: LocalPrometheus) -> None:
    llama = observe(prometheus, "llama")["llama"]
    assert llama.pods == 2
    assert llama.running.value == pytest.approx(48)
    # Both pods hold 2097 tokens per running sequence.
    assert llama.avg_context_tokens.value == pytest.approx(2097, rel=0.01)
    assert llama.kv_cache_usage.value == pytest.approx((0.1398 + 0.0699) / 2)
    assert llama.prefix_hit_ratio.value == pytest.approx(0.25, abs=0.01)
    # the mean step time is the inter-token latency's (per step), not the per-request TPOT's
    assert llama.tpot_mean_s.value == pytest.approx(0.024, rel=0.01)
    # Every sample is 30 ms: the p99 interpolates inside the (25 ms, 50 ms] bucket.
    assert llama.tpot_p99_s.value is not None
    assert 0.025 < llama.tpot_p99_s.value <= 0.05
    assert llama.generation_tokens_per_s.value == pytest.approx(2 * 20 * 100, rel=0.15)
    assert llama.waiting.value == 0


def test_legacy_names_and_the_colon_spelling(prometheus: LocalPrometheus) -> None:
    old = observe(prometheus, "llama-2")["llama-2"]
    assert old.pods == 1
    assert old.running.value == pytest.approx(8)
    assert old.avg_context_tokens.value == pytest.approx(0.1398 * 30000 * 16 / 8, rel=0.01)
    assert old.tpot_mean_s.value == pytest.approx(0.03, rel=0.01)  # from vllm:time_per_output_token_seconds
    assert old.prefix_hit_ratio.value == pytest.approx(0.25, abs=0.01)  # from vllm:gpu_prefix_cache_*


def test_nothing_to_measure_is_a_reason_not_a_zero(prometheus: LocalPrometheus) -> None:
    seen = observe(prometheus, "idle", "ghost")
    idle, ghost = seen["idle"], seen["ghost"]
    assert idle.running.value == 0
    assert idle.tpot_p99_s.value is None
    assert idle.tpot_p99_s.reason == f"no requests finished in the last {WINDOW_S}s"
    assert idle.avg_context_tokens.value is None
    assert "no running sequences" in idle.avg_context_tokens.reason
    assert ghost.pods == 0
    assert ghost.avg_context_tokens.reason == f"no VLLM engine metrics in the last {WINDOW_S}s"


def test_query_count_does_not_grow_with_the_number_of_llmservings(prometheus: LocalPrometheus) -> None:
    now = datetime.now(UTC)
    one = PrometheusObserver(prometheus.url)
    one.observe([target("llama")], now)
    many = PrometheusObserver(prometheus.url)
    many.observe([target(name) for name in ("llama", "llama-2", "idle", "ghost", "a", "b", "c")], now)
    assert many.queries_sent == one.queries_sent


def test_a_stale_pod_drops_out_after_the_window(fleet: Fleet, prometheus: LocalPrometheus) -> None:
    fleet.start("prod", "brief-5d6f7c8b9-zzzzz", BUSY)
    deadline = time.monotonic() + 30
    while not observe(prometheus, "brief")["brief"].running.available and time.monotonic() < deadline:
        time.sleep(1)
    assert observe(prometheus, "brief")["brief"].running.value == pytest.approx(32)
    fleet.stop("brief-5d6f7c8b9-zzzzz")
    time.sleep(WINDOW_S + 3)
    gone = observe(prometheus, "brief")["brief"]
    assert gone.running.value is None
    assert gone.avg_context_tokens.reason == f"no VLLM engine metrics in the last {WINDOW_S}s"


def test_a_pod_scraped_by_two_jobs_is_named_not_counted_twice(
    fleet: Fleet, prometheus: LocalPrometheus
) -> None:
    """A second scrape config over the same pods (a ServiceMonitor beside the PodMonitor) stores
    each engine's series twice; every sum by pod would count it twice. The observation says so,
    naming the pod, instead of a doubled reading (the module's one-job Prometheus reads them all)."""
    again = {
        "job_name": "pods-again",
        "file_sd_configs": [{"files": [str(fleet.file_sd)], "refresh_interval": "1s"}],
    }
    with LocalPrometheus(fleet.file_sd, scrape_interval_s=1, extra_scrape_configs=[again]) as twice:
        observer = PrometheusObserver(twice.url)
        try:
            deadline = time.monotonic() + 60
            while True:  # until both jobs have scraped the pods
                seen = observer.observe([target("llama")], datetime.now(UTC))[("prod", "llama")]
                if "scrape targets" in (seen.running.reason or "") or time.monotonic() > deadline:
                    break
                time.sleep(1)
        finally:
            observer.close()
    reason = seen.running.reason or ""
    assert reason.startswith("pod llama-7c9f8b6d5-") and reason.endswith(
        f"'s engine metrics came through 2 scrape targets (job, instance) in the last {WINDOW_S}s: "
        "two scrape configs select it, or it was replaced or relabelled within the window; every sum "
        "would count it 2 times, so the observation waits for one"
    ), reason
    assert observe(prometheus, "llama")["llama"].running.value == pytest.approx(48)  # one job: read


def chart_pod_monitor_metric_relabelings() -> list[dict[str, Any]]:
    """The vLLM PodMonitor's metricRelabelings as `helm template` renders them, spelled the way the
    Prometheus Operator writes them into Prometheus's scrape config."""
    chart = tools.repo_root() / "charts" / "batchknee"
    argv = [str(tools.tool("helm")), "template", "rel", str(chart), "--kube-version", "v1.36.3"]
    rendered = subprocess.run(
        [*argv, "--set", "metrics.podMonitor.enabled=true"], check=True, capture_output=True, text=True
    ).stdout
    [monitor] = [
        d for d in yaml.safe_load_all(rendered) if d and d["metadata"]["name"] == "rel-batchknee-vllm"
    ]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    spelled = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{spelled.get(k, k): v for k, v in rule.items()} for rule in endpoint["metricRelabelings"]]


def test_the_pod_monitors_drop_what_an_engine_pod_serves_under_the_operators_names(fleet: Fleet) -> None:
    """An engine pod runs the tenant's image and may serve `batchknee_*` series (the test exporter
    serves one, `batchknee_test_exporter_args_info`): scraped through the chart's PodMonitor rules,
    a real Prometheus keeps the engine's series and drops those, so no pod forges the operator's
    figures (its holds, its B_knee) in a Prometheus other teams read."""
    monitored = {
        "job_name": "podmonitor",
        "file_sd_configs": [{"files": [str(fleet.file_sd)], "refresh_interval": "1s"}],
        "metric_relabel_configs": chart_pod_monitor_metric_relabelings(),
    }
    pods = len(fleet.pods)
    with LocalPrometheus(fleet.file_sd, scrape_interval_s=1, extra_scrape_configs=[monitored]) as both:
        # every pod serves the forged name (the plain job keeps it), and the engine's own series
        # come through the PodMonitor's rules; the wait fails the test if either never holds
        both.wait_for(f'count(count by (pod) (batchknee_test_exporter_args_info{{job="pods"}})) == {pods}')
        both.wait_for(f'count(count by (pod) ({{__name__=~"vllm[:_].+", job="podmonitor"}})) == {pods}')
        time.sleep(2)  # two more scrapes of every pod by both jobs
        dropped = both.query('{__name__=~"batchknee_.*", job="podmonitor"}')
    assert dropped == []


def test_prometheus_down_makes_everything_unavailable(prometheus: LocalPrometheus) -> None:
    prometheus.stop()
    try:
        llama = observe(prometheus, "llama")["llama"]
        assert llama.avg_context_tokens.value is None
        assert llama.tpot_p99_s.reason.startswith(f"Prometheus at {prometheus.url} unreachable")
    finally:
        prometheus.start()


# --- names Kubernetes truncates, fleets, large queries, one slow Prometheus ----------------------------


def truncated_pod_name(llmserving: str, suffix: str) -> str:
    """What Kubernetes names a Deployment's pod: generateName `<name>-<rs hash>-` cut to 58
    characters, then 5 random ones."""
    return f"{llmserving}-7c9f8b6d5-"[:58] + suffix


def test_long_names_are_observed_by_their_label_not_their_pod_name(
    fleet: Fleet, prometheus: LocalPrometheus
) -> None:
    """Two 63-character names that share their first 58 characters: their pods' names carry
    neither name whole, and each LLMServing still sees only its own pod."""
    stem = ("support-bot-llama-3-1-8b-" * 3)[:58]
    first, second = stem + "-eu-1", stem + "-us-2"
    assert len(first) == len(second) == 63
    fleet.start("prod", truncated_pod_name(first, "abcde"), BUSY, llmserving=first)
    fleet.start("prod", truncated_pod_name(second, "fghij"), {**BUSY, "running": 8}, llmserving=second)
    try:
        deadline = time.monotonic() + 30
        seen = observe(prometheus, first, second)
        while not all(o.running.available for o in seen.values()) and time.monotonic() < deadline:
            time.sleep(1)
            seen = observe(prometheus, first, second)
        assert seen[first].pods == 1 and seen[first].running.value == pytest.approx(32)
        assert seen[second].pods == 1 and seen[second].running.value == pytest.approx(8)
    finally:
        fleet.stop(truncated_pod_name(first, "abcde"))
        fleet.stop(truncated_pod_name(second, "fghij"))


def test_a_thousand_long_names_are_served_by_the_same_small_queries(prometheus: LocalPrometheus) -> None:
    now = datetime.now(UTC)
    one = PrometheusObserver(prometheus.url)
    one.observe([target("llama")], now)
    many = PrometheusObserver(prometheus.url)
    names = [f"{'n' * 58}{i:05d}" for i in range(1000)]
    seen = many.observe([target(name) for name in [*names, "llama", "ghost"]], now)
    assert many.queries_sent == one.queries_sent
    assert many.largest_query_bytes == one.largest_query_bytes < 8 * 1024
    assert seen[("prod", "llama")].running.value == pytest.approx(48)
    assert (
        seen[("prod", names[0])].avg_context_tokens.reason
        == f"no VLLM engine metrics in the last {WINDOW_S}s"
    )
    one.close()
    many.close()


def test_queries_go_in_the_post_body_past_the_url_limit(prometheus: LocalPrometheus) -> None:
    """A selector value of 200 KB repeated in every matcher makes queries of over 1 MiB: in a GET
    URL Prometheus would cut the connection (1 MiB header limit); as a POST body it answers."""
    huge = ObservationTarget("prod", "custom", "VLLM", WINDOW_S, selector={"service": "s" * 200_000})
    observer = PrometheusObserver(prometheus.url, timeout_s=30)
    seen = observer.observe([huge], datetime.now(UTC))[huge.key]
    observer.close()
    assert observer.largest_query_bytes > 2**20
    assert seen.avg_context_tokens.reason == f"no VLLM engine metrics in the last {WINDOW_S}s"


def test_a_trickling_prometheus_never_delays_objects_of_another(prometheus: LocalPrometheus) -> None:
    """Two objects, two Prometheus URLs: the one whose Prometheus trickles waits out its deadline
    while the other is observed through the real Prometheus meanwhile."""
    from fake_prometheus import FakePrometheus

    from batchknee.adapters.observing import RoutedObserver
    from batchknee.adapters.prometheus import CachedObserver

    with FakePrometheus("trickle") as slow:
        cache = CachedObserver(lambda url: PrometheusObserver(url, timeout_s=5), ttl_s=60)
        router = RoutedObserver(cache, prometheus.url, [slow.url])
        router.route("prod", "stuck", slow.url)
        stuck, llama = target("stuck"), target("llama")

        async def both() -> None:
            now = datetime.now(UTC)
            waiting = asyncio.create_task(router.prepare(stuck, now))
            while not slow.requests:  # the slow refresh is in flight
                await asyncio.sleep(0.05)
            await router.prepare(llama, now)
            assert not waiting.done()
            assert router.observation(llama, now).running.value == pytest.approx(48)
            await waiting
            assert router.observation(stuck, now).avg_context_tokens.reason == (
                f"Prometheus at {slow.url} did not answer within 5s"
            )

        asyncio.run(both())
        for url in cache.urls():
            cache.drop_url(url)


def test_a_selector_override_reads_its_own_series(prometheus: LocalPrometheus) -> None:
    """spec.prometheus.selector: exact label matches instead of the llmserving label."""
    custom = ObservationTarget("prod", "custom", "VLLM", WINDOW_S, selector={"pod": "llama-7c9f8b6d5-abcde"})
    observer = PrometheusObserver(prometheus.url)
    seen = observer.observe([custom, target("llama")], datetime.now(UTC))
    observer.close()
    assert seen[custom.key].pods == 1 and seen[custom.key].running.value == pytest.approx(32)
    assert seen[custom.key].avg_context_tokens.value == pytest.approx(2097, rel=0.01)
    assert seen[custom.key].tpot_mean_s.value == pytest.approx(0.024, rel=0.01)
    assert seen[("prod", "llama")].pods == 2


# --- pods that fail the queries every LLMServing shares ---------------------------------------------

# One pod each, in the tenant namespace `evil`: every LLMServing of the operator's Prometheus is read
# through the same queries, so each of these made all of them hold (HTTP 422, or an answer past
# what is parsed), and the first two put the hostile pod's names in every status.
HOSTILE_PODS = {
    "spelled-5d6f7c8b9-aaaaa": {**BUSY, "bothSpellings": True},  # vllm:x and vllm_x, same labels
    "relabelled-5d6f7c8b9-bbbbb": {**BUSY, "dramActive": 0.5},  # two llmserving values in a window
    "engines-5d6f7c8b9-ccccc": {**BUSY, "extraEngines": 200},  # 201 `engine` label values
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, LocalPrometheus]]:
    fleet = Fleet(tmp_path_factory.mktemp("hostile"))
    try:
        fleet.start("prod", "llama-7c9f8b6d5-abcde", {**BUSY, "dramActive": 0.6})
        for pod, state in HOSTILE_PODS.items():
            fleet.start("evil", pod, state)
        with LocalPrometheus(fleet.file_sd, scrape_interval_s=1) as prom:
            prom.wait_for('count(count by (pod) ({__name__=~"vllm[:_]num_requests_running"})) == 4')
            prom.wait_for('count(DCGM_FI_PROF_DRAM_ACTIVE{namespace="evil"})')
            engines = '{__name__=~"vllm[:_]num_requests_running",namespace="evil"}'
            prom.wait_for(f"count(count by (engine) ({engines})) > 200")
            time.sleep(2)  # a few more scrapes of each
            yield fleet, prom
    finally:
        fleet.close()


def test_a_hostile_pod_fails_no_other_llmservings_reading(
    hostile: tuple[Fleet, LocalPrometheus], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod serving both spellings of every name, one relabelled within the window (with DCGM's
    series for its GPU), and one with 201 `engine` values — the parse limit scaled down to what
    one honest pod and 32 rows of each hostile one take: the other tenant's LLMServing is read,
    and its status quotes none of their names."""
    from batchknee.adapters import prometheus as adapter

    fleet, prom = hostile
    fleet.relabel("relabelled-5d6f7c8b9-bbbbb", "moved")
    prom.wait_for('DCGM_FI_PROF_DRAM_ACTIVE{namespace="evil",llmserving="moved"}')
    # within the window, the pod is read under both names
    both = "count by (pod) (count by (pod, llmserving) (last_over_time(DCGM_FI_PROF_DRAM_ACTIVE[10s]))) == 2"
    assert prom.query(both)
    monkeypatch.setattr(adapter, "MAX_ANSWER_VALUES", 1_500)
    observer = PrometheusObserver(prom.url)
    seen = observer.observe(
        [target("llama"), ObservationTarget("evil", "engines", "VLLM", WINDOW_S)], datetime.now(UTC)
    )
    observer.close()
    assert prom.query(both)  # still, when it was read
    llama = seen[("prod", "llama")]
    assert llama.running.value == pytest.approx(32), llama.running.reason
    assert llama.avg_context_tokens.value == pytest.approx(2097, rel=0.01)
    assert llama.dram_active.value == pytest.approx(0.6)
    reasons = " ".join(str(reading.reason) for reading in vars(llama).values() if hasattr(reading, "reason"))
    assert "evil" not in reasons and "relabelled" not in reasons
    # the pod with 201 engines is read as 32 of them: its own reading is off, no one else's
    assert seen[("evil", "engines")].pods == 1
