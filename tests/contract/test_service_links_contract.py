"""The port variables the engines read, against their pinned releases. The engine Service takes the
LLMServing's name, and the kubelet gives every pod started in the namespace variables of each
Service there: one named after a variable an engine reads as a port (`vllm`: VLLM_PORT=tcp://…)
stops the engines of other teams there, so those names are refused at admission."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
from contracts import environment_variables_read, sglang_sources, vllm_sources

from batchknee.api.crd import crd_manifest
from batchknee.api.models import RESERVED_NAMES, service_setting
from batchknee.engines import sglang, vllm


@pytest.mark.parametrize(
    ("engine", "sources"), [(vllm, vllm_sources), (sglang, sglang_sources)], ids=["vllm", "sglang"]
)
def test_every_variable_a_service_would_set_that_a_release_reads_names_a_refused_service(
    engine: ModuleType, sources: Callable[[], dict[str, str]]
) -> None:
    read = environment_variables_read(sources())
    linked = {name: path for name, path in read.items() if service_setting(name) is not None}
    assert set(engine.PORT_VARIABLES) == set(linked), f"the release reads: {linked}"
    refused = [service_setting(name) for name in linked]
    assert all(name in RESERVED_NAMES for name in refused), refused
    rule = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"][1]
    assert all(f"'{name}'" in rule["rule"] for name in refused), rule["rule"]
