"""SGLang's metric contract, read from the pinned wheel: the names and types the Prometheus adapter
queries and the emulator exports, held to the pinned release. `python
tests/contract/contracts.py sglang` prints everything SGLang registers (name, type, labels, source);
`<labels>` there is the collector's `labels` argument (model_name, engine_type, and the server's
optional priority/custom labels, filled in at run time).
"""

from __future__ import annotations

from contracts import emulator_exposition, sglang_contract
from extract import family_name, field_names, wheel_sources
from wheels import PINNED, wheel_path

from batchknee.adapters.prometheus import queried_metric_names
from batchknee.engines import sglang

VERSION = PINNED["sglang"]

# REFERENCE.md §2 "SGLang (read from the 0.5.23 wheel)": family names (counters without `_total`).
EXPECTED = {
    "gauge": [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:full_token_usage",
        "sglang:kv_used_tokens",
        "sglang:kv_available_tokens",
        "sglang:kv_evictable_tokens",
        "sglang:max_total_num_tokens",
        "sglang:num_pages",
        "sglang:page_size",
        "sglang:decode_sum_seq_lens",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
        "sglang:num_retracted_reqs",
        "sglang:utilization",
    ],
    "counter": [
        "sglang:prompt_tokens",
        "sglang:generation_tokens",
        "sglang:cached_tokens",
        "sglang:num_retracted_requests",
        "sglang:estimated_read_bytes_per_gpu",
    ],
    "histogram": [
        "sglang:time_to_first_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:request_time_per_output_token_seconds",
        "sglang:queue_time_seconds",
    ],
}


def test_the_pinned_release_is_read_completely() -> None:
    contract = sglang_contract()
    core = [line for line in contract.unresolved if "srt/observability/metrics_collector.py" in line]
    assert not core, "registrations the extractor could not read:\n" + "\n".join(core)
    assert len(contract.metrics) >= 100, f"only {len(contract.metrics)} metrics found in sglang {VERSION}"


def test_every_name_the_sglang_work_needs_exists_with_its_type() -> None:
    contract = sglang_contract()
    problems = []
    for kind, names in EXPECTED.items():
        for name in names:
            found = contract.types(name)
            if not found:
                problems.append(f"{name}: expected a {kind}; sglang {VERSION} does not register it")
            elif kind not in found:
                problems.append(
                    f"{name}: expected a {kind}; sglang {VERSION} registers a {'/'.join(sorted(found))}"
                )
    # What an adapter must sum over besides the pod: printed so a failure shows the whole picture.
    for name in (n for names in EXPECTED.values() for n in names):
        for metric in contract.metrics.get(name, []):
            print(f"{metric.type:9} {name:48} {','.join(metric.labels):32} {metric.source}")
    assert not problems, "\n".join(problems)


def test_every_metric_registers_one_label_set_per_type() -> None:
    # An adapter summing `by (pod)` relies on each family having one shape in a release.
    contract = sglang_contract()
    needed = {n for names in EXPECTED.values() for n in names}
    clashes = [
        f"{name}: " + "; ".join(f"{m.type} {m.labels} at {m.source}" for m in variants)
        for name, variants in sorted(contract.metrics.items())
        if name in needed and len(variants) > 1
    ]
    assert not clashes, "\n".join(clashes)


def colon_name(pattern: str) -> str:
    """`sglang[:_]x` (the adapter matches both spellings) → `sglang:x`, the name SGLang registers."""
    return pattern.replace("[:_]", ":")


def test_every_name_the_adapter_queries_exists_in_the_pinned_release_with_its_type() -> None:
    contract = sglang_contract()
    problems = []
    for queried in queried_metric_names("SGLang"):
        for pattern in queried.chain:
            name = colon_name(pattern)
            family = family_name(name, queried.type)
            found = contract.types(family)
            if queried.type not in found:
                registered = "/".join(sorted(found)) or "nothing"
                problems.append(
                    f"{name}: the adapter queries a {queried.type}; sglang {VERSION} registers {registered}"
                )
    assert not problems, "\n".join(problems)


EMULATOR = ["-m", "sglang.launch_server", "--model-path", "llama-3-8b", "--enable-metrics", "--gpu", "h100"]


def test_the_emulator_exports_every_name_the_adapter_queries() -> None:
    exported = emulator_exposition(EMULATOR)
    missing = [
        f"{family_name(colon_name(pattern), queried.type)} ({queried.type})"
        for queried in queried_metric_names("SGLang")
        for pattern in queried.chain
        if family_name(colon_name(pattern), queried.type) not in exported
    ]
    assert not missing, "the adapter queries these and the emulator does not export them:\n" + "\n".join(
        missing
    )


def test_the_emulator_exports_the_release_names_types_and_labels() -> None:
    # The collector's `<labels>` are filled in at run time (model_name, engine_type, and the
    # scheduler's parallel ranks); the rest of each label set is spelled out in the release.
    exported = emulator_exposition(EMULATOR)
    contract = sglang_contract()
    collector = set(sglang.SCHEDULER_LABELS) | set(sglang.TOKENIZER_LABELS)
    problems = []
    for family, have in sorted(exported.items()):
        if not family.startswith("sglang:"):
            continue
        variants = contract.metrics.get(family)
        if not variants:
            problems.append(f"{family}: the emulator exports it; sglang {VERSION} does not register it")
            continue
        if have.type not in {m.type for m in variants}:
            problems.append(
                f"{family}: the emulator exports a {have.type}; sglang registers {variants[0].type}"
            )
            continue
        if not any(have.labels - collector == m.static_labels and m.dynamic for m in variants):
            problems.append(
                f"{family}: the emulator's labels {sorted(have.labels)}; sglang {VERSION} has "
                + " or ".join(str(m.labels) for m in variants)
            )
    assert not problems, "\n".join(problems)


def test_the_switches_that_write_scheduler_series_twice_are_the_releases() -> None:
    """Two switches add series beside the ones the adapter sums: every TP rank's scheduler writing
    the same batch, and the queue gauges' breakdown by priority beside their total. The adapter
    reads them once (sglang.METRICS.rank_labels, gauge_matchers); the emulator writes them."""
    sources = wheel_sources(wheel_path("sglang"), "sglang")
    fields = field_names(sources["sglang/srt/arg_groups/fields/observability.py"]) | field_names(
        sources["sglang/srt/arg_groups/fields/schedule.py"]
    )
    for switch in (sglang.ALL_SCHEDULERS_SWITCH, sglang.PRIORITY_SWITCH):
        assert switch.removeprefix("--").replace("-", "_") in fields, switch
    collector = sources["sglang/srt/observability/metrics_collector.py"]
    assert 'labels["priority"] = str(priority)' in collector  # the breakdown, beside the total under ""
    assert '"tp_rank": parallel.tp_rank' in collector and "enable_metrics_for_all_schedulers" in collector
    assert set(sglang.METRICS.rank_labels) <= set(sglang.SCHEDULER_LABELS)
    exported = emulator_exposition(
        [*EMULATOR, "--tp-size", "2", sglang.ALL_SCHEDULERS_SWITCH, sglang.PRIORITY_SWITCH]
    )
    assert exported["sglang:num_running_reqs"].labels == {*sglang.SCHEDULER_LABELS, "priority"}
