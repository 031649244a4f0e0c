"""The LLMServing API: models, the generated CRD (drift, structure, descriptions, CEL lists)."""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchknee.api.crd import (
    CHART_CRD_FILE,
    CHART_PEERING_CRD_FILE,
    CRD_FILE,
    PEERING_CRD_FILE,
    chart_crd_template,
    chart_peering_crd_template,
    crd_manifest,
    crd_yaml,
    peering_crd_yaml,
)
from batchknee.api.models import (
    KvCacheDtype,
    LLMServing,
    LLMServingSpec,
    WeightDtype,
    catalog_gpu_names,
    catalog_model_names,
)
from batchknee.api.resolve import SpecError, parse_llmserving, resolve_roofline, tuning_rules
from batchknee.cli import main
from batchknee.core.dtypes import KV_DTYPES, WEIGHT_DTYPES

ROOT = Path(__file__).resolve().parents[2]


def schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def manifest(**spec: Any) -> dict[str, Any]:
    body = {"engine": "VLLM", "model": {"name": "llama-3-8b"}, "gpu": {"type": "a100-80gb"}, **spec}
    return {"metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "generation": 3}, "spec": body}


def test_committed_crd_matches_the_models() -> None:
    committed = (ROOT / CRD_FILE).read_text()
    assert committed == crd_yaml(), "crds/ drifted from batchknee.api.models: run `make crds`"
    assert (ROOT / PEERING_CRD_FILE).read_text() == peering_crd_yaml(), "run `make crds`"


def test_the_charts_crd_templates_match_the_models() -> None:
    """The chart's copies come from the same models (`make crds`); tests/package renders them with helm
    and compares the result with crds/."""
    assert (ROOT / CHART_CRD_FILE).read_text() == chart_crd_template(), "run `make crds`"
    assert (ROOT / CHART_PEERING_CRD_FILE).read_text() == chart_peering_crd_template(), "run `make crds`"
    plain = "\n".join(line for line in chart_crd_template().splitlines() if "{{" not in line)
    [document] = list(yaml.safe_load_all(plain))
    assert document["spec"] == crd_manifest()["spec"]
    assert document["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_crd_command_prints_the_committed_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == (ROOT / CRD_FILE).read_text()


def walk(node: dict[str, Any], path: str = "") -> typing.Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_every_field_is_described() -> None:
    for path, node in walk(schema()):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "$defs"} & node.keys(), path
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), path
        assert node.get("default", 0) is not None, path
        if path.count(".") >= 2 and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description"


def test_names_the_issue_fixes() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    assert spec["engine"]["enum"] == ["VLLM", "TensorRTLLM", "SGLang"]
    tuning = spec["tuning"]["properties"]
    assert tuning["mode"]["enum"] == ["Auto", "Recommend", "Pinned"]
    assert (tuning["kneeFactorPercent"]["minimum"], tuning["kneeFactorPercent"]["maximum"]) == (100, 200)
    for name in ("minMaxNumSeqs", "maxMaxNumSeqs", "tpotP99TargetMilliseconds", "windowSeconds"):
        assert tuning[name]["type"] == "integer"
    status = schema()["properties"]["status"]["properties"]
    for name in ("maxNumSeqs", "recommendedMaxNumSeqs", "bKnee", "conditions", "history", "observed"):
        assert name in status
    assert {"avgContextLength", "tpotP99Milliseconds", "sampledAt"} <= status["observed"]["properties"].keys()
    version = crd_manifest()["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:9] == [
        "Engine",
        "Model",
        "Ctx",
        "B-Knee",
        "Max-Seqs",
        "Recommended",
        "TPOT-p99",
        "Ready",
        "Age",
    ]
    assert next(c for c in version["additionalPrinterColumns"] if c["name"] == "Reason")["priority"] == 1
    assert crd_manifest()["spec"]["names"]["shortNames"] == ["llms"]


