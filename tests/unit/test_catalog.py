"""Catalog lookups by name and alias, and config.json models."""

from __future__ import annotations

import pytest

from batchknee.core import GPUS, MODELS, CatalogError, find_gpu, find_model
from batchknee.core.hf_config import ConfigError, architecture_from_hf_config


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("llama-3-8b", "llama-3-8b"),
        ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
        ("META-LLAMA/META-LLAMA-3-8B-INSTRUCT", "llama-3-8b"),
        ("llama-3-70b", "llama-3-70b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
        ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ],
)
def test_model_aliases(alias: str, name: str) -> None:
    assert find_model(alias).name == name


@pytest.mark.parametrize(
    "name",
    ["a100-80gb", "a100-40gb", "h100-sxm", "h100-pcie", "h200", "b200", "l40s", "l4", "a10g", "mi300x"],
)
def test_every_required_gpu_name(name: str) -> None:
    assert find_gpu(name).name == name


def test_gpu_feature_discovery_labels_are_aliases() -> None:
    assert find_gpu("NVIDIA-A100-SXM4-80GB").name == "a100-80gb"
    assert find_gpu("NVIDIA-H100-80GB-HBM3").name == "h100-sxm"


def test_unknown_names_list_the_closest() -> None:
    with pytest.raises(CatalogError, match=r"unknown model 'llama-3-7b' \(closest: .*llama-3-8b"):
        find_model("llama-3-7b")
    with pytest.raises(CatalogError, match=r"unknown GPU 'h1000'.*h100"):
        find_gpu("h1000")


def test_catalog_figures_match_the_reference_table() -> None:
    a100 = find_gpu("a100-80gb")
    assert (a100.bandwidth_bytes_per_s, a100.peak_bf16_flops) == (2039e9, 312e12)
    assert find_gpu("h200").bandwidth_bytes_per_s == 4800e9
    assert len({m.name for m in MODELS}) == len(MODELS) and len({g.name for g in GPUS}) == len(GPUS)
    mixtral = find_model("mixtral-8x7b")
    assert mixtral.dense_params + mixtral.routed_expert_params * 2 / 8 == pytest.approx(12.9e9)


LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_llama_config_json_matches_the_catalog() -> None:
    model = architecture_from_hf_config(LLAMA_3_8B_CONFIG, "my-llama")
    catalog = find_model("llama-3-8b")
    assert (model.layers, model.kv_heads, model.head_dim) == (
        catalog.layers,
        catalog.kv_heads,
        catalog.head_dim,
    )
    assert model.params == pytest.approx(8.03e9, rel=0.001)


def test_moe_mla_and_window_configs() -> None:
    deepseek = architecture_from_hf_config(
        {
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "vocab_size": 129280,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        },
        "deepseek",
    )
    assert deepseek.params == pytest.approx(671e9, rel=0.01)
    assert deepseek.active_params == pytest.approx(37e9, rel=0.02)
    assert (deepseek.kv_lora_rank, deepseek.qk_rope_head_dim, deepseek.experts) == (512, 64, 256)

    mistral = architecture_from_hf_config({**LLAMA_3_8B_CONFIG, "sliding_window": 4096}, "m")
    assert (mistral.sliding_window, mistral.sliding_window_layers) == (4096, 32)
    qwen = architecture_from_hf_config(
        {**LLAMA_3_8B_CONFIG, "sliding_window": 4096, "use_sliding_window": False}, "q"
    )
    assert qwen.sliding_window is None
    gemma = architecture_from_hf_config(
        {**LLAMA_3_8B_CONFIG, "sliding_window": 4096, "model_type": "gemma2"}, "g"
    )
    assert gemma.sliding_window_layers == 16


def test_config_errors_name_the_key() -> None:
    broken = dict(LLAMA_3_8B_CONFIG)
    del broken["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        architecture_from_hf_config(broken, "x")
    with pytest.raises(ConfigError, match="'hidden_size' must be a non-negative integer"):
        architecture_from_hf_config({**LLAMA_3_8B_CONFIG, "hidden_size": "4096"}, "x")
