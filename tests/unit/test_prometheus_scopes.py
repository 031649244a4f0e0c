"""How the Prometheus adapter groups targets into batched queries and maps series back to them."""

from __future__ import annotations

import urllib.parse

from batchknee.adapters.prometheus import _scopes, queries, scope_for
from batchknee.core.observation import ObservationTarget


def test_targets_sharing_engine_and_window_share_one_scope() -> None:
    targets = [
        ObservationTarget("prod", "llama", "VLLM", 60),
        ObservationTarget("prod", "llama-2", "VLLM", 60),
        ObservationTarget("dev", "qwen.v2", "VLLM", 60),
        ObservationTarget("prod", "trt", "TensorRTLLM", 60),
        ObservationTarget("prod", "slow", "VLLM", 300),
        ObservationTarget("prod", "custom", "VLLM", 60, selector={"service": "custom-engine"}),
    ]
    scopes = _scopes(targets)
    assert sorted((s.engine, s.window_s, len(members)) for s, members in scopes.items()) == [
        ("TensorRTLLM", 60, 1),
        ("VLLM", 60, 1),
        ("VLLM", 60, 3),
        ("VLLM", 300, 1),
    ]
    shared = next(s for s, members in scopes.items() if len(members) == 3)
    # Series map back by their llmserving label, whatever the pod is called (long names are
    # truncated in pod names).
    assert shared.owner({"namespace": "prod", "llmserving": "llama", "pod": "x"}) == ("prod", "llama")
    assert shared.owner({"namespace": "dev", "llmserving": "qwen.v2"}) == ("dev", "qwen.v2")
    assert shared.matcher == 'llmserving!=""'
    assert shared.tag("x") == "x"


def test_a_selector_override_queries_its_own_labels() -> None:
    scope = scope_for(ObservationTarget("prod", "custom", "VLLM", 60, selector={"service": 'a"b'}))
    assert scope.matcher == 'namespace="prod",service="a\\"b"'
    assert scope.owner({"namespace": "prod", "pod": "anything"}) == ("prod", "custom")
    assert scope.tag("x") == 'label_replace(x, "llmserving", "custom", "", "")'


def test_query_text_does_not_depend_on_the_fleet() -> None:
    """The queries of a refresh are the same for 1 or 1,000 LLMServings of 63-character names,
    and each POST body stays far under Prometheus's limits."""
    long_name = "a" * 63
    one = _scopes([ObservationTarget("prod", "llama", "VLLM", 300)])
    many = _scopes(
        [ObservationTarget(f"ns{i % 50}", f"{long_name[:-4]}{i:04d}", "VLLM", 300) for i in range(1000)]
    )
    assert list(one) == list(many)
    assert len(many) == 1
    for engine in ("VLLM", "TensorRTLLM"):
        texts = queries(scope_for(ObservationTarget("prod", long_name, engine, 300)))
        assert texts == queries(scope_for(ObservationTarget("other", "x", engine, 300)))
        for promql in texts.values():
            assert long_name not in promql
            body = urllib.parse.urlencode({"query": promql, "time": "1767225600.000"})
            assert len(body) < 8 * 1024, promql


def test_an_engine_read_through_two_scrape_targets_is_no_observation() -> None:
    """Two scrape configs selecting one pod (a PodMonitor and a ServiceMonitor, say) store its
    series twice, and every sum by pod counts it twice (a KV pool "used" 1.2 times over, twice the
    tokens per second). The scrape targets (job, instance) per engine are counted: more than one is
    the reason, naming the pod; TP ranks labelled apart behind one target count once."""
    from datetime import UTC, datetime

    from batchknee.adapters.prometheus import ScopeData

    key = ("prod", "llama")
    promql = queries(scope_for(ObservationTarget(*key, "VLLM", 60)))["scrapes"]
    assert "count by (namespace, llmserving, pod, engine, job, instance) ((last_over_time(" in promql

    def seen(scrapes: list[float]) -> str:
        found = ScopeData(scope_for(ObservationTarget(*key, "VLLM", 60)), datetime.now(UTC), min_samples=3)
        pods = [{"namespace": "prod", "llmserving": "llama", "pod": f"llama-{i}"} for i in range(2)]
        found.pod_rows = {
            "running": {key: [(p, 16.0) for p in pods]},
            "samples": {key: [(p, 10.0) for p in pods]},
            "scrapes": {key: [(p, n) for p, n in zip(pods, scrapes, strict=True)]},
        }
        return found.observation(key).running.reason

    assert seen([1, 2]) == (
        "pod llama-1's engine metrics came through 2 scrape targets (job, instance) in the last 60s: "
        "two scrape configs select it, or it was replaced or relabelled within the window; every sum "
        "would count it 2 times, so the observation waits for one"
    )
    assert seen([1, 1]) == ""  # one target each: read


def test_an_adopted_workloads_pods_are_matched_by_their_exact_names() -> None:
    """Pod names go into a regex: a dot left bare in `a.b-0` matched `axb-0`, another workload's
    pod in the namespace."""
    scope = scope_for(ObservationTarget("prod", "t", "VLLM", 60, pods=("a.b-0", "c-1")))
    assert scope.matcher == 'namespace="prod",pod=~"a\\\\.b\\\\-0|c\\\\-1"'
    assert scope.owner_key == ("prod", "t")
    nothing = scope_for(ObservationTarget("prod", "t", "VLLM", 60, pods=()))
    assert nothing.matcher == 'namespace="prod",pod=~"$^"'  # no pod yet: matches none, not every one
