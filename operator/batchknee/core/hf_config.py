"""A model architecture from a Hugging Face `config.json` (already parsed; nothing is downloaded).

The parameter count is estimated from the shapes (embeddings, attention, MLP or experts); pass an
override when the exact figure matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchknee.core.catalog import ModelArchitecture


class ConfigError(ValueError):
    """A config.json that lacks what the planner needs; the message names the key."""


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json {key!r} must be a non-negative integer, got {value!r}")
    return value


def _optional_int(config: Mapping[str, Any], key: str) -> int | None:
    return _int(config, key) if config.get(key) is not None else None


def architecture_from_hf_config(config: Mapping[str, Any], name: str) -> ModelArchitecture:
    """Shapes, MoE, MLA and sliding-window settings of a decoder-only model's config.json."""
    if isinstance(config.get("text_config"), Mapping):  # multimodal wrappers nest the language model
        config = config["text_config"]
    layers = _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", heads)
    hidden = _int(config, "hidden_size")
    head_dim = _optional_int(config, "head_dim") or hidden // max(heads, 1)
    vocab = _int(config, "vocab_size")
    intermediate = _int(config, "intermediate_size", 4 * hidden)

    kv_lora_rank = _optional_int(config, "kv_lora_rank")
    rope_dim = _optional_int(config, "qk_rope_head_dim") if kv_lora_rank is not None else None
    if kv_lora_rank is not None:
        if rope_dim is None:
            raise ConfigError("config.json has kv_lora_rank but no 'qk_rope_head_dim'")
        nope = _int(config, "qk_nope_head_dim", head_dim)
        v_dim = _int(config, "v_head_dim", head_dim)
        q_lora = _optional_int(config, "q_lora_rank")
        q_proj = (
            hidden * q_lora + q_lora * heads * (nope + rope_dim)
            if q_lora
            else hidden * heads * (nope + rope_dim)
        )
        attention = q_proj + hidden * (kv_lora_rank + rope_dim) + kv_lora_rank * heads * (nope + v_dim)
        attention += heads * v_dim * hidden
        head_dim = nope + rope_dim
    else:
        attention = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim

    experts = (
        _optional_int(config, "num_local_experts")
        or _optional_int(config, "n_routed_experts")
        or _optional_int(config, "num_experts")
    )
    dense_mlp = 3 * hidden * intermediate
    active_params: float | None = None
    experts_per_token: int | None = None
    if experts:
        experts_per_token = _int(config, "num_experts_per_tok")
        expert_size = 3 * hidden * _int(config, "moe_intermediate_size", intermediate)
        shared = _int(config, "n_shared_experts", 0) * expert_size
        shared += 3 * hidden * _int(config, "shared_expert_intermediate_size", 0)
        dense_layers = _int(config, "first_k_dense_replace", 0)
        moe_layers = layers - dense_layers
        mlp_total = dense_layers * dense_mlp + moe_layers * (
            experts * expert_size + shared + hidden * experts
        )
        mlp_active = dense_layers * dense_mlp + moe_layers * (experts_per_token * expert_size + shared)
    else:
        mlp_total = mlp_active = layers * dense_mlp

    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    norms = layers * 2 * hidden
    params = float(embeddings + norms + layers * attention + mlp_total)
    if experts:
        active_params = float(embeddings + norms + layers * attention + mlp_active)

    sliding_window, windowed_layers = _sliding_window(config, layers)
    return ModelArchitecture(
        name=name,
        layers=layers,
        attention_heads=heads,
        kv_heads=kv_heads if kv_lora_rank is None else heads,
        head_dim=head_dim,
        params=params,
        active_params=active_params,
        experts=experts or None,
        experts_per_token=experts_per_token,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        sliding_window=sliding_window,
        sliding_window_layers=windowed_layers,
    )


def _sliding_window(config: Mapping[str, Any], layers: int) -> tuple[int | None, int]:
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None, 0
    if config.get("use_sliding_window") is False:  # Qwen2 ships a window it does not use
        return None, 0
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        windowed = sum(1 for kind in layer_types if kind == "sliding_attention")
        return (window, windowed) if windowed else (None, 0)
    if str(config.get("model_type", "")).startswith("gemma2"):  # alternates local and global layers
        return window, layers // 2
    return window, layers
