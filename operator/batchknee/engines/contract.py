"""The shape of one engine's contract with the operator: its command line, its metric names, its HTTP
surface. Pure data; each engine module (`vllm`, `trtllm`, `sglang`) fills one in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommandLine:
    """How the engine's parser reads a long option, for finding the flags the operator manages.

    `aliases`: canonical flag → its other spellings (`-tp`, `--tensor-parallel-size`). `abbreviable`:
    the long options argparse would expand an unambiguous prefix to (the managed ones and every
    option sharing a stem with them); empty where the parser takes no abbreviations."""

    managed: tuple[str, ...]
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    abbreviable: frozenset[str] = frozenset()


@dataclass(frozen=True)
class EngineMetrics:
    """Metric names of one engine family; each tuple is a fallback chain, newest name first."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]
    tpot: tuple[str, ...]  # histograms (base names)
    ttft: tuple[str, ...]
    generation_tokens: tuple[str, ...]  # counters
    preemptions: tuple[str, ...]
    prefix_hits: tuple[str, ...]
    prefix_queries: tuple[str, ...]
    prompt_length: tuple[str, ...]  # histograms of tokens per request
    generation_length: tuple[str, ...]
    # Engines that reserve prompt + whole output per request (the KV pool shows the reservation):
    # the prompt-token counter and the finished-request counter give the mean prompt.
    prompt_tokens: tuple[str, ...] = ()
    finished_requests: tuple[str, ...] = ()


@dataclass(frozen=True)
class HttpSurface:
    """Where the engine serves: the container port the operator gives it, readiness, Prometheus text."""

    port: int
    health_path: str
    metrics_path: str
