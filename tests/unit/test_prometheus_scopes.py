"""How the Prometheus adapter groups targets into batched queries and maps series back to them."""

from __future__ import annotations

import re

from batchknee.adapters.prometheus import _scopes
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
    assert sorted((s.engine, s.window_s, len(s.targets)) for s in scopes) == [
        ("TensorRTLLM", 60, 1),
        ("VLLM", 60, 1),
        ("VLLM", 60, 3),
        ("VLLM", 300, 1),
    ]
    shared = next(s for s in scopes if len(s.targets) == 3)
    # Pods map back by name: exactly two hash segments after the LLMServing's name.
    assert shared.owner("prod", "llama-7c9f8b6d5-abcde") == ("prod", "llama")
    assert shared.owner("prod", "llama-2-7c9f8b6d5-abcde") == ("prod", "llama-2")
    assert shared.owner("dev", "qwen.v2-7c9f8b6d5-abcde") == ("dev", "qwen.v2")
    assert shared.owner("dev", "qwenXv2-7c9f8b6d5-abcde") is None  # the dot is literal
    assert shared.owner("dev", "llama-7c9f8b6d5-abcde") is None  # not a target in that namespace
    assert shared.owner("prod", "llama-abc") is None
    assert 'label_replace(x, "llmserving", "$1", "pod", ' in shared.tag("x")
    assert re.search(r'namespace=~"dev\|prod"', shared.matcher)


def test_a_selector_override_queries_its_own_labels() -> None:
    [scope] = _scopes([ObservationTarget("prod", "custom", "VLLM", 60, selector={"service": 'a"b'})])
    assert scope.matcher == 'namespace="prod",service="a\\"b"'
    assert scope.owner("prod", "anything") == ("prod", "custom")
    assert scope.tag("x") == 'label_replace(x, "llmserving", "custom", "", "")'
