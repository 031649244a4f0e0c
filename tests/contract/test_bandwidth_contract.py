"""The bandwidth signal against the pinned releases: the read-bytes counter each engine registers
(name, type, labels), the switch that makes it count (`--enable-mfu-metrics` in both), and the
emulator exporting it the way the release does — at zero without the switch in vLLM, which
registers it either way; without a sample in SGLang, whose collector has no series until it counts.
"""

from __future__ import annotations

import ast
import io

from contracts import emulator_exposition, sglang_contract, vllm_contract, vllm_sources
from extract import family_name, field_names, wheel_sources
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from wheels import PINNED, wheel_path

from batchknee.adapters.prometheus import queried_metric_names
from batchknee.engines import sglang, vllm

VLLM_FAMILY = "vllm:estimated_read_bytes_per_gpu"
SGLANG_FAMILY = "sglang:estimated_read_bytes_per_gpu"


def _option_strings(source: str) -> set[str]:
    """Every string constant in a module (argparse option names among them)."""
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_the_adapter_reads_the_counter_each_release_registers() -> None:
    for engine, family, contract, version in (
        ("VLLM", VLLM_FAMILY, vllm_contract(), PINNED["vllm"]),
        ("SGLang", SGLANG_FAMILY, sglang_contract(), PINNED["sglang"]),
    ):
        read = [q for q in queried_metric_names(engine) if "estimated_read_bytes" in q.chain[0]]
        assert len(read) == 1, f"the adapter queries no read-bytes counter for {engine}"
        assert read[0].type == "counter"
        name = read[0].chain[0].replace("[:_]", ":")
        assert family_name(name, "counter") == family
        assert contract.types(family) == {"counter"}, f"{family} in {engine} {version}"


def test_vllm_labels_its_counter_per_engine_and_counts_it_behind_enable_mfu_metrics() -> None:
    variants = vllm_contract().metrics[VLLM_FAMILY]
    assert {m.static_labels for m in variants} == {frozenset({"model_name", "engine"})}
    assert all(m.source.startswith("vllm/v1/metrics/perf.py") for m in variants)
    sources = vllm_sources()
    assert vllm.MFU_METRICS_SWITCH in _option_strings(sources["vllm/engine/arg_utils.py"])
    assert "enable_mfu_metrics" in field_names(sources["vllm/config/observability.py"])


def test_sglang_labels_its_counter_with_the_scheduler_labels_and_a_switch_of_the_same_name() -> None:
    variants = sglang_contract().metrics[SGLANG_FAMILY]
    assert len(variants) == 1
    assert variants[0].dynamic and variants[0].static_labels == frozenset()  # the collector's labels
    assert variants[0].source.startswith("sglang/srt/observability/metrics_collector.py")
    fields = wheel_sources(wheel_path("sglang"), "sglang")["sglang/srt/arg_groups/fields/observability.py"]
    # SGLang's flags are its dataclass fields, dash-spelled.
    assert sglang.MFU_METRICS_SWITCH.removeprefix("--").replace("-", "_") in field_names(fields)


def _samples(argv: list[str]) -> dict[str, float]:
    """Sample name → value of the emulator's read-bytes counter after it ran some traffic."""
    from batchknee.emulator.engine_args import parse_emulator_args
    from batchknee.emulator.server import EmulatorServer

    settings = parse_emulator_args(
        ["--host", "127.0.0.1", "--port", "0", "--startup-delay-s", "0", "--request-rate", "20", *argv],
        environ={},
    )
    server = EmulatorServer(settings, log=io.StringIO(), out=io.StringIO())
    server.engine.run_until(10.0)
    text = generate_latest(server.registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        if "estimated_read_bytes" in family.name
        for sample in family.samples
    }


def test_the_emulator_counts_behind_the_same_switch_as_each_release() -> None:
    vllm_argv = ["--engine", "vllm", "llama-3-8b"]
    sglang_argv = ["-m", "sglang.launch_server", "--model-path", "llama-3-8b", "--enable-metrics"]
    assert family_name(VLLM_FAMILY, "counter") in emulator_exposition(vllm_argv)
    assert _samples(vllm_argv) == {f"{VLLM_FAMILY}_total": 0.0}  # registered, not counting
    assert _samples([*vllm_argv, vllm.MFU_METRICS_SWITCH])[f"{VLLM_FAMILY}_total"] > 0
    assert SGLANG_FAMILY in emulator_exposition(sglang_argv)
    assert _samples(sglang_argv) == {}  # registered, no series until it counts
    assert _samples([*sglang_argv, sglang.MFU_METRICS_SWITCH])[f"{SGLANG_FAMILY}_total"] > 0