def test_no_floats_in_spec() -> None:
    for path, node in walk(schema()["properties"]["spec"]):
        assert node.get("type") != "number", path


def test_cel_rules_cover_the_catalog() -> None:
    text = yaml.safe_dump(crd_manifest())
    for name in catalog_model_names() + catalog_gpu_names():
        assert f"'{name}'" in text
    assert "meta-llama/llama-3.1-8b-instruct" in catalog_model_names()
    rules = [r["rule"] for _, node in walk(schema()) for r in node.get("x-kubernetes-validations", [])]
    assert "self.minMaxNumSeqs <= self.maxMaxNumSeqs" in rules
    assert "self.goal != 'SLO' || has(self.tpotP99TargetMilliseconds)" in rules


def test_dtype_enums_follow_the_core() -> None:
    assert typing.get_args(WeightDtype) == WEIGHT_DTYPES
    assert typing.get_args(KvCacheDtype) == KV_DTYPES


def apiserver_defaults(node: dict[str, Any], value: Any) -> Any:
    """What the apiserver's structural defaulting does to `value` under the schema `node`: an absent
    property with a default gets it, within every object that is there."""
    if isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apiserver_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            apiserver_defaults(node["items"], item)
    return value


@pytest.mark.parametrize("rollout", [None, {}, {"allowServingGap": True}])
def test_a_progress_deadline_not_given_stays_unset_through_the_crd(rollout: dict[str, Any] | None) -> None:
    """The operator derives the deadline from the model when it is unset: the CRD must not fill one
    in (it filled 600, the same for every model), and the spec read back says it is unset."""
    rollout_schema = schema()["properties"]["spec"]["properties"]["rollout"]
    assert "default" not in rollout_schema["properties"]["progressDeadlineSeconds"]
    body = manifest(**({} if rollout is None else {"rollout": rollout}))
    stored = apiserver_defaults(schema(), copy.deepcopy(body))
    assert "progressDeadlineSeconds" not in stored["spec"].get("rollout", {})
    obj = parse_llmserving(stored)
    assert obj.spec.rolling_update.progress_deadline_seconds is None
    assert "progressDeadlineSeconds" not in obj.spec.dump().get("rollout", {})
    # one given is kept, within its bounds
    given = manifest(rollout={"progressDeadlineSeconds": 600})
    assert (
        parse_llmserving(apiserver_defaults(schema(), given)).spec.rolling_update.progress_deadline_seconds
        == 600
    )
    for wrong in (9, 86401):
        with pytest.raises(SpecError, match="progressDeadlineSeconds"):
            parse_llmserving(manifest(rollout={"progressDeadlineSeconds": wrong}))


