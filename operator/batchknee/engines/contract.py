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
    tpot: tuple[str, ...]  # histograms (base names): per finished request first, then per step
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
    # Bytes the engine estimates it read from GPU memory, per GPU (a counter; rate() is the achieved
    # bandwidth). Exported only behind the engine's own switch (`--enable-mfu-metrics`).
    read_bytes: tuple[str, ...] = ()
    # Inter-token latency: one sample per output step, so its mean over the window is the step time
    # of the window's own steps. The per-request TPOT of the requests that finished in the window
    # spans their whole lives: after a shift it still shows the steps before it for as long as a
    # request runs (minutes at long outputs), and a fit on it picks a batch too large.
    step_time: tuple[str, ...] = ()
    # Label matchers the engine's own gauges are read with: one series per rank of what each
    # counts, not a breakdown written beside it (SGLang's queue gauges by priority).
    gauge_matchers: str = ""
    # Labels that tell apart ranks of one tensor-parallel group writing the same batch's gauges and
    # counters (SGLang with --enable-metrics-for-all-schedulers): read once (max), not summed.
    rank_labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class HttpSurface:
    """Where the engine serves: the container port the operator gives it, readiness, Prometheus text."""

    port: int
    health_path: str
    metrics_path: str


# dcgm-exporter's DRAM activity: a gauge, the fraction (0–1) of cycles the device memory interface
# was sending or receiving data, labelled `gpu`, `UUID`, `modelName`, `Hostname` and — with the
# exporter's Kubernetes mapping — the `namespace`, `pod` and `container` using the GPU. It is a
# profiling (DCP) field: in dcgm-exporter's `dcp-metrics-included.csv`, not `default-counters.csv`.
DCGM_DRAM_ACTIVE = "DCGM_FI_PROF_DRAM_ACTIVE"
DCGM_POD_LABELS = ("namespace", "pod")
