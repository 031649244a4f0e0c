"""The TensorRT-LLM names the operator reads and the emulator writes, against the collector TensorRT-LLM
registers them in (`tensorrt_llm/metrics/collector.py`, pinned by commit: its wheel is not on the
package index, so `trtllm_collector_050f80d.json` records what that file registers; see its provenance).
"""

from __future__ import annotations

from contracts import emulator_exposition, trtllm_contract, trtllm_provenance
from extract import family_name

from batchknee.adapters.prometheus import queried_metric_names

PINNED = "{repository}@{commit}:{path}".format(**trtllm_provenance())
BASE_LABELS = frozenset(trtllm_provenance()["base_labels"])
EMULATOR = ["--engine", "trtllm", "--gpu", "a100-80gb", "serve", "meta-llama/Meta-Llama-3-8B"]


def test_every_name_the_adapter_queries_exists_in_the_pinned_collector() -> None:
    contract = trtllm_contract()
    problems = []
    for queried in queried_metric_names("TensorRTLLM"):
        for index, name in enumerate(queried.chain):
            found = contract.types(family_name(name, queried.type))
            if queried.type in found:
                continue
            what = (
                "its newest name" if index == 0 else "an older fallback (no legacy TRT-LLM emulation exists)"
            )
            if found:
                problems.append(
                    f"{name} ({what}): queried as a {queried.type}; {PINNED} registers a {'/'.join(found)}"
                )
            else:
                problems.append(
                    f"{name} ({what}): queried as a {queried.type}; {PINNED} does not register it"
                )
    assert not problems, "\n".join(problems)


def test_the_emulator_exports_the_collectors_names_types_and_labels() -> None:
    exported = emulator_exposition(EMULATOR)
    contract = trtllm_contract()
    problems = []
    for family, have in sorted(exported.items()):
        if not family.startswith("trtllm_"):
            continue
        variants = contract.metrics.get(family)
        if not variants:
            problems.append(f"{family}: the emulator exports it; {PINNED} does not register it")
            continue
        [metric] = variants
        if have.type != metric.type:
            problems.append(
                f"{family}: the emulator exports a {have.type}; {PINNED} registers a {metric.type}"
            )
            continue
        if (
            metric.dynamic and metric.static_labels == frozenset()
        ):  # config info: the caller's labels + config keys
            if not have.labels >= BASE_LABELS:
                problems.append(
                    f"{family}: the emulator's labels {sorted(have.labels)} lack {sorted(BASE_LABELS)}"
                )
            continue
        expected = BASE_LABELS | metric.static_labels
        if have.labels != expected:
            problems.append(
                f"{family}: the emulator's labels {sorted(have.labels)}; {PINNED} has {sorted(expected)}"
            )
    assert not problems, "\n".join(problems)


def test_the_emulator_exports_every_name_the_adapter_queries() -> None:
    exported = emulator_exposition(EMULATOR)
    missing = [
        f"{name} ({queried.type})"
        for queried in queried_metric_names("TensorRTLLM")
        for name in queried.chain
        if family_name(name, queried.type) not in exported
    ]
    assert not missing, (
        "the adapter queries these, the TensorRT-LLM emulator does not export them:\n" + "\n".join(missing)
    )