def test_defaults_fill_in() -> None:
    obj = parse_llmserving(manifest())
    assert obj.spec.tuning.knee_factor_percent == 100
    assert obj.spec.rolling_update.max_surge == 0 and obj.spec.rolling_update.max_unavailable == 1
    assert obj.spec.replicas is None  # the Deployment's replicas are left to whoever scales it
    assert tuning_rules(obj.spec).mode == "Auto"
    assert tuning_rules(obj.spec).goal == "Knee" and tuning_rules(obj.spec).slo_margin_percent == 10
    assert tuning_rules(obj.spec).max_num_batched_tokens == 2048  # vLLM's default on an A100
    # and on an H100 (70 GiB or more, not an A100) vLLM's 8,192: the p99 model's prefill budget
    h100 = parse_llmserving(manifest(gpu={"type": "h100-sxm", "count": 1}))
    assert tuning_rules(h100.spec).max_num_batched_tokens == 8192
    slo = parse_llmserving(
        manifest(
            tuning={"goal": "SLO", "tpotP99TargetMilliseconds": 30, "sloMarginPercent": 5},
            args=["--max-num-batched-tokens", "8192"],
        )
    )
    rules = tuning_rules(slo.spec)
    assert (rules.goal, rules.slo_margin_percent, rules.max_num_batched_tokens) == ("SLO", 5, 8192)
    assert resolve_roofline(obj.spec).b_knee(2048) == pytest.approx(59.8, abs=0.05)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (
            {"tuning": {"minMaxNumSeqs": 64, "maxMaxNumSeqs": 8}},
            "spec.tuning",
            "minMaxNumSeqs must not exceed",
        ),
        (
            {"tuning": {"kneeFactorPercent": 250}},
            "spec.tuning.kneeFactorPercent",
            "less than or equal to 200",
        ),
        ({"tuning": {"mode": "Pinned"}}, "spec.tuning", "pinnedMaxNumSeqs"),
        ({"tuning": {"goal": "SLO"}}, "spec.tuning", "goal SLO needs tpotP99TargetMilliseconds"),
        ({"tuning": {"goal": "Throughput"}}, "spec.tuning.goal", "Knee"),
        ({"gpu": {"type": "a100-80gb", "count": 0}}, "spec.gpu.count", "greater than or equal to 1"),
        ({"engine": "TGI"}, "spec.engine", "SGLang"),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}, "spec.rollout", "both be zero"),
        (  # a key is written into the operator's PromQL as it is: this one would read another namespace
            {"prometheus": {"selector": {'a="b"}[1s]) or last_over_time({namespace="victim",zz': ""}}},
            "spec.prometheus",
            "is not a Prometheus label name",
        ),
        (
            {"prometheus": {"selector": {"__name__": "up"}}},
            "spec.prometheus",
            "not starting with a digit or __",
        ),
        (
            {"prometheus": {"selector": {f"label_{i}": "x" for i in range(17)}}},
            "spec.prometheus.selector",
            "at most 16 items",
        ),
    ],
)
def test_bad_specs_name_the_field(change: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_llmserving(manifest(**change))
    assert caught.value.field == field
    assert words in caught.value.message


def test_unknown_model_or_gpu_names_the_fix() -> None:
    with pytest.raises(SpecError, match=r"spec.model.name: unknown model .* set spec.model.architecture"):
        resolve_roofline(parse_llmserving(manifest(model={"name": "acme/x-13b"})).spec)
    with pytest.raises(SpecError, match=r"spec.gpu.type: unknown GPU .* spec.gpu.memoryMebibytes"):
        resolve_roofline(parse_llmserving(manifest(gpu={"type": "tpu-v9"})).spec)
    custom = parse_llmserving(
        manifest(
            model={
                "name": "acme/x-13b",
                "architecture": {
                    "layers": 40,
                    "attentionHeads": 40,
                    "kvHeads": 8,
                    "headDim": 128,
                    "params": 13000000000,
                },
            },
            gpu={"type": "tpu-v9", "memoryMebibytes": 98304, "bandwidthGigabytesPerSecond": 4000},
        )
    )
    roofline = resolve_roofline(custom.spec)
    assert roofline.kv_bytes_per_token == 2 * 40 * 8 * 128 * 2
    assert roofline.bandwidth == 4000e9


def test_status_round_trips_with_kubernetes_spelling() -> None:
    raw = manifest()
    raw["status"] = {
        "history": [{"time": "2026-03-01T12:00:00Z", "from": 256, "to": 64, "reason": "r"}],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "lastTransitionTime": "2026-03-01T12:00:00Z",
                "reason": "EngineAvailable",
            }
        ],
    }
    obj = LLMServing.model_validate(raw)
    dumped = obj.status.dump()
    assert dumped["history"][0] == {"time": "2026-03-01T12:00:00Z", "from": 256, "to": 64, "reason": "r"}
    assert dumped["conditions"][0]["lastTransitionTime"] == "2026-03-01T12:00:00Z"
    assert LLMServingSpec.model_validate(raw["spec"]).dump()["engine"] == "VLLM"
