"""The vLLM names the operator reads and the emulator writes, against the pinned vLLM release's own
source (the wheel in the user cache, read with `ast`, never imported).

A bump of `wheels.PINNED["vllm"]` reruns all of this against the new release; a red test names each
metric that moved: the name, the type or labels expected, and what the release has instead.
"""

from __future__ import annotations

from contracts import (
    VLLM_CACHE_CONFIG,
    VLLM_CACHE_INFO,
    emulator_exposition,
    vllm_cache_config_labels,
    vllm_contract,
)
from extract import family_name
from wheels import PINNED

from batchknee.adapters.prometheus import queried_metric_names

VERSION = PINNED["vllm"]
EMULATOR = ["--engine", "vllm", "--gpu", "a100-80gb", "llama-3-8b"]
# The release lines the emulator's --metric-version claims: `current` is every release since 0.12,
# so it is held to the pinned one; `legacy` (≤ 0.9) only has to carry the adapter's old fallbacks.
CLAIMED_BY_CURRENT = VERSION


def colon_name(pattern: str) -> str:
    """`vllm[:_]x` (the adapter matches both spellings) → `vllm:x`, the name vLLM registers."""
    return pattern.replace("[:_]", ":")


def _type_problem(name: str, assumed: str, found: set[str], where: str) -> str | None:
    if not found:
        return f"{name}: the adapter queries it as a {assumed}; {where} does not register it"
    if assumed not in found:
        return f"{name}: the adapter queries it as a {assumed}; {where} registers it as {'/'.join(sorted(found))}"
    return None


def test_the_pinned_release_is_read_completely() -> None:
    contract = vllm_contract()
    # The stat logger's registrations must all be readable; a connector plugin that builds names
    # from run-time metadata is reported, not guessed.
    core = [line for line in contract.unresolved if line.startswith("vllm/v1/metrics/")]
    assert not core, "registrations the extractor could not read:\n" + "\n".join(core)
    assert len(contract.metrics) >= 40, f"only {len(contract.metrics)} metrics found in vllm {VERSION}"


def test_every_name_the_adapter_queries_first_exists_in_the_pinned_release() -> None:
    contract = vllm_contract()
    problems = []
    for queried in queried_metric_names("VLLM"):
        newest = colon_name(queried.chain[0])
        family = family_name(newest, queried.type)
        problem = _type_problem(newest, queried.type, contract.types(family), f"vllm {VERSION}")
        if problem:
            problems.append(problem)
            continue
        for label in queried.labels:
            available = (
                vllm_cache_config_labels()
                if family == VLLM_CACHE_INFO
                else {label for m in contract.metrics[family] for label in m.static_labels}
            )
            if label not in available:
                problems.append(
                    f"{newest}: the adapter reads label {label!r}; vllm {VERSION} has {sorted(available)}"
                )
    assert not problems, "\n".join(problems)


def test_every_older_fallback_is_in_the_release_or_in_the_emulators_legacy_mode() -> None:
    contract = vllm_contract()
    legacy = emulator_exposition([*EMULATOR, "--metric-version", "legacy"])
    problems = []
    for queried in queried_metric_names("VLLM"):
        for pattern in queried.chain[1:]:
            name = colon_name(pattern)
            family = family_name(name, queried.type)
            if queried.type in contract.types(family):
                continue
            exported = legacy.get(family)
            if exported is None:
                problems.append(
                    f"{name}: an older fallback that vllm {VERSION} does not register and the emulator's "
                    "legacy mode does not export, so nothing tests that query"
                )
            elif exported.type != queried.type:
                problems.append(
                    f"{name}: queried as a {queried.type}; the legacy emulator exports a {exported.type}"
                )
    assert not problems, "\n".join(problems)


def test_the_emulator_exports_every_queried_name_of_the_release_it_claims() -> None:
    exported = emulator_exposition([*EMULATOR, "--metric-version", "current"])
    contract = vllm_contract()
    missing = []
    for queried in queried_metric_names("VLLM"):
        for pattern in queried.chain:
            family = family_name(colon_name(pattern), queried.type)
            if queried.type in contract.types(family) and family not in exported:
                missing.append(f"{family} ({queried.type}, in vllm {CLAIMED_BY_CURRENT})")
    assert not missing, (
        "the adapter queries these and vLLM exports them, the emulator does not:\n" + "\n".join(missing)
    )


def test_the_emulator_exports_the_release_names_types_and_labels() -> None:
    exported = emulator_exposition([*EMULATOR, "--metric-version", "current"])
    contract = vllm_contract()
    problems = []
    for family, have in sorted(exported.items()):
        if not family.startswith("vllm:"):
            continue
        variants = contract.metrics.get(family)
        if not variants:
            problems.append(
                f"{family}: the emulator exports it; vllm {CLAIMED_BY_CURRENT} does not register it"
            )
            continue
        types = {m.type for m in variants}
        if have.type not in types:
            problems.append(
                f"{family}: the emulator exports a {have.type}; vllm registers a {'/'.join(sorted(types))}"
            )
            continue
        if family == VLLM_CACHE_INFO:
            unknown = have.labels - vllm_cache_config_labels()
            if unknown:
                problems.append(
                    f"{family}: the emulator's labels {sorted(unknown)} are not CacheConfig fields in vllm "
                    f"{CLAIMED_BY_CURRENT} ({VLLM_CACHE_CONFIG[0]})"
                )
            continue
        label_sets = {m.static_labels for m in variants if m.type == have.type}
        if have.labels not in label_sets:
            problems.append(
                f"{family}: the emulator's labels {sorted(have.labels)}; vllm {CLAIMED_BY_CURRENT} has "
                + " or ".join(str(sorted(s)) for s in label_sets)
            )
    assert not problems, "\n".join(problems)
