"""Model and GPU catalogs (REFERENCE.md §3) as data, with alias lookup.

Parameter counts other than Llama's are approximate public figures; callers may override them.
GPU memory is what the driver reports (MiB); bandwidth and peak FLOP/s are the vendors' figures.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class ModelArchitecture:
    """What decode reads per step: the transformer's shape and parameter count.

    MoE: `experts` routed experts per MoE layer, `experts_per_token` chosen per token; the routed
    experts hold `params - dense_params` of the parameters. MLA (DeepSeek): one latent of
    `kv_lora_rank + qk_rope_head_dim` per token per layer replaces K and V. Sliding window:
    `sliding_window_layers` of the layers keep at most `sliding_window` tokens.
    """

    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    params: float
    active_params: float | None = None
    experts: int | None = None
    experts_per_token: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "attention_heads", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {self.name}: {name} must be a positive integer")
        if self.params <= 0:
            raise ValueError(f"model {self.name}: params must be positive")
        if (self.experts is None) != (self.experts_per_token is None):
            raise ValueError(f"model {self.name}: set both experts and experts_per_token, or neither")
        if self.experts is not None:
            assert self.experts_per_token is not None
            if not 1 <= self.experts_per_token <= self.experts:
                raise ValueError(f"model {self.name}: experts_per_token must be within 1..experts")
            if self.active_params is None or not 0 < self.active_params <= self.params:
                raise ValueError(f"model {self.name}: an MoE model needs 0 < active_params <= params")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"model {self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim")
        if self.sliding_window is not None and not 0 < self.sliding_window_layers <= self.layers:
            raise ValueError(f"model {self.name}: sliding_window_layers must be within 1..layers")

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def routed_expert_params(self) -> float:
        """Parameters held by the routed experts (all layers), derived from total and active counts:
        active = dense + k/E · routed, total = dense + routed."""
        if self.experts is None or self.experts_per_token is None or self.active_params is None:
            return 0.0
        k_over_e = self.experts_per_token / self.experts
        if k_over_e >= 1.0:
            return 0.0
        return (self.params - self.active_params) / (1.0 - k_over_e)

    @property
    def dense_params(self) -> float:
        """Parameters every token reads: attention, embeddings, norms, shared experts."""
        return self.params - self.routed_expert_params


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_bf16_flops: float
    aliases: tuple[str, ...] = field(default=(), compare=False)
    note: str = field(default="", compare=False)


MODELS: tuple[ModelArchitecture, ...] = (
    ModelArchitecture(
        "llama-3-8b",
        32,
        32,
        8,
        128,
        8.03e9,
        aliases=(
            "llama-3.1-8b",
            "llama3-8b",
            "meta-llama/Meta-Llama-3-8B",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Meta-Llama-3.1-8B",
            "meta-llama/Meta-Llama-3.1-8B-Instruct",
        ),
    ),
    ModelArchitecture(
        "llama-3-70b",
        80,
        64,
        8,
        128,
        70.6e9,
        aliases=(
            "llama-3.1-70b",
            "llama-3.3-70b",
            "llama3-70b",
            "meta-llama/Meta-Llama-3-70B",
            "meta-llama/Meta-Llama-3-70B-Instruct",
            "meta-llama/Llama-3.1-70B",
            "meta-llama/Llama-3.1-70B-Instruct",
            "meta-llama/Llama-3.3-70B-Instruct",
            "meta-llama/Meta-Llama-3.1-70B-Instruct",
        ),
    ),
    ModelArchitecture(
        "llama-3.1-405b",
        126,
        128,
        8,
        128,
        405.9e9,
        aliases=(
            "llama-3-405b",
            "meta-llama/Llama-3.1-405B",
            "meta-llama/Llama-3.1-405B-Instruct",
            "meta-llama/Meta-Llama-3.1-405B-Instruct",
        ),
    ),
    ModelArchitecture(
        "mistral-7b",
        32,
        32,
        8,
        128,
        7.24e9,
        aliases=("mistral-7b-v0.3", "mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    ),
    ModelArchitecture(
        "mistral-7b-v0.1",
        32,
        32,
        8,
        128,
        7.24e9,
        sliding_window=4096,
        sliding_window_layers=32,
        aliases=("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1"),
    ),
    ModelArchitecture(
        "mixtral-8x7b",
        32,
        32,
        8,
        128,
        46.7e9,
        active_params=12.9e9,
        experts=8,
        experts_per_token=2,
        aliases=("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    ),
    ModelArchitecture(
        "qwen2.5-7b", 28, 28, 4, 128, 7.6e9, aliases=("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct")
    ),
    ModelArchitecture(
        "qwen2.5-72b", 80, 64, 8, 128, 72.7e9, aliases=("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct")
    ),
    ModelArchitecture("qwen3-8b", 36, 32, 8, 128, 8.2e9, aliases=("Qwen/Qwen3-8B",)),
    ModelArchitecture("qwen3-32b", 64, 64, 8, 128, 32.8e9, aliases=("Qwen/Qwen3-32B",)),
    ModelArchitecture(
        "qwen3-30b-a3b",
        48,
        32,
        4,
        128,
        30.5e9,
        active_params=3.3e9,
        experts=128,
        experts_per_token=8,
        aliases=("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Instruct-2507"),
    ),
    ModelArchitecture(
        # 256 routed experts + 1 shared (counted in the dense part), 8 routed per token.
        "deepseek-v3",
        61,
        128,
        128,
        128,
        671e9,
        active_params=37e9,
        experts=256,
        experts_per_token=8,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        aliases=(
            "deepseek-ai/DeepSeek-V3",
            "deepseek-ai/DeepSeek-V3-0324",
            "deepseek-r1",
            "deepseek-ai/DeepSeek-R1",
        ),
    ),
    ModelArchitecture(
        # Every other layer attends within a 4096-token window.
        "gemma-2-9b",
        42,
        16,
        8,
        256,
        9.2e9,
        sliding_window=4096,
        sliding_window_layers=21,
        aliases=("google/gemma-2-9b", "google/gemma-2-9b-it"),
    ),
)

GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("a100-40gb", 40960 * MIB, 1555e9, 312e12, aliases=("a100-sxm4-40gb", "NVIDIA-A100-SXM4-40GB")),
    GpuSpec(
        "a100-80gb",
        81920 * MIB,
        2039e9,
        312e12,
        aliases=("a100", "a100-sxm4-80gb", "a100-sxm", "NVIDIA-A100-SXM4-80GB"),
    ),
    GpuSpec("a100-80gb-pcie", 81920 * MIB, 1935e9, 312e12, aliases=("a100-pcie", "NVIDIA-A100-80GB-PCIe")),
    GpuSpec("h100-sxm", 81559 * MIB, 3350e9, 989e12, aliases=("h100", "h100-sxm5", "NVIDIA-H100-80GB-HBM3")),
    GpuSpec("h100-pcie", 81559 * MIB, 2000e9, 756e12, aliases=("NVIDIA-H100-PCIe",)),
    GpuSpec("h200", 143771 * MIB, 4800e9, 989e12, aliases=("h200-sxm", "NVIDIA-H200")),
    GpuSpec("b200", 183359 * MIB, 7700e9, 2250e12, aliases=("NVIDIA-B200",), note="peak FLOP/s unconfirmed"),
    GpuSpec("l40s", 46068 * MIB, 864e9, 362e12, aliases=("NVIDIA-L40S",)),
    GpuSpec("l4", 23034 * MIB, 300e9, 121e12, aliases=("NVIDIA-L4",)),
    GpuSpec("a10g", 23028 * MIB, 600e9, 125e12, aliases=("NVIDIA-A10G",), note="peak FLOP/s is the A10's"),
    GpuSpec("mi300x", 192 * GIB, 5300e9, 1307e12, aliases=("AMD-Instinct-MI300X",)),
)


class _Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


Entry = TypeVar("Entry", bound=_Named)


class CatalogError(LookupError):
    """An unknown catalog name; the message lists the closest known names."""


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _index(entries: tuple[Entry, ...]) -> dict[str, Entry]:
    return {_normalise(key): entry for entry in entries for key in (entry.name, *entry.aliases)}


_MODEL_INDEX = _index(MODELS)
_GPU_INDEX = _index(GPUS)


def _lookup(kind: str, name: str, index: dict[str, Entry]) -> Entry:
    key = _normalise(name)
    if key in index:
        return index[key]
    close = difflib.get_close_matches(key, index.keys(), n=3, cutoff=0.5)
    primary = sorted({entry.name for entry in index.values()})
    hint = f"closest: {', '.join(close)}" if close else f"known: {', '.join(primary)}"
    raise CatalogError(f"unknown {kind} {name!r} ({hint})")


def find_model(name: str) -> ModelArchitecture:
    """The catalog model called `name` or one of its aliases (case-insensitive)."""
    return _lookup("model", name, _MODEL_INDEX)


def find_gpu(name: str) -> GpuSpec:
    """The catalog GPU called `name` or one of its aliases (case-insensitive)."""
    return _lookup("GPU", name, _GPU_INDEX)
